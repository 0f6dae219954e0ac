#!/usr/bin/env python3
"""How long the progress watchdog takes to name a stuck rank, at a fast and a slow step, side by side.

Why: the watchdog has no timeout to tune; its bound is max(STALL_FACTOR x the job's p99 step time, STALL_FLOOR)
(toolkit.contracts.protocol.stall_bound: 10 x p99, at least 5 s). This measures what that gives in a real job, against
the bound, for each step time. Not a test: it prints medians and ratios; docs/benchmarks.md has the results.

    .venv/bin/python bench/stall_detection.py [--step-times 0.05,2] [--repeats 3] [--mode ported|report|plain]

Each run is a local 2-worker job (scheduler, agent, gloo) of tests/scripts/stuck_worker.py: --step-delay T, and rank
1 sleeping forever in its own code before the forward of a random step (after at least 8 steps and 16 s of
training, so that the p99 is the job's own). Metrics:
  detected  the rank's "stuck ... at <time>" line -> the agent's "the scheduler declared pid N dead (stuck" line
            (both wall clock, this machine)
  bound     the bound the scheduler said it applied (its log line)
  ratio     detected / bound: above 1 by the heartbeat interval (1 s: the peer's wait is seen at its next
            heartbeat) and the check interval (1 s)
  total     the job's wall time (start to exit 0, the stuck rank replaced in between)
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from toolkit.testing.localjob import LocalJob

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "stuck_worker.py"
JOB_TIMEOUT = 600.0  # s for one job on a loaded machine
STUCK_AT = re.compile(r"^stuck 1 at step \d+ \(sleep\) at ([\d.]+)$", re.M)
DECLARED = re.compile(r"^(\S+)Z localhost:worker_1: the scheduler declared pid \d+ dead \(stuck", re.M)
BOUND = re.compile(r"is dead: stuck: .*\(bound ([\d.e+]+) s: ")


def run(root: Path, step_time: float, mode: str, rng: random.Random) -> dict[str, float]:
    """One job; its figures (AssertionError with the evidence if it fails)."""
    at = max(8, int(16 / max(step_time, 0.05)) // 2 * 2) + rng.randrange(0, 6)
    project = root / "project"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / SCRIPT.name)
    job = LocalJob(root / "work", 2, ["--mode", mode, "--marks", str(root / "marks"), "--steps", str(at + 6),
                                      "--step-delay", str(step_time), "--stuck", f"1:{at}:sleep"],
                   job="stall", project=project, script=SCRIPT.name, warm_spare=False)
    started = time.monotonic()
    job.start()
    try:
        code = job.finish(JOB_TIMEOUT)
        total = time.monotonic() - started
    finally:
        job.cleanup()
    assert code == 0, job.evidence()
    stuck = STUCK_AT.search(job.log("worker_1.log"))
    declared = DECLARED.search(job.log("agent.log"))
    bound = BOUND.search(job.log("scheduler.log"))
    assert stuck and declared and bound, job.evidence()
    detected = datetime.fromisoformat(declared.group(1) + "+00:00").timestamp() - float(stuck.group(1))
    return {"detected": detected, "bound": float(bound.group(1)), "ratio": detected / float(bound.group(1)),
            "total": total}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-times", default="0.05,2", help="seconds per step, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", choices=("ported", "report", "plain"), default="ported")
    args = p.parse_args()
    rng = random.Random()
    times = [float(t) for t in args.step_times.split(",")]
    results: dict[float, list[dict[str, float]]] = {t: [] for t in times}
    with tempfile.TemporaryDirectory(prefix="stall-", dir="/tmp") as tmp:  # short: the job's sockets live there
        for i in range(args.repeats):
            for t in times:  # alternating, so that load from others hits every step time alike
                r = run(Path(tmp) / f"{t}-{i}", t, args.mode, rng)
                results[t].append(r)
                print(f"step {t:g} s, run {i + 1}: detected in {r['detected']:.2f} s (bound {r['bound']:g} s, "
                      f"ratio {r['ratio']:.2f}), job {r['total']:.1f} s", flush=True)
    print(f"\nmode {args.mode}, {args.repeats} runs each (medians; min-max)")
    print(f"{'step time':>10} {'bound':>8} {'detected':>18} {'detected/bound':>16} {'job':>8}")
    for t in times:
        d = [r["detected"] for r in results[t]]
        ratio = [r["ratio"] for r in results[t]]
        print(f"{t:>9g}s {statistics.median(r['bound'] for r in results[t]):>7g}s "
              f"{statistics.median(d):>7.2f}s ({min(d):.2f}-{max(d):.2f}) {statistics.median(ratio):>15.2f} "
              f"{statistics.median(r['total'] for r in results[t]):>7.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
