"""host.json: what one host runs and how its agent supervises it. The one definition of that document: its
fields, version, defaults and validation (`load`), and how it is made from a launch plan (`document`), which the
renderer writes and the Ansible playbooks copy. Read by the agent (`python -m toolkit.agent --job-dir DIR`).

Every path in it is relative to the job directory (or absolute, in local mode). Every problem found when reading
it is one line naming the file and the key, and what to do.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from toolkit.contracts import agentdoc, envvars
from toolkit.errors import UserError

VERSION = 1
DEFAULT_MAX_RESTARTS = 3
DEFAULT_BACKOFF_BASE = 1.0  # s
DEFAULT_BACKOFF_MAX = 30.0  # s
DEFAULT_HEALTHY_RESET = 300.0  # s (the refill rule "time" only)
REFILL_PROGRESS, REFILL_NEVER, REFILL_TIME = "progress", "never", "time"  # when the restart budget refills
DEFAULT_GRACE = 10.0  # s between SIGTERM and SIGKILL
MAX_SOCKET_PATH = 107  # bytes of a unix socket path (sun_path, with its NUL)


@dataclass(frozen=True)
class ProcSpec:
    """One process this host runs; paths are absolute."""

    node_id: str
    role: str
    rank: int | None
    local_rank: int | None
    argv: tuple[str, ...]
    cwd: str
    env_file: str
    log_file: str

    @property
    def is_worker(self) -> bool:
        """A worker (MS_WORKER), as opposed to the scheduler."""
        return self.role == envvars.ROLE_WORKER


@dataclass(frozen=True)
class RestartDecision:
    """What RestartPolicy.after_failure decided: give up (the job fails), or relaunch after `delay` s."""

    give_up: bool
    delay: float
    counted: int  # restarts counted against max_restarts once this one is done
    failed_at: int | None = None  # the furthest step the failures of this count reached (None: none reported)
    refilled: str = ""  # why the count started again with this failure ("": it did not, or it was the first)


@dataclass(frozen=True)
class RestartPolicy:
    """host.json's restart settings, the same for every process of the host (toolkit.agent.policy's docstring explains
    the rule). Pure: `backoff` and `after_failure` only compute.

    `refill` says when a process's count of failures starts again: REFILL_PROGRESS (the default) when the incarnation
    that failed got past the step at which the previous failure happened, REFILL_NEVER as under torchrun, REFILL_TIME
    after `healthy_reset` seconds of running (what toolkit did before: a script that resumes from its checkpoint and
    fails at the same step later than that restarted forever)."""

    max_restarts: int = DEFAULT_MAX_RESTARTS
    backoff_base: float = DEFAULT_BACKOFF_BASE
    backoff_max: float = DEFAULT_BACKOFF_MAX
    healthy_reset: float = DEFAULT_HEALTHY_RESET
    refill: str = REFILL_PROGRESS

    def backoff(self, counted: int) -> float:
        """Delay before the restart that follows `counted` counted restarts: 0, base, 2 base, 4 base ... max."""
        if counted <= 0:
            return 0.0
        return min(self.backoff_base * 2.0 ** min(counted - 1, 62), self.backoff_max)

    def forgives(self, ran_for: float, reached: int | None, failed_at: int | None) -> bool:
        """Whether a failure starts the count again: by `refill`. `reached` is the last step the failed
        incarnation completed (None: it reported none), `failed_at` the furthest step the failures counted so far
        had reached (None: none, or no step). Progress means a step beyond it; an incarnation that reported no step
        never made progress that toolkit can see, so under REFILL_PROGRESS every such crash counts."""
        if self.refill == REFILL_TIME:
            return ran_for >= self.healthy_reset
        if self.refill == REFILL_PROGRESS:
            return reached is not None and (failed_at is None or reached > failed_at)
        return False

    def after_failure(self, counted: int, ran_for: float, progressed: bool = False, reached: int | None = None,
                      failed_at: int | None = None) -> RestartDecision:
        """What to do after a failed exit, `counted` restarts already counted. Every failure counts against
        max_restarts unless `forgives` says the budget refills first (then this failure is the first of a new count).
        The backoff is for crash loops, which never get to train: a process that had made progress (reported a
        step, or joined its group) since its launch is relaunched at once, however many faults came before. The
        decision carries the furthest step of this count's failures, the next failure's `failed_at` (a run that
        falls back to an earlier checkpoint and fails there again has not got past the furthest)."""
        refilled = ""
        if self.forgives(ran_for, reached, failed_at):
            if counted:
                refilled = (f"it ran {ran_for:.1f} s (restart_refill {self.healthy_reset:g} s)" if self.refill ==
                            REFILL_TIME else f"it got to step {reached}" +
                            (f", past step {failed_at} where it failed before" if failed_at is not None else ""))
            counted, failed_at = 0, None
        mark = max((s for s in (failed_at, reached) if s is not None), default=None)
        if counted >= self.max_restarts:
            return RestartDecision(True, 0.0, counted, mark)
        return RestartDecision(False, 0.0 if progressed else self.backoff(counted), counted + 1, mark, refilled)


def parse_refill(text: str) -> tuple[str, float]:
    """The refill rule as typed (`--restart-refill`): "progress", "never", or a number of seconds (the rule "time"),
    as (rule, healthy_reset seconds). ValueError, saying what may be given, for anything else."""
    value = text.strip().lower()
    if value in (REFILL_PROGRESS, REFILL_NEVER):
        return value, DEFAULT_HEALTHY_RESET
    try:
        seconds = float(value.removesuffix("s"))
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"{text!r}: give 'progress' (the count of a process's failures starts again once it gets "
                         "past the step where it failed last), 'never' (as torchrun) or a number of seconds (after "
                         "that long a run)")
    return REFILL_TIME, seconds


@dataclass(frozen=True)
class HostSpec:
    """A checked host.json, made by `load`: what one host runs for one job, where its scheduler listens, and how its
    agent supervises. Paths are absolute; the properties name the agent's own files in the job directory
    (docs/architecture.md, remote layout)."""

    job: str
    host: str
    job_dir: Path
    sched_host: str
    sched_port: int
    token_file: Path
    policy: RestartPolicy
    grace: float
    bind_core: bool
    warm_spare: bool
    processes: tuple[ProcSpec, ...]
    standby: tuple[ProcSpec, ...] = ()  # a spare host's: every worker it could take over (none runs at first)
    job_id: str = ""  # the job directory's agentdoc.JOB_ID_FILE: which project's job it holds ("": none written)
    origin: str = ""  # ... and where that job was deployed from (for people)

    @property
    def spare(self) -> bool:
        """A spare host's agent: it starts nothing and waits for the scheduler's `takeover`."""
        return bool(self.standby)

    @property
    def state_dir(self) -> Path:
        """state/: the agent's own files (0700)."""
        return self.job_dir / "state"

    @property
    def agent_json(self) -> Path:
        """state/agent.json: the agent's state, rewritten atomically on every change."""
        return self.state_dir / "agent.json"

    @property
    def pid_file(self) -> Path:
        """state/agent.pid: "<pid> <start ticks>" of the running agent."""
        return self.state_dir / "agent.pid"

    @property
    def lock_file(self) -> Path:
        """state/agent.lock: the flock the running agent holds."""
        return self.state_dir / "agent.lock"

    @property
    def control_socket(self) -> Path:
        """state/agent.sock: the agent's control socket (stream, JSON lines)."""
        return self.state_dir / "agent.sock"

    @property
    def progress_socket(self) -> Path:
        """state/progress.sock: the workers' progress datagrams (TOOLKIT_AGENT_SOCKET)."""
        return self.state_dir / "progress.sock"

    @property
    def errors_dir(self) -> Path:
        """state/errors/: the error files of process incarnations (TORCHELASTIC_ERROR_FILE), read when they fail."""
        return self.state_dir / "errors"

    @property
    def agent_log(self) -> Path:
        """logs/agent.log: the agent's own log."""
        return self.job_dir / "logs" / "agent.log"

    @property
    def standby_log(self) -> Path:
        """logs/standby.log: the warm spare's output until it becomes a worker."""
        return self.job_dir / "logs" / "standby.log"

    def step_file(self, node_id: str) -> Path:
        """state/<node_id>.step: the worker's latest step, for the restart budget (toolkit.contracts.stepfile)."""
        return self.state_dir / f"{node_id}.step"

    def proc(self, node_id: str) -> ProcSpec | None:
        """The process named `node_id`, or None if this host does not run it."""
        return next((p for p in self.processes if p.node_id == node_id), None)


