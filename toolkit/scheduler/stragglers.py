"""Stragglers named: which rank is persistently slower than the others, on which host, and by how much.

Each worker's heartbeat carries `busy`, the median time of its recent steps spent on its own work before its last
gradient bucket went to the allreduce (toolkit.train.pace). In synchronous data parallelism every rank's step takes
as long as the slowest one's, so the step time cannot tell who is slow; the own-work time can: the slow rank's is
high, the others' low (they spend the difference waiting for it).

A rank's score is the median `busy` of the other ranks over its own (nvidia-resiliency-ext scores median / rank's
time); a score below `threshold` (default 0.75, nvidia-resiliency-ext's: a rank that takes a third longer than
the median) for `persist` evaluations in a row names it a straggler; as many evaluations at or above the
threshold clear it. The median of the others, not of all: in a world of two the slow rank would otherwise pull
the median half-way to itself. Figures older than `stale` seconds (a rank that died, or stopped reporting) are not
compared.

Cost: one sort per evaluation, O(N log N) for N ranks (the median of the others is read off the sorted figures at
fixed indices, `_median_without`), so evaluating 4096 ranks every EVAL_INTERVAL stays in milliseconds.

Pure: figures and times come in, events come out; the scheduler's journal logs them and puts them in the ledger.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Mapping

THRESHOLD = 0.75  # score (median of the others / this rank's own-work time) below which a rank is slow
PERSIST = 5  # evaluations in a row before a rank is named, or cleared
EVAL_INTERVAL = 2.0  # s between evaluations (heartbeats come every second; the figures are medians of 32 steps)
STALE = 10.0  # s: figures older than this are not compared


_WHO = frozenset(("rank", "node_id", "host", "pid", "step"))  # a pace Note's fields that are no figures


@dataclass
class RankFigures:
    """The latest pace figures of one rank (a heartbeat's, toolkit.contracts.messages.Heartbeat.pace) and where it
    runs."""

    rank: int
    node_id: str
    host: str
    pid: int | None
    seen_at: float
    step: int | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    stepped_at: float | None = None  # when its step last changed (None: no step heard yet)


@dataclass(frozen=True)
class Named:
    """`rank` became a straggler: its own work per step takes `busy` s, `factor` times the others' median."""

    rank: int
    node_id: str
    host: str
    busy: float
    median: float
    factor: float


@dataclass(frozen=True)
class Cleared:
    """`rank` is no longer slower than the threshold."""

    rank: int
    node_id: str
    host: str


class Stragglers:
    """The ranks' latest figures and the straggler verdicts on them."""

    def __init__(self, threshold: float = THRESHOLD, persist: int = PERSIST, stale: float = STALE) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"straggler threshold {threshold!r}: give a score between 0 and 1 (e.g. 0.75)")
        self.threshold = threshold
        self.persist = persist
        self.stale = stale
        self.ranks: dict[int, RankFigures] = {}
        self.flagged: dict[int, Named] = {}
        self.streak: dict[int, int] = {}  # evaluations in a row on the other side of the threshold
        self.scores: dict[int, float] = {}  # the last evaluation's scores

    def observe(self, fields: Mapping[str, Any], now: float) -> None:
        """A heartbeat's figures (a membership `pace` Note: rank, node_id, host, pid, step and pace fields)."""
        rank = fields["rank"]
        figures = {k: v for k, v in fields.items() if k not in _WHO}
        before, step = self.ranks.get(rank), fields.get("step")
        same = before is not None and before.step == step and before.node_id == fields["node_id"]
        self.ranks[rank] = RankFigures(rank, fields["node_id"], fields["host"], fields.get("pid"), now, step, figures,
                                       before.stepped_at if same and before is not None else
                                       (now if step is not None else None))

    def forget(self, rank: int) -> list[Cleared]:
        """`rank` died: its figures go (its replacement starts afresh); a straggler verdict on it is cleared."""
        self.ranks.pop(rank, None)
        self.streak.pop(rank, None)
        self.scores.pop(rank, None)
        named = self.flagged.pop(rank, None)
        return [Cleared(rank, named.node_id, named.host)] if named else []

    def evaluate(self, now: float) -> list[Named | Cleared]:
        """Score every rank with a fresh own-work figure against the median of the others; return who became a
        straggler and who stopped being one."""
        fresh = {r: f.figures["busy"] for r, f in self.ranks.items()
                 if now - f.seen_at <= self.stale and isinstance(f.figures.get("busy"), float)
                 and f.figures["busy"] > 0}
        self.scores = {}
        events: list[Named | Cleared] = []
        if len(fresh) < 2:
            return events
        ordered = sorted(fresh.values())
        for rank, busy in fresh.items():
            median = _median_without(ordered, bisect_left(ordered, busy))
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


def _median_without(ordered: list[float], i: int) -> float:
    """statistics.median of `ordered` (sorted, at least 2 values) without its value at index `i`, in O(1): index j of
    the others is j below i and j + 1 from i on. Equal values are interchangeable, so any index of the rank's value
    gives the same result, bit for bit the one statistics.median gives (the middle one, or the mean of the two
    middle ones as (a + b) / 2)."""
    n = len(ordered) - 1

    def other(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    if n % 2 == 1:
        return other(n // 2)
    return (other(n // 2 - 1) + other(n // 2)) / 2
