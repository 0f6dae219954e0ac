"""What each command does, given resolved Settings. The Fabric/invoke declarations live in cli.py; the SSH
transport in remote.py. Each cluster command contacts every host in parallel and fails with one error that
lists every failed host (root cause first).

`deploy` decides where the job lives and writes the local job record; every later command (`train`, `status`,
`logs`, `stop`, `restart`) reads that record, so no host has to be typed twice. With no hosts at all the same
commands run the job on this machine, without SSH (remote.LocalHost).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import secrets
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from rich.console import Console
from rich.table import Table

from toolkit import jobrecord
from toolkit.errors import UserError
from toolkit.jobrecord import HostRecord, JobRecord
from toolkit.plan import LaunchPlan, make_plan
from toolkit.protocol import RECOVERY_IN_PLACE, RECOVERY_RESTART
from toolkit.remote import (
    DEFAULT_EXCLUDE,
    AuthenticationFailed,
    ChangedHostKey,
    ClusterError,
    Host,
    HostPool,
    HostResult,
    HostUnreachable,
    PreflightFailed,
    SshSettings,
    SyncStats,
    Target,
    UnknownHostKey,
    check_all,
    rich_progress,
    run_on_all,
)
from toolkit.render import RenderedFile, plan_json, render_host, write_files
from toolkit.settings import JOB_OPTIONS, CoreFlags, JobRef, Request, Settings

PROJECT_EXCLUDE = DEFAULT_EXCLUDE + (".toolkit",)
LAUNCH_TIMEOUT = 60.0  # s for launch.sh to report the agent up
STOP_TIMEOUT_EXTRA = 30.0  # s beyond the grace period for stop.sh to finish
STATUS_TIMEOUT = 30.0  # s for one host's status or log command
LOG_LINES = 20  # default of `logs -n`
FAILURE_TAIL_LINES = 10  # log lines shown for a process that ended badly, when its agent recorded none
JOIN_POLL_INTERVAL = 2.0  # s between status polls of `train --join`: remote state cannot be waited on otherwise
JOIN_GONE_AFTER = 60.0  # s a host may be unreachable, or its agent gone, before --join stops watching it
JOIN_SETTLE = 30.0  # s beyond the grace period that --join waits, after a host failed, for the others to stop
FINAL_STATES = ("succeeded", "failed", "stopped")  # an agent in one of these has exited for good
EXIT_JOB_FAILED = 1
EXIT_INTERRUPTED = 130


class JobFailed(UserError):
    """`train --join` saw the job end badly (or stop being observable); the message holds the evidence."""

    exit_code = EXIT_JOB_FAILED


class Interrupted(UserError):
    exit_code = EXIT_INTERRUPTED


def launch_plan(settings: Settings) -> LaunchPlan:
    return make_plan(settings.inventory, settings.options, str(settings.project) if settings.local else None)


# --- plan --------------------------------------------------------------------------------------------------------


def show_plan(settings: Settings, as_json: bool = False, render_dir: Path | None = None) -> None:
    plan = launch_plan(settings)
    script = Path(settings.options.script)
    if not script.is_absolute() and not (settings.project / script).is_file():
        _say(f"note: {script} is not in {settings.project} (yet): deploy will need it there (--project DIR, --script)")
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
    _table_console().print(table)
    if render_dir is not None:
        Console(stderr=True).print(f"rendered files: {render_dir}/<host>/")


# --- deploy ------------------------------------------------------------------------------------------------------

# Makes the job's layout and lists mode and checksum of the rendered files already there, in one round trip, so
# a second deploy of an unchanged job writes none of them.
_LAYOUT_SCRIPT = r"""
d=$1; shift
me=$(id -u)
umask 077
mkdir -p -- "${d%/*}" && mkdir -p -- "$d" || exit 1
for p in "${d%/*}" "$d"; do
    owner=$(stat -c %u -- "$p") mode=$(stat -c %a -- "$p")
    [ "$owner" = "$me" ] || { echo "$p $owner $me"; exit 20; }
    [ $((0$mode & 022)) -eq 0 ] || { echo "$p $mode"; exit 21; }
done
mkdir -p -- "$d/env" "$d/logs" "$d/state" "$d/recovery" "$d/ckpt" && cd -- "$d" \
    && chmod 700 . env logs state recovery ckpt || exit 1
for f; do
    [ -f "$f" ] && printf '%s %s\n' "$(stat -c %a -- "$f")" "$(sha256sum -- "$f")"
