"""A small ported script for the replica check's tests (tests/train/test_corruption.py): three Linear layers, SGD
with momentum, a DataLoader, the Trainer with `--verify-every` (rank-ordered reduction: bitwise reproducible).

usage: corrupt_worker.py [--steps N] [--verify-every K] [--die-rank R --die-at S]

Prints `rank R step S` per step and, on rank 0 at the end, `final parameters: - sha256 HEX` (parameters and
optimizer state), so that two runs compare bit for bit. Faults come from TOOLKIT_INJECT_CORRUPTION in a worker's env
file (toolkit.train.inject). With --die-rank and --die-at, that rank's first process kills itself (SIGKILL) after step
S: its agent launches it again and it takes the state from a peer (an in-place recovery).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit.train
from toolkit.train import determinism


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24, help="steps of one epoch")
    p.add_argument("--verify-every", type=int, default=4)
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-at", type=int, default=0)
    args = p.parse_args()
    determinism.configure(1)
    determinism.seed_all(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rt = toolkit.train.init(timeout=60)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(4 * args.steps * rt.world_size, 16, generator=g),
                         torch.randint(0, 4, (4 * args.steps * rt.world_size,), generator=g))
    trainer = toolkit.train.Trainer(rt, model, optimizer, DataLoader(data, batch_size=4), ckpt_every=8,
                                    verify_every=args.verify_every)
    for x, y in trainer.batches(1):
        with trainer.step() as step:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(trainer.model(x), y)
            loss.backward()
            optimizer.step()
            print(f"rank {rt.rank} step {step}", flush=True)
        if (rt.rank, step) == (args.die_rank, args.die_at) and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    trainer.finish()
    if rt.rank == 0:
        h = hashlib.sha256()
        state = {**{f"p.{k}": v for k, v in model.state_dict().items()},
                 **{f"o.{i}.{k}": v for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()}}
        for name, t in sorted(state.items()):
            h.update(name.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        print(f"final parameters: - sha256 {h.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
