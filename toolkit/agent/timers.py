"""Deadlines of the agent's event loop (backoffs, grace periods, retries), in one heap on an injectable clock
(time.monotonic by default; a test passes a fake one): the loop's select() waits until the nearest one, so no
interval is polled."""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable


class Timer:
    """One deadline of the loop: `fn` runs once, from Timers.run_due, at or after the monotonic time `when`, unless it
    is cancelled first."""

    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        """Make sure `fn` never runs (if it has not run already); idempotent. The entry leaves the heap lazily, when it
        reaches the top."""
        self.cancelled = True


class Timers:
    """Deadlines of the event loop (backoffs, grace periods, retries), in one heap on `clock` (monotonic seconds;
    time.monotonic unless a test passes a fake). Used from the agent's loop thread only: nothing runs except inside
    `run_due`. The agent's parts read the time through `now()`, so one fake clock drives them all."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._clock = clock

    def now(self) -> float:
        """The clock's time (monotonic s): what deadlines are measured against."""
        return self._clock()

    def after(self, delay: float, fn: Callable[[], None]) -> Timer:
        """Schedule `fn` to run once, `delay` s from now (a negative delay counts as 0); returns its Timer, for
        cancelling."""
        t = Timer(self._clock() + max(0.0, delay), fn)
        heapq.heappush(self._heap, (t.when, next(self._seq), t))
        return t

    def timeout(self, cap: float) -> float:
        """Seconds until the nearest live deadline, at most `cap` and never negative: what the loop passes to select().
        Drops cancelled entries from the top of the heap."""
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        if not self._heap:
            return cap
        return min(cap, max(0.0, self._heap[0][0] - self._clock()))

    def run_due(self) -> None:
        """Run every live timer whose deadline has passed, earliest first (ties in the order they were made). The clock
        is read once, at the start. A timer counts as cancelled before its `fn` runs, so it fires at most once. An
        exception from a callback propagates and leaves the later timers for the next call."""
        now = self._clock()
        while self._heap and self._heap[0][0] <= now:
            _, _, t = heapq.heappop(self._heap)
            if not t.cancelled:
                t.cancelled = True
                t.fn()