done
exit 0
"""
_NOT_OURS, _OPEN_TO_OTHERS = 20, 21  # exit codes of the layout script


def deploy(settings: Settings) -> JobRecord:
    """Make every host's job directory (workdirs resolved on the host), upload the rendered files and the
    project (only what changed), and write the local job record."""
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
    # Recorded before the upload (marked incomplete until it is done): from now on `status` looks where this
    # deploy puts the job, never at an earlier deploy's job directories as if they were this one's.
    jobrecord.save(settings.project, replace(_record(plan, settings), deployed=False), typed_in=Path.cwd())

    def upload(host: Host) -> SyncStats:
        hp = plan.host_plan(host.name)
        stats = _upload_rendered(host, hp.job_dir, render_host(plan, hp, token))
        if plan.local:
            return stats
        project = host.sync_dir(settings.project, f"{hp.job_dir}/project", exclude=PROJECT_EXCLUDE, delete=True)
        return _sum_stats([stats, project])

    def line(r: HostResult[SyncStats]) -> str:
        if not r.ok or r.value is None:
            return f"{r.error}"
        s = r.value
        return (f"{r.host}: {s.files_sent} file(s) sent ({_size(s.bytes_sent)}), {s.files_unchanged} unchanged"
                + (f", {s.removed} removed" if s.removed else "") + f" ({r.seconds:.1f} s)")

    stats = _fan_out("deploying", targets, upload, ssh, line=line)
    outside = sorted({name for st in stats.values() for name in st.outside})
    if outside:
        _say(f"not copied: {len(outside)} symlink(s) pointing out of {settings.project} ({', '.join(outside[:5])}"
             + (", ..." if len(outside) > 5 else "") + "): toolkit never follows a link out of the project")
    record = _record(plan, settings)
    path = jobrecord.save(settings.project, record, typed_in=Path.cwd())
    total = _sum_stats(stats.values())
    _say(f"deployed job {plan.job} to {len(stats)} host(s): {total.files_sent} file(s) sent "
         f"({_size(total.bytes_sent)}), {total.files_unchanged} unchanged; job record {_rel(path)}")
    return record


def _upload_rendered(host: Host, job_dir: str, files: list[RenderedFile]) -> SyncStats:
    result = host.run(["sh", "-c", _LAYOUT_SCRIPT, "sh", job_dir, *(f.path for f in files)], timeout=STATUS_TIMEOUT)
    if result.exit_code == _NOT_OURS:
        path, owner, me = (result.stdout.split() + ["?", "?", "?"])[:3]
        raise UserError(f"{host.name}: {path} belongs to uid {owner}, not to you (uid {me}): another user made it, "
                        "and could change what the job runs; remove it or choose a --workdir of your own")
    if result.exit_code == _OPEN_TO_OTHERS:
        path, mode = (result.stdout.split() + ["?", "?"])[:2]
        raise UserError(f"{host.name}: {path} is writable by other users (mode {mode}): they could change what "
                        f"the job runs; chmod go-w it, or choose a --workdir of your own")
    listing = result.check().stdout
    there: dict[str, tuple[int, str]] = {}
    for entry in listing.splitlines():
        words = entry.split(None, 2)
        if len(words) == 3:
            with contextlib.suppress(ValueError):
                there[words[2]] = (int(words[0], 8), words[1])
    sent = nbytes = 0
    for f in files:
        data = f.content.encode()
        if there.get(f.path) == (f.mode, hashlib.sha256(data).hexdigest()):
            continue
        host.write(f"{job_dir}/{f.path}", data, f.mode)
        sent += 1
        nbytes += len(data)
    return SyncStats(files_sent=sent, bytes_sent=nbytes, files_unchanged=len(files) - sent)


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
            ckpt_dir=h.ckpt_dir,
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
    return JobRecord(plan.job, plan.local, plan.scheduler_host, plan.sched_port, hosts, processes, ssh,
                     grace=plan.options.grace, options={name: getattr(plan.options, name) for name in JOB_OPTIONS})


# --- train -------------------------------------------------------------------------------------------------------


def load_record(ref: JobRef) -> JobRecord:
    """The deployed job a command means, checked against what was typed: a flag that contradicts the record is
    an error (deploy again to change the job), never silently ignored."""
    record = jobrecord.load(ref.project, ref.job, ref.default_job)
    wrong = ref.request.contradictions(record.job, record.options, tuple(h.name for h in record.hosts), record.local)
    if wrong:
        raise UserError("; ".join(wrong) + f": run 'fleet deploy' with the new values to change job {record.job} "
                        "(or leave the flags out: every task reads them from the job record)")
    return record


def train(request: Request, join: bool = False, join_timeout: float | None = None, fresh: bool = False,
          again: bool = False) -> None:
    """Start the deployed job on every host at once (deploying it first if it never was); all or nothing: if a
    host fails to start, what started elsewhere is stopped. With `join`, wait for the job to end.

    A job whose every host finished successfully is not started again by accident (its workers would resume
    from their final checkpoints and end at once): `fresh` starts it over (its checkpoints and state are moved
    aside, never deleted), `again` runs it once more from where it ended (with more epochs, say)."""
    if fresh and again:
        raise UserError("--fresh and --again both given: start the job over (--fresh) or go on from where it "
                        "ended (--again), not both")
    ref = request.job_ref()
    record = None
    name = jobrecord.choose(ref.project, ref.job, ref.default_job)
    if name is not None and jobrecord.exists(ref.project, name):
        record = load_record(ref)
    if record is None or not record.deployed:  # never deployed, or its last deploy did not complete
        record = deploy(request.settings())
    ssh = record_ssh(record, request.core)
    sched = record.host(record.scheduler_host)
    port = record.sched_port
    _previous_run(record, ssh, fresh=fresh, again=again)

    def start(host: Host) -> bool:
        """True if this call started the agent (False: it already ran)."""
        h = record.host(host.name)
        if h.name == sched.name and not _poll_status(host, h)["doc"]["alive"]:
            host.preflight(h.python, h.job_dir, ports=(port, port + 1))
        out = host.run([f"{h.job_dir}/launch.sh"], timeout=LAUNCH_TIMEOUT, check=True).stdout
        return "already running" not in out

    begun = time.monotonic()
    with rich_progress("starting", len(record.hosts)) as progress:
        results = run_on_all(record_targets(record), start, ssh, progress=progress, fail_fast=True)
    if any(not r.ok for r in results.values()):
        _roll_back(record, ssh, results)
    fresh = sum(1 for r in results.values() if r.value)
    already = "" if fresh == len(results) else f" ({len(results) - fresh} already running)"
    _say(f"job {record.job} started on {len(results)} host(s){already} in {time.monotonic() - begun:.1f} s: "
         f"{record.world_size} worker(s), scheduler on {record.scheduler_host}:{port}; "
         "follow it with 'fleet status' and 'fleet logs -f', end it with 'fleet stop'")
    if join:
        join_job(record, ssh, join_timeout)


@dataclass(frozen=True)
class Finished:
    """A run that ended with every host's agent succeeded: the job is done."""

    step: int | None  # the last step any worker reported
    at: str | None  # when the last agent recorded it (its own clock)


