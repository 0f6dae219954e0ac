"""The agent's judgement of a worker's open files (toolkit.agent.openfiles.Trend), sample by sample: counts before the
worker joined its group set nothing, a climb to twice the low (and CLIMB_MIN more) is named once, then only at each
doubling, and the cause of its death says so."""

from __future__ import annotations

from toolkit.agent.openfiles import CLIMB_MIN, Trend


def test_a_climbing_count_is_named_at_twice_its_low_then_at_each_doubling() -> None:
    trend = Trend(limit=1024)
    assert trend.sample(900, trained=False) is None  # building its group: no low yet
    assert [trend.sample(n, trained=True) is not None for n in (120, 100, 130, 100 + CLIMB_MIN - 1)] == [False] * 4
    warning = trend.sample(100 + CLIMB_MIN, trained=True)
    assert warning and f"holds {100 + CLIMB_MIN} open files, up from 100" in warning and "(limit 1024)" in warning
    assert trend.climbing and trend.sample(2 * (100 + CLIMB_MIN) - 1, trained=True) is None
    assert trend.sample(2 * (100 + CLIMB_MIN), trained=True) is not None
    assert trend.cause() == (f"; its open files had climbed from 100 to {2 * (100 + CLIMB_MIN)} (limit 1024): "
                             "connections to its gloo port from outside the job? (docs/security.md, 'Gloo's port')")
    assert trend.document() == {"count": 2 * (100 + CLIMB_MIN), "low": 100, "limit": 1024, "climbing": True}


def test_a_steady_count_is_never_named() -> None:
    trend = Trend(limit=1 << 20)
    assert all(trend.sample(n, trained=True) is None for n in [400, 420, 380, 450, 390] * 20)
    assert not trend.climbing and trend.cause() == ""
