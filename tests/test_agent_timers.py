"""The agent loop's deadlines (toolkit.agent.timers) on a fake clock: order, ties, cancelling, the select timeout,
and a failing callback."""

from __future__ import annotations

import pytest

from toolkit.agent.timers import Timers
from toolkit.testing.clock import FakeClock


def test_due_timers_run_earliest_first_and_ties_in_the_order_they_were_made() -> None:
    clock = FakeClock()
    timers, ran = Timers(clock), []
    timers.after(2.0, lambda: ran.append("b"))
    timers.after(1.0, lambda: ran.append("a"))
    timers.after(2.0, lambda: ran.append("c"))
    timers.after(-5.0, lambda: ran.append("now"))  # a negative delay counts as 0
    timers.run_due()
    assert ran == ["now"]
    clock.advance(1.999)
    timers.run_due()
    assert ran == ["now", "a"]
    clock.advance(0.001)
    timers.run_due()
    assert ran == ["now", "a", "b", "c"]
    clock.advance(100)
    timers.run_due()
    assert ran == ["now", "a", "b", "c"]  # each fires once
    assert timers.now() == clock.now


def test_a_timer_cancelled_before_it_is_due_never_runs() -> None:
    clock = FakeClock()
    timers, ran = Timers(clock), []
    t = timers.after(1.0, lambda: ran.append("cancelled"))
    timers.after(1.0, lambda: ran.append("kept"))
    t.cancel()
    t.cancel()  # idempotent
    clock.advance(1.0)
    timers.run_due()
    assert ran == ["kept"]


def test_timeout_is_the_nearest_live_deadline_capped_and_never_negative() -> None:
    clock = FakeClock()
    timers = Timers(clock)
    assert timers.timeout(30.0) == 30.0  # nothing armed: the cap
    first = timers.after(3.0, lambda: None)
    timers.after(7.0, lambda: None)
    assert timers.timeout(30.0) == 3.0
    assert timers.timeout(1.0) == 1.0
    first.cancel()
    assert timers.timeout(30.0) == 7.0  # a cancelled one does not count
    clock.advance(10.0)
    assert timers.timeout(30.0) == 0.0  # overdue: select must not wait


def test_a_failing_callback_leaves_the_later_timers_for_the_next_call() -> None:
    clock = FakeClock()
    timers, ran = Timers(clock), []

    def boom() -> None:
        raise RuntimeError("bug")

    timers.after(1.0, boom)
    timers.after(2.0, lambda: ran.append("later"))
    clock.advance(5.0)
    with pytest.raises(RuntimeError):
        timers.run_due()
    assert ran == []
    timers.run_due()  # the failed one does not run again; the later one does
    assert ran == ["later"]

