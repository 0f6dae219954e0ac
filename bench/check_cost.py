#!/usr/bin/env python3
"""What `fleet check` costs on the namespace cluster: the first check of a job (every data file hashed), the
second (manifests from the hosts' caches), and `train --no-check` against `train` (the check it runs first).

Why: the check runs before every `train`; it should cost seconds, most of it starting Python and importing torch
on each host for the health test. Not a test: it prints numbers. Needs root (the namespace cluster).

    .venv/bin/python bench/check_cost.py [--hosts 4] [--data-mb 64]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from toolkit.testing.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent
FLEET = str(Path(sys.executable).parent / "fleet")
WORKER = ROOT / "tests" / "scripts" / "tasks_worker.py"
TIMEOUT = 600.0  # s for one fleet command


def fleet(*args: str, cwd: Path) -> float:
    """Run fleet, return its wall time; exit with its output if it fails."""
    began = time.monotonic()
    r = subprocess.run([FLEET, *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode != 0:
        sys.exit(f"fleet {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--data-mb", type=int, default=64, help="MB of data on each host, in 16 files")
    a = parser.parse_args()
    cluster = Cluster.up(a.hosts)
    tmp = Path(tempfile.mkdtemp(prefix="check-cost-"))
    try:
        for h in cluster.hosts:
            data = h.home / "data"
            data.mkdir()
            for i in range(16):
                (data / f"{i}.bin").write_bytes(bytes([i]) * (a.data_mb * 1_000_000 // 16))
        project = tmp / "proj"
        project.mkdir()
        shutil.copy(WORKER, project / "train.py")
        (project / "fabric.yaml").write_text(f"toolkit:\n  inventory: {cluster.inventory}\n"
                                             f"  known_hosts: {cluster.known_hosts}\n  warm_spare: false\n")
        job = f"b{uuid.uuid4().hex[:6]}"
        flags = ["--job", job]
        fleet("deploy", *flags, "--data-path", "/root/data", "--script-args", "--steps 1", cwd=project)
        first = fleet("check", *flags, cwd=project)
        second = fleet("check", *flags, cwd=project)
        print(f"{a.hosts} hosts, {a.data_mb} MB of data each")
        print(f"first check (hashes the data):      {first:6.1f} s")
        print(f"second check (manifests cached):    {second:6.1f} s  ({first / second:.1f}x faster)")
        unchecked = fleet("train", "--no-check", *flags, cwd=project)
        fleet("stop", *flags, cwd=project)
        checked = fleet("train", "--fresh", *flags, cwd=project)
        fleet("stop", *flags, cwd=project)
        print(f"train --no-check:                   {unchecked:6.1f} s")
        print(f"train (check first):                {checked:6.1f} s  (+{checked - unchecked:.1f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        cluster.down()


if __name__ == "__main__":
    main()
