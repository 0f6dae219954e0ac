"""A ported script that clears its gradients after its optimizer step (`optimizer.zero_grad()` last, a common
pattern), for the test that a step redone after a fault starts without the gradients of the step abandoned
(tests/train/test_redone_step.py).

usage: zero_at_end.py [--steps N] [--die-in-backward STEP]

Three Linear layers, SGD with momentum, a DataLoader, the Trainer (rank-ordered reduction: bitwise reproducible).
Prints `rank R step S` per step and, on rank 0 at the end, `final parameters: - sha256 HEX`. With
--die-in-backward, the last rank kills itself (SIGKILL) in the backward of step STEP, once its last layer's
gradients are accumulated; only the job's first process of that rank does (a file in $CKPT_DIR marks it done), so
its replacement trains on.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit.train
from toolkit.train import determinism


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12, help="steps of one epoch")
    p.add_argument("--die-in-backward", type=int, default=None)
    args = p.parse_args()
    determinism.configure(1)
    determinism.seed_all(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rt = toolkit.train.init(timeout=60)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(4 * args.steps * rt.world_size, 16, generator=g),
                         torch.randint(0, 4, (4 * args.steps * rt.world_size,), generator=g))
    trainer = toolkit.train.Trainer(rt, model, optimizer, DataLoader(data, batch_size=4), ckpt_every=100)
    marker = Path(os.environ.get("CKPT_DIR", ".")) / "died-in-backward"
    victim = args.die_in_backward is not None and rt.rank == rt.world_size - 1 and not marker.exists()
    for x, y in trainer.batches(1):
        with trainer.step() as step:
            hook = None
            if victim and step == args.die_in_backward:
                def die(_: torch.Tensor) -> None:
                    marker.write_text("")
                    os.kill(os.getpid(), signal.SIGKILL)
                hook = model[0].weight.register_hook(die)  # the first layer's: its gradient comes last
            loss = torch.nn.functional.cross_entropy(trainer.model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if hook is not None:
                hook.remove()
            print(f"rank {rt.rank} step {step}", flush=True)
    trainer.finish()
    if rt.rank == 0:
        h = hashlib.sha256()
        for name, t in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        print(f"final parameters: - sha256 {h.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
