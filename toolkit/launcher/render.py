"""LaunchPlan -> the files of one host's job directory (docs/architecture.md, "Remote layout").

The templates in templates/ are shared with the Ansible playbooks, so their context is plain data and the only
filter they use for values is `quote` (Ansible has the same one): every value reaches the shell quoted.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from toolkit import atomicfile
from toolkit.contracts import hostspec
from toolkit.errors import UserError
from toolkit.launcher.plan import EXPECTED_FILE, HostPlan, LaunchPlan, Process

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
SCRIPTS = ("launch.sh", "recover.sh", "stop.sh")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: `$` would accept a trailing newline


class RenderError(UserError):
    """The plan holds something that cannot be rendered safely; the message is the one line shown to the user."""


@dataclass(frozen=True)
class RenderedFile:
    """One file of a host's job directory: its path relative to the job directory, its text, and the mode it is
    created with (0600 for the token and env files, 0755 for scripts, 0644 otherwise)."""

    path: str  # relative to the job directory
    content: str
    mode: int


def environment() -> jinja2.Environment:
    """The Jinja environment of templates/: an undefined variable is an error, not an empty string, and `quote`
    (shlex.quote) is the filter that puts values into the shell. No HTML autoescaping: these are shell scripts."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # noqa: S701 - shell scripts, not HTML: values are shell-quoted by the templates
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["quote"] = lambda value: shlex.quote(str(value))
    return env


def render_host(plan: LaunchPlan, host: HostPlan, token: str,
                jinja: jinja2.Environment | None = None) -> list[RenderedFile]:
    """Every file of `host`'s job directory: scripts, host.json, one env file per process, the token (0600), and
    on the scheduler's host expected.json. Writes nothing; RenderError if an environment variable name is unsafe."""
    jinja = jinja or environment()
    context = {
        "job": plan.job,
        "host": host.name,
        "python": host.python,
        "node_ids": [p.node_id for p in host.processes],
    }
    files = [RenderedFile(s, jinja.get_template(f"{s}.j2").render(context), 0o755) for s in SCRIPTS]
    files.append(RenderedFile("host.json", json.dumps(host_spec(plan, host), indent=2) + "\n", 0o644))
    for p in host.processes + host.standby:
        files.append(RenderedFile(env_file(p), render_env(p, jinja), 0o600))
    if host.name == plan.scheduler_host:
        files.append(RenderedFile(EXPECTED_FILE, json.dumps(plan.expected_hosts(), indent=2) + "\n", 0o644))
    files.append(RenderedFile("token", token + "\n", 0o600))
    return files


def render_env(process: Process, jinja: jinja2.Environment | None = None) -> str:
    """The env file of `process`: one `export NAME='value'` line per variable, values shell-quoted. RenderError
    if a variable name is not a shell name (it could not be exported, or would inject code)."""
    bad = [name for name in process.env if not _ENV_NAME.fullmatch(name)]
    if bad:
        raise RenderError(f"{process.node_id}: {bad[0]!r} is not an environment variable name")
    jinja = jinja or environment()
    return jinja.get_template("env.j2").render(node_id=process.node_id, env=dict(process.env))


def env_file(process: Process) -> str:
    """Where the env file of `process` lives, relative to the job directory: env/<node_id>.env."""
    return f"env/{process.node_id}.env"


def host_spec(plan: LaunchPlan, host: HostPlan) -> dict[str, Any]:
    """The agent's input (host.json, toolkit.contracts.hostspec): what to run on this host and how to supervise it; on a
    spare, nothing, and every worker it could take over (`standby`)."""
    o = plan.options

    def entries(processes: tuple[Process, ...]) -> list[dict[str, Any]]:
        return [{"node_id": p.node_id, "role": p.role, "rank": p.rank, "local_rank": p.local_rank,
                 "argv": list(p.argv), "cwd": p.cwd, "env_file": env_file(p), "log_file": f"logs/{p.log_name}"}
                for p in processes]

    return hostspec.document(plan.job, host.name, plan.sched_address, plan.sched_port, o.max_restarts, o.grace,
                             o.bind_core, o.warm_spare, entries(host.processes), entries(host.standby),
                             o.restart_refill)


def plan_json(plan: LaunchPlan) -> dict[str, Any]:
    """The plan as `fleet plan --json` prints it (and the Ansible playbooks read it). Holds no secret."""
    return {
        "job": plan.job,
        "scheduler": {"host": plan.scheduler_host, "address": plan.sched_address, "port": plan.sched_port,
                      "store_port": plan.store_port},
        "world_size": plan.world_size,
        "hosts": [
            {"host": h.name, "address": h.host.reach, "job_dir": h.job_dir, "python": h.python,
             "spec": host_spec(plan, h)}
            for h in plan.hosts
        ],
        "processes": [
            {
                "host": p.host,
                "role": p.role,
                "node_id": p.node_id,
                "rank": p.rank,
                "local_rank": p.local_rank,
                "argv": list(p.argv),
                "cwd": p.cwd,
                "env": dict(p.env),
            }
            for p in plan.processes()
        ],
        # a spare host's standby workers, in the same form: their env files are rendered on the spare too
        "standby": [
            {"host": p.host, "role": p.role, "node_id": p.node_id, "rank": p.rank, "local_rank": p.local_rank,
             "argv": list(p.argv), "cwd": p.cwd, "env": dict(p.env)}
            for h in plan.hosts for p in h.standby
        ],
    }


def write_files(files: list[RenderedFile], job_dir: Path) -> None:
    """Write rendered files under `job_dir` (local mode, and `plan --render`), each with its mode from the start."""
    for f in files:
        path = job_dir / f.path
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomicfile.write(path, f.content, mode=f.mode)
