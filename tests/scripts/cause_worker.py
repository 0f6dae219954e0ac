"""A worker that fails on purpose, one way per run, for the tests of failure causes.

usage: cause_worker.py --fault raise|exit3|segv|record|none [--trainer] [--at STEP] [--steps N] [--step-delay S]

The last rank fails at step --at: `raise` raises RuntimeError("boom at step N") (inside the Trainer's step with
--trainer, else in a plain torchrun-style loop); `exit3` calls sys.exit(3); `segv` sends itself SIGSEGV; `record`
raises ValueError in a function decorated with torch's @record and exits 1 without letting it out (only the error
file @record wrote tells why); `none` trains --steps steps (a test kills or stops it). Every rank prints
`rank R step S` each step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, TensorDataset

import toolkit.train


def fail(how: str, step: int) -> None:
    if how == "raise":
        raise RuntimeError(f"boom at step {step}")
    if how == "exit3":
        sys.exit(3)
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "record":
        raise ValueError(f"bad input at step {step}, as @record wrote it")


def plain(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, args.steps + 1):
        if step == args.at and rank == last:
            fail(args.fault, step)
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(args.step_delay)
    dist.destroy_process_group()


def trainer(args: argparse.Namespace) -> None:
    rt = toolkit.train.init()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64 * rt.world_size, 4)), batch_size=4)
    t = toolkit.train.Trainer(rt, model, opt, loader, ckpt_every=10)
    for (x,) in t.batches(args.steps):
        with t.step() as step:
            if step == args.at and rt.rank == rt.world_size - 1:
                fail(args.fault, step)
            opt.zero_grad()
            t.model(x).pow(2).mean().backward()
            opt.step()
            print(f"rank {rt.rank} step {step}", flush=True)
        time.sleep(args.step_delay)
    t.finish()


@record
def main(args: argparse.Namespace) -> None:
    (trainer if args.trainer else plain)(args)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", required=True, choices=["raise", "exit3", "segv", "record", "none"])
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-delay", type=float, default=0.05)
    parsed = p.parse_args()
    if parsed.fault != "record":
        (trainer if parsed.trainer else plain)(parsed)
    else:
        try:
            main(parsed)
        except ValueError:
            sys.exit(1)  # @record wrote the error file; nothing else says why