def finished_run(hosts: list[HostStatus]) -> Finished | None:
    """The job's previous run, if every host reached says it succeeded (None while anything runs, or ended
    otherwise: a stopped or failed run is resumed by the next `train`)."""
    if not hosts or not all(h.reached and h.agent == "succeeded" for h in hosts):
        return None
    steps = [p.step for h in hosts for p in h.processes if p.role == "worker" and p.step is not None]
    stamps = [h.updated_at for h in hosts if h.updated_at]
    return Finished(max(steps) if steps else None, max(stamps) if stamps else None)


# Moves a run's checkpoints, scheduler state and agent.json aside under one stamp (a shared checkpoint directory
# is moved once: the first host's mv wins, the others find nothing to move).
_ARCHIVE_SCRIPT = r"""
d=$1 ckpt=$2 stamp=$3
for p in "$ckpt" "$d/recovery"; do
    if [ -e "$p" ]; then mv -- "$p" "$p.previous-$stamp" && echo "moved $p to $p.previous-$stamp"; fi
done
if [ -e "$d/state/agent.json" ]; then mv -- "$d/state/agent.json" "$d/state/agent.previous-$stamp.json"; fi
exit 0
"""


def _previous_run(record: JobRecord, ssh: SshSettings, fresh: bool, again: bool) -> None:
    """Refuse to start a finished job again unless told how (see `train`); with `fresh`, move its previous run
    aside on every host, so that the new run starts from step 0 and no status shows the old run's processes."""
    hosts = collect_status(record, ssh)
    alive = [h.host for h in hosts if h.alive]
    if alive:
        if fresh:
            raise UserError(f"job {record.job} is running on {', '.join(alive)}: stop it first ('fleet stop'), "
                            "then 'fleet train --fresh' starts it over")
        return
    done = finished_run(hosts)
    if done is not None and not (fresh or again):
        step = f" at step {done.step}" if done.step is not None else ""
        when = f" ({done.at})" if done.at else ""
        raise UserError(f"job {record.job} already finished{step}{when}: nothing to train. 'fleet train --fresh' "
                        "trains it again from the start (its checkpoints and state are moved aside, not deleted), "
                        "'fleet train --again' goes on from its final checkpoints (e.g. with more epochs), or "
                        "deploy it under another --job name")
    if not fresh:
        return
    stamp = time.strftime("%Y%m%dT%H%M%S")

    def archive(host: Host) -> str:
        h = record.host(host.name)
        return host.run(["sh", "-c", _ARCHIVE_SCRIPT, "sh", h.job_dir, h.ckpt_dir or f"{h.job_dir}/ckpt", stamp],
                        timeout=STATUS_TIMEOUT, check=True).stdout.strip()

    moved = _fan_out("moving the previous run aside", record_targets(record), archive, ssh)
    for name, text in moved.items():
        for line in text.splitlines():
            _say(f"{name}: {line}")


def _roll_back(record: JobRecord, ssh: SshSettings, results: Mapping[str, HostResult[bool]]) -> None:
    """Stop the job where this train started it (or may have), then raise the start failure."""
    never = (HostUnreachable, AuthenticationFailed, UnknownHostKey, ChangedHostKey, PreflightFailed)
    started = [record.host(n) for n, r in results.items()
               if (r.ok and r.value) or (not r.ok and not r.skipped and not isinstance(r.exception, never))]
    error = ClusterError(results)
    lines = [str(error)]
    if started:
        stopped = run_on_all([_target(h, record.local) for h in started],
                             lambda host: _stop_one(host, record), ssh)
        ok = [n for n, r in stopped.items() if r.ok]
        bad = [r for r in stopped.values() if not r.ok]
        if ok:
            lines.append(f"stopped the job again on {', '.join(ok)}: no process of it is left there")
        lines += [f"could not stop it on {r.error}; run 'fleet stop' once the host is back" for r in bad]
    else:
        lines.append("nothing was started")
    raise UserError("\n".join(lines))


# --- stop --------------------------------------------------------------------------------------------------------

_STOP_SCRIPT = r"""
if [ -x "$1/stop.sh" ]; then exec "$1/stop.sh"; fi
echo "$2: nothing deployed in $1: nothing to stop"
"""


def stop(ref: JobRef) -> None:
    """Stop the job on every host (SIGTERM, grace, SIGKILL) and verify that no process of it remains."""
    record = load_record(ref)
    ssh = record_ssh(record, ref.request.core)
    with rich_progress("stopping", len(record.hosts), line=_result_line) as progress:
        results = run_on_all(record_targets(record), lambda host: _stop_one(host, record), ssh, progress=progress)
    try:
        check_all(results)
    except ClusterError as e:
        raise UserError(f"{e}\nthe job may still run there: run 'fleet stop' again once the host answers") from None
    _say(f"job {record.job} stopped on {len(results)} host(s); each verified that no process of the job is left")


def _stop_one(host: Host, record: JobRecord) -> str:
    h = record.host(host.name)
    result = host.run(["sh", "-c", _STOP_SCRIPT, "sh", h.job_dir, h.name],
                      timeout=record.grace + STOP_TIMEOUT_EXTRA, check=True)
    return result.stdout.strip()


