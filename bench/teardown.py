"""How long the kernel takes to tear down a killed worker, with and without torch's huge pages: the time from a
SIGKILL to its parent seeing the death (waitpid), for a process holding GB of CPU tensors. Every peer of a dead rank
learns of the death only after it (its sockets close after its memory is freed), so this time is the first part of
every recovery; the agent sets THP_MEM_ALLOC_ENABLE=1 for the workers for it (toolkit/contracts/envvars.py).

    .venv/bin/python bench/teardown.py              # 2 GB, 5 kills each way
    .venv/bin/python bench/teardown.py --gb 1 --kills 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

HOLDER = """
import sys, time, torch
held = [torch.ones(25_000_000) for _ in range(int(sys.argv[1]))]  # 100 MB each, every page written
print("ready", flush=True)
time.sleep(600)
"""
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def teardown(hundreds: int, thp: str) -> tuple[float, int]:
    """(seconds from SIGKILL to the death seen, kB of the process's memory on huge pages)."""
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": thp}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(hundreds)], stdout=subprocess.PIPE, env=env)
    try:
        if p.stdout is None or p.stdout.readline() != b"ready\n":
            raise SystemExit("the holder process did not start")
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            huge = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
        began = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(60)
        return time.monotonic() - began, huge
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="memory the killed process holds")
    ap.add_argument("--kills", type=int, default=5)
    a = ap.parse_args()
    hundreds = max(1, round(a.gb * 10))
    mode = open(THP_MODE).read().strip() if os.path.exists(THP_MODE) else "absent"
    print(f"a process holding {hundreds * 100} MB of CPU tensors, kill -9 -> death seen; the kernel's THP: {mode}")
    medians = {}
    for thp, name in (("0", "small pages (torch's default)"), ("1", "huge pages (THP_MEM_ALLOC_ENABLE=1)")):
        runs = [teardown(hundreds, thp) for _ in range(a.kills)]
        medians[thp] = statistics.median(t for t, _ in runs)
        print(f"{name}: median {medians[thp]:.3f} s of {a.kills} (max {max(t for t, _ in runs):.3f} s), "
              f"{runs[0][1] >> 10} MB on huge pages")
    print(f"ratio: {medians['0'] / medians['1']:.1f}x faster with huge pages")


if __name__ == "__main__":
    main()
