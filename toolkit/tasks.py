"""What each command does, given resolved Settings. The Fabric/invoke declarations live in cli.py; the SSH
transport in remote.py. Each cluster command contacts every host in parallel and fails with one error that
lists every failed host."""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from toolkit import jobrecord
from toolkit.errors import UserError
from toolkit.jobrecord import HostRecord, JobRecord
from toolkit.plan import LaunchPlan, make_plan
from toolkit.remote import (
    DEFAULT_EXCLUDE,
    ClusterError,
    Host,
    HostResult,
    SshSettings,
    SyncStats,
    Target,
    check_all,
    rich_progress,
    run_on_all,
)
from toolkit.render import plan_json, render_host, write_files
from toolkit.settings import Settings

PROJECT_EXCLUDE = DEFAULT_EXCLUDE + (".toolkit",)
LAUNCH_TIMEOUT = 60.0  # s for launch.sh to report the agent up
STOP_TIMEOUT_EXTRA = 30.0  # s beyond the grace period for stop.sh to finish


def launch_plan(settings: Settings) -> LaunchPlan:
    return make_plan(settings.inventory, settings.options, str(settings.project) if settings.local else None)


# --- plan --------------------------------------------------------------------------------------------------------


def show_plan(settings: Settings, as_json: bool = False, render_dir: Path | None = None) -> None:
    plan = launch_plan(settings)
    if render_dir is not None:
        token = secrets.token_hex(16)  # a preview: the job's real token is made at deploy
        for host in plan.hosts:
            write_files(render_host(plan, host, token), render_dir / host.name)
    if as_json:
        print(json.dumps(plan_json(plan), indent=2))
        return
    table = Table(title=f"job {plan.job}: {plan.world_size} workers, scheduler {plan.sched_address}:{plan.sched_port}"
                  f" (store {plan.store_port})")
    for column in ("host", "node id", "rank", "local rank", "port", "command"):
        table.add_column(column)
    for p in plan.processes():
        port = str(plan.sched_port) if p.rank is None else ""
        table.add_row(p.host, p.node_id, _dash(p.rank), _dash(p.local_rank), port, " ".join(p.argv))
    Console().print(table)
    if render_dir is not None:
        Console(stderr=True).print(f"rendered files: {render_dir}/<host>/")


# --- deploy ------------------------------------------------------------------------------------------------------


def deploy(settings: Settings) -> JobRecord:
    """Make every host's job directory (workdirs resolved on the host), upload the rendered files and the
    project, and write the local job record."""
    plan = launch_plan(settings)
    ssh = ssh_settings(settings)
    targets = [Target.of(h.host, local=plan.local) for h in plan.hosts]

    def prepare(host: Host) -> str:
        hp = plan.host_plan(host.name)
        workdir = hp.job_dir.rsplit("/", 1)[0]
        host.preflight(hp.python, workdir)
        return host.run(["sh", "-c", 'cd -- "$1" && pwd -P', "sh", workdir], check=True).stdout.strip()

    workdirs = _fan_out("checking hosts", targets, prepare, ssh)
    inventory = settings.inventory.with_hosts(
        replace(settings.inventory.host(name), workdir=path) for name, path in workdirs.items()
    )
    plan = make_plan(inventory, settings.options, str(settings.project) if settings.local else None)
    token = jobrecord.token(settings.project, plan.job)

    def upload(host: Host) -> SyncStats:
        hp = plan.host_plan(host.name)
        host.run(["mkdir", "-p", "--", *(f"{hp.job_dir}/{d}" for d in ("env", "logs", "state", "recovery"))],
                 check=True)
        for f in render_host(plan, hp, token):
            host.write(f"{hp.job_dir}/{f.path}", f.content, f.mode)
        if plan.local:
            return SyncStats()
        return host.sync_dir(settings.project, f"{hp.job_dir}/project", exclude=PROJECT_EXCLUDE, delete=True)

    stats = _fan_out("deploying", targets, upload, ssh)
    record = _record(plan, settings)
    jobrecord.save(settings.project, record)
    sent = sum(s.files_sent for s in stats.values())
    size = sum(s.bytes_sent for s in stats.values())
    _say(f"deployed job {plan.job} to {len(stats)} host(s): project files sent {sent} ({size} bytes), "
         f"unchanged {sum(s.files_unchanged for s in stats.values())}")
    return record


def _record(plan: LaunchPlan, settings: Settings) -> JobRecord:
    hosts = tuple(
        HostRecord(
            name=h.name,
            hostname=h.host.address or h.name,
            port=h.host.port,
            user=h.host.user,
            key_file=h.host.key_file,
            job_dir=h.job_dir,
            python=h.python,
            node_ids=tuple(p.node_id for p in h.processes),
        )
        for h in plan.hosts
    )
    processes = tuple(
        {"host": p.host, "role": p.role, "node_id": p.node_id, "rank": p.rank, "local_rank": p.local_rank,
         "log": f"logs/{p.log_name}"}
        for p in plan.processes()
    )
    ssh = {
        "known_hosts": settings.known_hosts,
        "accept_new_host_keys": settings.accept_new_host_keys,
        "ssh_config": settings.core.ssh_config,
        "identities": list(settings.core.identities),
        "connect_timeout": settings.core.connect_timeout,
        "parallel": settings.parallel,
    }
    return JobRecord(plan.job, plan.local, plan.scheduler_host, plan.sched_port, hosts, processes, ssh)


