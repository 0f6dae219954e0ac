"""HSDP on a (2, 2) mesh, 4 local workers (issue 45): MTTR over kill -9 at random moments of a step, and steady
steps/s with the rank-ordered reduction against torch's own (FSDP2's reduce-scatter and all-reduce), side by side.

    .venv/bin/python bench/hsdp_recovery.py                 # ~600 MB of state (width 2048, depth 12: 50 M params,
                                                            # AdamW: 12 bytes each over the 4 ranks)
    .venv/bin/python bench/hsdp_recovery.py --width 256 --depth 4 --kills 3   # a quick look

MTTR of a kill: from the SIGKILL to the moment every rank has printed a step past the one it had reached (so it holds
the step in flight, done again); "resumed": from the SIGKILL to every rank's `resumed from step` line (the recovery
without that step). Each kill waits until every rank trained 2 steps past the previous recovery and the agent's warm
spare is ready, as in a job that has been running a while (bench/compare_torchrun.py measures DDP the same way)."""

from __future__ import annotations

import argparse
import os
import random
import re
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
RESUMED = re.compile(r"^rank \d+: resumed from step ", re.M)


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


def resumes(j: LocalJob, rank: int) -> int:
    return len(RESUMED.findall(j.log(f"worker_{rank}.log")))


def mttrs(j: LocalJob, kills: int, rng: random.Random) -> tuple[list[float], list[float]]:
    """(MTTR, resumed) of each of `kills` kills, in seconds."""
    out, back = [], []
    floor = 3
    for _ in range(kills):
        wait("training", lambda floor=floor: min(steps(j, r) for r in range(WORLD)) >= floor, j)
        wait("the warm spare", lambda: (j.doc().get("warm_spare") or {}).get("ready"), j)
        time.sleep(rng.uniform(0.0, 1.0))
        victim = rng.randrange(WORLD)
        pid = (j.procs().get(f"worker_{victim}") or {}).get("pid")
        reached = {r: steps(j, r) for r in range(WORLD)}
        before = {r: resumes(j, r) for r in range(WORLD)}
        began = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        resumed = None
        while not all(steps(j, r) > reached[r] for r in range(WORLD)):
            if resumed is None and all(resumes(j, r) > before[r] for r in range(WORLD)):
                resumed = time.monotonic() - began
            wait("recovery", lambda: True, j)  # the job's liveness, checked between looks
            time.sleep(POLL)
            if time.monotonic() - began > TIMEOUT:
                raise SystemExit(f"gave up waiting for recovery\n{j.evidence()}")
        out.append(time.monotonic() - began)
        back.append(resumed if resumed is not None else out[-1])
        floor = max(reached.values()) + 3
    return out, back


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
                    times, back = mttrs(j, a.kills, rng)
                    print(f"MTTR over {len(times)} random-moment kills: p50 {statistics.median(times):.2f} s, "
                          f"max {max(times):.2f} s; resumed p50 {statistics.median(back):.2f} s, max {max(back):.2f} s;"
                          f" a steady step {1 / rates['ordered']:.2f} s (load {os.getloadavg()[0]:.1f})")
            finally:
                j.cleanup()
        print(f"steady steps/s: rank-ordered {rates['ordered']:.3f}, torch's own {rates['torch']:.3f}, ratio "
              f"{rates['ordered'] / rates['torch']:.2f}x")


if __name__ == "__main__":
    main()
