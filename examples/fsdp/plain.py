#!/usr/bin/env python3
"""A plain torchrun-style FSDP2 script, as users write them: env:// init, a device mesh, `fully_shard` on each
layer and the model, DistributedSampler, AdamW, and its own sharded checkpoint (torch.distributed.checkpoint:
every rank writes its shard into CKPT_DIR/step_<N>/ every --ckpt-every steps, then rank 0 names it in
CKPT_DIR/latest; every rank resumes from the one named there). It knows nothing of toolkit: `fleet deploy train
--script fsdp/plain.py` runs it as it is and restarts every worker from that checkpoint after a fault.

    torchrun --nproc-per-node 2 examples/fsdp/plain.py
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
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


def save(ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Every rank writes its shard of step `step`; once all have (dcp.save returns on every rank), rank 0 names it."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=ckpt / f"step_{step}")
    if dist.get_rank() == 0:
        (ckpt / "latest.tmp").write_text(str(step))
        os.replace(ckpt / "latest.tmp", ckpt / "latest")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (a slower model)")
    args = p.parse_args()
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = Teacher()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    ckpt = Path(os.environ.get("CKPT_DIR", "ckpt"))
    ckpt.mkdir(parents=True, exist_ok=True)
    step = 0
    if (ckpt / "latest").exists():
        step = int((ckpt / "latest").read_text())
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": step}
        dcp.load(state, checkpoint_id=ckpt / f"step_{step}")
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        print(f"rank {rank}: resumed from step {step}", flush=True)
    for epoch in range(step // len(loader), args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * len(loader) + i < step:
                continue  # done before the restart
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            if step % args.ckpt_every == 0:
                save(ckpt, model, optimizer, step)
            time.sleep(args.step_delay)
    save(ckpt, model, optimizer, step)
    if rank == 0:
        print(f"final checkpoint: step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