# --- train -------------------------------------------------------------------------------------------------------


def train(settings: Settings) -> None:
    """Start the deployed job on every host at once; all or nothing."""
    record = jobrecord.load(settings.project, settings.options.job)
    ssh = record_ssh(record)
    sched = record.host(record.scheduler_host)
    port = record.sched_port

    def start(host: Host) -> str:
        h = record.host(host.name)
        if h.name == sched.name and not agent_alive(host, h):
            host.preflight(h.python, h.job_dir, ports=(port, port + 1))
        result = host.run([f"{h.job_dir}/launch.sh"], timeout=LAUNCH_TIMEOUT, check=True)
        return result.stdout.strip()

    results = run_on_all(record_targets(record), start, ssh, fail_fast=False)
    if any(not r.ok for r in results.values()):
        started = [record.host(n) for n, r in results.items() if r.ok]
        if started:
            run_on_all([_target(h, record.local) for h in started], lambda host: _stop_one(host, record, settings),
                       ssh)
        raise ClusterError(results)
    _say(f"job {record.job} started on {len(results)} host(s); follow it with 'fleet status' and 'fleet logs -f'")


# --- stop --------------------------------------------------------------------------------------------------------


def stop(settings: Settings) -> None:
    """Stop the job on every host (SIGTERM, grace, SIGKILL) and verify that no process of it remains."""
    record = jobrecord.load(settings.project, settings.options.job)
    results = run_on_all(record_targets(record), lambda host: _stop_one(host, record, settings), record_ssh(record))
    check_all(results)
    _say(f"job {record.job} stopped on {len(results)} host(s); no process of it is left")


def _stop_one(host: Host, record: JobRecord, settings: Settings) -> str:
    h = record.host(host.name)
    result = host.run([f"{h.job_dir}/stop.sh"], timeout=settings.options.grace + STOP_TIMEOUT_EXTRA, check=True)
    return result.stdout.strip()


# --- restart -----------------------------------------------------------------------------------------------------


def restart(settings: Settings, node: str | None, host_name: str | None) -> None:
    """Restart one process by hand through its agent (`--node`), or bring a host's agent back (`--host`)."""
    record = jobrecord.load(settings.project, settings.options.job)
    if (node is None) == (host_name is None):
        raise UserError("restart needs exactly one of --node NODE_ID or --host HOST")
    if node is not None:
        h = record.host(record.process(node)["host"])
        command = [f"{h.job_dir}/recover.sh", node]
    else:
        h = record.host(host_name)  # type: ignore[arg-type]
        command = [f"{h.job_dir}/launch.sh"]
    results = run_on_all([_target(h, record.local)], lambda host: host.run(command, timeout=LAUNCH_TIMEOUT,
                                                                           check=True).stdout.strip(),
                         record_ssh(record))
    out = check_all(results)[h.name]
    _say(out or f"restarted {node or host_name}")


# --- status ------------------------------------------------------------------------------------------------------


def agent_status(host: Host, h: HostRecord) -> dict[str, Any]:
    result = host.run([h.python, "-m", "toolkit.agent", "status", "--job-dir", h.job_dir], timeout=30, check=True)
    return json.loads(result.stdout)


def agent_alive(host: Host, h: HostRecord) -> bool:
    return bool(agent_status(host, h).get("alive"))


# --- helpers -----------------------------------------------------------------------------------------------------


def ssh_settings(settings: Settings) -> SshSettings:
    return SshSettings(
        known_hosts=settings.known_hosts,
        accept_new_host_keys=settings.accept_new_host_keys,
        ssh_config=settings.core.ssh_config,
        identity_files=settings.core.identities,
        connect_timeout=settings.core.connect_timeout,
        parallel=settings.parallel,
    )


def record_ssh(record: JobRecord) -> SshSettings:
    s = record.ssh
    return SshSettings(
        known_hosts=s["known_hosts"],
        accept_new_host_keys=s["accept_new_host_keys"],
        ssh_config=s["ssh_config"],
        identity_files=tuple(s["identities"]),
        connect_timeout=s["connect_timeout"],
        parallel=s["parallel"],
    )


def record_targets(record: JobRecord) -> list[Target]:
    return [_target(h, record.local) for h in record.hosts]


def _target(h: HostRecord, local: bool) -> Target:
    hostname = None if h.hostname == h.name else h.hostname
    return Target(h.name, hostname=hostname, port=h.port, user=h.user, key_file=h.key_file, local=local)


def _fan_out(what: str, targets: list[Target], fn: Callable[[Host], Any], ssh: SshSettings) -> dict[str, Any]:
    with rich_progress(what, len(targets)) as progress:
        results: dict[str, HostResult[Any]] = run_on_all(targets, fn, ssh, progress=progress)
    return check_all(results)


def _say(text: str) -> None:
    Console(stderr=True, highlight=False).print(text)


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)
