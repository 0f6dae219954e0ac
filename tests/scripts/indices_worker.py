"""Trains nothing, records which samples each step sees: a DataLoader (map-style dataset returning its index) under
toolkit.train.Trainer, alone (a world of one). Each step prints `step S: i i i ...`; with --stop-at K the process
sends itself SIGTERM during step K (the Trainer saves that step and ends the process), so that a second run on
the same CKPT_DIR resumes there.

usage: indices_worker.py --workers N --sampler distributed|random [--stop-at K] [--epochs E]
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

import toolkit.train


class Indices(Dataset):
    def __len__(self) -> int:
        return 203  # not a multiple of the batch: the last batch of an epoch is short

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i], dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--sampler", choices=("distributed", "random"), default="distributed")
    ap.add_argument("--stop-at", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    rt = toolkit.train.init()
    dataset = Indices()
    sampler = (DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
               if args.sampler == "distributed" else RandomSampler(dataset))
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=args.workers)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = toolkit.train.Trainer(rt, model, optimizer, loader, ckpt_every=5, async_ckpt=False)
    for batch in trainer.batches(args.epochs):
        with trainer.step() as step:
            optimizer.zero_grad()
            model(batch).sum().backward()
            optimizer.step()
            print(f"step {step}: " + " ".join(str(int(i)) for i in batch.flatten().tolist()), flush=True)
            if step == args.stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
    trainer.finish()


if __name__ == "__main__":
    main()