# --- restart -----------------------------------------------------------------------------------------------------


def restart(ref: JobRef, node: str | None, host_name: str | None) -> None:
    """Restart one process by hand through its agent, with the same environment (`--node`, what recover.sh
    does on the host), or every process of one host (`--host`; starts the host's agent if it is gone)."""
    if (node is None) == (host_name is None):
        raise UserError("restart needs exactly one of --node NODE_ID (e.g. worker_3) or --host HOST")
    record = load_record(ref)
    h = record.host(record.process(node)["host"]) if node is not None else record.host(host_name)  # type: ignore

    def do(host: Host) -> str:
        if node is not None:
            return host.run([f"{h.job_dir}/recover.sh", node], timeout=LAUNCH_TIMEOUT, check=True).stdout.strip()
        if not _poll_status(host, h)["doc"]["alive"]:
            return host.run([f"{h.job_dir}/launch.sh"], timeout=LAUNCH_TIMEOUT, check=True).stdout.strip()
        return "\n".join(host.run([f"{h.job_dir}/recover.sh", n], timeout=LAUNCH_TIMEOUT, check=True).stdout.strip()
                         for n in h.node_ids)

    out = check_all(run_on_all([_target(h, record.local)], do, record_ssh(record, ref.request.core)))[h.name]
    _say(out or f"restarted {node or host_name}")


# --- status ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStatus:
    """One process as its host's agent sees it."""

    host: str
    node_id: str
    role: str  # "sched" or "worker"
    rank: int | None
    pid: int | None
    state: str  # the agent's (running, backoff, restarting, succeeded, failed, stopped), or gone, unreachable
    restarts: int
    step: int | None
    log_age: float | None  # s since its log was last written, by the host's clock
    last_exit: str | None  # "exit code 3", "killed by SIGKILL"
    recovery: str | None = None  # how the worker said it recovers (protocol.RECOVERY_*), once it has

    @property
    def prefix(self) -> str:
        """`host:role:rank`, what every line of output about this process starts with."""
        return f"{self.host}:{self.role}:{_dash(self.rank)}"


@dataclass(frozen=True)
class HostStatus:
    host: str
    reached: bool
    error: str | None  # why the host could not be asked
    agent: str  # the agent's state (starting, running, finishing, stopping, succeeded, failed, stopped), gone,
    # absent (never started), unreachable
    alive: bool
    agent_pid: int | None
    reason: str | None  # why the agent ended
    failure: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)  # the give-up evidence
    processes: tuple[ProcStatus, ...] = ()
    updated_at: str | None = None  # when the agent last wrote its state (the host's clock)


_STATUS_SCRIPT = r"""
py=$1 d=$2
if [ -f "$d/host.json" ]; then
    "$py" -m toolkit.agent status --job-dir "$d" || exit
else
    echo '{"state": "absent", "alive": false, "processes": []}'
fi
printf '\036\n'
date +%s.%N
find "$d/logs" -maxdepth 1 -name '*.log' -printf '%T@ %f\n' 2>/dev/null
exit 0
"""

# What --join polls: the agent's own files, read without starting a Python on every host every interval.
# Liveness is decided here as `agent status` decides it: the pid file's process exists, is no zombie and
# started at the recorded clock tick, and agent.json was written by it.
_POLL_SCRIPT = r"""
d=$1
cat -- "$d/state/agent.pid" 2>/dev/null; printf '\036\n'
{ read -r pid _ < "$d/state/agent.pid"; } 2>/dev/null && cat "/proc/$pid/stat" 2>/dev/null; printf '\036\n'
cat -- "$d/state/agent.json" 2>/dev/null; printf '\036\n'
date +%s.%N
find "$d/logs" -maxdepth 1 -name '*.log' -printf '%T@ %f\n' 2>/dev/null
exit 0
"""


def status(ref: JobRef, as_json: bool = False) -> None:
    """One table of every process of the job (or JSON); a host that cannot be asked gets a row saying so, and
    the command then ends non-zero after listing the failed hosts."""
    record = load_record(ref)
    results = run_on_all(record_targets(record), lambda host: _fetch_status(host, record.host(host.name)),
                         record_ssh(record, ref.request.core))
    hosts = [_host_status(record, name, r) for name, r in results.items()]
    if as_json:
        print(json.dumps(_status_json(record, hosts), indent=2))
    else:
        _print_status(record, hosts)
    if any(not r.ok for r in results.values()):
        raise ClusterError(results)


def collect_status(record: JobRecord, ssh: SshSettings, pool: HostPool | None = None,
                   hosts: list[HostRecord] | None = None) -> list[HostStatus]:
    """Every host's status from its agent's files (cheap enough to poll; see _POLL_SCRIPT)."""
    chosen = record.hosts if hosts is None else hosts
    results = run_on_all([_target(h, record.local) for h in chosen],
                         lambda host: _poll_status(host, record.host(host.name)), ssh, pool=pool)
    return [_host_status(record, name, r) for name, r in results.items()]


def _fetch_status(host: Host, h: HostRecord) -> dict[str, Any]:
    out = host.run(["sh", "-c", _STATUS_SCRIPT, "sh", h.python, h.job_dir], timeout=STATUS_TIMEOUT, check=True)
    doc_text, _, rest = out.stdout.partition("\x1e\n")
    try:
        doc = json.loads(doc_text)
    except ValueError:
        raise UserError(f"{h.name}: the agent's status is not JSON: {doc_text.strip()[:200]}") from None
    return {"doc": doc, **_clock_and_logs(rest)}


