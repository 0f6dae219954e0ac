"""What `fleet` knows of the job's hosts, as the commands show it: one HostStatus per host with one ProcStatus per
process (made by toolkit.launcher.jobhosts.judge), where the scheduler's live.json is (`live_path`, `job_live`), and the
job's recovery mode as its workers reported it (`recovery_mode`)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any, Mapping

from toolkit.contracts import rundoc
from toolkit.contracts.jobrecord import JobRecord
from toolkit.contracts.protocol import RECOVERY_IN_PLACE, RECOVERY_RESTART, is_number
from toolkit.launcher.jobhosts.output import dash


@dataclass(frozen=True)
class ProcStatus:
    """One process as its host's agent sees it."""

    host: str
    node_id: str
    role: str  # "sched" or "worker"
    rank: int | None
    pid: int | None
    state: str  # the agent's (running, backoff, restarting, succeeded, failed, stopped), or gone, unreachable
    restarts: int  # for its own faults and the operator's restarts
    step: int | None
    log_age: float | None  # s since its log was last written, by the host's clock
    last_exit: str | None  # "exit code 3", "killed by SIGKILL"
    recovery: str | None = None  # how the worker said it recovers (protocol.RECOVERY_*), once it has
    steps_per_s: float | None = None  # the scheduler's figures (live.json) for this worker, while it reports
    loss: float | None = None
    heartbeat_age: float | None = None  # s since the scheduler last heard from it
    straggler: float | None = None  # named a straggler: its own work per step over the others' median
    no_step_for: float | None = None  # the job is stalled (live.json `stalled_for`): s since this rank's step moved
    repeating: str | None = None  # it keeps failing the same way: how (the agent's policy.repeated_failure)
    relaunched: int = 0  # relaunches for the job's restart (a peer's fault), not counted in `restarts`

    @property
    def prefix(self) -> str:
        """`host:role:rank`, what every line of output about this process starts with."""
        return f"{self.host}:{self.role}:{dash(self.rank)}"


@dataclass(frozen=True)
class HostStatus:
    """One host as its agent's files show it: the agent's state and whether it still runs, why it ended, the
    give-up evidence (`failure`: node, rank, pid, status, restarts, log tail), and one ProcStatus per process
    the record places there (`reached` False: the host could not be asked, see `error`)."""

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
    live: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)  # the scheduler host's
    # live.json (toolkit.contracts.rundoc), if this host runs the scheduler and it could be read
    took_over: tuple[Mapping[str, Any], ...] = field(default=(), hash=False, compare=False)  # a spare's takeovers:
    # {host (the lost one), by (this one), node_ids, seq}, as its agent recorded them
    other_job: str | None = None  # the job directory holds another project's job of this name (where it is from)


OTHER_JOB = "another project's"  # the state of a host (and its processes) whose job directory is not this job's


def live_path(record: JobRecord) -> tuple[str, str]:
    """The host that runs the scheduler and the path there of its live.json (in MS_RECOVERY_PATH, which the plan
    puts in `<job dir>/recovery`)."""
    name = record.process("sched")["host"]
    return name, posixpath.join(record.host(name).job_dir, "recovery", rundoc.LIVE_FILE)


def job_live(hosts: list[HostStatus]) -> Mapping[str, Any] | None:
    """The scheduler's live.json as the scheduler host's status read it, or None."""
    return next((h.live for h in hosts if h.live is not None), None)


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


def number(value: Any) -> float | None:
    return float(value) if is_number(value) else None
