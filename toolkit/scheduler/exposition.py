"""What the scheduler's Prometheus endpoint serves: a snapshot of what the scheduler already holds, turned into
metric families by prometheus_client (no exposition text is written here).

`take` copies, on the scheduler's loop thread, the figures the journal (its straggler tracking and goodput ledger)
and the membership's roster hold into a `Snapshot` of plain values; `JobCollector` (a prometheus_client Collector)
turns the newest snapshot into metric families when the listener's thread renders a scrape. The loop's objects are
never read from another thread (toolkit.scheduler.metrics hands snapshots between the two).

The per-rank families are most of a page (16,384 of its 16,934 series at 4096 ranks), and prometheus_client's
generate_latest escapes, validates and sorts every label of every sample anew: about 6 us a sample, 100 ms of CPU a
scrape at 4096 ranks, while a rank's labels never change between scrapes, only its values. `RankLines` renders
them with the library's own pieces, once per label set: each rank's label text comes from generate_latest itself
(kept while the rank keeps its node id and host), the families' HELP and TYPE lines too, and each value is
formatted by the library's floatToGoString; the page is byte for byte generate_latest's (tests/test_metrics.py
compares them). The rest of the page (per job, per host, incidents) is generate_latest's over `JobCollector(...,
ranks=False)`.

The series, and why their number is bounded (N ranks, H hosts): per rank 4 gauges (steps/s, step, own work per step,
and the loss when the script reports one), labelled job, rank, node_id, host; per rank named a straggler one gauge
(1: the verdict; the others have none, which keeps a scrape at 4096 ranks a quarter cheaper than a 0 per rank); per
process that restarted one counter; per host one gauge (H); per job 40 (19 gauges, the goodput's 4 lost parts among
them, 7 kinds of cause, 14 histogram samples). At 4096 ranks on 512 hosts: 4 x 4096 + 512 + 40 = 16,936 series in a
healthy job, at most 6 x 4096 + 512 + 40 = 25,128 if every rank were a straggler and had restarted
(tests/test_metrics.py counts them).

Nothing here names a file, a token, a command line or a script's error text: incidents are counted by `cause_kind`,
a fixed set of kinds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from toolkit.scheduler.actions import CAUSE_CLOSED, CAUSE_NOT_BACK, CAUSE_REPLACED, CAUSE_SILENCE
from toolkit.scheduler.journal import Journal
from toolkit.scheduler.roster import Roster

# Bounds of the time-to-recover histogram, s: in-place recovery takes a second or two, a restart from checkpoints
# tens of seconds, a lost host waits for its spare (TOOLKIT_HOST_TIMEOUT, 60 s by default) and more.
MTTR_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CAUSE_KINDS = ("signal", "exit code", "script error", "heartbeat silence", "connection closed", "host lost",
               "did not reconnect")
GOODPUT_PARTS = ("startup", "recovery", "recomputed", "checkpoint")
RANK_LABELS = ("job", "rank", "node_id", "host")


def cause_kind(cause: str) -> str:
    """The kind of an incident's cause (one of CAUSE_KINDS): its text may hold a script's error message, which is
    neither bounded in number nor fit to publish."""
    if cause.startswith("killed by "):
        return "signal"
    if cause.startswith("exit code "):
        return "exit code"
    if cause.startswith(("host lost", "host ")) or cause == CAUSE_REPLACED:
        return "host lost"
    if cause in (CAUSE_SILENCE, CAUSE_CLOSED, CAUSE_NOT_BACK):
        return cause
    return "script error"


class RankRow(NamedTuple):
    """One rank's latest figures, as its heartbeats carried them (a tuple: 4096 of them are made per scrape)."""

    rank: int
    node_id: str
    host: str
    step: int | None
    step_time: float | None
    busy: float | None
    loss: float | None
    straggler: bool


