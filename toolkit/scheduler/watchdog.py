"""The progress watchdog: which rank stopped making progress while its peers wait for it.

In synchronous data parallelism one stuck rank (in its own code, a deadlock, a blocking call, a call into C that
never returns) stops every rank: the others enter the step's collective and wait there for it. Steps alone cannot
tell who is stuck (every rank's step stops at once), nor can heartbeats (a rank asleep in its own code still
heartbeats). What does: each worker's heartbeat says whether its training thread is waiting in a collective now
(`waiting`: toolkit.train.stacks looks at the thread's Python stack), and a rank holding its GIL sends no heartbeat
at all while its agent still sees it running. So once the job has made no step for

    bound = max(STALL_FACTOR x p99, STALL_FLOOR)         (protocol.stall_bound; 10 x p99, at least 5 s)

with p99 the job's observed 99th percentile of the time between two steps (the largest any rank reports), and some
rank has been waiting in a collective for that long too (every heartbeat since said so), a rank that is not waiting
(for OUTSIDE_BEATS heartbeats in a row, or silent for SILENT_BEATS) is stuck. The wait counts, not only the time
since the last step: ranks that all spend long in their own work (an evaluation on every rank) and end it at
different times make the first ones wait briefly, which is no hang. No setting: the bound follows the job's own
step times.

A script that reports no step (a torchrun-style script that never calls `toolkit.train.report()`) is judged by its
collectives instead: each heartbeat also carries `collectives`, the sequence number of the worker's default
process group (toolkit.train.stacks.collectives: torch counts every collective a rank enters, DDP's gradient
allreduces issued from C++ included). A rank's count moving is its progress; a rank stuck in its own code stays at
the count of the last collective it entered while the peers waiting for it are past it, which names the culprit
(a rank at the peers' count, or ahead of them, is never blamed). With no step time reported, the p99 in the bound
is that of the ranks' observed intervals between moves of their counts (the last GAP_WINDOW of any rank, kept
across generations, each rank's counted once past its first steps in the generation: below). Seen at heartbeats
only, an interval is taken at its least: the time between the two heartbeats that brought a new count, less one
heartbeat interval (so a job that moves at every heartbeat has the floor; a rank that works 6 s at each step while
its peers wait learns a bound near 50 s). A rank's first steps in a generation are over once more than
COLLECTIVE_STEPS of its heartbeats brought a new count (the group's set-up and DDP's construction move it before
the first step, which can be long).

What must not trip it: the first step of a generation (every rank must have made a step in the current generation
before its stalls are judged: the first step of the job, the first after a recovery, compile and warm-up), a phase
a rank says is legitimately long (`long` in its heartbeat: a checkpoint the Trainer writes, an evaluation in
`toolkit.train.long_phase`), ranks that are all busy in their own work (nobody waits), and ranks that all wait (a
collective every rank entered and none completes: no rank to blame; its timeout ends it).

Pure: heartbeats and times come in, verdicts come out; the membership declares a stuck rank dead (cause
CAUSE_STUCK) and has its agent dump its stacks and kill it. Cost: a heartbeat O(1) and `due` O(1) (the server asks
at every pass of its loop), `check` O(N), and only once the bound can have passed since the job's last step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol

OUTSIDE_BEATS = 2  # heartbeats in a row a rank must say it is outside any collective before it can be blamed
SILENT_BEATS = 3  # heartbeat intervals without one: the rank cannot say where it is (a call holding its GIL)
# heartbeat intervals past a silent rank's last heartbeat after which its agent must have seen it running: a
# word from earlier may predate a SIGSTOP (then heartbeat silence is the truthful verdict, not stuck)
VOUCH_AFTER_BEATS = 2
CHECK_INTERVAL = 1.0  # s between checks while the job is formed
# A rank judged by its collectives (it reports no step): its first steps in a generation are over after more than
# this many heartbeats with a new count (the group's set-up and DDP's construction move it before any training step)
COLLECTIVE_STEPS = 3
GAP_WINDOW = 256  # the ranks' latest intervals between moves whose p99 stands for the step time of such a job


@dataclass
class RankProgress:
    """What the watchdog knows of one rank in the current generation."""

    node_id: str
    heard_at: float
    step: int | None = None
    stepped_at: float | None = None  # when its step last changed in this generation (None: not yet)
    waiting: bool = False  # its last heartbeat said: waiting in a collective
    waiting_since: float | None = None  # the first of the heartbeats in a row that said so
    outside: int = 0  # heartbeats in a row that said: not waiting
    long: str | None = None  # a legitimately long phase it said it is in
    p99: float | None = None  # its p99 time between steps
    collectives: int | None = None  # its default group's collective count, last heard (a script with no step)
    mark: tuple[int | None, int | None] = (None, None)  # its progress: (step, or the count when it reports none)
    moves: int = 0  # heartbeats in this generation whose mark had changed


@dataclass(frozen=True)
class Stuck:
    """`rank` has made no progress for `stalled` s (more than `bound`) since the job's step `step` while `waiting`
    wait in a collective; `silent`: it sent no heartbeat for `silent_for` s (its agent sees it running: a call that
    holds its GIL)."""

    rank: int
    node_id: str
    step: int | None
    stalled: float
    bound: float
    p99: float | None
    waiting: tuple[str, ...]
    silent: bool
    silent_for: float
    collectives: int | None = None  # judged by collectives (it reports no step): the count it stopped at
    peers_at: int | None = None  # and the waiting peers' (the largest)

    def reason(self) -> str:
        """The one line the scheduler's log, the ledger and the agent's exit record carry."""
        where = (f"sent no heartbeat for {self.silent_for:.1f} s though running (a call holding its GIL?)"
                 if self.silent else "not in any collective")
        peers = ", ".join(self.waiting[:4]) + (f" and {len(self.waiting) - 4} more" if len(self.waiting) > 4 else "")
        bound = f"(bound {self.bound:.3g} s: max({protocol.STALL_FACTOR:g} x {{}}, {protocol.STALL_FLOOR:g} s))"
        if self.collectives is not None:
            p99 = "no interval yet" if self.p99 is None else f"p99 interval {self.p99:.3g} s"
            return (f"stuck: entered no collective for {self.stalled:.0f} s after its collective {self.collectives} "
                    f"({where}) while {peers} waited for it in a collective (theirs: {self.peers_at}; it reports no "
                    f"step: judged by its collectives) " + bound.format(p99))
        p99 = "no step time yet" if self.p99 is None else f"p99 step {self.p99:.3g} s"
        return (f"stuck: no step for {self.stalled:.0f} s after step {self.step} ({where}) while {peers} waited for it "
                f"in a collective " + bound.format(p99))


class Watchdog:
    """Each member's progress in the current generation and the stuck verdicts on them. `beat`: the workers'
    heartbeat interval (s)."""

    def __init__(self, beat: float) -> None:
        self.beat = beat
        self.ranks: dict[int, RankProgress] = {}
        self.checked_at = -math.inf
        # kept as heartbeats come, so that `due` costs O(1): the ranks with no step in this generation, those in a
        # long phase, the job's last step, the largest p99 heard in this generation
        self.unstepped: set[int] = set()
        self.longs: set[int] = set()
        self.last_step_at = -math.inf
        self.p99 = 0.0
        # the intervals between moves of ranks judged by their collectives, and their p99 (kept across generations:
        # the job's pace is its own), brought up to date by `check` (`gaps_new`: since the last time)
        self.gaps: deque[float] = deque(maxlen=GAP_WINDOW)
        self.gap_p99 = 0.0
        self.gaps_new = False

    def formed(self) -> None:
        """A generation formed: every rank must make a step in it before its stalls are judged (its first step,
        which may take long: the group's warm-up, a replacement's state, a compile)."""
        for r in self.ranks.values():
            r.stepped_at, r.moves = None, 0
        self.unstepped = set(self.ranks)
        self.last_step_at, self.p99 = -math.inf, 0.0

    def heard(self, rank: int, node_id: str, step: int | None, beat: wire.Heartbeat, now: float) -> None:
        """A heartbeat `beat` of `rank` (the member `node_id`) with its `step` (the membership's): its watchdog
        fields are `waiting`, `long`, `step_p99` and `collectives` (absent when the peer sent a value of the wrong
        type: messages.Heartbeat). A rank with no step progresses by its collectives (see the module docstring)."""
        r = self.ranks.get(rank)
        if r is None or r.node_id != node_id:
            r = self.ranks[rank] = RankProgress(node_id, now)
            self.unstepped.add(rank)
        r.collectives = beat.collectives
        mark = (step, r.collectives if step is None else None)
        if mark != r.mark:
            if step is None and r.stepped_at is not None and r.moves >= COLLECTIVE_STEPS:  # past its first steps
                self.gaps.append(max(0.0, now - r.stepped_at - self.beat))
                self.gaps_new = True
            r.mark, r.step, r.stepped_at, r.moves = mark, step, now, r.moves + 1
            if step is not None or r.moves > COLLECTIVE_STEPS:
                self.unstepped.discard(rank)
            self.last_step_at = now
        r.heard_at = now
        r.waiting = beat.waiting is True
        r.waiting_since = (r.waiting_since if r.waiting_since is not None else now) if r.waiting else None
        r.outside = 0 if r.waiting else r.outside + 1
        r.long = beat.long
        (self.longs.add if r.long else self.longs.discard)(rank)
        r.p99 = beat.step_p99 or r.p99
        self.p99 = max(self.p99, r.p99 or 0.0)

    def forget(self, rank: int) -> None:
        """`rank` died or left: its figures go (a replacement starts afresh)."""
        self.ranks.pop(rank, None)
        self.unstepped.discard(rank)
        self.longs.discard(rank)

    def due(self) -> float:
        """When `check` next may have work: inf while fewer than two ranks are known or some has made no step in
        this generation; else not before the bound can have passed since the job's last step, nor within
        CHECK_INTERVAL of the last check."""
        judged = self._judged()
        if judged is None:
            return math.inf
        last_step, bound, _ = judged
        return max(last_step + bound, self.checked_at + CHECK_INTERVAL)

    def _judged(self) -> tuple[float, float, float | None] | None:
        """(the job's last step, the bound, the p99 it came from: the largest heard in this generation, or of the
        intervals between collectives as of the last check), or None
        when stalls are not judged now: fewer than two ranks, one that made no step in this generation, or one in
        a legitimately long phase."""
        if len(self.ranks) < 2 or self.unstepped or self.longs:
            return None
        p99 = max(self.p99, self.gap_p99) or None
        return self.last_step_at, protocol.stall_bound(p99), p99

    def check(self, now: float, vouched: Callable[[int, float], bool] = lambda rank, since: True) -> list[Stuck]:
        """The stuck ranks now (see the module docstring); each is named once (forgotten here). `vouched(rank,
        since)`: whether the rank's agent said after `since` that its process runs (not stopped). `since` is
        VOUCH_AFTER_BEATS heartbeats past the rank's last one, when a process that runs would have sent another: a
        word from before then may predate a SIGSTOP. A silent rank not vouched for is no call holding its GIL but
        a stopped or cut-off process, which heartbeat silence declares dead."""
        self.checked_at = now
        if self.gaps_new:  # here, not at each heartbeat: O(GAP_WINDOW), at most every CHECK_INTERVAL
            self.gap_p99, self.gaps_new = sorted(self.gaps)[int(0.99 * (len(self.gaps) - 1))], False
        ranks = self.ranks
        judged = self._judged()
        if judged is None:
            return []
        last_step, bound, p99 = judged
        stalled = now - last_step
        if stalled < bound:
            return []
        silent_after = SILENT_BEATS * self.beat
        waiters = [r for r in ranks.values() if r.waiting_since is not None and now - r.heard_at <= silent_after]
        if not waiters or now - min(r.waiting_since for r in waiters if r.waiting_since is not None) < bound:
            return []
        waiting = tuple(r.node_id for r in waiters)
        steps = [r.step for r in ranks.values() if r.step is not None]
        job_step = max(steps) if steps else None  # a silent rank's last heartbeat may be a few steps behind
        counts = [r.collectives for r in waiters if r.step is None and r.collectives is not None]
        peers_at = max(counts) if counts else None
        out = []
        for rank, r in ranks.items():
            silent = now - r.heard_at > silent_after
            if not ((silent and vouched(rank, r.heard_at + VOUCH_AFTER_BEATS * self.beat))
                    or (not silent and r.outside >= OUTSIDE_BEATS)):
                continue
            if r.step is None and r.collectives is not None:  # judged by collectives: it must be behind its peers
                if peers_at is None or r.collectives >= peers_at:
                    continue
                out.append(Stuck(rank, r.node_id, job_step, stalled, bound, p99, waiting, silent, now - r.heard_at,
                                 r.collectives, peers_at))
            else:
                out.append(Stuck(rank, r.node_id, job_step, stalled, bound, p99, waiting, silent, now - r.heard_at))
        for s in out:
            self.forget(s.rank)
        return out