def load(job_dir: str | Path) -> HostSpec:
    """Read and check host.json; every problem is one line naming the file and the key.

    `job_dir` is resolved, every path in the document is made absolute against it, and defaults are filled in. Raises
    UserError (exit code 2) for a missing or unreadable file, invalid JSON, an unsupported version, a missing or
    mistyped key (a bool is never taken for a number), a negative or infinite time or count, a node id given twice, and
    a socket path longer than MAX_SOCKET_PATH."""
    job_dir = Path(job_dir).resolve()
    path = job_dir / "host.json"
    doc = _read_document(path)
    fields = _Fields(str(path))
    if fields.get(doc, "version", int, "version") != 1:
        raise UserError(f"{path}: version {doc['version']} is not supported by this toolkit (1); update toolkit")
    sched = fields.get(doc, "scheduler", dict, "scheduler")
    policy = _restart_policy(fields, doc)
    processes, standby = _process_lists(fields, doc, job_dir)
    spec = HostSpec(
        job=fields.get(doc, "job", str, "job"),
        host=fields.get(doc, "host", str, "host"),
        job_dir=job_dir,
        sched_host=fields.get(sched, "host", str, "scheduler.host"),
        sched_port=fields.get(sched, "port", int, "scheduler.port", check=lambda v: 0 < v < 65536, hint="not a port"),
        token_file=job_dir / fields.get(doc, "token_file", str, "token_file", "token"),
        policy=policy,
        grace=float(fields.get(doc, "grace", (int, float), "grace", DEFAULT_GRACE, _finite_nonnegative,
                               "give 0 or more seconds")),
        bind_core=fields.get(doc, "bind_core", bool, "bind_core", False),
        warm_spare=fields.get(doc, "warm_spare", bool, "warm_spare", True),
        processes=processes,
        standby=standby,
    )
    spec = _with_identity(spec)
    for sock in (spec.control_socket, spec.progress_socket):
        if len(os.fsencode(str(sock))) > MAX_SOCKET_PATH:
            raise UserError(f"{sock}: longer than a unix socket path may be ({MAX_SOCKET_PATH} bytes); use a shorter "
                            "--workdir")
    return spec


