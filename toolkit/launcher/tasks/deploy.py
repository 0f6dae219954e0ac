"""`plan` and `deploy`: what would run where, and making it so on every host (the job's layout, the rendered files, the
project, the local job record); `record`: the same job record for a deploy the Ansible playbooks made.

`plan` touches no host. `deploy` is safe to repeat: it writes only what changed (rendered files by checksum, the
project by size, mtime and mode), reuses the job's token (so running processes keep their scheduler), and refuses
job directories, and a --ckpt-dir, that other users own or may write (docs/security.md). It starts nothing: `train`
does. The deploying itself is toolkit.launcher.jobhosts.deployment's (shared with `train` and `run`)."""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from toolkit.contracts import jobrecord
from toolkit.contracts.jobrecord import JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts import deployment
from toolkit.launcher.jobhosts.deployment import job_record, launch_plan
from toolkit.launcher.jobhosts.output import dash, say, table_console
from toolkit.launcher.render import plan_json, render_host, write_files
from toolkit.launcher.settings import Settings


def deploy(settings: Settings) -> JobRecord:
    """`fleet deploy`: deploy the job as typed (toolkit.launcher.jobhosts.deployment.deploy, which says how and what it
    raises); returns the job record."""
    return deployment.deploy(settings)


def show_plan(settings: Settings, as_json: bool = False, render_dir: Path | None = None) -> None:
    """`fleet plan`: print which process runs where (a table on stdout, or the plan as JSON), without reaching any
    host. With `render_dir`, also write every host's rendered files under `render_dir/<host>/` for inspection,
    with a throwaway token (the job's real one is made by deploy). Notes on stderr when the script is not in the
    project yet. Raises UserError for an impossible plan."""
    plan = launch_plan(settings)
    if settings.inventory.note:
        say(f"note: {settings.inventory.note}")
    script = Path(settings.options.script)
    if not script.is_absolute() and not (settings.project / script).is_file():
        say(f"note: {script} is not in {settings.project} (yet): deploy will need it there (--project DIR, --script)")
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
        table.add_row(p.host, p.node_id, dash(p.rank), dash(p.local_rank), port, " ".join(p.argv))
    for h in plan.hosts:
        if h.spare:
            table.add_row(h.name, "(spare)", "-", "-", "", "nothing until it takes over a lost host's ranks")
    table_console().print(table)
    if render_dir is not None:
        Console(stderr=True).print(f"rendered files: {render_dir}/<host>/")


def record_deploy(settings: Settings, deployed: bool) -> JobRecord:
    """`fleet record`: the job record (and the job token, made once per job) for a deploy done by other means, the
    Ansible playbooks, which render the same files and then call this on the control node: with `deployed` False
    before they touch a host, True once every host has its files. The record is the one `deploy` would write, so
    `status`, `logs`, `stop`, `restart` and `train` work on a job the playbooks started.

    Reaches no host, so it cannot resolve a workdir there: every host's job directory must be absolute, else
    UserError naming the host (a relative one would be resolved differently on the hosts). Returns the record."""
    plan = launch_plan(settings)
    relative_dirs = [h for h in plan.hosts if not h.job_dir.startswith("/")]
    if relative_dirs:
        h = relative_dirs[0]
        raise UserError(f"host {h.name}: job directory {h.job_dir} is relative; give the hosts an absolute workdir "
                        "(workdir=/path in the inventory, or --workdir /path)")
    token = jobrecord.token(settings.project, plan.job)
    record = replace(job_record(plan, settings, jobrecord.job_id(token)), deployed=deployed)
    jobrecord.save(settings.project, record, typed_in=Path.cwd())
    return record
