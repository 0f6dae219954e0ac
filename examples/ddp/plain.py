#!/usr/bin/env python3
"""A plain torchrun-style DDP script, as users write them: env:// init, DistributedSampler, a DataLoader with
worker processes, AdamW, and its own checkpoint (rank 0 saves CKPT_DIR/plain.pt every --ckpt-every steps; every
rank resumes from it). It knows nothing of toolkit: `fleet deploy train --script ddp/plain.py` runs it as it is
and restarts every worker from that checkpoint after a fault. ported.py is the same script on toolkit.train.

    torchrun --nproc-per-node 2 examples/ddp/plain.py
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


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


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (a slower model)")
    args = p.parse_args()
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = Teacher()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    ckpt = Path(os.environ.get("CKPT_DIR", "ckpt")) / "plain.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"rank {rank}: resumed from step {step}", flush=True)
    ddp = DistributedDataParallel(model)
    for epoch in range(step // len(loader), args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * len(loader) + i < step:
                continue  # done before the restart
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            if rank == 0 and step % args.ckpt_every == 0:
                save(ckpt, model, optimizer, step)
            time.sleep(args.step_delay)
    if rank == 0:
        save(ckpt, model, optimizer, step)
        print(f"final checkpoint: step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
