#!/usr/bin/env python3
"""How the scheduler and the job's store hold up with thousands of ranks: formation, the steady state, and a loss
and its re-formation, at 64 to 4096 simulated ranks against one real `python -m toolkit.scheduler`.

Why: a lab that outgrows one rack runs 128 hosts x 8 GPUs; the scheduler is one Python thread serving every rank's
control and store connection, and a cost that grows with N per message, per pass or per incident turns into a cliff
(issue 24). Not a test: it prints numbers (tests/test_scale.py checks the same harness for correctness at 256).

    .venv/bin/python bench/scheduler_scale.py [--sizes 64,256,1024] [--patterns gloo,nccl] [--repeats 3]
                                              [--steady 10] [--kill rank|host] [--baseline REV] [--keep DIR]
    .venv/bin/python bench/scheduler_scale.py --scrape 5 --sizes 4096 --steady 20   # the metrics endpoint's cost
    .venv/bin/python bench/scheduler_scale.py --scrape 5 --sizes 4096 --steady 20 --baseline REV   # and REV's

The harness (toolkit.testing.simjob): the real scheduler configured as a deployed job (recovery on, on disk), and
simulated hosts (toolkit.testing.simhosts; an agent and 8 workers each, from their own loopback address, in
clamp(N/512, 2, 8) processes) speaking the real protocol: authenticated hellos, heartbeats with every pace field,
commits, `recovered`, and per formation a new store connection per rank running the pattern's bootstrap:
- gloo: set + multi_get of every rank's key, 128 a request (what the agent's GLOO_* variables make gloo do);
- gloo-legacy: gloo's default (a value of 154 + 8N bytes, a wait and a get per rank; at most 256 ranks);
- nccl: rank 0 sets the unique id, the N - 1 others get it; nccl-scalable: a root per 128 ranks, one multi_get;
  both with NCCL's heartbeat monitor (`check exception_dump` per rank per second) in the steady state.

Columns (median of --repeats runs; times in s from `go`, or from the kill):
- formed / built: the last rank holds `formed` / has finished its bootstrap;
- notice p50/max: each survivor's `generation` notice after the kill; reformed / rebuilt: the last rank holds the
  new `formed` / has finished its bootstrap again;
- CPU% / RSS: the scheduler over --steady seconds of steady state (RSS at its end, peak in parentheses); wr kB/s:
  what it wrote to disk meanwhile;
- inc CPU / inc MB: the scheduler's CPU seconds and bytes written from the kill until the ledger says every rank
  trains again;
- refused: connections refused, reset or closed before their hello was answered, at the simulators, plus the
  scheduler log's refusal lines (closed to make room, rejected, dropped); err/s: the most times one WARNING or
  ERROR line (digits masked) was logged within one second; errors: ERROR lines and simulator errors;
- queued%: the share of the phases' wall time the scheduler was ready to run but waited for a CPU (on a loaded
  machine the latencies include it); sims%: the simulators' CPU together in the loss's phase, in % of a core;
  bound: "client" if a simulator used more than 80% of a core in a phase, or the simulators and the scheduler
  together more than 80% of the machine's cores (the latencies then measure the clients or the machine).
The load average is printed with each row.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from toolkit.contracts import envvars as E
from toolkit.freeports import free_port
from toolkit.testing.simjob import SimJob, percentile

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("targets at 4096 (issue 24): formed <= 3 s; notice p50 <= 0.5 s; nccl rebuilt <= 2 s; CPU% <= 25; "
           "RSS <= 300 MB; refused 0; err/s <= 1. At 1024, gloo: inc CPU <= 10 s")
COLUMNS = (f"{'N':>5} {'pattern':<13} {'formed':>7} {'built':>7} {'notice p50/max':>15} {'reformed':>8} "
           f"{'rebuilt':>8} {'CPU%':>5} {'RSS MB':>12} {'wr kB/s':>8} {'inc CPU':>7} {'inc MB':>7} {'refused':>8} "
           f"{'err/s':>5} {'errors':>6} {'queued%':>7} {'sims%':>6} {'bound':>6}  load")


def one_run(world: int, pattern: str, args: argparse.Namespace, workdir: Path, tree: Path | None) -> dict[str, Any]:
    """One job: start, form, --steady seconds, one loss (rank N/2 + 3, or its host), finish. Its figures; a phase
    that fails (its bound passed, or a process ended) leaves the figures so far, `failed` saying where and why, and
    the scheduler's cost since the start in `so_far`."""
    fig: dict[str, Any] = {"samples": [], "failed": None}
    profile = args.profile / f"{workdir.name}.pstats" if args.profile else None
    with SimJob(world, workdir, patterns=(pattern,), tree=tree, node_timeout=args.node_timeout,
                profile=profile) as job:
        phase = "start"
        try:
            job.start()
            phase = "formation"
            built, formation = job.form(args.bound)
            fig.update(formed=built.last(0) - job.go_at, built=built.last(2) - job.go_at, phases=[formation])
            phase = "steady state"
            steady = job.steady(args.steady)
            fig.update(cpu=100 * steady.cpu_share, rss=steady.rss / 1e6, wr=steady.written / steady.wall / 1e3)
            fig["phases"].append(steady)
            phase = "loss"
            loss = job.lose(min(world - 1, world // 2 + 3), host=args.kill == "host", bound=args.bound)
            fig.update(p50=percentile(loss.notices, 0.5), max=max(loss.notices, default=0.0), reformed=loss.reformed,
                       rebuilt=loss.rebuilt, inc_cpu=loss.phase.cpu, inc_mb=loss.phase.written / 1e6)
            fig["phases"].append(loss.phase)
            fig["sims"] = 100 * loss.phase.sims_total
            phase = "finish"
            stats = job.stats()
            code = job.finish(args.bound)
        except AssertionError as e:
            fig["failed"] = f"{phase} failed: {str(e).splitlines()[0][:300]}"
            fig["so_far"] = job.so_far() if job.began is not None else None
            stats, code = _stats_or_none(job), None
        log = job.log()
    counts = stats["counts"] if stats else {}
    phases = fig.pop("phases", [])
    fig.update(refused=counts.get("refused", 0) + counts.get("unproven", 0) + len(log.refusals), burst=log.burst,
               errors=len(log.errors) + counts.get("errors", 0) + (code not in (0, None)),
               hwm=max(p.hwm for p in phases) / 1e6 if phases else None,
               queued=100 * sum(p.queued for p in phases) / sum(p.wall for p in phases) if phases else None,
               client=any(p.client_bound for p in phases))
    fig["samples"] = ((stats["samples"][:3] if stats else []) + log.errors[:3]
                      + ([f"scheduler exit code {code}"] if code else []))
    return fig


def scrape_run(world: int, args: argparse.Namespace, workdir: Path, tree: Path | None = None) -> dict[str, Any]:
    """The metrics endpoint's cost (issue 46: a scrape every 5 s adds <= 2% scheduler CPU and answers in <= 200 ms):
    one job with the endpoint on, formed; --steady s unscraped, then --steady s scraped every --scrape s, in turn,
    --repeats times each (the machine's other load spreads over both); the scheduler's CPU share in each, the
    difference, and the scrapes' latency, size and series count. `tree`: a baseline's scheduler instead of this
    tree's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    quiet, scraped, latency, size, series = [], [], [], 0, 0
    with SimJob(world, workdir, patterns=("gloo",), node_timeout=args.node_timeout, metrics_port=port,
                tree=tree) as job:
        job.start()
        job.form(args.bound)
        for _ in range(args.repeats):
            quiet.append(job.steady(args.steady).cpu_share)
            stop = threading.Event()

            def scrape(stop: threading.Event = stop) -> None:
                nonlocal size, series
                while not stop.is_set():
                    began = time.monotonic()
                    with urllib.request.urlopen(url, timeout=30) as reply:  # noqa: S310 - our loopback endpoint
                        text = reply.read()
                    latency.append(time.monotonic() - began)
                    size = len(text)
                    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
                    stop.wait(args.scrape)

            scraper = threading.Thread(target=scrape, daemon=True)
            scraper.start()
            scraped.append(job.steady(args.steady).cpu_share)
            stop.set()
            scraper.join(60)
        job.finish(args.bound)
    return {"world": world, "quiet": statistics.median(quiet), "scraped": statistics.median(scraped),
            "per_scrape": (sum(scraped) - sum(quiet)) * args.steady / max(1, len(latency)),
            "p50": percentile(latency, 0.5), "p99": percentile(latency, 0.99), "max": max(latency),
            "scrapes": len(latency), "load": Path("/proc/loadavg").read_text().split()[0], "series": series,
            "size": size}


def scrape_line(r: dict[str, Any], args: argparse.Namespace) -> str:
    """One scrape_run's figures, on one line."""
    q, s = r["quiet"], r["scraped"]
    return (f"{r['world']:>5} ranks: scheduler CPU {100 * q:.1f}% unscraped, {100 * s:.1f}% scraped every "
            f"{args.scrape:g} s: {100 * (s - q):+.2f} points (medians of {args.repeats} x {args.steady:g} s; "
            f"{1000 * r['per_scrape']:.0f} CPU-ms a scrape); scrape p50 {1000 * r['p50']:.0f} ms, p99 "
            f"{1000 * r['p99']:.0f} ms, max {1000 * r['max']:.0f} ms ({r['scrapes']} scrapes, load {r['load']}); "
            f"{r['series']} series, {r['size'] / 1e6:.2f} MB")


def _stats_or_none(job: SimJob) -> dict[str, Any] | None:
    try:
        return job.stats(10.0)
    except AssertionError:
        return None


def _num(runs: list[dict[str, Any]], key: str, width: int, digits: int) -> str:
    """The median of `key` over the runs that have it, or "-"."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return f"{statistics.median(values):>{width}.{digits}f}" if values else f"{'-':>{width}}"


def row(world: int, pattern: str, runs: list[dict[str, Any]]) -> str:
    bound = "client" if any(r["client"] for r in runs) else "-"
    load = Path("/proc/loadavg").read_text().split()[0]
    notice = f"{_num(runs, 'p50', 7, 3)}/{_num(runs, 'max', 7, 3).strip():<7}"
    return (f"{world:>5} {pattern:<13} {_num(runs, 'formed', 7, 2)} {_num(runs, 'built', 7, 2)} {notice} "
            f"{_num(runs, 'reformed', 8, 2)} {_num(runs, 'rebuilt', 8, 2)} {_num(runs, 'cpu', 5, 1)} "
            f"{_num(runs, 'rss', 5, 0)} ({_num(runs, 'hwm', 4, 0)}) {_num(runs, 'wr', 8, 1)} "
            f"{_num(runs, 'inc_cpu', 7, 2)} {_num(runs, 'inc_mb', 7, 2)} {_num(runs, 'refused', 8, 0)} "
            f"{_num(runs, 'burst', 5, 0)} {_num(runs, 'errors', 6, 0)} {_num(runs, 'queued', 7, 0)} "
            f"{_num(runs, 'sims', 6, 0)} {bound:>6}  {load}")


def export(rev: str, into: Path) -> Path:
    """The toolkit package of git revision `rev` of this repository, as files under `into` (git archive: the
    checkout is not touched): the scheduler to measure ("before")."""
    archive = subprocess.run(["git", "archive", rev, "toolkit"], cwd=ROOT, capture_output=True, check=True,  # noqa: S607
                             timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=120)  # noqa: S607
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024", help="ranks, comma-separated (4096 takes minutes)")
    parser.add_argument("--patterns", default="gloo,nccl", help="store bootstraps: gloo, gloo-legacy, nccl, "
                                                                 "nccl-scalable")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of steady state measured")
    parser.add_argument("--kill", choices=["rank", "host"], default="rank", help="lose one rank, or its whole host")
    parser.add_argument("--bound", type=float, default=600.0, help="s any one phase may take before the run fails")
    parser.add_argument("--node-timeout", type=float, default=E.DEFAULT_NODE_TIMEOUT,
                        help="MS_NODE_TIMEOUT for the scheduler (default: a deployed job's)")
    parser.add_argument("--baseline", default=None, help="a git revision whose scheduler to run instead of this tree's")
    parser.add_argument("--profile", type=Path, default=None, help="run the scheduler under cProfile, its statistics "
                                                                   "into this directory (python -m pstats reads them)")
    parser.add_argument("--keep", type=Path, default=None, help="keep each run's logs and records under this directory")
    parser.add_argument("--scrape", type=float, default=None, help="instead: the metrics endpoint's cost, scraped "
                                                                    "every this many seconds")
    args = parser.parse_args()
    if args.scrape:
        with tempfile.TemporaryDirectory(prefix="sched-scale-") as tmp:
            tree = export(args.baseline, Path(tmp)) if args.baseline else None
            for world in (int(s) for s in args.sizes.split(",")):
                if tree is not None:  # side by side: the baseline's scheduler first, then this tree's
                    base = scrape_run(world, args, Path(tmp) / f"{world}-base", tree)
                    print(f"{args.baseline}: {scrape_line(base, args)}", flush=True)
                new = scrape_run(world, args, Path(tmp) / str(world))
                print(f"this tree: {scrape_line(new, args)}", flush=True)
                if tree is not None:
                    print(f"      ratio (baseline / this tree): scrape p50 {base['p50'] / new['p50']:.2f}x, p99 "
                          f"{base['p99'] / new['p99']:.2f}x, CPU-ms a scrape "
                          f"{base['per_scrape'] / max(new['per_scrape'], 1e-6):.2f}x", flush=True)
        return 0
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sched-scale-") as tmp:
        base = args.keep or Path(tmp)
        tree = export(args.baseline, Path(tmp)) if args.baseline else None
        print(f"scheduler: {args.baseline or 'this tree'}; {args.steady:g} s steady; lose one {args.kill}; median "
              f"of {args.repeats}\n{TARGETS}\n{COLUMNS}", flush=True)
        for world in (int(s) for s in args.sizes.split(",")):
            for pattern in args.patterns.split(","):
                if pattern == "gloo-legacy" and world > 256:
                    continue  # 8N^3 bytes per generation: it measures the clients
                runs = [one_run(world, pattern, args, base / f"{world}-{pattern}-{i}", tree)
                        for i in range(args.repeats)]
                print(row(world, pattern, runs), flush=True)
                for r in runs:
                    if r["failed"]:
                        so_far = r["so_far"]
                        cost = "" if so_far is None else (f" (scheduler so far: {so_far.cpu:.1f} CPU-s in "
                                                          f"{so_far.wall:.1f} s, {so_far.queued:.1f} s queued for a "
                                                          f"CPU, RSS {so_far.rss / 1e6:.0f} MB; busiest simulator "
                                                          f"{100 * so_far.sims:.0f}% of a core)")
                        print(f"      ! {r['failed']}{cost}", flush=True)
                for sample in sorted({s for r in runs for s in r["samples"]})[:5]:
                    print(f"      ! {sample[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
