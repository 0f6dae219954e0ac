#!/usr/bin/env python3
"""The same DDP script as plain.py, ported to toolkit.train (docs/porting.md shows the diff): under toolkit a
fault costs no restart of the survivors and no step; the result is bitwise that of an uninterrupted run.
Checkpoints (CKPT_DIR/host_<host>/, one copy per host) serve whole-job restarts only.

    torchrun --nproc-per-node 2 examples/ddp/ported.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import toolkit.train


class Teacher(Dataset):
    """2048 samples of 16 features labelled by a fixed random linear teacher: offline and the same everywhere."""

    def __init__(self, n: int = 2048, features: int = 16, classes: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = (self.x @ torch.randn(features, classes, generator=g)).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (a slower model)")
    args = p.parse_args()
    torch.manual_seed(0)
    rt = toolkit.train.init()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = Teacher()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    trainer = toolkit.train.Trainer(rt, model, optimizer, loader, ckpt_every=args.ckpt_every)
    for x, y in trainer.batches(args.epochs):
        with trainer.step() as step:
            optimizer.zero_grad()
            loss = F.cross_entropy(trainer.model(x), y)
            loss.backward()
            optimizer.step()
            trainer.report(loss)  # for fleet status and fleet report
            print(f"epoch {trainer.epoch} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(args.step_delay)
    trainer.finish()


if __name__ == "__main__":
    main()
