#!/usr/bin/env python3
"""The rank-ordered allreduce (toolkit.train.determinism, the Trainer's default) against DDP's own allreduce: training
steps per second and bytes sent per step, side by side in the same processes.

Why: bitwise reproducibility across recoveries must not cost a slower job. The rank-ordered reduction moves what a
ring allreduce moves (2(n-1)/n of the gradients per rank) instead of an all-gather's n-1 times; this measures
whether it also keeps pace. Not a test: it prints medians and ratios (target: steps/s >= 0.95x, bytes <= 1.1x).

    .venv/bin/python bench/bitwise_allreduce.py [--worlds 2,3,4] [--params 25] [--steps 10] [--rounds 3] [--bucket-mb 0]

For each world size, that many processes (gloo over loopback, one thread each) train a stack of 1024x1024 Linear
layers of about --params million parameters with SGD on a batch of --batch rows; each round builds three DDP
wrappers, in rotating order: DDP's defaults (the target's reference), DDP's allreduce with the Trainer's bucket
size and gradients as bucket views for the rank-ordered reduction (where the rest of the difference comes from),
and the rank-ordered hook as the Trainer builds it (toolkit.train.ddpmodel.ddp_arguments); each is timed over
--steps steps (forward, backward, optimizer) after 2 warm-up steps. Bytes sent per step: what rank 0 wrote to its
sockets (/proc/self/io wchar; gloo writes with writev), per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from toolkit.freeports import free_port

ROOT = Path(__file__).resolve().parent.parent
PROC_TIMEOUT = 1800.0

WORKER = r"""
import json, statistics, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
from toolkit.train import determinism
from toolkit.train.ddpmodel import ddp_arguments

rank, world, port, params, steps, rounds, batch = (int(a) for a in sys.argv[1:8])
bucket_mb = float(sys.argv[8])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=600))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
torch.manual_seed(0)
layers = max(1, round(params * 1e6 / (1024 * 1024 + 1024)))
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
opt = torch.optim.SGD(model.parameters(), lr=1e-6)
x = torch.randn(batch, 1024, generator=torch.Generator().manual_seed(rank))

def wchar():
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("wchar"))

ours = ddp_arguments({"bucket_cap_mb_list": [bucket_mb]} if bucket_mb else {}, True, "gloo")
args = {"plain": {}, "plain_ours": {k: ours[k] for k in ("bucket_cap_mb_list", "gradient_as_bucket_view")},
        "ordered": ours}
res = {variant: [] for variant in args}
for r in range(rounds):
    for variant in [list(args)[(r + j) % len(args)] for j in range(len(args))]:
        ddp = nn.parallel.DistributedDataParallel(model, **args[variant])
        reducer = None
        if variant == "ordered":
            reducer = determinism.OrderedReducer(None)
            ddp.register_comm_hook(reducer, determinism.ordered_allreduce_hook)
        for i in range(steps + 2):
            if i == 2:
                dist.barrier()
                t0, w0 = time.perf_counter(), wchar()
            opt.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            opt.step()
        dist.barrier()
        res[variant].append(((steps / (time.perf_counter() - t0)), (wchar() - w0) / steps))
        if reducer is not None:
            reducer.close()
        del ddp
if rank == 0:
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()),
                      "bucket_mb": ours["bucket_cap_mb_list"][0], **{
        k: {"steps_per_s": statistics.median(s for s, _ in v), "bytes": statistics.median(b for _, b in v)}
        for k, v in res.items()}}), flush=True)
dist.destroy_process_group()
"""


def measure(world: int, args: argparse.Namespace) -> dict:
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin")}
    argv = [str(port), str(args.params), str(args.steps), str(args.rounds), str(args.batch), str(args.bucket_mb)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), *argv], stdout=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for r in range(world)]
    try:
        out = [p.communicate(timeout=PROC_TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(out[0].strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--params", type=int, default=25, help="millions of parameters")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per wrapper and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    ap.add_argument("--bucket-mb", type=float, default=0.0,
                    help="DDP bucket size of the second and third wrapper (0: the Trainer's for the rank-ordered "
                         "reduction)")
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"gloo over loopback, {os.cpu_count()} CPUs, load average {load[0]:.2f}; medians of {args.rounds} rounds "
          f"of {args.steps} steps")
    print(f"{'world':>5}{'params':>9}{'DDP, defaults':>26}{'DDP, our layout':>18}{'rank-ordered':>26}"
          f"{'steps/s ratio':>15}{'bytes ratio':>13}{'ratio, same layout':>20}")
    for world in (int(w) for w in args.worlds.split(",")):
        r = measure(world, args)
        plain, same, ordered = r["plain"], r["plain_ours"], r["ordered"]
        print(f"{world:>5}{r['params'] / 1e6:>8.1f}M"
              f"{plain['steps_per_s']:>8.2f} steps/s {plain['bytes'] / 1e6:>6.1f} MB"
              f"{same['steps_per_s']:>10.2f} steps/s"
              f"{ordered['steps_per_s']:>8.2f} steps/s {ordered['bytes'] / 1e6:>6.1f} MB"
              f"{ordered['steps_per_s'] / plain['steps_per_s']:>15.2f}{ordered['bytes'] / plain['bytes']:>13.2f}"
              f"{ordered['steps_per_s'] / same['steps_per_s']:>20.2f}", flush=True)
    print(f"bytes: sent per step by rank 0 (a ring allreduce: 2(n-1)/n of the 4-byte gradients); our layout: "
          f"{r['bucket_mb']:g} MB buckets from the first step, gradients as their views (DDP's default: 25 MB, "
          "one bucket in the first step, gradients copied); targets: steps/s ratio >= 0.95 and bytes ratio <= 1.1, "
          "both against DDP's defaults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