@dataclass(frozen=True)
class Snapshot:
    """What one scrape serves, copied from the scheduler's state on its loop thread (`take`)."""

    job: str
    world_size: int
    members: int  # ranks whose live process is connected
    generation: int
    ranks: tuple[RankRow, ...]
    hosts: tuple[tuple[str, bool], ...]  # (host, its agent connected) for every host watched
    goodput: dict[str, Any]
    causes: dict[str, int]
    incidents: int
    recover_times: tuple[float, ...]
    restarts: tuple[tuple[int, str, int], ...]  # (rank, node id, deaths of its processes)
    checkpoint_stall: float  # s, mean over ranks
    checkpoint_bytes: int  # bytes written by the newest checkpoint, summed over ranks
    last_step: int | None
    total: int | None  # the steps the run will take, as the ranks reported it
    since_last_step: float | None  # s since the newest step was first heard
    max_restarts: int | None
    host_of: dict[int, str] = field(default_factory=dict)
    workers: int | None = None  # processes in the newest formed generation (fewer than world_size: degraded)
    logical_world: int | None = None  # the logical ranks they serve (issue 42)


def take(journal: Journal, roster: Roster, generation: int, max_restarts: int | None, now: float,
         wall: float) -> Snapshot:
    """Copy the figures of `journal` and `roster` (the membership's) into a Snapshot; `now` monotonic, `wall` the
    time of day. O(ranks + incidents kept); run on the loop's thread."""
    strag, ledger = journal.stragglers, journal.ledger
    ranks = tuple(RankRow(r, f.node_id, f.host, f.step, f.figures.get("step_time"), f.figures.get("busy"),
                          f.figures.get("loss"), r in strag.flagged) for r, f in sorted(strag.ranks.items()))
    causes = dict.fromkeys(CAUSE_KINDS, 0)
    for inc in ledger.faults.incidents:
        causes[cause_kind(inc.cause)] += 1
    hosts = tuple((name, rec.connected) for name, rec in sorted(roster.hosts.items())
                  if rec.heard_at is not None or rec.connected)
    host_of = {r: roster.node_host.get(node_id, "") for r, node_id, _ in journal.restarts()}
    stalls = [base + last for base, last in ledger.accounting.stall.values()]
    return Snapshot(
        job=journal.job, world_size=journal.world_size, members=roster.connected_members, generation=generation,
        ranks=ranks, hosts=hosts, goodput=ledger.goodput(wall), causes=causes, incidents=ledger.faults.count,
        recover_times=tuple(i.time_to_recover for i in ledger.faults.incidents if i.time_to_recover is not None),
        restarts=tuple(journal.restarts()), checkpoint_stall=sum(stalls) / len(stalls) if stalls else 0.0,
        checkpoint_bytes=journal.checkpoint_bytes(), last_step=ledger.accounting.last_step,
        total=journal.progress(()).get("total"),
        since_last_step=None if journal.step_heard_at is None else max(0.0, now - journal.step_heard_at),
        max_restarts=max_restarts, host_of=host_of,
        workers=(journal.elastic or {}).get("workers", journal.world_size),
        logical_world=(journal.elastic or {}).get("logical_world", journal.world_size))


def p99(values: list[float]) -> float | None:
    """The 99th percentile of `values` (nearest rank), None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def rank_families() -> tuple[GaugeMetricFamily, ...]:
    """The per-rank gauges (labels RANK_LABELS), empty: steps/s, step, own work, loss, straggler, in this order."""
    return (GaugeMetricFamily("toolkit_rank_steps_per_second", "Steps a second (1 / the median of the rank's recent "
                              "step times)", labels=RANK_LABELS),
            GaugeMetricFamily("toolkit_rank_step", "The newest step the rank reported", labels=RANK_LABELS),
            GaugeMetricFamily("toolkit_rank_busy_seconds", "The rank's own work per step (median of recent steps), "
                              "before its last gradient bucket went to the allreduce", labels=RANK_LABELS),
            GaugeMetricFamily("toolkit_rank_loss", "The loss the rank reported last", labels=RANK_LABELS),
            GaugeMetricFamily("toolkit_rank_straggler", "1 while the rank is named a straggler (no series for the "
                              "others)", labels=RANK_LABELS))


def rank_values(row: RankRow) -> tuple[float | None, ...]:
    """`row`'s value in each of rank_families() (None: no series)."""
    return (1.0 / row.step_time if row.step_time else None, row.step, row.busy, row.loss,
            1.0 if row.straggler else None)


