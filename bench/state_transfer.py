#!/usr/bin/env python3
"""What it costs a replacement to take the training state from a survivor, per MB of model + optimizer state.

Why: toolkit's zero-loss recovery (toolkit.train.Trainer) moves the whole state (model, AdamW's two moments, the
step) from the survivor at the newest step to every rank, as one torch.save payload broadcast over the new gloo
group. Its cost per MB is what to compare with DLRover's flash checkpoint, which copies the state to shared
memory on the same host (6.2 ms for 15 MB, measured here: REFERENCE.md) but then loses the steps since that copy
and cannot give the state to a host that lost it. Not a test: it prints numbers.

    .venv/bin/python bench/state_transfer.py [--world 2] [--sizes 1.5,15,150] [--repeats 5]

For each size, `--world` processes on this machine (gloo over loopback) build a model whose parameters and AdamW
state add up to about that many MB, take one optimizer step, then time, as Trainer._agree_state does it: the
source serialising its state, the broadcast, and the receivers loading it (medians over --repeats).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from toolkit.testing.ports import free_port_pair

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, statistics, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
from toolkit.train.trainer import _deserialize, _serialize

rank, world, port, mb, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
    int(sys.argv[5])
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
width = max(8, int((mb * 1e6 / 4 / 3) ** 0.5))  # parameters + AdamW's exp_avg and exp_avg_sq, float32
model = nn.Linear(width, width)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, width)).sum().backward()
opt.step()
times = {"serialize": [], "broadcast": [], "load": [], "total": []}
size = 0
for _ in range(repeats):
    dist.barrier()
    t0 = time.perf_counter()
    payload = _serialize({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}) if rank == 0 else b""
    t1 = time.perf_counter()
    n = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(n, 0)
    if rank == 0:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buf = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    t2 = time.perf_counter()
    if rank != 0:
        state = _deserialize(bytes(buf.numpy()))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    t3 = time.perf_counter()
    dist.barrier()
    size = int(n)
    for k, v in (("serialize", t1 - t0), ("broadcast", t2 - t1), ("load", t3 - t2), ("total", t3 - t0)):
        times[k].append(v)
if rank in (0, 1):  # the source serialises, a receiver loads
    print(json.dumps({"rank": rank, "bytes": size, **{k: statistics.median(v) for k, v in times.items()}}), flush=True)
dist.destroy_process_group()
"""


def measure(world: int, mb: float, repeats: int) -> dict[str, float]:
    port = free_port_pair()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), str(port), str(mb), str(repeats)],
                              stdout=subprocess.PIPE, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
             for r in range(world)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    source, receiver = (json.loads(o) for o in out[:2])
    return {**receiver, "serialize": source["serialize"],
            "total": source["serialize"] + receiver["broadcast"] + receiver["load"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="1.5,15,150", help="MB of model + optimizer state, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{args.world} processes, gloo over loopback; medians of {args.repeats}")
    print(f"{'state':>10}{'serialize':>12}{'broadcast':>12}{'load':>10}{'total':>10}{'per MB':>10}")
    for mb in (float(x) for x in args.sizes.split(",")):
        r = measure(args.world, mb, args.repeats)
        size = r["bytes"] / 1e6
        print(f"{size:>7.1f} MB{1e3 * r['serialize']:>10.1f}ms{1e3 * r['broadcast']:>10.1f}ms"
              f"{1e3 * r['load']:>8.1f}ms{1e3 * r['total']:>8.1f}ms{1e3 * r['total'] / size:>8.2f}ms")
    print("DLRover's flash checkpoint, measured here: 6.2 ms for 15 MB (0.41 ms per MB), a copy to shared memory on "
          "the same host, without the steps since that copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
