"""A Trainer script for torchrun whose survivors end up blocked where gloo never wakes them: in step --at, rank 1
kills itself (SIGKILL) while ranks 0 and 2 each wait for a message from the other (a survivor that finished a
collective its peers did not is left so). The peer they wait on is alive, so no broken connection reaches their
receives: only the launcher's SIGTERM and the Trainer's answer to it can end the wait before its timeout.

Prints `rank R: step S` per step, and `rank R: waiting on rank P` just before the wait.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import toolkit.train


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--at", type=int, default=3, help="the step in which rank 1 dies")
    args = p.parse_args()
    rt = toolkit.train.init(timeout=120)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(60, 4))
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, rt.world_size, rt.rank, shuffle=False))
    trainer = toolkit.train.Trainer(rt, model, optimizer, loader, ckpt_every=1000)
    for (batch,) in trainer.batches(1):
        with trainer.step() as step:
            optimizer.zero_grad()
            trainer.model(batch).pow(2).mean().backward()
            optimizer.step()
            print(f"rank {rt.rank}: step {step}", flush=True)
            if step == args.at:
                if rt.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                other = 2 if rt.rank == 0 else 0
                print(f"rank {rt.rank}: waiting on rank {other}", flush=True)
                dist.recv(torch.zeros(1), src=other)
    trainer.finish()


if __name__ == "__main__":
    main()
