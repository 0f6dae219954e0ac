"""Deadlines of the agent's event loop (backoffs, grace periods, retries), in one heap on the monotonic clock:
the loop's select() waits until the nearest one, so no interval is polled."""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable


class Timer:
    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    """Deadlines of the event loop (backoffs, grace periods, retries), in one heap on the monotonic clock."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()

    def after(self, delay: float, fn: Callable[[], None]) -> Timer:
        t = Timer(time.monotonic() + max(0.0, delay), fn)
        heapq.heappush(self._heap, (t.when, next(self._seq), t))
        return t

    def timeout(self, cap: float) -> float:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        if not self._heap:
            return cap
        return min(cap, max(0.0, self._heap[0][0] - time.monotonic()))

    def run_due(self) -> None:
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            _, _, t = heapq.heappop(self._heap)
            if not t.cancelled:
                t.cancelled = True
                t.fn()
