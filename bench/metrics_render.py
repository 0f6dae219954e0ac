#!/usr/bin/env python3
"""The CPU of one rendering of the scheduler's /metrics page, side by side: prometheus_client's generate_latest over
the whole collector (what the endpoint did) and the endpoint's way now (RankLines for the per-rank families, their
labels rendered once and kept between scrapes, plus generate_latest for the rest).

Why: at 4096 ranks the page is ~17,000 series, most of them per rank, and generate_latest formats every label of
every sample anew at each scrape (issue 46: a scrape must answer within 200 ms). Both ways give the same bytes
(checked here on every repeat, and in tests/test_metrics.py). Not a test: it prints medians and the ratio.

    .venv/bin/python bench/metrics_render.py [--sizes 1024,4096] [--repeats 7]

The snapshot is synthetic (every rank with a step, a step time, its own work and a loss, one in 97 a straggler, 8
ranks a host); its values change between repeats, as between scrapes. CPU time of this process (time.process_time),
so a loaded machine changes the figures less than wall time would; the first rendering of the new way (which
renders every rank's labels) is shown apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry, generate_latest

from toolkit.scheduler.exposition import CAUSE_KINDS, JobCollector, RankLines, RankRow, Snapshot

PER_HOST = 8


def snapshot(world: int, scrape: int) -> Snapshot:
    """A job of `world` ranks as the scrape `scrape` sees it."""
    ranks = tuple(RankRow(r, f"worker_{r}", f"host{r // PER_HOST}", 1000 * scrape + r, 0.1 + (r % 13) / 1e3 + scrape,
                          0.05 + (r % 7) / 1e3, 2.0 - scrape / 1e3 - r / 1e6, r % 97 == 0) for r in range(world))
    return Snapshot(job="job", world_size=world, members=world, generation=1, ranks=ranks,
                    hosts=tuple((f"host{h}", True) for h in range(world // PER_HOST)),
                    goodput={"goodput": 0.9, "wall": 100.0, "productive": 90.0}, causes=dict.fromkeys(CAUSE_KINDS, 0),
                    incidents=0, recover_times=(1.5,), restarts=((3, "worker_3", 1),), checkpoint_stall=0.1,
                    checkpoint_bytes=10**9, last_step=1000 * scrape + world, total=10**6, since_last_step=0.1,
                    max_restarts=3)


def measure(world: int, repeats: int) -> str:
    """One line: the median CPU ms of each way at `world` ranks, and their ratio."""
    lines = RankLines()
    old, new, first = [], [], None
    for scrape in range(repeats + 1):
        snap = snapshot(world, scrape)
        whole, rest = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
        whole.register(JobCollector(lambda snap=snap: snap))
        rest.register(JobCollector(lambda snap=snap: snap, ranks=False))
        began = time.process_time()
        before = generate_latest(whole)
        old.append(time.process_time() - began)
        began = time.process_time()
        now = lines.render(snap) + generate_latest(rest)
        took = time.process_time() - began
        if scrape == 0:
            first = took
        else:
            new.append(took)
        if now != before:
            raise SystemExit(f"{world} ranks, scrape {scrape}: the pages differ")
    o, n = statistics.median(old), statistics.median(new)
    return (f"{world:>5} ranks, {len(before.splitlines()):,} lines: generate_latest {1000 * o:.0f} ms, labels kept "
            f"{1000 * n:.0f} ms (first {1000 * (first or 0):.0f} ms): {o / n:.1f}x less CPU a scrape (medians of "
            f"{repeats}, same bytes)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096", help="ranks, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for world in (int(s) for s in args.sizes.split(",")):
        print(measure(world, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
