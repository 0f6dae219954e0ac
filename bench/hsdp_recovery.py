"""HSDP on a (2, 2) mesh, 4 local workers (issue 45): MTTR over kill -9 at random moments of a step, and steady
steps/s with the rank-ordered reduction against torch's own (FSDP2's reduce-scatter and all-reduce), side by side.

    .venv/bin/python bench/hsdp_recovery.py                 # ~600 MB of state (width 2048, depth 12: 50 M params,
                                                            # AdamW: 12 bytes each over the 4 ranks)
    .venv/bin/python bench/hsdp_recovery.py --width 256 --depth 4 --kills 3   # a quick look

MTTR of a kill: from the SIGKILL to the moment every rank has printed a step past the one it had reached."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from toolkit.testing.localjob import STEP_LINE, LocalJob

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "fsdp_train.py"
WORLD = 4
POLL = 0.01
TIMEOUT = 1800.0


def job(root: Path, name: str, args: list[str]) -> LocalJob:
    project = root / name / "project"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / SCRIPT.name)
    return LocalJob(root / name / "work", WORLD, args, job=name, project=project, script=SCRIPT.name, node_timeout=3,
                    cluster_time_out=300, grace=5, max_restarts=100)


def steps(j: LocalJob, rank: int) -> int:
    found = STEP_LINE.findall(j.log(f"worker_{rank}.log"))
    return int(found[-1][1]) if found else 0


def wait(what: str, predicate, j: LocalJob) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline or (j.agent is not None and j.agent.poll() is not None):
            raise SystemExit(f"gave up waiting for {what}\n{j.evidence()}")
        time.sleep(POLL)


def steady(j: LocalJob, skip: int, count: int) -> float:
    """Steps/s of rank 0 over `count` steps after `skip`."""
    wait("warm-up", lambda: steps(j, 0) >= skip, j)
    began = time.monotonic()
    wait("steady steps", lambda: steps(j, 0) >= skip + count, j)
    return count / (time.monotonic() - began)


def mttrs(j: LocalJob, kills: int, rng: random.Random) -> list[float]:
    out = []
    for _ in range(kills):
        wait("training", lambda: min(steps(j, r) for r in range(WORLD)) >= 3, j)
        time.sleep(rng.uniform(0.0, 1.0))
        victim = rng.randrange(WORLD)
        pid = (j.procs().get(f"worker_{victim}") or {}).get("pid")
        reached = {r: steps(j, r) for r in range(WORLD)}
        began = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait("recovery", lambda reached=reached: all(steps(j, r) > reached[r] for r in range(WORLD)), j)
        out.append(time.monotonic() - began)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    base = ["--mesh", "2,2", "--width", str(a.width), "--depth", str(a.depth), "--samples", "100000", "--epochs", "1"]
    params = 16 * a.width + a.width + a.depth * (a.width * a.width + a.width) + 4 * a.width + 4
    print(f"HSDP (2, 2), 4 workers, {params / 1e6:.1f} M parameters, {params * 12 / 1e6:.0f} MB of state in all")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="hsdp-bench-") as tmp:
        rates = {}
        for name, extra in (("ordered", []), ("torch", ["--plain-reduction"])):
            j = job(Path(tmp), name, base + extra)
            try:
                j.start()
                rates[name] = steady(j, 3, a.steps)
                if name == "ordered" and a.kills:
                    times = mttrs(j, a.kills, rng)
                    print(f"MTTR over {len(times)} random-moment kills: p50 {statistics.median(times):.2f} s, "
                          f"max {max(times):.2f} s")
            finally:
                j.cleanup()
        print(f"steady steps/s: rank-ordered {rates['ordered']:.3f}, torch's own {rates['torch']:.3f}, ratio "
              f"{rates['ordered'] / rates['torch']:.2f}x")


if __name__ == "__main__":
    main()