def _poll_status(host: Host, h: HostRecord) -> dict[str, Any]:
    out = host.run(["sh", "-c", _POLL_SCRIPT, "sh", h.job_dir], timeout=STATUS_TIMEOUT, check=True).stdout
    pid_text, stat_text, doc_text, rest = (out.split("\x1e\n", 3) + ["", "", ""])[:4]
    try:
        doc = json.loads(doc_text) if doc_text.strip() else None
    except ValueError:
        doc = None  # written atomically, so this is not a half-written file: treat as unknown
    alive, pid = _alive(pid_text, stat_text)
    if doc is None:
        doc = {"state": "absent", "processes": []}
    alive = alive and (doc.get("agent") or {}).get("pid") == pid
    if not alive and doc.get("state") not in FINAL_STATES + ("absent",):
        doc["state"] = "gone"
    return {"doc": {**doc, "alive": alive}, **_clock_and_logs(rest)}


def _alive(pid_text: str, stat_text: str) -> tuple[bool, int | None]:
    words = pid_text.split()
    try:
        pid, ticks = int(words[0]), int(words[1])  # a pid alone is never trusted (pids are reused)
    except (IndexError, ValueError):
        return False, None
    fields = stat_text.rsplit(")", 1)[-1].split()
    if len(fields) < 20:
        return False, pid
    state, started = fields[0], fields[19]
    return state not in ("Z", "X") and str(ticks) == started, pid


def _clock_and_logs(text: str) -> dict[str, Any]:
    lines = text.splitlines()
    try:
        now = float(lines[0])
    except (IndexError, ValueError):
        now = None
    mtimes = {}
    for line in lines[1:]:
        stamp, _, name = line.partition(" ")
        with contextlib.suppress(ValueError):
            mtimes[name] = float(stamp)
    return {"now": now, "mtimes": mtimes}


def _host_status(record: JobRecord, name: str, result: HostResult[dict[str, Any]]) -> HostStatus:
    expected = [p for p in record.processes if p["host"] == name]
    if not result.ok or result.value is None:
        procs = tuple(_proc(name, p, {}, "unreachable", None, {}) for p in expected)
        return HostStatus(name, False, result.error, "unreachable", False, None, None, None, procs)
    doc, now, mtimes = result.value["doc"], result.value["now"], result.value["mtimes"]
    agent = str(doc.get("state") or "absent")
    alive = bool(doc.get("alive"))
    seen = {p.get("node_id"): p for p in doc.get("processes") or [] if isinstance(p, dict)}
    procs = []
    for p in expected:
        got = seen.get(p["node_id"], {})
        state = str(got.get("state") or ("not started" if agent == "absent" else "unknown"))
        if agent == "gone" and state not in FINAL_STATES:
            state = "gone"
        procs.append(_proc(name, p, got, state, now, mtimes))
    pid = (doc.get("agent") or {}).get("pid")
    updated = doc.get("updated_at")
    return HostStatus(name, True, None, agent, alive, pid if isinstance(pid, int) else None, doc.get("reason"),
                      doc.get("failure"), tuple(procs), updated if isinstance(updated, str) else None)


def _proc(host: str, p: Mapping[str, Any], got: Mapping[str, Any], state: str, now: float | None,
          mtimes: Mapping[str, float]) -> ProcStatus:
    log_name = p["log"].rsplit("/", 1)[-1]
    age = None
    if now is not None and log_name in mtimes:
        age = max(0.0, now - mtimes[log_name])
    last = got.get("last_exit") or None
    how = None
    if isinstance(last, dict):
        how = f"killed by {last['signal']}" if last.get("signal") else f"exit code {last.get('code')}"
    step = got.get("step")
    return ProcStatus(
        host=host,
        node_id=p["node_id"],
        role="worker" if p["rank"] is not None else "sched",
        rank=p["rank"],
        pid=got.get("pid") if state not in ("gone", "unreachable") else None,
        state=state,
        restarts=int(got.get("restarts") or 0),
        step=step if isinstance(step, int) else None,
        log_age=age,
        last_exit=how,
        recovery=got.get("recovery") if got.get("recovery") in (RECOVERY_IN_PLACE, RECOVERY_RESTART) else None,
    )


# What each recovery mode means, and why a job runs in it: status says it in one line.
RECOVERY_WHY = {
    RECOVERY_IN_PLACE: "in place: the script uses toolkit.train, so after a fault the survivors re-form the group "
                       "and the replacement takes the state from a peer",
    RECOVERY_RESTART: "restart: the script initialises torch.distributed itself (a torchrun-style script), so a "
                      "fault relaunches every worker, which resume from the script's own checkpoints",
}


def recovery_mode(processes: list[ProcStatus], forced: bool = False) -> dict[str, str] | None:
    """The job's recovery mode as its workers reported it ({"mode", "why"}), None before any did."""
    modes = {p.recovery for p in processes if p.role == "worker" and p.recovery}
    if not modes:
        return None
    mode = RECOVERY_RESTART if RECOVERY_RESTART in modes else RECOVERY_IN_PLACE
    why = RECOVERY_WHY[mode]
    if forced and mode == RECOVERY_RESTART:
        why = "restart: --torchrun-script asks for it: a fault relaunches every worker"
    elif len(modes) > 1:
        why += " (some workers use toolkit.train, some do not: the job restarts as a whole)"
    return {"mode": mode, "why": why}


def _status_json(record: JobRecord, hosts: list[HostStatus]) -> dict[str, Any]:
    return {
        "job": record.job,
        "scheduler": {"host": record.scheduler_host, "port": record.sched_port},
        "world_size": record.world_size,
        "recovery": recovery_mode([p for h in hosts for p in h.processes], bool(record.options.get("torchrun_script"))),
        "hosts": [{k: v for k, v in asdict(h).items() if k != "processes"} for h in hosts],
        "processes": [asdict(p) for h in hosts for p in h.processes],
    }