def _read_document(path: Path) -> dict[str, Any]:
    """host.json at `path` as a JSON object. UserError naming the file for a missing or unreadable file, invalid
    JSON, or JSON that is not an object."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; --job-dir must be a job directory rendered by fleet deploy") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: line {e.lineno}: not valid JSON ({e.msg}); re-render the job") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a JSON object; re-render the job")
    return doc


def _finite_nonnegative(value: float) -> bool:
    """0 or more, and finite: a time or a count."""
    return 0 <= value < math.inf


class _Fields:
    """Checked reads of host.json's keys: every problem is one UserError naming the file (`where`) and the key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def get(self, obj: dict, key: str, kind: type | tuple, label: str, default: Any = ...,
            check: Callable[[Any], Any] | None = None, hint: str = "") -> Any:
        """`obj[key]`, of type `kind` (a bool is never taken for a number) and passing `check`; `default` when the
        key is absent (none given: the key is required). UserError naming `label` and the value (with `hint`, or
        "wrong type") otherwise."""
        if key not in obj:
            if default is ...:
                raise UserError(f"{self.where}: {label} is missing; re-render the job")
            return default
        value = obj[key]
        bad = isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))
        if bad or not isinstance(value, kind) or (check is not None and not check(value)):
            raise UserError(f"{self.where}: {label}={json.dumps(value)}: {hint or 'wrong type'}")
        return value


def _restart_policy(fields: _Fields, doc: dict) -> RestartPolicy:
    """The document's restart settings, each defaulted and checked."""
    get, nonneg = fields.get, _finite_nonnegative
    return RestartPolicy(
        max_restarts=get(doc, "max_restarts", int, "max_restarts", DEFAULT_MAX_RESTARTS, nonneg, "give 0 or more"),
        backoff_base=float(get(doc, "backoff_base", (int, float), "backoff_base", DEFAULT_BACKOFF_BASE, nonneg,
                               "give 0 or more")),
        backoff_max=float(get(doc, "backoff_max", (int, float), "backoff_max", DEFAULT_BACKOFF_MAX, nonneg,
                              "give 0 or more")),
        healthy_reset=float(get(doc, "healthy_reset", (int, float), "healthy_reset", DEFAULT_HEALTHY_RESET,
                                lambda v: 0 < v < math.inf,
                                "give a positive number of seconds")),
        refill=get(doc, "restart_refill", str, "restart_refill", REFILL_PROGRESS,
                   lambda v: v in (REFILL_PROGRESS, REFILL_NEVER, REFILL_TIME),
                   f"give {REFILL_PROGRESS}, {REFILL_NEVER} or {REFILL_TIME}"),
    )


def _process_lists(fields: _Fields, doc: dict, job_dir: Path) -> tuple[tuple[ProcSpec, ...], tuple[ProcSpec, ...]]:
    """(processes, standby): a host runs at least one process or is a spare, and only workers stand by."""
    fields.get(doc, "processes", list, "processes")
    fields.get(doc, "standby", list, "standby", [])
    processes, standby = _procs(fields, doc, "processes", job_dir), _procs(fields, doc, "standby", job_dir)
    if not processes and not standby:
        raise UserError(f"{fields.where}: processes=[]: a host runs at least one process, or is a spare (standby); "
                        "re-render the job")
    if any(not p.is_worker for p in standby):
        raise UserError(f"{fields.where}: standby: only workers stand by on a spare host; re-render the job")
    return processes, standby


