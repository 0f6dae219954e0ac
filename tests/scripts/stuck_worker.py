"""A small DDP job whose ranks get stuck on cue: the progress watchdog's tests (tests/train/test_watchdog.py) and
its benchmark (bench/stall_detection.py).

    python -m toolkit.train stuck_worker.py --mode ported|report|plain --marks DIR [--steps N] [--step-delay S]
        [--stuck RANK:STEP:HOW ...] [--slow-first RANK:SECONDS] [--slow RANK:SECONDS] [--pause STEP:FILE]

--mode: ported (toolkit.train.Trainer, in-place recovery), report (a torchrun-style script with
toolkit.train.report()), plain (the same without report()). --stuck: rank RANK gets stuck before the forward of
step STEP, once for the job (a file in --marks says it happened: its replacement trains on); HOW is `sleep` (in its
own Python code), `spin` (busy in its own Python code), `gil` (in a C call that holds the GIL: ctypes.PyDLL's sleep),
`c` (in a C call that releases it: ctypes.CDLL's sleep). It first prints "stuck RANK at step STEP (HOW) at
<time.time()>". --slow-first: rank RANK's first step of the job takes SECONDS more (healthy, just slow: a compile, a
warm-up); --slow: each of its steps does (a slow rank its peer waits for at every step, but not stuck). --pause:
every rank sleeps before step STEP while FILE exists, once (a stall nobody waits in: no rank to blame). Each rank
prints "step N" after each step; plain and report modes keep no checkpoint (a restart trains from step 0 again).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import toolkit.train

FOREVER = 3600  # s: longer than any test waits


def stuck(rank: int, step: int, how: str, marks: Path) -> None:
    """Get stuck, as `how` says (see the module docstring); never returns."""
    print(f"stuck {rank} at step {step} ({how}) at {time.time():.3f}", flush=True)
    if how == "gil":
        ctypes.PyDLL(None).sleep(FOREVER)  # PyDLL keeps the GIL through the call
    elif how == "c":
        ctypes.CDLL(None).sleep(FOREVER)  # CDLL releases it
    elif how == "spin":
        deadline = time.monotonic() + FOREVER
        while time.monotonic() < deadline:
            pass
    else:
        time.sleep(FOREVER)


def faults(args: argparse.Namespace, rank: int, step: int) -> None:
    """Before step `step`'s forward on `rank`: a slow first step, or getting stuck, as the arguments say."""
    marks = Path(args.marks)
    if args.slow_first:
        who, seconds = args.slow_first.split(":")
        mark = marks / f"slow-{who}"
        if int(who) == rank and not mark.exists():
            mark.touch()
            print(f"slow first step on rank {rank}: {seconds} s", flush=True)
            time.sleep(float(seconds))
    if args.slow:
        who, seconds = args.slow.split(":")
        if int(who) == rank:
            time.sleep(float(seconds))
    if args.pause:
        at, hold = args.pause.split(":", 1)
        mark = marks / f"pause-{rank}"
        if int(at) == step and not mark.exists():
            mark.touch()
            print(f"pause at step {step}", flush=True)
            deadline = time.monotonic() + FOREVER
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.1)
    for spec in args.stuck:
        who, at, how = spec.split(":")
        mark = marks / f"stuck-{who}-{at}-{how}"
        if int(who) == rank and int(at) == step and not mark.exists():
            mark.touch()
            stuck(rank, step, how, marks)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    return TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(1))


def ported(args: argparse.Namespace) -> None:
    rt = toolkit.train.init()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(data(), batch_size=8, shuffle=True)
    trainer = toolkit.train.Trainer(rt, model, optimizer, loader, ckpt_every=1000, ckpt_dir=Path(args.marks) / "ckpt")
    for x, y in trainer.batches(1):
        with trainer.step() as step:
            faults(args, rt.rank, step)
            optimizer.zero_grad()
            F.cross_entropy(trainer.model(x), y).backward()
            optimizer.step()
            print(f"step {step}", flush=True)
        if trainer.step_count >= args.steps:
            break
        time.sleep(args.step_delay)
    trainer.finish()


def plain(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data().tensors
    for step in range(1, args.steps + 1):
        faults(args, rank, step)
        optimizer.zero_grad()
        i = (step * 8) % 4000
        F.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
        optimizer.step()
        if args.mode == "report":
            toolkit.train.report(step)
        print(f"step {step}", flush=True)
        time.sleep(args.step_delay)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("ported", "report", "plain"), required=True)
    p.add_argument("--marks", required=True, help="directory of the faults that happened")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-delay", type=float, default=0.05)
    p.add_argument("--stuck", action="append", default=[], metavar="RANK:STEP:HOW")
    p.add_argument("--slow-first", default=None, metavar="RANK:SECONDS")
    p.add_argument("--slow", default=None, metavar="RANK:SECONDS")
    p.add_argument("--pause", default=None, metavar="STEP:FILE")
    args = p.parse_args()
    os.makedirs(args.marks, exist_ok=True)
    torch.manual_seed(0)
    (ported if args.mode == "ported" else plain)(args)


if __name__ == "__main__":
    main()