class JobCollector(Collector):
    """A prometheus_client Collector over the newest Snapshot that `source()` returns (None: nothing yet, no
    series); `ranks` False leaves the per-rank families out (RankLines renders them)."""

    def __init__(self, source: Callable[[], Snapshot | None], ranks: bool = True) -> None:
        self.source = source
        self.ranks = ranks

    def collect(self) -> Iterator[Metric]:
        snap = self.source()
        if snap is None:
            return
        if self.ranks:
            yield from self._ranks(snap)
        yield from self._job(snap)
        yield from self._incidents(snap)

    @staticmethod
    def _ranks(snap: Snapshot) -> Iterator[Metric]:
        """The per-rank gauges (labels RANK_LABELS)."""
        families = rank_families()
        for row in snap.ranks:
            labels = [snap.job, str(row.rank), row.node_id, row.host]
            for family, value in zip(families, rank_values(row), strict=True):
                if value is not None:
                    family.add_metric(labels, value)
        yield from families

    @staticmethod
    def _job(snap: Snapshot) -> Iterator[Metric]:
        """The job's gauges: its size, pace, goodput and checkpoints, and its hosts."""
        job = [snap.job]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            family = GaugeMetricFamily(name, doc, labels=["job"])
            if value is not None:
                family.add_metric(job, value)
            yield family

        g = snap.goodput
        yield from gauge("toolkit_job_world_size", "Ranks the job runs", snap.world_size)
        yield from gauge("toolkit_job_workers", "Processes in the newest formed generation (fewer than the world "
                         "size: a degraded, shrunk job)", snap.workers)
        yield from gauge("toolkit_job_logical_ranks", "Logical ranks the workers serve (a shrunk job serves all of "
                         "them with fewer processes)", snap.logical_world)
        yield from gauge("toolkit_job_members", "Ranks whose live process is connected to the scheduler",
                         snap.members)
        yield from gauge("toolkit_job_generation", "The job's generation (1 up at every re-formation)",
                         snap.generation)
        yield from gauge("toolkit_job_last_step", "The newest step any rank reported", snap.last_step)
        yield from gauge("toolkit_job_total_steps", "The steps the run will take (the Trainer's, or report(total=))",
                         snap.total)
        yield from gauge("toolkit_job_seconds_since_last_step", "Seconds since the scheduler first heard the job's "
                         "newest step (its own clock)", snap.since_last_step)
        yield from gauge("toolkit_job_step_p99_seconds", "The 99th percentile of the ranks' recent step times",
                         p99([r.step_time for r in snap.ranks if r.step_time]))
        yield from gauge("toolkit_job_goodput_ratio", "Productive time / wall time since the job started",
                         g.get("goodput"))
        yield from gauge("toolkit_job_wall_seconds", "Wall time since the job started, less the time its operator "
                         "had it stopped", g.get("wall"))
        yield from gauge("toolkit_job_productive_seconds", "Wall time in steps that count", g.get("productive"))
        lost = GaugeMetricFamily("toolkit_job_lost_seconds", "Wall time not productive, by what it went to",
                                 labels=["job", "part"])
        for part in GOODPUT_PARTS:
            lost.add_metric([snap.job, part], g.get(part) or 0.0)
        yield lost
        yield from gauge("toolkit_job_checkpoint_stall_seconds", "Seconds the training thread was blocked in "
                         "checkpoint saves (mean over ranks)", snap.checkpoint_stall)
        yield from gauge("toolkit_job_checkpoint_bytes", "Bytes of the newest checkpoint, summed over ranks",
                         snap.checkpoint_bytes)
        yield from gauge("toolkit_job_max_restarts", "Restarts allowed to each process (--max-restarts)",
                         snap.max_restarts)
        up = GaugeMetricFamily("toolkit_host_up", "1 while the host's agent is connected to the scheduler",
                               labels=["job", "host"])
        for host, connected in snap.hosts:
            up.add_metric([snap.job, host], 1.0 if connected else 0.0)
        yield up

    @staticmethod
    def _incidents(snap: Snapshot) -> Iterator[Metric]:
        """Incidents by cause, time to recover, restarts per process."""
        inc = CounterMetricFamily("toolkit_job_incidents", "Incidents (faults) of the job, by the kind of their "
                                  "cause", labels=["job", "cause"])
        for kind, n in snap.causes.items():
            inc.add_metric([snap.job, kind], n)
        yield inc
        counted = sorted(snap.recover_times)
        buckets, i = [], 0
        for bound in MTTR_BUCKETS:
            while i < len(counted) and counted[i] <= bound:
                i += 1
            buckets.append((repr(bound), i))
        buckets.append(("+Inf", len(counted)))
        mttr = HistogramMetricFamily("toolkit_job_time_to_recover_seconds", "Seconds from each failure until every "
                                     "rank trained again", labels=["job"])
        mttr.add_metric([snap.job], buckets, sum(counted))
        yield mttr
        restarts = CounterMetricFamily("toolkit_process_restarts", "Deaths of each rank's processes (each one "
                                       "restarted or replaced)", labels=list(RANK_LABELS))
        for rank, node_id, n in snap.restarts:
            restarts.add_metric([snap.job, str(rank), node_id, snap.host_of.get(rank, "")], n)
        yield restarts


