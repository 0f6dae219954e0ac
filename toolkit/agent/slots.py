"""What the agent knows of each process it supervises (a Slot: its running incarnation, launches, exits, progress,
and the timers pending for it), and the pure views of them the agent needs: the CPU sets of bind_core (`cpu_sets`),
the children it vouches for in heartbeats (`running`), and what the warm spare reads of the workers (`WorkersOf`:
the cold relaunches that hold it back, the memory it faults in ahead). No I/O but a process's step file and /proc
reads; the loop that changes slots is supervisor.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from toolkit import procs, standby
from toolkit.agent import openfiles, policy
from toolkit.agent.agentlog import iso
from toolkit.agent.progressinbox import Report
from toolkit.agent.timers import Timer
from toolkit.contracts import stepfile
from toolkit.contracts.agentdoc import ExitRecord, ProcDoc, ProcState
from toolkit.contracts.hostspec import ProcSpec, RestartPolicy
from toolkit.errors import UserError
from toolkit.procs import Child

EXIT_HISTORY = 10  # exits (and pids) kept per process for agent.json


def cpu_sets(cpus: set[int] | frozenset[int], n: int, host: str = "this host") -> list[frozenset[int]]:
    """`n` disjoint CPU sets of equal size from `cpus`, in order (msrun's --bind_core: each worker its own). Pure. The
    CPUs left over by the division go to no worker; `n` 0 gives no sets. Raises UserError, naming `host`, when there are
    fewer CPUs than workers."""
    if n == 0:
        return []
    ordered = sorted(cpus)
    if len(ordered) < n:
        raise UserError(f"{host}: bind_core needs one CPU per worker, but {n} workers share {len(ordered)} usable "
                        f"CPUs ({','.join(map(str, ordered))}); run fewer workers there or turn bind_core off")
    size = len(ordered) // n
    return [frozenset(ordered[i * size:(i + 1) * size]) for i in range(n)]


def running(slots: Iterable[Slot]) -> dict[str, int]:
    """node_id -> pid of every child alive and not stopped (/proc state other than T, t, Z, X): what the agent vouches
    for in its heartbeats. A worker busy in a call that holds its GIL sends no heartbeat of its own, but it runs: the
    scheduler does not take it for a hung one. A SIGSTOPped one is left out, so its silence stays a death."""
    out = {}
    for slot in slots:
        child = slot.child
        info = procs.proc_info(child.pid) if child is not None else None
        if child is not None and info is not None and info.state not in ("T", "t", "Z", "X"):
            out[slot.spec.node_id] = child.pid
    return out


class Slot:
    """What the agent knows of one process across its incarnations.

    `child` is the running incarnation (None between incarnations). `launches` counts every start (its restarts are
    `launches - 1`, and the value before a start is that start's TORCHELASTIC_RESTART_COUNT); `counted` counts only the
    restarts charged against max_restarts, as policy.on_exit decides. `state` is pending, running, backoff (a relaunch
    timer is armed), restarting (the operator's restart: SIGTERM sent), succeeded, failed or stopped. `progressed` (a
    step or the group joined since the latest launch) spares the next relaunch its backoff. Read and written by the
    Agent's loop thread only."""

    def __init__(self, spec: ProcSpec, cpus: frozenset[int] | None, step_file: Path | None = None) -> None:
        self.spec = spec
        self.cpus = cpus
        self.step_file = step_file if spec.is_worker else None  # contracts.stepfile: a death's step, exactly
        self.child: Child | None = None
        self.state: ProcState = ProcState.PENDING
        self.launches = 0
        self.counted = 0
        self.relaunched = 0  # launches that were the job's restart of this healthy process (EXIT_REJOIN, EXIT_FENCED)
        self.started_mono = 0.0
        self.started_wall: float | None = None
        self.warm = False
        self.last_exit: ExitRecord | None = None
        self.exits: list[ExitRecord] = []
        self.step: int | None = None
        self.epoch: int | None = None
        self.step_at: float | None = None
        self.progressed = False  # progress reported since the latest launch
        self.said_done = False  # the latest incarnation told the scheduler it finished training
        self.timer: Timer | None = None
        self.next_start: float | None = None
        self.manual = False  # the operator asked for a restart: the coming death is expected and not counted
        self.kill_timer: Timer | None = None
        self.pids: list[int] = []
        self.last_pid: int | None = None  # the latest incarnation (running or not): what `stop` verifies
        self.last_ticks: int | None = None
        self.seen_dead: float | None = None  # monotonic time the latest death was seen, until the relaunch
        self.recovery: str | None = None  # how the worker said it recovers (protocol.RECOVERY_*), once it did
        self.error_file: Path | None = None  # the running incarnation's TORCHELASTIC_ERROR_FILE
        self.fenced: str | None = None  # the scheduler's cause, once it had the running incarnation killed
        self.files: openfiles.Trend | None = None  # the running incarnation's open files (workers)
        self.reached: int | None = None  # the highest step the running incarnation reported (datagrams)
        self.failed_at: int | None = None  # the furthest step this count's failures reached (the restart budget)
        self.same_failure: dict[str, Any] | None = None  # policy.repeated_failure of `exits`

    def fresh_steps(self) -> str | None:
        """Before a launch: make the step file hold no step (and forget the steps reported). Returns why it could
        not be made (then the restart budget has the progress datagrams only), or None."""
        self.reached = None
        if self.step_file is None:
            return None
        try:
            stepfile.reset(self.step_file)
        except OSError as e:
            self.step_file = None
            return f"cannot make its step file ({e}): the restart budget knows its steps from its progress reports"
        return None

    def note_progress(self, report: Report, wall: float) -> bool:
        """Apply one progress report received at `wall` (time.time()); returns whether agent.json changed. A
        `recovery` (the worker joined its group) or a `step` marks the process `progressed` since its launch, which
        spares its next failure the backoff (hostspec.RestartPolicy.after_failure); `epoch` counts only with a step."""
        changed = False
        if report.done:
            self.said_done = True
        if report.recovery is not None:
            self.progressed = True  # it got as far as its process group: not a crash loop
            if report.recovery != self.recovery:
                self.recovery, changed = report.recovery, True
        if report.step is None:
            return changed
        self.step, self.step_at, self.progressed = report.step, wall, True
        self.reached = report.step if self.reached is None else max(self.reached, report.step)
        if report.epoch is not None:
            self.epoch = report.epoch
        return True

    def reached_step(self) -> int | None:
        """After an exit: the last step the incarnation completed, from its step file (exact, whatever the death) or
        the highest step it reported by datagram (a lower bound); None if neither says one."""
        steps = [s for s in (stepfile.read(self.step_file) if self.step_file else None, self.reached) if s is not None]
        return max(steps) if steps else None

    def judged(self, reaction: Any, record: ExitRecord) -> None:
        """After an exit: if the restart budget judged it (a counted relaunch or the give-up), mark its record (the
        latest) a failure, keep the count's furthest step, and see whether it keeps failing the same way."""
        if not (isinstance(reaction, policy.GiveUp) or isinstance(reaction, policy.Relaunch) and reaction.failure):
            return
        self.last_exit = replace(record, failure=True)
        self.exits = [e if e is not record else self.last_exit for e in self.exits]
        self.failed_at = reaction.failed_at
        self.same_failure = policy.repeated_failure([e.to_dict() for e in self.exits])

    def document(self, policy: RestartPolicy) -> ProcDoc:
        """This process's entry in agent.json's `processes`; no I/O. `pid`, `pgid` and `start_ticks` name the running
        incarnation (None between incarnations), `last_pid` and `last_start_ticks` the latest one, running or not:
        `stop` and the next agent find leftover groups from these (toolkit.contracts.agentdoc.recorded_groups), so a
        group is always recorded with its leader's start time."""
        c = self.child
        return ProcDoc(
            node_id=self.spec.node_id, role=self.spec.role, rank=self.spec.rank,
            local_rank=self.spec.local_rank, state=self.state,
            pid=c.pid if c else None, pgid=c.pgid if c else None, start_ticks=c.start_ticks if c else None,
            last_pid=self.last_pid, last_start_ticks=self.last_ticks,
            started_at=iso(self.started_wall), warm=self.warm if c else None,
            restarts=max(0, self.launches - 1), counted_restarts=self.counted, relaunched=self.relaunched,
            max_restarts=policy.max_restarts, next_start_at=iso(self.next_start),
            last_exit=self.last_exit, exits=tuple(self.exits),
            step=self.step, epoch=self.epoch, step_at=iso(self.step_at), recovery=self.recovery,
            cpus=tuple(sorted(self.cpus)) if self.cpus else None,
            open_files=self.files.document() if self.files else None,
            failed_at=self.failed_at, same_failure=self.same_failure,
            log_file=self.spec.log_file, argv=tuple(self.spec.argv),
        )


class WorkersOf:
    """What the warm spare reads of a host's workers (toolkit.agent.port.Workers), from its slots as they are at each
    call (`slots`: Processes.slots, which a takeover grows)."""

    def __init__(self, slots: Mapping[str, Slot]) -> None:
        self.slots = slots

    def template(self) -> ProcSpec:
        """The first worker: its interpreter and env file are what a spare uses."""
        return next(s.spec for s in self.slots.values() if s.spec.is_worker)

    def largest_memory(self) -> int:
        """The private resident memory of the largest running worker in bytes, 0 if none can be read: what the warm
        spare faults in ahead (toolkit.standby)."""
        return max([0, *(standby.private_bytes(s.child.pid) for s in self.slots.values()
                         if s.spec.is_worker and s.child is not None)])

    def cold_launches(self) -> list[float]:
        """When each worker relaunched cold that has not progressed since was launched (monotonic s): what holds the
        warm spare back (toolkit.agent.warmspare). A first start is not a recovery: SPARE_DELAY paces the spare
        then."""
        return [s.started_mono for s in self.slots.values() if s.spec.is_worker and s.child is not None
                and not s.warm and not s.progressed and s.launches > 1]
