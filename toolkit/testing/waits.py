"""Bounded waits on a condition, for tests and benchmarks: the one way they wait for a remote or asynchronous
state that no event announces (a line appended to a log, a process listed by an agent).

Why one helper: a wait must have a generous bound (CI's machine is shared), must not sleep past a condition that
already holds, must stop early when what it waits for can no longer happen (the job ended), and must fail with the
evidence a reader needs, never with a bare timeout."""

from __future__ import annotations

import time
from typing import Callable, Protocol, TypeVar

T = TypeVar("T")

POLL = 0.05  # s between looks: no event tells that the condition now holds


def wait_for(what: str, predicate: Callable[[], T], bound: float, *, poll: float = POLL,
             evidence: Callable[[], str] | None = None, ended: Callable[[], str | None] | None = None) -> T:
    """Poll `predicate` until it returns something true (returned), for at most `bound` seconds. `ended()` returns
    why the condition can no longer come about (None while it still can); the AssertionError raised then, or on
    timeout, carries that and `evidence()`."""
    deadline = time.monotonic() + bound
    while True:
        value = predicate()
        if value:
            return value
        why = ended() if ended is not None else None
        if why is None and time.monotonic() > deadline:
            why = f"not within {bound:g} s"
        if why is not None:
            more = evidence() if evidence is not None else ""
            raise AssertionError(f"waiting for {what}: {why}" + (f"\n{more}" if more else ""))
        time.sleep(poll)


class Watched(Protocol):
    """A running job a test waits on (toolkit.testing.localjob's LocalJob and FleetRun)."""

    def ended(self) -> str | None:
        """Why what the test waits for can no longer come about (the job ended, and how); None while it runs."""

    def evidence(self) -> str:
        """What a failed wait prints: the job's state and its logs' tails."""


def until(what: str, predicate: Callable[[], T], job: Watched, bound: float, *, poll: float = POLL) -> T:
    """`wait_for` on a running job: stops as soon as the job ends, and fails with the job's evidence. A test module
    binds its bound once (`until = functools.partial(waits.until, bound=TIMEOUT)`)."""
    return wait_for(what, predicate, bound, poll=poll, evidence=job.evidence, ended=job.ended)