class _Families(Collector):
    """A Collector of the given families (for generate_latest to render them)."""

    def __init__(self, families: tuple[Metric, ...]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _latest(*families: Metric) -> str:
    """generate_latest's text of `families`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


class RankLines:
    """The per-rank families' text as generate_latest renders it, the labels rendered once per rank (see the module
    docstring). Used from one thread (the listener's, under its lock)."""

    def __init__(self) -> None:
        families = rank_families()
        self.heads = tuple(_latest(f) for f in families)  # each family's HELP and TYPE lines
        self.names = tuple(f.name for f in families)
        # (job, rank, node id, host) -> each family's "name{labels} ", for the ranks of the last rendering
        self.prefixes: dict[tuple[str, int, str, str], tuple[str, ...]] = {}

    def render(self, snap: Snapshot | None) -> bytes:
        """The per-rank families of `snap` (b"" for None), as generate_latest would render them."""
        if snap is None:
            return b""
        keys = [(snap.job, row.rank, row.node_id, row.host) for row in snap.ranks]
        self._learn([k for k in keys if k not in self.prefixes])
        self.prefixes = {k: self.prefixes[k] for k in keys}  # ranks gone, or moved, are forgotten
        parts: list[list[str]] = [[head] for head in self.heads]
        for key, row in zip(keys, snap.ranks, strict=True):
            prefixes = self.prefixes[key]
            for i, value in enumerate(rank_values(row)):
                if value is not None:
                    parts[i].append(f"{prefixes[i]}{floatToGoString(value)}\n")
        return "".join("".join(p) for p in parts).encode()

    def _learn(self, keys: list[tuple[str, int, str, str]]) -> None:
        """Render the label text of `keys` through generate_latest (one family of one sample per key) and keep each
        family's line prefix."""
        if not keys:
            return
        probe = GaugeMetricFamily("x", "", labels=RANK_LABELS)
        for job, rank, node_id, host in keys:
            probe.add_metric([job, str(rank), node_id, host], 0.0)
        lines = _latest(probe).splitlines()[2:]  # after its HELP and TYPE lines, one line per key, in order
        for key, line in zip(keys, lines, strict=True):
            labels = line[1:line.rindex(" ")]  # x{...} 0.0: the value has no space, a label value may
            self.prefixes[key] = tuple(f"{name}{labels} " for name in self.names)
