#!/usr/bin/env python3
"""How much memory a checkpoint restore takes: the file streamed into the tensors (CheckpointManager.load) next to
the way it was read before (the whole file into memory, authenticated, copied into a BytesIO, then unpickled).

Why: the rank that reads its host's copy in a whole-job restart loads every part of it; at 3x the state a job near
its host's memory fails its restart. Not a test: it prints numbers.

    .venv/bin/python bench/restore_memory.py [--mb 512]

Each way runs in a fresh process: its peak resident memory (VmHWM) during the load, less what it held before
(VmRSS), divided by the state's size. The file is in the page cache either way (not counted: it is not the
process's memory).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

KEY = b"restore memory bench key 32 byte"


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(root: str, way: str) -> None:
    """Load step 1 from `root` the `way` asked; print the extra peak memory in bytes and the state's size."""
    import torch

    from toolkit.train.ckpt import partfile, parts
    from toolkit.train.ckpt.manager import CheckpointManager, Placement
    from toolkit.train.ckpt.partfile import PartName

    m = CheckpointManager(root, placement=Placement("bench"), key=KEY)
    before = _status("VmRSS")
    if way == "streamed":
        state = m.load(1)
    else:  # as before: read whole, verify, copy into a BytesIO, unpickle
        data = (m.directory / PartName(1, 0, 1).name).read_bytes()
        payload = partfile.verify(memoryview(data), PartName(1, 0, 1), KEY)
        state = parts.merge([torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)])
    peak = _status("VmHWM")
    print(peak - before, state["w"].nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=512, help="size of the state (MB)")
    args = parser.parse_args()
    import torch

    from toolkit.train.ckpt.manager import CheckpointManager, Placement

    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o700)
        with CheckpointManager(root, placement=Placement("bench"), key=KEY) as m:
            m.save(1, {"w": torch.ones(args.mb * 1_000_000 // 4)})
        results = {}
        for way in ("whole file (before)", "streamed"):
            run = subprocess.run([sys.executable, __file__, "--child", root, way.split()[0]],
                                 capture_output=True, text=True, timeout=600)
            if run.returncode:
                sys.exit(f"{way}: {run.stderr.strip()}")
            out = run.stdout.split()
            extra, size = int(out[0]), int(out[1])
            results[way] = extra / size
            print(f"{way:20s} peak during load {extra / 1e6:8.0f} MB = {extra / size:.2f} x the state "
                  f"({size / 1e6:.0f} MB)")
        print(f"streamed / before: {results['streamed'] / results['whole file (before)']:.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], "streamed" if sys.argv[3] == "streamed" else "whole")
    else:
        main()
