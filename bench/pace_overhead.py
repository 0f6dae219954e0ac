"""What step reporting and straggler tracking cost: steady-state steps/s of the sample trainer (2 local workers,
the real agent and scheduler) with the pace figures on (the default) and off (TOOLKIT_PACE=0: no step timing, no
comm-hook clock, heartbeats without figures, so the scheduler has nothing to track), run in turn so that a busy
machine slows both alike. The target is a ratio within 1% of 1.

Steps/s is read from the workers' step lines: the time each new step line appears in worker_0.log (looked at every
POLL s) over the steady part of the run (after SKIP steps). Run: .venv/bin/python bench/pace_overhead.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from toolkit.testing.localjob import LocalJob, clean_env

WORKERS = 2
ARGS = ["--epochs", "4", "--batch-size", "16", "--ckpt-interval", "50", "--log-every", "1"]
SKIP = 30  # steps before the steady state (group formation, first checkpoint, warm-up)
POLL = 0.01  # s between looks at the log
BOUND = 600.0  # s for one run


def one_run(root: Path, pace: bool) -> float:
    """Steady-state steps/s of one run."""
    job = LocalJob(root, WORKERS, ARGS, job="pace-on" if pace else "pace-off", node_timeout=10, grace=5)
    env = {**clean_env(), "TOOLKIT_PACE": "1" if pace else "0"}
    job.start(env)
    seen: dict[int, float] = {}
    deadline = time.monotonic() + BOUND
    try:
        while job.agent is not None and job.agent.poll() is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"a run took over {BOUND:.0f} s\n{job.evidence()}")
            step = job.last_step(0)
            if step and step not in seen:
                seen[step] = time.perf_counter()
            time.sleep(POLL)
        if job.agent.returncode != 0:
            raise SystemExit(f"the run failed ({job.agent.returncode})\n{job.evidence()}")
    finally:
        job.cleanup()
    steady = sorted((s, t) for s, t in seen.items() if s >= SKIP)
    (s0, t0), (s1, t1) = steady[0], steady[-1]
    return (s1 - s0) / (t1 - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    on, off = [], []
    with tempfile.TemporaryDirectory(prefix="toolkit-bench-pace-") as tmp:
        for i in range(args.repeat):
            for pace, out in ((True, on), (False, off)) if i % 2 == 0 else ((False, off), (True, on)):
                out.append(one_run(Path(tmp) / f"{i}-{pace}", pace))
                print(f"run {i + 1}: pace {'on ' if pace else 'off'} {out[-1]:.2f} steps/s", flush=True)
    a, b = statistics.median(on), statistics.median(off)
    print(f"\nsteady steps/s, median of {args.repeat}: pace on {a:.2f}, off {b:.2f}; ratio on/off {a / b:.3f} "
          f"({100 * (1 - a / b):+.1f}% cost)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
