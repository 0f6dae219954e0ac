#!/usr/bin/env python3
"""The shard mirror's cost through the Trainer (toolkit.train.shardrollback): pure FSDP2 at world 4 on two
simulated hosts of two ranks, steps/s with the copies in memory ("auto": K for at most 3% of the step time) and
without them (shard_mirror=0), side by side.

    .venv/bin/python bench/shard_mirror_trainer.py [--width 512] [--epochs 2] [--repeats 2]

Each run is a real local job (the agent, the scheduler, 4 workers: tests/scripts/fsdp_train.py with --mesh 4,
AdamW, an LR scheduler), its workers numbered as two hosts of two (LocalJob.number_hosts). Runs alternate off/on,
--repeats of each, the first mode alternating, so that both share the machine's load, which on a shared machine
changes by the minute; the load average is printed beside. Rate: rank 0's steps after the first over their wall
time (`steady steps/s`). The table gives each mode's median and their ratio (target: at least 0.97).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolkit.testing.localjob import LocalJob  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "fsdp_train.py"
RUN_TIMEOUT = 1800.0  # s for one job on a loaded machine
RATE = re.compile(r"^steady steps/s: ([0-9.]+)$", re.M)
EVERY = re.compile(r"refreshed every (\S+) steps", re.M)


def run(root: Path, name: str, mirror: str, args: argparse.Namespace) -> float:
    project = root / name / "project"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / SCRIPT.name)
    script_args = ["--mesh", "4", "--width", str(args.width), "--depth", str(args.depth), "--epochs",
                   str(args.epochs), "--samples", str(args.samples), "--mirror-every", mirror]
    j = LocalJob(root / name / "work", 4, script_args, job=name, project=project, script=SCRIPT.name)
    j.number_hosts(2)
    try:
        j.start()
        code = j.finish(RUN_TIMEOUT)
    finally:
        j.cleanup()
    log = j.log("worker_0.log")
    if code != 0 or not RATE.search(log):
        raise SystemExit(f"run {name} failed (exit {code}):\n{j.evidence()}")
    return float(RATE.findall(log)[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    rates: dict[str, list[float]] = {"0": [], "auto": []}
    with tempfile.TemporaryDirectory(prefix="bench-mirror-") as tmp:
        for i in range(args.repeats):
            for mode in (("0", "auto") if i % 2 == 0 else ("auto", "0")):
                rate = run(Path(tmp), f"r{i}m{mode}", mode, args)
                rates[mode].append(rate)
                print(f"run {i} shard_mirror={mode:>4}: {rate:.2f} steps/s (load {os.getloadavg()[0]:.1f})",
                      flush=True)
    off, on = statistics.median(rates["0"]), statistics.median(rates["auto"])
    params = 16 * args.width + args.depth * args.width * (args.width + 1) + args.width * 4 + args.width + 4
    print(f"pure FSDP, world 4 (2 simulated hosts x 2), {params * 12 / 1e6:.1f} MB of parameters and AdamW moments")
    print(f"steps/s   off {off:.2f}   on {on:.2f}   on/off {on / off:.3f}   load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