def _print_status(record: JobRecord, hosts: list[HostStatus]) -> None:
    table = Table(title=f"job {record.job}: {record.world_size} worker(s) on {len(record.hosts)} host(s), "
                        f"scheduler {record.scheduler_host}:{record.sched_port}")
    for column in ("host", "node id", "rank", "pid", "state", "restarts", "last step", "log age"):
        table.add_column(column, justify="right" if column in ("rank", "pid", "restarts", "last step") else "left")
    for h in hosts:
        for p in h.processes:
            table.add_row(p.host, p.node_id, _dash(p.rank), _dash(p.pid), p.state, str(p.restarts), _dash(p.step),
                          _age(p.log_age))
    _table_console().print(table)
    for h in hosts:
        note = _host_note(h)
        if note:
            _say(note)
    mode = recovery_mode([p for h in hosts for p in h.processes], bool(record.options.get("torchrun_script")))
    if mode is not None:
        _say(f"recovery: {mode['why']}")


def _host_note(h: HostStatus) -> str | None:
    if not h.reached:
        return None  # listed by the error that follows
    if h.agent == "gone":
        return (f"{h.host}: the agent is gone (it stopped without finishing the job): its processes show as gone; "
                f"'fleet restart --host {h.host}' starts it again")
    if h.agent == "absent":
        return f"{h.host}: the job was never started here; 'fleet train' starts it"
    if h.agent == "failed":
        return f"{h.host}: failed: {h.reason or 'no reason recorded'}"
    if h.agent == "stopped":
        return f"{h.host}: stopped ({h.reason or 'by the operator'})"
    return None


# --- logs --------------------------------------------------------------------------------------------------------

_TAIL_HEADER = re.compile(r"^==> (.*) <==$")
_TAIL_MISSING = re.compile(r"cannot open '(.*)' for reading")


def logs(ref: JobRef, node: str | None = None, rank: int | None = None, host_name: str | None = None,
         follow: bool = False, lines: int = LOG_LINES) -> None:
    """The last `lines` lines of the chosen processes' logs (msrun's names: scheduler.log, worker_<rank>.log),
    each prefixed host:role:rank; with `follow`, keep printing new lines from every host until Ctrl-C."""
    if lines < 0:
        raise UserError(f"-n {lines}: give 0 or more lines")
    record = load_record(ref)
    chosen = _choose(record, node, rank, host_name)
    by_host: dict[str, list[Mapping[str, Any]]] = {}
    for p in chosen:
        by_host.setdefault(p["host"], []).append(p)
    ssh = record_ssh(record, ref.request.core)
    targets = [_target(record.host(n), record.local) for n in by_host]
    out = _Printer()

    def files(name: str) -> dict[str, str]:
        h = record.host(name)
        return {f"{h.job_dir}/{p['log']}": _prefix(p) for p in by_host[name]}

    if not follow:
        def fetch(host: Host) -> tuple[list[tuple[str, str]], list[str]]:
            paths = files(host.name)
            result = host.run(["tail", "-v", "-n", str(lines), "--", *paths], timeout=STATUS_TIMEOUT)
            if not result.ok and (result.exit_code is None or not (result.stdout or "cannot open" in result.stderr)):
                result.check()
            got: list[tuple[str, str]] = []
            parser = _TailParser(paths, lambda prefix, line: got.append((prefix, line)))
            for line in result.stdout.splitlines():
                parser(line)
            return got, _missing(result.stderr, paths)

        results = run_on_all(targets, fetch, ssh)
        for r in results.values():
            if r.ok and r.value is not None:
                got, missing = r.value
                for prefix, line in got:
                    out.line(prefix, line)
                for note in missing:
                    _say(note)
        check_all(results)
        return

    stop_event = threading.Event()

    def follow_one(host: Host) -> None:
        paths = files(host.name)
        parser = _TailParser(paths, out.line)
        # --pid: if this end vanishes without killing it, tail still ends once the SSH session's process does.
        command = f'exec tail -v -F -n {lines} --pid="$PPID" -- ' + " ".join(shlex.quote(p) for p in paths)
        result = host.stream(command, parser, stop_event)
        for note in _missing(result.stderr, paths):
            _say(note)
        if not result.stopped:
            result.check()
            raise UserError(f"{host.name}: tail ended on its own ({result.describe()})")

    def ended(r: HostResult[None]) -> None:
        if not r.ok and not stop_event.is_set():
            _say(f"{r.error}; no more lines from {r.host}")

    with _interrupt_sets(stop_event):
        results = run_on_all(targets, follow_one, replace(ssh, parallel=max(1, len(targets))), progress=ended)
    failed = {n: r for n, r in results.items() if not r.ok}
    if failed:
        raise ClusterError(results)


def _choose(record: JobRecord, node: str | None, rank: int | None, host_name: str | None) -> list[Mapping[str, Any]]:
    given = [x for x in (node, rank, host_name) if x is not None]
    if len(given) > 1:
        raise UserError("give one of --node, --rank or --host (or none for every process)")
    if node is not None:
        return [record.process(node)]
    if rank is not None:
        return [record.process_of_rank(rank)]
    if host_name is not None:
        record.host(host_name)
        return [p for p in record.processes if p["host"] == host_name]
    return list(record.processes)


def _prefix(p: Mapping[str, Any]) -> str:
    return f"{p['host']}:{'sched' if p['rank'] is None else 'worker'}:{_dash(p['rank'])}"


