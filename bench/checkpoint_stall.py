#!/usr/bin/env python3
"""How long a checkpoint of a 600 MB state stalls training, side by side: a synchronous ``torch.save``, toolkit's
synchronous save, and toolkit's asynchronous one, without and with the digest of the state the Trainer records in
each checkpoint (toolkit.train.agreement: taken on the training thread at the save, checked at a restore); a
sharded checkpoint of the same bytes (one rank's shard: toolkit.train.ckpt.shards, whose writer copies the
parameters and moments during the next step and takes the digest); and the bytes one host writes.

Why: the checkpoint interval trades lost work against stall. An asynchronous checkpoint should cost the loop
only the state's structure and its small tensors: the parameters and optimizer state are copied by the writer
thread while the next step's forward and backward run, and the optimizer step waits only if that copy is not done
(toolkit.train.ckpt.manager). Not a test: it prints numbers and ratios.

    .venv/bin/python bench/checkpoint_stall.py [--repeats 3] [--dir /path/on/the/disk/to/measure]

The state: an MLP and AdamW (parameters + two moments: 12 bytes per parameter), about 600 MB by default. For each
mode it trains a few steps, then checkpoints R times, one every few steps, and reports medians of the stall (the
time the training thread is blocked by the checkpoint: in ``save()``, and for the asynchronous mode also waiting
before the next optimizer step), the time until the checkpoint is on disk, and the step time while a background
write runs (the writer competes for the CPU and the disk) next to the step time with none. Then one host of
``--host-ranks`` ranks writes one checkpoint between them: the bytes on disk against the state's size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toolkit.train import determinism
from toolkit.train.agreement import DIGEST
from toolkit.train.ckpt.manager import CheckpointManager, Placement
from toolkit.train.ckpt.shards import Manifest, ShardCheckpoints
from toolkit.train.digest import Digester

KEY = b"benchmark key, thirty-two bytes!"


def build(width: int, depth: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def state_of(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(), "extra": {}}


def stable(model: nn.Module, opt: torch.optim.Optimizer) -> frozenset[int]:
    """What the Trainer passes: the storages only optimizer.step() changes."""
    tensors = list(model.parameters()) + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


class Loop:
    """A training loop that checkpoints the way the Trainer does, timing the stall."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.model, self.opt = build(args.width, args.depth)
        self.x, self.y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
        self.waited = 0.0
        self.manager: CheckpointManager | ShardCheckpoints | None = None
        self.opt.register_step_pre_hook(self._before_step)

    def _before_step(self, *_: Any) -> None:
        if self.manager is not None:
            self.waited += self.manager.wait_staged()

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()
        return time.perf_counter() - t0


def run(mode: str, directory: Path, args: argparse.Namespace) -> dict[str, float]:
    loop = Loop(args)
    plain, during, stalls, durable = [], [], [], []
    for _ in range(2):
        loop.step()  # warm up: AdamW's moments exist from the first step
    background = "async" in mode
    digester = Digester() if mode == "async+digest" else None
    if mode == "shard async":  # one rank's shard of a sharded state (toolkit.train.ckpt.shards), the same bytes
        loop.manager = ShardCheckpoints(directory / "shards", 0, Manifest(1, (1,)), key=KEY,
                                        placement=Placement("bench"), async_write=True)
    elif mode != "torch.save":
        loop.manager = CheckpointManager(directory / mode, keep_max=2, placement=Placement("bench"), key=KEY,
                                         async_write=background)
    for s in range(1, args.repeats + 1):
        for _ in range(args.between):
            plain.append(loop.step())
        state = state_of(s, loop.model, loop.opt)
        t0 = time.perf_counter()
        if digester is not None:  # as TrainingState.checkpoint: on the training thread, inside the save's stall
            state[DIGEST] = digester.state(state)
        if loop.manager is None:
            torch.save(state, directory / f"torch-{s % 2}.pt")
        else:
            loop.manager.save(s, state, stable=stable(loop.model, loop.opt) if loop.manager.copies_later else
                              frozenset())
        blocked = time.perf_counter() - t0
        loop.waited = 0.0
        if background:
            for _ in range(args.between):  # the loop goes on while the writer stages and writes
                during.append(loop.step())
            loop.manager.flush()
        stalls.append(blocked + loop.waited)
        durable.append(time.perf_counter() - t0)
    if loop.manager is not None:
        loop.manager.close()
    return {"stall": statistics.median(stalls), "durable": statistics.median(durable),
            "step": statistics.median(plain), "step_during": statistics.median(during) if during else float("nan")}


