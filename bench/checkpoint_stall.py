#!/usr/bin/env python3
"""How long a checkpoint stalls the training loop: synchronous vs asynchronous save, ~10 M parameters.

Why: the checkpoint interval trades lost work against stall; an asynchronous save should cost only the
in-memory snapshot, so checkpoints can be frequent and a fault loses few steps. Not a test: it prints numbers.

    .venv/bin/python bench/checkpoint_stall.py [--repeats 7] [--dir /path/on/the/disk/to/measure]

For each mode it trains a few steps, then saves R times, one save every few steps, and reports medians of:
the time ``save()`` blocks the loop (the stall), the time until the checkpoint is durable, and the step time
while a background write is running (the writer competes for the CPU), next to the step time with no checkpoint.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from toolkit.train import checkpoint, determinism
from toolkit.train.checkpoint import CheckpointManager


def build(width: int, depth: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def run(mode: str, directory: Path, args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    model, opt = build(args.width, args.depth)
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    plain, during, stalls, durable = [], [], [], []
    with CheckpointManager(directory / mode, keep_max=2, async_write=(mode == "async")) as m:
        for _ in range(3):
            step(model, opt, x, y)  # warm up (allocations, momentum buffers)
        for s in range(1, args.repeats + 1):
            for _ in range(args.between):
                plain.append(step(model, opt, x, y))
            state = {"step": s, "model": model.state_dict(), "optimizer": opt.state_dict(),
                     "rng": checkpoint.capture_rng_state()}
            t0 = time.perf_counter()
            m.save(s, state)
            stalls.append(time.perf_counter() - t0)
            if mode == "async":
                for _ in range(args.between):  # the loop goes on while the writer works
                    during.append(step(model, opt, x, y))
            m.flush()
            durable.append(time.perf_counter() - t0)
    return {
        "stall": statistics.median(stalls),
        "durable": statistics.median(durable),
        "step": statistics.median(plain),
        "step_during": statistics.median(during) if during else float("nan"),
        "size": m.path_for(args.repeats).stat().st_size,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--depth", type=int, default=4, help="hidden layers of width x width")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7, help="saves per mode (medians are reported)")
    p.add_argument("--between", type=int, default=3, help="training steps between saves")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir under /tmp)")
    args = p.parse_args(argv)
    determinism.configure(args.threads)
    params = sum(t.numel() for t in build(args.width, args.depth)[0].parameters())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = {mode: run(mode, Path(tmp), args) for mode in ("sync", "async")}
    size = results["sync"]["size"] / 1e6
    print(f"model: {params / 1e6:.2f} M parameters, checkpoint {size:.1f} MB (model + SGD momentum + RNG), "
          f"{args.repeats} saves per mode, medians, {args.threads} thread(s)")
    print(f"{'mode':<6} {'stall ms':>10} {'durable ms':>11} {'step ms':>9} {'step during write ms':>21}")
    for mode, r in results.items():
        print(f"{mode:<6} {r['stall'] * 1e3:>10.1f} {r['durable'] * 1e3:>11.1f} {r['step'] * 1e3:>9.1f} "
              f"{r['step_during'] * 1e3:>21.1f}")
    ratio = results["sync"]["stall"] / results["async"]["stall"]
    print(f"async stall is {ratio:.1f}x shorter than sync "
          f"({results['async']['stall'] / results['async']['step']:.2f} steps vs "
          f"{results['sync']['stall'] / results['sync']['step']:.2f} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