def _missing(stderr: str, paths: Mapping[str, str]) -> list[str]:
    notes = []
    for line in stderr.splitlines():
        m = _TAIL_MISSING.search(line)
        if m and m.group(1) in paths:
            notes.append(f"{paths[m.group(1)]}: no log yet ({m.group(1)})")
    return notes


class _TailParser:
    """`tail -v` output (a `==> path <==` header before each file's lines, a blank line before every header but
    the first) -> (prefix, line) for each line of the logs."""

    def __init__(self, prefixes: Mapping[str, str], emit: Callable[[str, str], None]) -> None:
        self.prefixes = prefixes
        self.emit = emit
        self.current = next(iter(prefixes.values()), "?")
        self.blank = False  # a blank line held back: it may be the separator before the next header

    def __call__(self, line: str) -> None:
        m = _TAIL_HEADER.match(line)
        if m and m.group(1) in self.prefixes:
            self.current, self.blank = self.prefixes[m.group(1)], False
            return
        if self.blank:
            self.emit(self.current, "")
            self.blank = False
        if line == "":
            self.blank = True
            return
        self.emit(self.current, line)


class _Printer:
    """Whole lines to stdout from several threads at once, each with its prefix."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def line(self, prefix: str, text: str) -> None:
        with self.lock:
            sys.stdout.write(f"{prefix} | {text}\n")
            sys.stdout.flush()


@contextlib.contextmanager
def _interrupt_sets(event: threading.Event) -> Iterator[None]:
    """Ctrl-C (SIGINT) sets `event` instead of raising in the middle of a fan-out, so every thread can end its
    remote command cleanly. Only the main thread can install a handler; elsewhere the event is all there is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# --- join --------------------------------------------------------------------------------------------------------


def join_job(record: JobRecord, ssh: SshSettings, timeout: float | None = None,
             interval: float = JOIN_POLL_INTERVAL) -> None:
    """Wait until the job ends, printing every change of state; return if every worker succeeded, else raise
    JobFailed with the evidence (node, host, exit status, log tail). A host that cannot be asked, or whose
    agent is gone, for JOIN_GONE_AFTER is no longer watched and counts as a failure. After a host failed, the
    others get the grace period and JOIN_SETTLE to stop (the scheduler stops them); what still runs then is
    stopped, so a failed job leaves nothing behind."""
    if timeout is not None and timeout <= 0:
        raise UserError(f"--join-timeout {timeout:g}: give a positive number of seconds")
    begun = time.monotonic()
    deadline = None if timeout is None else begun + timeout
    interrupted = threading.Event()
    seen: dict[tuple[str, str], tuple[Any, ...]] = {}
    agents: dict[str, str] = {}
    trouble_since: dict[str, float] = {}
    unwatched: dict[str, str] = {}  # host -> why it is no longer watched
    failed_at: float | None = None
    last: dict[str, HostStatus] = {}
    with HostPool() as pool, _interrupt_sets(interrupted):
        while True:
            watched = [h for h in record.hosts if h.name not in unwatched]
            now = time.monotonic()
            for st in collect_status(record, ssh, pool, watched):
                last[st.host] = st
                _report_changes(st, seen, agents)
                if st.agent == "unreachable" or st.agent == "gone":
                    since = trouble_since.setdefault(st.host, now)
                    if now - since >= JOIN_GONE_AFTER:
                        why = (st.error or "unreachable") if st.agent == "unreachable" else "its agent is gone"
                        unwatched[st.host] = f"{why} for {now - since:.0f} s"
                        _say(f"{st.host}: {unwatched[st.host]}: no longer watched")
                else:
                    trouble_since.pop(st.host, None)
            states = {h.name: last[h.name].agent for h in record.hosts if h.name not in unwatched}
            if all(s in FINAL_STATES for s in states.values()):
                break
            if failed_at is None and (unwatched or any(s in ("failed", "stopped") for s in states.values())):
                failed_at = now
            if failed_at is not None and now - failed_at > record.grace + JOIN_SETTLE:
                running = [n for n, s in states.items() if s not in FINAL_STATES]
                _say(f"the job failed but is still running on {', '.join(running)} after "
                     f"{now - failed_at:.0f} s: stopping it there")
                check_all(run_on_all([_target(record.host(n), record.local) for n in running],
                                     lambda host: _stop_one(host, record), ssh))
                last.update({st.host: st for st in collect_status(record, ssh, pool,
                                                                  [record.host(n) for n in running])})
                break
            wait = interval
            if deadline is not None:
                if now >= deadline:
                    raise JobFailed(f"job {record.job} still runs after --join-timeout {timeout:g} s; it keeps "
                                    "running: 'fleet status' to look, 'fleet stop' to end it")
                wait = min(wait, deadline - now)
            if interrupted.wait(wait):
                raise Interrupted(f"stopped waiting for job {record.job}; it keeps running: 'fleet status' to "
                                  "look, 'fleet stop' to end it")
    hosts = [last[h.name] for h in record.hosts]
    took = time.monotonic() - begun
    if not unwatched and all(h.agent == "succeeded" for h in hosts):
        _say(f"job {record.job} succeeded: every worker exited 0 ({took:.1f} s)")
        return
    raise JobFailed(_failure_text(record, hosts, unwatched, took, _failed_tails(record, ssh, hosts)))