def host_bytes(directory: Path, ranks: int, args: argparse.Namespace) -> tuple[int, int]:
    """(bytes of the state's tensors, bytes one host of `ranks` ranks writes for one checkpoint)."""
    loop = Loop(args)
    loop.step()
    state = state_of(1, loop.model, loop.opt)
    size = sum(t.nbytes for t in state["model"].values()) + sum(
        v.nbytes for s in loop.opt.state.values() for v in s.values() if torch.is_tensor(v))
    managers = [CheckpointManager(directory / "host", placement=Placement("h", r, ranks), key=KEY)
                for r in range(ranks)]
    for m in managers:
        m.save(1, state)
    written = sum(p.stat().st_size for p in managers[0].directory.iterdir() if p.is_file())
    return size, written


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2500)
    p.add_argument("--depth", type=int, default=8, help="hidden layers of width x width")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="checkpoints per mode (medians are reported)")
    p.add_argument("--between", type=int, default=3, help="training steps between checkpoints")
    p.add_argument("--host-ranks", type=int, default=4, help="ranks of the host that shares one checkpoint")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir under /tmp)")
    args = p.parse_args(argv)
    determinism.configure(args.threads)
    params = sum(t.numel() for t in build(args.width, args.depth)[0].parameters())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        os.chmod(tmp, 0o700)
        results = {mode: run(mode, Path(tmp), args)
                   for mode in ("torch.save", "sync", "async", "async+digest", "shard async")}
        size, written = host_bytes(Path(tmp), args.host_ranks, args)
    print(f"model: {params / 1e6:.1f} M parameters + AdamW = {size / 1e6:.0f} MB of state, {args.repeats} "
          f"checkpoints per mode, medians, {args.threads} thread(s)")
    print(f"{'mode':<13} {'stall ms':>10} {'durable ms':>11} {'step ms':>9} {'step during write ms':>21}")
    for mode, r in results.items():
        print(f"{mode:<13} {r['stall'] * 1e3:>10.1f} {r['durable'] * 1e3:>11.1f} {r['step'] * 1e3:>9.1f} "
              f"{r['step_during'] * 1e3:>21.1f}")
    base = results["torch.save"]["stall"]
    print(f"async stall / torch.save: {results['async']['stall'] / base:.3f} ({results['async']['stall'] * 1e3:.1f} ms "
          f"vs {base * 1e3:.0f} ms); toolkit sync / torch.save: {results['sync']['stall'] / base:.2f}")
    digested = results["async+digest"]["stall"]
    print(f"the digest in the async stall: {(digested - results['async']['stall']) * 1e3:.1f} ms "
          f"(async+digest / async: {digested / results['async']['stall']:.2f}; / torch.save: {digested / base:.3f})")
    shard = results["shard async"]["stall"]
    print(f"a sharded checkpoint's stall (one rank's shard of these bytes; its copy and digest by the writer): "
          f"{shard * 1e3:.1f} ms ({shard / base:.4f} of torch.save; {shard / results['async']['stall']:.3f} of the "
          "replicated async stall)")
    print(f"one host of {args.host_ranks} ranks wrote {written / 1e6:.0f} MB for one checkpoint of a "
          f"{size / 1e6:.0f} MB state ({written / size:.3f}x the state; one copy per rank would be "
          f"{args.host_ranks}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
