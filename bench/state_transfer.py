#!/usr/bin/env python3
"""The in-place recovery's state transfer against a raw broadcast of the same bytes between the same processes.

Why: a replacement takes the training state (model, AdamW's moments, the step) from a survivor; the transfer should
move it at the speed of the link, not at the speed of pickling. The yardstick is the link itself: one gloo
broadcast of a flat buffer of as many bytes, between the same processes, in the same run. Not a test: it prints
numbers (target: the transfer at >= 50% of the raw broadcast's speed).

    .venv/bin/python bench/state_transfer.py [--sizes 150,600,2400] [--world 2] [--repeats 5] [--pickle]

For each size, --world processes on this machine (gloo over loopback) build a model (a stack of Linear +
LayerNorm layers: a realistic mix of large and small tensors) whose parameters and AdamW state add up to about
that many MB. Rank 0 trains a step: it holds the state. The others are replacements: a model of their own
(other values). Each repeat times, on the receivers, one after the other:
  transfer  the Trainer's path (toolkit.train.transfer.share, then load_state_dict) into a replacement whose
            optimizer never stepped (a process that has just started: its optimizer state is new memory), in
            deterministic mode as the Trainer's scripts run (toolkit.train.determinism.configure);
  warm      the same into a receiver that holds the optimizer state already (a survivor a step behind);
  raw       a broadcast of as many bytes into a buffer allocated and touched beforehand (the link's best case);
  raw new   the same into a buffer allocated in the timing (new memory, as the replacement's optimizer state).
Medians. The ratio is raw / transfer: the replacement's transfer against the link's best case.
--pickle adds the previous path (torch.save into bytes, broadcast, torch.load) for sizes up to 600 MB.
Memory: about twice the state per process.
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
PROC_TIMEOUT = 1800.0  # s for one size (2.4 GB on a loaded machine)

WORKER = r"""
import io, json, os, statistics, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
from toolkit.train import determinism, transfer
from toolkit.train.newmemory import unfilled

rank, world, port, mb, repeats, pickle = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
                                          int(sys.argv[5]), sys.argv[6] == "1")
determinism.configure(1)  # as the Trainer's scripts run: deterministic mode fills torch.empty's new memory
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=600))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
layers = 12
width = max(16, int((mb * 1e6 / 12 / layers) ** 0.5))  # parameters + AdamW's two moments, float32
torch.manual_seed(rank)
model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.LayerNorm(width))])
opt = torch.optim.AdamW(model.parameters())
if rank == 0:
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

def capture():
    return {"step": 1, "model": model.state_dict(), "optimizer": opt.state_dict(), "extra": {}}

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

times = {"raw": [], "raw_fresh": [], "transfer": [], "warm": [], "pickle": []}
extra = []
size = 0

def timed_transfer(key, fresh):
    global opt
    if rank != 0 and fresh:
        opt = torch.optim.AdamW(model.parameters())  # a replacement's: never stepped
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size
    before = rss("VmRSS")
    t0 = time.perf_counter()
    got, nbytes = transfer.share(capture(), [0], rank=rank, world=world, device=torch.device("cpu"))
    if got is not None:
        model.load_state_dict(got["model"])
        opt.load_state_dict(got["optimizer"])
    times[key].append(time.perf_counter() - t0)
    extra.append(rss("VmHWM") - max(before, rss("VmRSS")))  # transient: beyond what stays (the new moments)
    return nbytes

def timed_raw(key, nbytes, touched):
    raw = torch.ones(nbytes, dtype=torch.uint8) if touched or rank == 0 else None
    dist.barrier()
    t0 = time.perf_counter()
    if raw is None:
        raw = unfilled((nbytes,), torch.uint8, torch.device("cpu"))  # untouched
    dist.broadcast(raw, 0)
    times[key].append(time.perf_counter() - t0)

for _ in range(repeats):
    nbytes = timed_transfer("transfer", fresh=True)
    n = torch.tensor([nbytes if rank else 0], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    size = int(n)
    timed_transfer("warm", fresh=False)  # into the optimizer state the previous transfer left
    timed_raw("raw", size, touched=True)
    timed_raw("raw_fresh", size, touched=False)
    if pickle:
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            buf = io.BytesIO()
            torch.save(capture(), buf)
            payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.empty(1, dtype=torch.int64)
        dist.broadcast(length, 0)
        if rank:
            payload = torch.empty(int(length), dtype=torch.uint8)
        dist.broadcast(payload, 0)
        if rank:
            state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            del state
        del payload
        times["pickle"].append(time.perf_counter() - t0)
    dist.barrier()
peak = torch.tensor([max(extra)], dtype=torch.int64)
dist.all_reduce(peak, op=dist.ReduceOp.MAX)
if rank == 1:
    print(json.dumps({"bytes": size, "width": width, "extra": int(peak), **{k: statistics.median(v) for k, v in
                                                                             times.items() if v}}), flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)  # gloo's teardown at interpreter exit aborted here now and then (SIGABRT, no Python frame left)
"""


def measure(world: int, mb: float, repeats: int, pickle: bool) -> dict[str, float]:
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin")}
    argv = [str(world), str(port), str(mb), str(repeats), "1" if pickle else "0"]
    procs = [subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", WORKER, str(r), *argv],
                              stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) for r in range(world)]
    try:
        out = [p.communicate(timeout=PROC_TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(out[1].strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="processes: rank 0 holds the state, the others receive it")
    ap.add_argument("--sizes", default="150,600,2400", help="MB of model + optimizer state, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pickle", action="store_true", help="also time the previous torch.save path (up to 600 MB)")
    args = ap.parse_args()
    if args.world < 2 or args.repeats < 1:
        ap.error("--world must be >= 2 and --repeats >= 1")
    load = os.getloadavg()
    print(f"{args.world} processes, gloo over loopback, {os.cpu_count()} CPUs, load average {load[0]:.2f}; medians "
          f"of {args.repeats}, measured on a receiver")
    print(f"{'state':>10}{'raw':>18}{'transfer':>18}{'ratio':>7}{'warm':>9}{'raw new':>9}{'extra memory':>14}"
          + (f"{'torch.save path':>20}" if args.pickle else ""))
    for mb in (float(x) for x in args.sizes.split(",")):
        r = measure(args.world, mb, args.repeats, args.pickle and mb <= 600)
        gb = r["bytes"] / 1e9
        line = (f"{r['bytes'] / 1e6:>7.0f} MB{r['raw']:>7.3f} s {gb / r['raw']:>4.2f} GB/s"
                f"{r['transfer']:>7.3f} s {gb / r['transfer']:>4.2f} GB/s{r['raw'] / r['transfer']:>7.2f}"
                f"{r['warm']:>7.3f} s{r['raw_fresh']:>7.3f} s{r['extra'] / 1e6:>11.0f} MB")
        if "pickle" in r:
            line += f"{r['pickle']:>9.3f} s {gb / r['pickle']:>4.2f} GB/s"
        print(line, flush=True)
    print("ratio: the transfer's speed as a fraction of the raw broadcast's (target >= 0.5); extra memory: the most "
          "any rank held during a transfer beyond its state before and after it (peak RSS)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
