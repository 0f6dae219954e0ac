"""A fake monotonic clock for unit tests of the parts that take a clock (toolkit.agent.timers.Timers and what reads
the time through it): time moves only when the test says so."""

from __future__ import annotations


class FakeClock:
    """Callable like time.monotonic; `advance(s)` moves it forward and returns the new time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock `seconds` forward (never back) and return the new time."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock does not go back ({seconds} s)")
        self.now += seconds
        return self.now


class JournalClock:
    """Both clocks the scheduler's journal takes (`mono` and `wall`), moved together by hand: set or advance `t`,
    the seconds since the start; the wall clock reads `start` + t."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.t = 0.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.start + self.t
