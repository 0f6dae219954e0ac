"""The warm spare's decisions (pure: facts and a clock in; toolkit.agent.warmprocess applies them): whether one is
wanted at all (`next_step`), and when it may import torch: never while a worker relaunched cold starts beside it
(`spare_plan`).

Wanted: a spare is (re)built SPARE_DELAY after a launch or a handoff (sooner once every worker has progressed), never
while the agent is closing, and no more once SPARE_MAX_FAILURES spares died on their own with no handoff between.

Why: a relaunch takes the spare only once it is ready (its imports done); until then the worker starts cold, at
once. But a spare still importing (`import torch` and DDP's lazy imports, seconds of CPU and page cache) competes
with that cold start: on a loaded 2-core machine a kill 4 s after the start, while the spare was importing, took
10.2 s to recover (a ready spare: 1.8 s); `bench/agent_restart.py --modes cold,early` measured the spare taking 2.3
s of CPU during the replacement's cold start (docs/benchmarks.md). So a spare that is not ready is held
(SIGSTOP) while any worker relaunched cold has not reached its process group yet (reported progress), and goes on
(SIGCONT) after, keeping what it had imported; a spare not started yet waits as long. A relaunch before the spare
is ready therefore costs what a cold start costs, and the spare is ready for the next fault soon after. A ready
spare is idle (blocked reading its socket) and never held. The job's first start is not a relaunch: the agent's
SPARE_DELAY paces the spare then, as before.

Every hold is bounded: a worker that never reports progress (a script that never forms a process group) holds the
spare at most HOLD_MAX seconds from its launch.

Topped up (`topup`): a spare faults in ahead what the largest worker held when the spare started (toolkit.standby),
but a spare started early in a job is told too little: workers grow over their first steps and checks (here 906 MB
at the spare's start, 1.4 GB ten seconds later), and a replacement that faults in the rest does so inside the step
every rank waits for. So while a ready spare waits, the agent looks at the workers (at its READY, then every
TOPUP_EVERY seconds) and, once the largest has grown by TOPUP_GROWTH beyond what the spare was told, tells it the
new figure; the spare faults in the difference.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

HOLD_MAX = 60.0  # s after a cold launch past which it no longer holds the spare back
SPARE_DELAY = 10.0  # s after a launch before the warm spare is (re)built, unless every worker already made progress
SPARE_MAX_FAILURES = 3  # spares that die on their own before the agent stops making them
TOPUP_EVERY = 5.0  # s between two looks at the workers' memory while a ready spare waits (/proc tells no growth)
TOPUP_GROWTH = 0.1  # of what a spare was told: growth past this share is faulted in ahead too
TOPUP_MIN = 64 << 20  # bytes: less growth than this is not worth a top-up


class Step(enum.Enum):
    """What to do about the warm spare now: ARM (build one, after SPARE_DELAY or at once), WAIT (nothing: one exists,
    or the agent is closing), OFF (spares are off for this agent's life)."""

    ARM = "arm"
    WAIT = "wait"
    OFF = "off"


def next_step(enabled: bool, failures: int, closing: bool, exists: bool,
              max_failures: int = SPARE_MAX_FAILURES) -> Step:
    """Whether a spare is wanted, given whether spares are `enabled`, how many died with no handoff between
    (`failures`), whether the agent is `closing`, and whether a spare `exists`."""
    if not enabled or failures >= max_failures:
        return Step.OFF
    if closing or exists:
        return Step.WAIT
    return Step.ARM


def early_start(running_progressed: Iterable[bool]) -> bool:
    """Whether a spare waiting out SPARE_DELAY may be built now: every running worker has progressed (there is one at
    least), so the job is past its start and a spare's imports no longer compete with it."""
    flags = list(running_progressed)
    return bool(flags) and all(flags)


@dataclass(frozen=True)
class SparePlan:
    """`run`: the spare may import (start it, or let it go on); else hold it until the cold starts have progressed,
    deciding again at `until` at the latest (monotonic s)."""

    run: bool
    until: float | None = None


def spare_plan(ready: bool, cold_launches: Iterable[float], now: float, hold_max: float = HOLD_MAX) -> SparePlan:
    """The plan for the warm spare, `ready` or not, given the launch times (monotonic s) of the workers started cold
    that have not progressed since, at `now`."""
    if ready:
        return SparePlan(True)
    ends = [t + hold_max for t in cold_launches if t + hold_max > now]
    return SparePlan(False, max(ends)) if ends else SparePlan(True)


def topup(told: int, largest: int, growth: float = TOPUP_GROWTH, least: int = TOPUP_MIN) -> int | None:
    """The private memory to tell a ready spare about now (it faults in ahead the difference), given what it was
    `told` and what the `largest` worker holds; None while what it was told still covers the workers."""
    if largest - told >= max(least, told * growth):
        return largest
    return None
