#!/usr/bin/env python3
"""What the replica check (toolkit.train.replicas) costs: at 25 M and 150 M parameters (SGD with momentum: the
state is twice the parameters), the check's own work on one rank (the digest of every byte of the state, the copy
of the state kept in host memory for a roll-back, the all_gather of its five integers), the step time, the interval
`verify_every="auto"` chooses from the two, and steps/s with the check off and on at that interval, side by side.
Also the digest's speed against blake2b and sha256 over the same 100 MB.

Why one process: the check's cost does not depend on the world size (one all_gather of 40 bytes per rank), and a
step without an allreduce is shorter than a real one, so the share measured here is an upper bound.

    .venv/bin/python bench/replica_check.py [--sizes 25 150] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from toolkit.train.digest import Digester
from toolkit.train.replicas import AUTO, Schedule, Verified, fingerprint, parse_every

WIDTH = 2048  # a Linear(WIDTH, WIDTH) holds 4.2 M parameters
BATCH = 32


def model_of(millions: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(millions * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
    return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def check(d: Digester, model: nn.Module, opt: torch.optim.Optimizer, n: int, kept: list[Verified]) -> None:
    """One rank's work in a check that agrees: fingerprint, all_gather, the verified copy (into the last one's
    memory, as the Trainer keeps it)."""
    mine = torch.tensor(fingerprint(d, model, opt, {}, False, 0), dtype=torch.int64)
    every = [torch.empty_like(mine)]
    dist.all_gather(every, mine)
    kept[:] = [Verified(n, {"model": model.state_dict(), "optimizer": opt.state_dict()}, kept[0] if kept else None)]


def hashes() -> None:
    x = torch.randn(25_000_000)  # 100 MB
    d = Digester()
    d.tensors([x])
    for name, fn in (("digest", lambda: d.tensors([x])),
                     ("blake2b", lambda: hashlib.blake2b(x.numpy().data).digest()),
                     ("sha256", lambda: hashlib.sha256(x.numpy().data).digest())):
        times = []
        for _ in range(5):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        print(f"  {name:8s} 100 MB: {1e3 * statistics.median(times):6.1f} ms")


def measure(millions: int, rounds: int) -> None:
    model, opt = model_of(millions)
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(BATCH, WIDTH)
    d = Digester()
    kept: list[Verified] = []
    for _ in range(2):
        step(model, opt, x)  # warm: the momentum buffers exist
    steps = []
    for _ in range(5):
        began = time.perf_counter()
        step(model, opt, x)
        steps.append(time.perf_counter() - began)
    costs = []
    for i in range(5):
        began = time.perf_counter()
        check(d, model, opt, i, kept)
        costs.append(time.perf_counter() - began)
    s, c = statistics.median(steps), statistics.median(costs)
    every = Schedule(2, parse_every(AUTO)).proposal(c, s)
    print(f"{params / 1e6:.1f} M parameters ({4 * 2 * params / 1e6:.0f} MB of state): step {s:.3f} s, check "
          f"{c:.3f} s ({100 * c / s:.1f}% of a step): auto interval {every} steps -> {100 * c / (every * s):.2f}%")
    off, on = [], []
    for _ in range(rounds):  # side by side: a run of `every` steps without the check, then one with it
        for kind in ("off", "on"):
            began = time.perf_counter()
            for _ in range(every):
                step(model, opt, x)
            if kind == "on":
                check(d, model, opt, every, kept)
            (off if kind == "off" else on).append(every / (time.perf_counter() - began))
    a, b = statistics.median(off), statistics.median(on)
    print(f"  steps/s off {a:.3f}, on {b:.3f}: ratio {b / a:.4f} (runs of {every} steps, {rounds} of each)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[25, 150], help="millions of parameters")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (a data-parallel worker's, fixed)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    hashes()
    for m in a.sizes:
        measure(m, a.rounds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