def _procs(fields: _Fields, doc: dict, key: str, job_dir: Path) -> tuple[ProcSpec, ...]:
    """The process list under `key`, each checked, its paths made absolute against `job_dir`; node ids unique
    within it."""
    out = []
    seen: set[str] = set()
    for i, p in enumerate(doc.get(key) or []):
        label = f"{key}[{i}]"
        if not isinstance(p, dict):
            raise UserError(f"{fields.where}: {label}: expected an object; re-render the job")
        node_id = fields.get(p, "node_id", str, f"{label}.node_id", check=lambda v: v and "/" not in v,
                             hint="a non-empty name without '/'")
        if node_id in seen:
            raise UserError(f"{fields.where}: {label}.node_id={node_id!r} appears twice; every process needs its own")
        seen.add(node_id)
        out.append(_proc(fields, p, label, node_id, job_dir))
    return tuple(out)


def _proc(fields: _Fields, p: dict, label: str, node_id: str, job_dir: Path) -> ProcSpec:
    """The process entry `p` (`label`, e.g. processes[0]; its node id already checked) as a ProcSpec."""
    get = fields.get
    argv = get(p, "argv", list, f"{label}.argv", check=lambda v: v and all(isinstance(a, str) for a in v),
               hint="a non-empty list of strings")
    opt_int = (int, type(None))
    return ProcSpec(
        node_id=node_id,
        role=get(p, "role", str, f"{label}.role", check=lambda v: v in (envvars.ROLE_SCHED, envvars.ROLE_WORKER),
                 hint=f"{envvars.ROLE_SCHED} or {envvars.ROLE_WORKER}"),
        rank=get(p, "rank", opt_int, f"{label}.rank", None),
        local_rank=get(p, "local_rank", opt_int, f"{label}.local_rank", None),
        argv=tuple(argv),
        cwd=str(job_dir / get(p, "cwd", str, f"{label}.cwd", ".")),
        env_file=str(job_dir / get(p, "env_file", str, f"{label}.env_file")),
        log_file=str(job_dir / get(p, "log_file", str, f"{label}.log_file", f"logs/{node_id}.log")),
    )


def _with_identity(spec: HostSpec) -> HostSpec:
    """`spec` with the job directory's identity (agentdoc.JOB_ID_FILE) filled in, if there is one. UserError if it
    exists but cannot be read."""
    try:
        with open(spec.job_dir / agentdoc.JOB_ID_FILE, encoding="utf-8", errors="replace") as f:
            job_id, origin = agentdoc.read_identity(f.read(agentdoc.MAX_IDENTITY))
        return replace(spec, job_id=job_id, origin=origin)
    except FileNotFoundError:
        return spec  # rendered by hand or by an older deploy: no identity to compare
    except OSError as e:
        raise UserError(f"{spec.job_dir / agentdoc.JOB_ID_FILE}: cannot read it ({e})") from None


def document(job: str, host: str, sched_address: str, sched_port: int, max_restarts: int, grace: float,
             bind_core: bool, warm_spare: bool, processes: list[dict[str, Any]],
             standby: list[dict[str, Any]] | None = None, refill: str = REFILL_PROGRESS) -> dict[str, Any]:
    """host.json for one host: `processes` are dicts with node_id, role, rank, local_rank, argv, cwd, env_file and
    log_file (what ProcSpec holds), paths relative to the job directory; `standby` (a spare host's; then `processes`
    is empty) the workers it could take over, in the same form; `refill` the budget's refill rule as typed
    (`parse_refill`: checked by JobOptions). Pure. The backoff settings are always the defaults: only max_restarts,
    the refill rule, grace, bind_core and warm_spare are options."""
    extra = {"standby": standby} if standby else {}
    rule, seconds = parse_refill(refill)
    return {
        "version": VERSION, "job": job, "host": host, "scheduler": {"host": sched_address, "port": sched_port},
        "token_file": "token", "max_restarts": max_restarts, "backoff_base": DEFAULT_BACKOFF_BASE,
        "backoff_max": DEFAULT_BACKOFF_MAX, "restart_refill": rule, "healthy_reset": seconds, "grace": grace,
        "bind_core": bind_core, "warm_spare": warm_spare, "processes": processes, **extra,
    }
