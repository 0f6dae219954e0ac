"""Straggler verdicts from the sorted figures (toolkit.scheduler.stragglers, O(N log N) per evaluation) are bit for
bit those of the definition: each rank's score is statistics.median of the others' own-work times over its own.
The definition is kept here as the reference; a fake clock drives both through the same heartbeats."""

from __future__ import annotations

import random
import statistics

import pytest

from toolkit.scheduler.stragglers import EVAL_INTERVAL, PERSIST, STALE, Cleared, Named, Stragglers


class Reference(Stragglers):
    """The definition, as it was written before the sort: the median of the others, computed per rank."""

    def evaluate(self, now: float) -> list[Named | Cleared]:
        fresh = {r: f.figures["busy"] for r, f in self.ranks.items()
                 if now - f.seen_at <= self.stale and isinstance(f.figures.get("busy"), float)
                 and f.figures["busy"] > 0}
        self.scores = {}
        events: list[Named | Cleared] = []
        if len(fresh) < 2:
            return events
        for rank, busy in fresh.items():
            median = statistics.median(v for r, v in fresh.items() if r != rank)
            score = median / busy
            self.scores[rank] = score
            slow = score < self.threshold
            if slow == (rank in self.flagged):
                self.streak[rank] = 0
                continue
            self.streak[rank] = self.streak.get(rank, 0) + 1
            if self.streak[rank] < self.persist:
                continue
            self.streak[rank] = 0
            f = self.ranks[rank]
            if slow:
                named = Named(rank, f.node_id, f.host, busy, median, busy / median)
                self.flagged[rank] = named
                events.append(named)
            else:
                del self.flagged[rank]
                events.append(Cleared(rank, f.node_id, f.host))
        return events


def _beat(trackers: list[Stragglers], rank: int, busy: float | None, now: float) -> None:
    fields = {"rank": rank, "node_id": f"worker_{rank}", "host": f"h{rank // 8}", "pid": 100 + rank, "step": 1}
    if busy is not None:
        fields["busy"] = busy
    for s in trackers:
        s.observe(fields, now)


def _same_run(rng: random.Random, world: int, evaluations: int) -> int:
    """Drive the tracker and the reference through the same random heartbeats; assert equal events and scores after
    every evaluation. Returns how many events there were (so a caller can tell the run named someone)."""
    fast, ref = Stragglers(threshold=0.75), Reference(threshold=0.75)
    slow = set(rng.sample(range(world), max(1, world // 7)))
    grid = [0.05, 0.05, 0.05, 0.06, 0.1, 0.2]  # few distinct values: ties everywhere
    now, events = 0.0, 0
    for _ in range(evaluations):
        for rank in range(world):
            if rng.random() < 0.1:
                continue  # a missed heartbeat: older figures, some of them stale by now
            if rng.random() < 0.5:
                busy = rng.choice(grid) * (3.0 if rank in slow else 1.0)
            else:
                busy = rng.uniform(0.01, 0.5) if rank in slow else rng.uniform(0.04, 0.06)
            _beat([fast, ref], rank, busy if rng.random() > 0.02 else None, now)
        if rng.random() < 0.05:  # a rank dies: both forget it
            dead = rng.randrange(world)
            assert fast.forget(dead) == ref.forget(dead)
        got, want = fast.evaluate(now), ref.evaluate(now)
        assert got == want
        assert fast.scores == ref.scores  # the same floats, in the same order
        assert list(fast.scores) == list(ref.scores)
        assert fast.flagged == ref.flagged and fast.streak == ref.streak
        events += len(got)
        now += EVAL_INTERVAL * rng.choice([1, 1, 1, 6])  # now and then long enough for figures to go stale
    return events


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 9, 64, 65])
def test_the_verdicts_are_the_definitions_bit_for_bit_on_random_figures_with_ties(world: int) -> None:
    rng = random.Random(world)
    events = sum(_same_run(rng, world, 60) for _ in range(4))
    assert events > 0  # the runs named and cleared stragglers: the comparison covered verdicts, not only scores


def test_a_world_of_two_compares_each_rank_with_the_other() -> None:
    s = Stragglers(threshold=1 / 1.5)
    now = 0.0
    events: list[Named | Cleared] = []
    for _ in range(PERSIST):
        _beat([s], 0, 0.1, now)
        _beat([s], 1, 0.2, now)
        events += s.evaluate(now)
        now += EVAL_INTERVAL
    assert s.scores == {0: 2.0, 1: 0.5}
    assert events == [Named(1, "worker_1", "h0", 0.2, 0.1, 2.0)]


def test_a_streak_names_then_clears_and_stale_or_dead_ranks_are_not_compared() -> None:
    s = Stragglers(threshold=1 / 1.5)
    now = 0.0
    named: list[Named | Cleared] = []
    for i in range(PERSIST):
        for rank in range(5):
            _beat([s], rank, 0.3 if rank == 2 else 0.1, now)
        named += s.evaluate(now)
        assert (named == []) == (i < PERSIST - 1)  # not before PERSIST evaluations in a row
        now += EVAL_INTERVAL
    assert [type(e) for e in named] == [Named] and named[0].rank == 2 and named[0].factor == pytest.approx(3.0)
    cleared: list[Named | Cleared] = []
    for _ in range(PERSIST):
        for rank in range(5):
            _beat([s], rank, 0.1, now)
        cleared += s.evaluate(now)
        now += EVAL_INTERVAL
    assert cleared == [Cleared(2, "worker_2", "h0")]
    _beat([s], 4, 0.9, now)  # rank 4 slow, but only once: then it falls silent
    now += STALE + 1
    for rank in range(4):
        _beat([s], rank, 0.1, now)
    s.evaluate(now)
    assert 4 not in s.scores  # stale figures are not compared
    assert s.forget(3) == [] and 3 not in s.ranks


def test_the_threshold_is_validated() -> None:
    for bad in (0.0, 1.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="between 0 and 1"):
            Stragglers(threshold=bad)
