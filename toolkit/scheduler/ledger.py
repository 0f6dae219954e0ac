"""The goodput ledger: every incident of a job, what it cost, and how much of the wall time trained for good.

An incident is one fault: the first death that moves a formed job to a new generation, with every death while that
generation gathers (a lost host's ranks die together). For each: its cause (the first cause as its agent saw it: the
script's error, its exit code or signal; heartbeat silence, a closed connection, a host lost with its agent, a
member that did not reconnect to a restarted scheduler), the processes and hosts, when it failed (for silence: when
the rank was last heard, not when the silence was noticed), when it was detected, when the replacement generation
formed, when every rank trained again (their `recovered` reports; for restart-recovery scripts, the first step after
the formation), the step they trained again from, and how many steps were computed again (what the survivors had
done beyond that step; after a restart from checkpoints, the newest step heard in heartbeats minus the step resumed
from). A torchrun-style script reports no recovery: with toolkit.train.report it trained again at its first step
after the formation, from the step before it (reporting every k-th step: from the checkpoint it reported if that
lies in the k steps before, see `Goodput.resumed`); without, only its group's formation is known. When a job its
operator stopped is started again, the restored members that do not reconnect are no incident if none of them does
(they were all stopped): that wait is start-up.

Goodput = time in steps that survive / wall time. The wall time since the job started splits into:
  startup      until the first step (launch, imports, the first formation)
  recovery     from each failure until every rank trains again (detection included)
  recomputed   the steps trained again after a recovery, at the step time of the moment
  checkpoint   the training thread blocked in checkpoint saves (mean over ranks: they stall together)
  productive   the rest: steps that count.
For a torchrun-style script that reports no steps the goodput stands on its group's formations instead (start-up
until the first, recovery until the next; its own resume is not known): an upper bound, and `goodput` says so.
Straggler episodes, the checkpoint intervals workers chose and the runs of checkpoints a full disk made a rank skip
(`skipped_checkpoints`: training went on, the older copies stayed) are kept alongside.

Pure: facts come in with the time (wall-clock seconds, since the ledger outlives the scheduler process: it is
persisted by toolkit.scheduler.journal and read back after a scheduler restart); nothing here does I/O.
The document's fields are defined by `to_json`; toolkit.contracts.rundoc reads it for `fleet report`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from toolkit.contracts.protocol import RECOVERY_IN_PLACE, RECOVERY_RESTART, is_int, worker_node_id
from toolkit.contracts.rundoc import LEDGER_VERSION as VERSION
from toolkit.scheduler.actions import CAUSE_CLOSED, CAUSE_NOT_BACK, CAUSE_SILENCE, NoteKind
from toolkit.scheduler.state import JobStatus

HOST_LOST_WINDOW = 10.0  # s: deaths on a host this close to its agent's disconnection are the host's loss
MAX_INCIDENTS = 10_000  # kept in the document (the oldest go first); counts stay exact
MAX_EPISODES = 1_000  # straggler episodes and interval changes kept
STEPLESS_NOTE = ("an upper bound: the script reports no steps, so the time after each formation of its group counts "
                 "as training; one line, toolkit.train.report(step, loss=...), makes it exact")


@dataclass
class Incident:
    """One fault and what it cost; times are wall-clock seconds."""

    number: int
    cause: str
    failed_at: float
    detected_at: float
    generation: int  # the generation it began (or that was gathering when it happened)
    step: int | None  # the newest step the ranks had reported (heartbeats) when it was detected
    step_time: float | None  # the job's step time then (for the recomputation's cost)
    recovery: str  # in-place, restart or unknown: how its first process's script recovers
    processes: list[dict[str, Any]] = field(default_factory=list)  # node_id, rank, host, pid, cause, reason
    relaunched: list[dict[str, Any]] = field(default_factory=list)  # healthy ranks relaunched with them: node_id, ...
    formed_at: float | None = None
    recovered_at: float | None = None
    recomputed: int | None = None
    resumed_from: int | None = None  # the step the ranks trained again from (their `recovered` reports)
    recovered_ranks: list[int] = field(default_factory=list)
    fenced: list[dict[str, Any]] = field(default_factory=list)  # incarnations that came back and were refused
    checkpoint: int | None = None  # the newest checkpoint step a torchrun-style script had reported before it
    corruption: dict[str, Any] | None = None  # ranks, hosts, window [from, to] and action of a corruption found

    @property
    def time_to_recover(self) -> float | None:
        """Seconds from the failure until every rank trained again (None while it has not)."""
        return None if self.recovered_at is None else self.recovered_at - self.failed_at


class Goodput:
    """The steps the ranks report and what the wall time went to (the module docstring's split): pace (first and
    newest step, step time, each rank's latest step and report stride), checkpoint stalls and intervals, the time
    paused by the operator and spent starting again, the job's recovery mode. `changed(urgent)` marks the ledger
    for writing. The incidents it counts against are the `Incidents`', passed to `goodput`."""

    def __init__(self, world_size: int, started_at: float, changed: Callable[[bool], None]) -> None:
        self.world_size = world_size
        self.started_at = started_at
        self.changed = changed
        self.first_step_at: float | None = None
        self.last_step: int | None = None
        self.step_time: float | None = None
        self.intervals: list[dict[str, Any]] = []  # at, rank, steps, why
        self.stall: dict[int, list[float]] = {}  # rank -> [stall of its earlier processes, its current counter]
        self.interval: dict[int, int] = {}  # rank -> its latest ckpt_every (`intervals` keeps only MAX_EPISODES)
        self.paused = 0.0  # s the job was stopped by its operator and started again
        self.restarting = 0.0  # s from such a start again until it stepped
        self.awaiting_step: float | None = None  # when it was started again, until it steps (or forms, stepless)
        self.recovery: str | None = None  # the job's recovery mode, as its members registered (protocol.RECOVERY_*)
        self.checkpoint_step: int | None = None  # the newest checkpoint a torchrun-style script reported
        self._rank_step: dict[int, int] = {}  # rank -> the step its latest heartbeat carried (not persisted)
        self._stride: dict[int, int] = {}  # rank -> steps between a torchrun-style script's reports (not persisted)
        # runs of checkpoints a full disk made a rank skip: rank, node_id, host, since, until (None while it lasts),
        # skipped (how many), why (the worker's line); the open one per rank in `skipping`
        self.skipped: list[dict[str, Any]] = []
        self.skipping: dict[int, dict[str, Any]] = {}

    def pace(self, f: Mapping[str, Any], now: float) -> None:
        """A heartbeat's figures (NoteKind.PACE): step, step time, checkpoint stall, stride and checkpoints."""
        step = f.get("step")
        if isinstance(step, int):
            if step >= 1 and self.first_step_at is None:
                self.first_step_at = now
                self.changed(False)
            if step >= 1 and self.awaiting_step is not None:
                self.restarting += now - self.awaiting_step
                self.awaiting_step = None
                self.changed(False)
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            self._rank_step[f["rank"]] = step
        if "step_time" in f:
            self.step_time = f["step_time"]
        if "ckpt_stall" in f:
            base, last = self.stall.get(f["rank"], [0.0, 0.0])
            if f["rank"] not in self.stall or f["ckpt_stall"] != last:  # in every heartbeat: changed when moved
                if f["ckpt_stall"] < last:  # a new process of the rank: its counter started again
                    base += last
                self.stall[f["rank"]] = [base, f["ckpt_stall"]]
                self.changed(False)
        if "stride" in f:
            self._stride[f["rank"]] = f["stride"]
        if "ckpt_step" in f and (self.checkpoint_step is None or f["ckpt_step"] > self.checkpoint_step):
            self.checkpoint_step = f["ckpt_step"]
            self.changed(False)
        if "ckpt_every" in f:
            if self.interval.get(f["rank"]) != f["ckpt_every"]:  # O(1) per heartbeat, whatever the list holds
                self.interval[f["rank"]] = f["ckpt_every"]
                self.intervals.append({"at": now, "rank": f["rank"], "steps": f["ckpt_every"],
                                       "why": f.get("ckpt_why", "")})
                del self.intervals[:-MAX_EPISODES]
                self.changed(False)

    def skipped_checkpoints(self, f: Mapping[str, Any], now: float) -> None:
        """A heartbeat's `ckpt_skipped` (checkpoints skipped in a row for a full disk, 0 once one is written) and
        `ckpt_full` (why): a run of them opens an episode (said in `fleet status` while it lasts and kept in the
        ledger), its count follows, and a checkpoint written again closes it."""
        count = f.get("ckpt_skipped")
        if count is None:
            return
        rank = f["rank"]
        open_ = self.skipping.get(rank)
        if count > 0 and (open_ is None or open_["skipped"] != count):
            if open_ is None:
                open_ = self.skipping[rank] = {"rank": rank, "node_id": f.get("node_id"), "host": f.get("host"),
                                                "since": now, "until": None, "skipped": count,
                                                "why": f.get("ckpt_full", "")}
                self.skipped.append(open_)
                del self.skipped[:-MAX_EPISODES]
            open_["skipped"] = count
            self.changed(True)
        elif count == 0 and open_ is not None:
            open_["until"] = now
            del self.skipping[rank]
            self.changed(True)

    def formed(self, f: Mapping[str, Any], now: float) -> None:
        """A generation formed: the recovery mode its members registered; for a script that reports no steps, a
        start again ends here (no step will tell when it trains again)."""
        modes = f.get("recovery") or []
        if modes:
            self.recovery = RECOVERY_RESTART if RECOVERY_RESTART in modes else RECOVERY_IN_PLACE
        if self.awaiting_step is not None and self.stepless():
            self.restarting += now - self.awaiting_step  # no step will tell when it trains again: the formation
            self.awaiting_step = None

    def left(self, rank: int, step: Any) -> int | None:
        """A rank died, its last step `step` (if an int): the newest step heard from any rank then (O(N): once per
        death), and the rank's latest step is forgotten."""
        steps = [s for s in (*self._rank_step.values(), step) if isinstance(s, int)]
        self._rank_step.pop(rank, None)
        return max(steps, default=None)

    def resumed(self, checkpoint: int | None, rank: int, first: int) -> int:
        """The step a torchrun-style script resumed from, its first step reported after the restart being `first`:
        the one before it when it reports every step; reported every k-th step, somewhere in the k before it: the
        checkpoint it reported before the fault (`checkpoint`) if that lies there, else the lowest (the steps
        recomputed are not undercounted). The checkpoint alone would not do: survivors may save a newer one before
        they leave."""
        stride = self._stride.get(rank, 1)
        if stride <= 1:
            return max(0, first - 1)
        if checkpoint is not None and first - stride <= checkpoint < first:
            return checkpoint
        return max(0, first - stride)

    def stepless(self) -> bool:
        """A torchrun-style script that has reported no step (toolkit.train.report) so far: what it costs can only
        be told from its group's formations."""
        return self.recovery == RECOVERY_RESTART and self.last_step is None

    def resume(self, paused: float, now: float) -> None:
        """Started again after `paused` s stopped by its operator: until it steps, the time is start-up."""
        self.paused += paused
        self.awaiting_step = now

    def uptime(self, now: float) -> float:
        """Seconds since the job started (its first scheduler start)."""
        return max(0.0, now - self.started_at)

    def goodput(self, end: float, incidents: list[Incident], generations: list[dict[str, Any]],
                stalled: float = 0.0) -> dict[str, Any]:
        """The wall time until `end` split as the module docstring says, in seconds, and goodput = productive /
        wall; `stalled` s before `end` the job made no step (a stall not yet an incident: not productive, and
        `stalled` in the split while it lasts). `basis` says what it stands on: "steps" (the steps the ranks
        reported), or for a torchrun-style script that reports none, "formations": the time after each formation
        of its group counts as training (its own start-up and resume after it are not known), so the goodput is
        an upper bound, as `note` says."""
        wall = max(0.0, end - self.started_at - self.paused)
        formations = [g["formed_at"] for g in generations if isinstance(g.get("formed_at"), (int, float))]
        guess = self.stepless() and bool(formations)
        first = self.first_step_at if self.first_step_at is not None else formations[0] if guess else end
        startup = max(0.0, min(first, end) - self.started_at) + self.restarting
        recovery = recomputed = 0.0
        for i, inc in enumerate(incidents):
            following = incidents[i + 1].detected_at if i + 1 < len(incidents) else end
            until = inc.recovered_at if inc.recovered_at is not None else (
                inc.formed_at if guess and inc.formed_at is not None else following)
            recovery += max(0.0, min(until, end) - max(inc.failed_at, first))
            if inc.recomputed and inc.step_time:
                recomputed += inc.recomputed * inc.step_time
        stalls = [base + last for base, last in self.stall.values()]
        checkpoint = sum(stalls) / len(stalls) if stalls else 0.0
        open_ = bool(incidents) and incidents[-1].recovered_at is None  # its recovery already counts the time
        stalled = 0.0 if open_ or guess else min(stalled, max(0.0, end - first))
        productive = max(0.0, wall - startup - recovery - recomputed - checkpoint - stalled)
        return {"wall": round(wall, 3), "startup": round(startup, 3), "recovery": round(recovery, 3),
                **({"stalled": round(stalled, 3)} if stalled else {}),
                "recomputed": round(recomputed, 3), "checkpoint": round(checkpoint, 3),
                "productive": round(productive, 3), "goodput": round(productive / wall, 4) if wall > 0 else None,
                "basis": "formations" if guess else "steps", "note": STEPLESS_NOTE if guess else None}


class Incidents:
    """The job's faults (the module docstring's incidents) and its generations: what each death, exit report, lost
    agent, spare, formation, recovery and fenced incarnation says about them. Reads the pace from `steps` (the step
    each incident was detected at, the step time, the checkpoint); `changed(urgent)` marks the ledger for writing.

    After a start again following the operator's stop (`after_stop`), the deaths of restored members that did not
    come back are held until the next formation: faults only if fewer than `restored` of them stayed away."""

    def __init__(self, world_size: int, steps: Goodput, changed: Callable[[bool], None]) -> None:
        self.world_size = world_size
        self.steps = steps
        self.changed = changed
        self.incidents: list[Incident] = []
        self.count = 0  # exact, while `incidents` keeps the newest MAX_INCIDENTS
        self.generations: list[dict[str, Any]] = []  # generation, formed_at, seconds (the gathering)
        self.after_stop = False  # started again after its operator stopped it, until the next formation
        self.restored = world_size  # members the restarted scheduler waits for
        self.workers = world_size  # processes in the newest formed generation (fewer after a shrink: issue 42)
        self._held: list[tuple[dict[str, Any], float]] = []  # their deaths: a fault only if some came back
        self._agent_lost: dict[str, float] = {}  # host -> when its agent disconnected

    def death(self, f: Mapping[str, Any], now: float) -> None:
        """A member died (NoteKind.DEATH): it opens an incident, or joins the one whose generation gathers. A healthy
        restart-recovery member leaving to be relaunched (`relaunched`) opens none: it is listed apart, with the
        incident that made it leave."""
        if f.get("relaunched"):
            if self.incidents:
                self.incidents[-1].relaunched.append({k: f[k] for k in ("node_id", "rank", "host", "pid")})
                self.changed(True)
            return
        if self.after_stop and f["cause"] == CAUSE_NOT_BACK:
            self._held.append((dict(f), now))  # decided at the formation: every member gone is the operator's stop
            return
        cause = f["cause"]
        lost_at = self._agent_lost.get(f["host"])
        if lost_at is not None and abs(now - lost_at) <= HOST_LOST_WINDOW and cause in (CAUSE_CLOSED, CAUSE_SILENCE):
            cause = f"host lost ({f['host']}: its agent went too)"
        proc = {"node_id": f["node_id"], "rank": f["rank"], "host": f["host"], "pid": f["pid"], "cause": cause,
                "reason": f["reason"]}
        step = self.steps.left(f["rank"], f.get("step"))
        open_ = self.gathering()
        if f["begins"] or open_ is None:
            self.count += 1
            self.incidents.append(Incident(
                number=self.count, cause=cause, failed_at=now - float(f.get("silent_for") or 0.0),
                detected_at=now, generation=f["generation"], step=step, step_time=self.steps.step_time,
                recovery=f.get("recovery") or "unknown", processes=[proc], checkpoint=self.steps.checkpoint_step))
            del self.incidents[:-MAX_INCIDENTS]
        else:
            open_.processes.append(proc)
        self.changed(True)

    def exited(self, f: Mapping[str, Any], now: float) -> None:
        """An agent said how a process ended: a death noted as "connection closed" gets its real cause (the agent's
        first cause: the script's error, else its exit code or signal)."""
        how = f.get("cause") or (f"killed by {f['signal']}" if f.get("signal") else f"exit code {f.get('code')}")
        for inc in reversed(self.incidents[-3:]):
            for p in inc.processes:
                if p["node_id"] == f["node_id"] and p["pid"] == f["pid"] and p["cause"] == CAUSE_CLOSED:
                    p["cause"] = how
                    if inc.cause == CAUSE_CLOSED:
                        inc.cause = how
                    self.changed(True)
                    return

    def replaced(self, f: Mapping[str, Any], now: float) -> None:
        """A spare took a lost host's ranks: the incident that host's deaths opened names the replacement."""
        for inc in reversed(self.incidents[-3:]):
            if any(p["host"] == f["host"] for p in inc.processes):
                inc.cause = f"host {f['host']} lost, replaced by spare {f['by']}"
                self.changed(True)
                return

    def agent_lost(self, f: Mapping[str, Any], now: float) -> None:
        """A host's agent disconnected: its processes' deaths near then are the host's loss."""
        host = f["host"]
        self._agent_lost[host] = now
        for inc in self.incidents[-3:]:
            if now - inc.detected_at > HOST_LOST_WINDOW:
                continue
            for p in inc.processes:
                if p["host"] == host and p["cause"] in (CAUSE_CLOSED, CAUSE_SILENCE):
                    p["cause"] = f"host lost ({host}: its agent went too)"
            if all(p["host"] == host for p in inc.processes) and inc.cause in (CAUSE_CLOSED, CAUSE_SILENCE):
                inc.cause = f"host lost ({host}: its agent went too)"
                self.changed(True)

    def formed(self, f: Mapping[str, Any], now: float) -> None:
        """A generation formed. The deaths held since the job was started again after a stop are faults only if
        some restored member came back (else the operator stopped them all: no incident, the wait is start-up)."""
        held, self._held, self.after_stop = self._held, [], False
        if held and len(held) < self.restored:
            for death, at in held:
                self.death(death, at)
        generation = f["generation"]
        workers = f.get("workers")  # a shrunk generation's (issue 42): its incident closes when they all train
        self.workers = workers if type(workers) is int and 0 < workers <= self.world_size else self.world_size
        self.generations.append({"generation": generation, "formed_at": now, "seconds": f.get("seconds")})
        del self.generations[:-MAX_INCIDENTS]
        for inc in self.incidents[-3:]:
            if inc.formed_at is None and generation >= inc.generation:
                inc.formed_at = now
        self.changed(True)

    def recovered(self, f: Mapping[str, Any], now: float) -> None:
        """A rank trains again (its `recovered` report): every rank's closes the incident."""
        for inc in reversed(self.incidents[-3:]):
            if inc.formed_at is None or inc.recovered_at is not None:
                continue
            if f.get("generation") is not None and f["generation"] < inc.generation:
                continue
            if f["rank"] not in inc.recovered_ranks:
                inc.recovered_ranks.append(f["rank"])
            step, recomputed = f.get("step"), f.get("recomputed")
            if isinstance(step, int) and step >= 0:
                inc.resumed_from = step if inc.resumed_from is None else min(inc.resumed_from, step)
            if recomputed is not None and recomputed < 0 and isinstance(step, int) and inc.step is not None:
                recomputed = max(0, inc.step - step)  # from a checkpoint: the ranks' own last steps were lost
            if recomputed is not None and recomputed >= 0:
                inc.recomputed = max(inc.recomputed or 0, recomputed)
            if len(inc.recovered_ranks) >= self.workers:
                inc.recovered_at = now
            self.changed(inc.recovered_at is not None)  # at once when it closes: 4096 ranks' reports, one write
            return

    def stepped(self, f: Mapping[str, Any], now: float) -> None:
        """A heartbeat's step: restart recovery sends no `recovered` report, so a script's first step after the
        formation closes the incident (and tells the step it resumed from, `Goodput.resumed`)."""
        step = f.get("step")
        if not isinstance(step, int):
            return
        for inc in self.incidents[-3:]:
            if (inc.recovery != RECOVERY_IN_PLACE and inc.formed_at is not None and inc.recovered_at is None
                    and step >= 1 and now > inc.formed_at):
                inc.recovered_at = now
                if inc.resumed_from is None:  # no `recovered` report: the script's own first step tells
                    first = min(step, f.get("first_step", step))  # the heartbeat's first step after the restart
                    inc.resumed_from = self.steps.resumed(inc.checkpoint, f["rank"], first)
                    if inc.step is not None:
                        inc.recomputed = max(0, inc.step - inc.resumed_from)
                self.changed(True)

    def fenced(self, f: Mapping[str, Any], now: float) -> None:
        """A dead incarnation came back and was refused: the incident it died in lists it."""
        for inc in reversed(self.incidents):
            if any(p["node_id"] == f["node_id"] and p["pid"] == f["pid"] for p in inc.processes):
                inc.fenced.append({"at": now, "node_id": f["node_id"], "pid": f["pid"], "host": f["host"]})
                self.changed(True)
                return

    def corruption(self, f: Mapping[str, Any], now: float) -> None:
        """The replica check found corruption (NoteKind.CORRUPTION): an incident of its own, found and dealt with at
        once (healed, rolled back: the steps since the last good check are done again; fenced or stopped: the
        job's end follows)."""
        self.count += 1
        since, step, action = f["since"], f["step"], f["action"]
        who = ", ".join(f"rank {r} on {h}" for r, h in zip(f["ranks"], f["hosts"], strict=True))
        window = f"steps {since + 1}-{step}" if since is not None else f"at or before step {step}"
        done = action in ("healed", "rolled back")
        self.incidents.append(Incident(
            number=self.count, cause=f"corruption: {who}, started in {window}: {action}", failed_at=now,
            detected_at=now, generation=f["generation"] if f["generation"] is not None else -1, step=step,
            step_time=self.steps.step_time, recovery=RECOVERY_IN_PLACE,
            processes=[{"node_id": worker_node_id(r), "rank": r, "host": h, "pid": None, "cause": "corruption",
                        "reason": action} for r, h in zip(f["ranks"], f["hosts"], strict=True)],
            formed_at=now, recovered_at=now if done else None,
            recomputed=step - since if done and since is not None else 0 if done else None,
            resumed_from=since if done and since is not None else step if done else None,
            corruption={"ranks": list(f["ranks"]), "hosts": list(f["hosts"]), "window": [
                None if since is None else since + 1, step], "action": action}))
        del self.incidents[:-MAX_INCIDENTS]
        self.changed(True)

    def gathering(self) -> Incident | None:
        """The newest incident whose replacement generation has not formed yet."""
        if self.incidents and self.incidents[-1].formed_at is None:
            return self.incidents[-1]
        return None


class Ledger:
    """The ledger of one job (see the module docstring): its `Incidents` (`faults`) and its `Goodput`
    (`accounting`), the straggler episodes and the run's end. `world_size` ranks; `started_at` when the job
    started. `dirty`: changed since the last write; `urgent`: an incident changed, write now, not at the ledger
    interval."""

    def __init__(self, job: str, world_size: int, started_at: float) -> None:
        self.job = job
        self.world_size = world_size
        self.accounting = Goodput(world_size, started_at, self._changed)
        self.faults = Incidents(world_size, self.accounting, self._changed)
        self.stragglers: list[dict[str, Any]] = []  # rank, node_id, host, since, until, factor, busy, median
        self.scheduler_restarts: list[float] = []
        # shrinks and grows (issue 42), their own kind of incident: kind, at, host, slots, workers (after it),
        # generation, step (the job's newest when it happened: each period's throughput, `world_periods`)
        self.elastic: list[dict[str, Any]] = []
        self.first_step: int | None = None  # the first step reported (the first period's throughput counts from it)
        self.ended_at: float | None = None
        self.outcome: str | None = None  # finished, failed, stopped
        self.failure: str | None = None
        self.dirty = False  # changed since the last write
        self.urgent = False  # an incident changed: write now, not at the ledger interval
        self._handlers: Mapping[str, Callable[[Mapping[str, Any], float], None]] = {
            NoteKind.DEATH: self.faults.death, NoteKind.EXITED: self.faults.exited,
            NoteKind.REPLACED: self.faults.replaced, NoteKind.AGENT_LOST: self.faults.agent_lost,
            NoteKind.FORMED: self._on_formed, NoteKind.RECOVERED: self.faults.recovered,
            NoteKind.PACE: self._on_pace, NoteKind.FENCED: self.faults.fenced,
            NoteKind.CORRUPTION: self.faults.corruption, NoteKind.RESTORED: self._on_restored,
            NoteKind.FINISHED: self._on_finished, NoteKind.FAILED: self._on_failed,
            NoteKind.SHRINK: lambda f, now: self._on_world("shrink", f, now),
            NoteKind.GROW: lambda f, now: self._on_world("grow", f, now)}

    # -- facts

    def note(self, kind: NoteKind | str, fields: Mapping[str, Any], now: float) -> None:
        """A membership Note (toolkit.scheduler.actions.Note) of `kind` at wall time `now`; a kind the ledger does
        not count (`refused`) changes nothing. A plain string of a kind's value finds its handler too."""
        handler = self._handlers.get(kind)
        if handler is not None:
            handler(fields, now)

    def _on_formed(self, f: Mapping[str, Any], now: float) -> None:
        self.faults.formed(f, now)
        self.accounting.formed(f, now)

    def _on_pace(self, f: Mapping[str, Any], now: float) -> None:
        self.faults.stepped(f, now)  # first: the stride that closes an incident is the one before this heartbeat
        if self.first_step is None and type(f.get("step")) is int:
            self.first_step = f["step"]
        self.accounting.pace(f, now)
        self.accounting.skipped_checkpoints(f, now)

    def _on_restored(self, f: Mapping[str, Any], now: float) -> None:
        self.scheduler_restarts.append(now)
        self.faults.restored = int(f.get("members", self.world_size))
        self._changed(urgent=True)

    def _on_world(self, kind: str, f: Mapping[str, Any], now: float) -> None:
        self.elastic.append({"kind": kind, "at": now, "host": f.get("host"),
                             "slots": list(f.get("slots") or []), "workers": f.get("workers"),
                             "generation": f.get("generation"), "step": self.accounting.last_step})
        del self.elastic[:-MAX_EPISODES]
        self._changed(urgent=True)

    def world_periods(self, now: float) -> list[dict[str, Any]]:
        """The job's world size over time: one period per size (from its first step, then from each shrink or
        grow, until the next or `now`/the end), each with its workers and its throughput (steps/s; None when no
        step was reported in it)."""
        acc = self.accounting
        start = acc.first_step_at if acc.first_step_at is not None else acc.started_at
        marks = [(start, self.world_size, None)] + [(e["at"], e["workers"], e["step"]) for e in self.elastic]
        end = self.ended_at if self.ended_at is not None else now
        out = []
        for i, (at, workers, step) in enumerate(marks):
            until, last = (marks[i + 1][0], marks[i + 1][2]) if i + 1 < len(marks) else (end, acc.last_step)
            first = step if i else self.first_step
            rate = (last - first) / (until - at) if first is not None and last is not None and until > at else None
            out.append({"from": at, "until": until, "workers": workers,
                        "steps_per_s": None if rate is None else round(rate, 4)})
        return out

    def _on_finished(self, f: Mapping[str, Any], now: float) -> None:
        self._end(JobStatus.FINISHED, None, now)

    def _on_failed(self, f: Mapping[str, Any], now: float) -> None:
        self._end(JobStatus.FAILED, f.get("reason"), now)

    def stopped(self, why: str, now: float) -> None:
        """The scheduler was stopped (a signal) while the job ran: the run ends here unless it is restarted."""
        if self.outcome is None:
            self._end(JobStatus.STOPPED, why, now)

    def straggler(self, rank: int, node_id: str, host: str, factor: float, busy: float, median: float,
                  now: float) -> None:
        """A rank was named a straggler (toolkit.scheduler.stragglers.Named)."""
        self.stragglers.append({"rank": rank, "node_id": node_id, "host": host, "since": now, "until": None,
                                "factor": round(factor, 3), "busy": busy, "median": median})
        del self.stragglers[:-MAX_EPISODES]
        self._changed(urgent=True)

    def straggler_cleared(self, rank: int, now: float) -> None:
        """A straggler verdict on `rank` ended (it caught up, or it died)."""
        for ep in reversed(self.stragglers):
            if ep["rank"] == rank and ep["until"] is None:
                ep["until"] = now
                self._changed(urgent=True)
                return

    def _end(self, outcome: str, failure: str | None, now: float) -> None:
        self.outcome, self.failure, self.ended_at = outcome, failure, now
        self._changed(urgent=True)

    def _changed(self, urgent: bool = False) -> None:
        self.dirty = True
        self.urgent = self.urgent or urgent

    # -- figures

    def uptime(self, now: float) -> float:
        """Seconds since the job started (its first scheduler start)."""
        return self.accounting.uptime(now)

    def goodput(self, now: float, stalled: float = 0.0) -> dict[str, Any]:
        """The goodput so far, or until the job ended (Goodput.goodput); `stalled`: the job has made no step for
        that many seconds up to `now` (a stall the progress watchdog's bound says is one): not productive."""
        end = self.ended_at if self.ended_at is not None else now
        return self.accounting.goodput(end, self.faults.incidents, self.faults.generations,
                                       stalled if self.ended_at is None else 0.0)

    # -- the document

    def to_json(self, now: float) -> dict[str, Any]:
        """The persisted document (ledger.json), with the goodput as of `now`."""
        acc, faults = self.accounting, self.faults
        return {
            "version": VERSION, "job": self.job, "world_size": self.world_size, "started_at": acc.started_at,
            "ended_at": self.ended_at, "outcome": self.outcome, "failure": self.failure, "updated_at": now,
            "first_step_at": acc.first_step_at, "last_step": acc.last_step, "step_time": acc.step_time,
            "incident_count": faults.count,
            "incidents": [{**asdict(i), "time_to_recover": i.time_to_recover} for i in faults.incidents],
            "generations": faults.generations, "stragglers": self.stragglers, "intervals": acc.intervals,
            "scheduler_restarts": self.scheduler_restarts,
            "elastic": self.elastic, "world_periods": self.world_periods(now), "first_step": self.first_step,
            "checkpoint_stall": {str(r): [round(b, 4), round(last, 4)] for r, (b, last) in acc.stall.items()},
            "paused": round(acc.paused, 3), "restarting": round(acc.restarting, 3),
            "recovery": acc.recovery, "checkpoint_step": acc.checkpoint_step,
            "skipped_checkpoints": acc.skipped,
            "goodput": self.goodput(now),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Ledger:
        """A ledger read back (after a scheduler restart). KeyError, TypeError or ValueError if the document is
        not one `to_json` wrote; the journal then starts a new ledger and says so."""
        if doc.get("version") != VERSION:
            raise ValueError(f"ledger version {doc.get('version')!r}, expected {VERSION}")
        led = cls(str(doc["job"]), int(doc["world_size"]), float(doc["started_at"]))
        acc, faults = led.accounting, led.faults
        faults.count = int(doc["incident_count"])
        fields = set(Incident.__dataclass_fields__)
        faults.incidents = [Incident(**{k: v for k, v in i.items() if k in fields}) for i in doc["incidents"]]
        faults.generations = list(doc["generations"])
        led.stragglers = list(doc["stragglers"])
        acc.intervals = list(doc["intervals"])
        acc.interval = {i["rank"]: i["steps"] for i in acc.intervals}
        led.scheduler_restarts = [float(t) for t in doc["scheduler_restarts"]]
        led.elastic = [dict(e) for e in doc.get("elastic") or [] if isinstance(e, Mapping)]
        led.first_step = doc["first_step"] if type(doc.get("first_step")) is int else None
        acc.first_step_at = doc.get("first_step_at")
        acc.last_step = doc.get("last_step")
        acc.step_time = doc.get("step_time")
        for r, (base, last) in dict(doc["checkpoint_stall"]).items():
            acc.stall[int(r)] = [float(base), float(last)]
        led.ended_at, led.outcome, led.failure = doc.get("ended_at"), doc.get("outcome"), doc.get("failure")
        acc.paused = float(doc.get("paused", 0.0))
        acc.restarting = float(doc.get("restarting", 0.0))
        acc.recovery = doc.get("recovery") if doc.get("recovery") in (RECOVERY_IN_PLACE, RECOVERY_RESTART) else None
        step = doc.get("checkpoint_step")
        acc.checkpoint_step = step if is_int(step) else None
        acc.skipped = [dict(e) for e in doc.get("skipped_checkpoints") or []]  # older ledgers have none
        acc.skipping = {e["rank"]: e for e in acc.skipped if e.get("until") is None}
        return led

    def resume(self, now: float) -> None:
        """The job goes on after its scheduler was stopped (`fleet stop`, then `train` again): the time it was
        stopped is not the job's (`paused`), the time until it steps again is start-up (`restarting`)."""
        if self.outcome == JobStatus.STOPPED and self.ended_at is not None:
            self.accounting.resume(max(0.0, now - self.ended_at), now)
            self.outcome = self.ended_at = self.failure = None
            self.faults.after_stop = True  # its members may not come back: the operator stopped them (Incidents.formed)
            self._changed(urgent=True)
