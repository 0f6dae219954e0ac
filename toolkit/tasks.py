"""What each command does, given resolved Settings. The Fabric/invoke declarations live in cli.py."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from rich.console import Console
from rich.table import Table

from toolkit.plan import LaunchPlan, make_plan
from toolkit.render import plan_json, render_host, write_files
from toolkit.settings import Settings


def launch_plan(settings: Settings) -> LaunchPlan:
    return make_plan(settings.inventory, settings.options, str(settings.project) if settings.local else None)


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


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)