def _failed_tails(record: JobRecord, ssh: SshSettings, hosts: list[HostStatus]) -> dict[str, list[str]]:
    """The last log lines of every process that ended badly on a host that recorded no give-up evidence of its
    own (a scheduler that stopped the job, a process stopped with an error status), best effort."""
    wanted: dict[str, list[ProcStatus]] = {}
    for h in hosts:
        if h.reached and not h.failure:
            bad = [p for p in h.processes if p.last_exit and p.last_exit != "exit code 0"
                   and p.state not in ("running", "succeeded")]
            if bad:
                wanted[h.host] = bad
    if not wanted:
        return {}

    def tails(host: Host) -> dict[str, list[str]]:
        h = record.host(host.name)
        out = {}
        for p in wanted[host.name]:
            log = f"{h.job_dir}/{record.process(p.node_id)['log']}"
            result = host.run(["tail", "-n", str(FAILURE_TAIL_LINES), "--", log], timeout=STATUS_TIMEOUT)
            out[p.node_id] = result.stdout.splitlines() if result.ok else []
        return out

    results = run_on_all([_target(record.host(n), record.local) for n in wanted], tails, ssh)
    return {node: lines for r in results.values() if r.ok and r.value for node, lines in r.value.items()}


def _report_changes(st: HostStatus, seen: dict[tuple[str, str], tuple[Any, ...]], agents: dict[str, str]) -> None:
    if agents.get(st.host) != st.agent:
        agents[st.host] = st.agent
        if st.agent not in ("running", "starting"):
            why = f" ({st.reason})" if st.reason and st.agent in FINAL_STATES else ""
            _emit(f"{st.host}: agent {st.agent}{why}" if st.agent != "unreachable" else f"{st.error}")
    for p in st.processes:
        key = (p.state, p.pid, p.restarts)
        if seen.get((p.host, p.node_id)) == key:
            continue
        seen[(p.host, p.node_id)] = key
        parts = [p.state]
        if p.pid is not None:
            parts.append(f"pid {p.pid}")
        if p.restarts:
            parts.append(f"{p.restarts} restart(s)")
        if p.last_exit and p.last_exit != "exit code 0":
            parts.append(f"last exit: {p.last_exit}")
        _emit(f"{p.prefix} {', '.join(parts)}")


def _failure_text(record: JobRecord, hosts: list[HostStatus], unwatched: Mapping[str, str], took: float,
                  tails: Mapping[str, list[str]]) -> str:
    lines = [f"job {record.job} failed after {took:.1f} s"]
    causes = [h for h in hosts if h.failure]
    for h in causes:
        f = h.failure or {}
        role = "sched" if f.get("rank") is None else "worker"
        prefix = f"{h.host}:{role}:{_dash(f.get('rank'))}"
        lines.append(f"{f.get('node_id')} on {h.host} (rank {_dash(f.get('rank'))}, pid {_dash(f.get('pid'))}): "
                     f"{f.get('status')} after {f.get('restarts', 0)} restart(s); last lines of {f.get('log_file')}:")
        lines += [f"  {prefix} | {line}" for line in f.get("log_tail") or []]
    for h in hosts:
        if h.host in unwatched:
            lines.append(f"{h.host}: {unwatched[h.host]}")
        elif not h.failure and h.agent != "succeeded":
            lines.append(f"{h.host}: {h.agent}" + (f": {h.reason}" if h.reason else ""))
            for p in h.processes:
                if p.node_id in tails:
                    lines.append(f"  {p.node_id} on {h.host} ({p.state}, last exit: {p.last_exit}); last lines:")
                    lines += [f"    {p.prefix} | {line}" for line in tails[p.node_id]]
    return "\n".join(lines)


def _emit(text: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    sys.stdout.write(f"{stamp} {text}\n")
    sys.stdout.flush()


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


def record_ssh(record: JobRecord, core: CoreFlags | None = None) -> SshSettings:
    """How deploy reached the hosts; Fabric's own flags typed now (-S, -i, -t) take precedence."""
    s = record.ssh
    return SshSettings(
        known_hosts=s["known_hosts"],
        accept_new_host_keys=s["accept_new_host_keys"],
        ssh_config=(core.ssh_config if core and core.ssh_config else None) or s["ssh_config"],
        identity_files=(core.identities if core and core.identities else None) or tuple(s["identities"]),
        connect_timeout=(core.connect_timeout if core and core.connect_timeout else None) or s["connect_timeout"],
        parallel=s["parallel"],
    )


def record_targets(record: JobRecord) -> list[Target]:
    return [_target(h, record.local) for h in record.hosts]


def _target(h: HostRecord, local: bool) -> Target:
    hostname = None if h.hostname == h.name else h.hostname
    return Target(h.name, hostname=hostname, port=h.port, user=h.user, key_file=h.key_file, local=local)


def _fan_out(what: str, targets: list[Target], fn: Callable[[Host], Any], ssh: SshSettings,
             line: Callable[[HostResult[Any]], str | None] | None = None) -> dict[str, Any]:
    with rich_progress(what, len(targets), line=line) as progress:
        results: dict[str, HostResult[Any]] = run_on_all(targets, fn, ssh, progress=progress)
    return check_all(results)


def _result_line(r: HostResult[Any]) -> str | None:
    return (str(r.value) if r.value else None) if r.ok else r.error


def _sum_stats(stats: Any) -> SyncStats:
    stats = list(stats)
    return SyncStats(*(sum(getattr(s, f) for s in stats) for f in
                       ("files_sent", "bytes_sent", "files_unchanged", "dirs_created", "removed")),
                     outside=tuple(sorted({name for s in stats for name in s.outside})))


def _table_console() -> Console:
    """A terminal's width on a terminal; elsewhere (a pipe, a file, a test) the table's own width, so that
    no host name or state is cut short to fit 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=1000)


def _say(text: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(text, markup=False)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n:.1f} GB"


def _rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)
