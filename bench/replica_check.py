#!/usr/bin/env python3
"""What the replica check (toolkit.train.replicas) costs: at 25 M and 150 M parameters (SGD with momentum: the
state is twice the parameters), the check's own work on one rank (the digest of every byte of the state, the copy
of the state kept in host memory for a roll-back, the all_gather of its five integers), the step time, the interval
`verify_every="auto"` chooses from the two, and steps/s with the check off and on at that interval, side by side.
Also the digest's speed against blake2b and sha256 over the same 100 MB.

Why one process: the check's cost does not depend on the world size (one all_gather of 40 bytes per rank), and a
step without an allreduce is shorter than a real one, so the share measured here is an upper bound. Why CPU time
(this process's, one thread): on a machine shared with other jobs the wall time of a run swings by tens of percent
from one minute to the next, more than the 1% measured; the CPU time a run takes does not (both are printed).

    .venv/bin/python bench/replica_check.py [--sizes 25 150] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from datetime import timedelta
from typing import Any

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
        times = [timed(fn)[0] for _ in range(5)]
        print(f"  {name:8s} 100 MB: {1e3 * statistics.median(times):6.1f} ms CPU")


def measure(millions: int, rounds: int) -> None:
    model, opt = model_of(millions)
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(BATCH, WIDTH)
    d = Digester()
    kept: list[Verified] = []
    for _ in range(2):
        step(model, opt, x)  # warm: the momentum buffers exist
    steps, costs = [], []
    for i in range(5):
        steps.append(timed(lambda: step(model, opt, x)))
        costs.append(timed(lambda i=i: check(d, model, opt, i, kept)))
    s, c = (statistics.median(t[0] for t in v) for v in (steps, costs))
    sw, cw = (statistics.median(t[1] for t in v) for v in (steps, costs))
    every = Schedule(2, parse_every(AUTO)).proposal(c, s)
    print(f"{params / 1e6:.1f} M parameters ({4 * 2 * params / 1e6:.0f} MB of state): step {s:.3f} s, check "
          f"{c:.3f} s CPU ({sw:.3f} s, {cw:.3f} s wall): {100 * c / s:.1f}% of a step: auto interval {every} steps "
          f"-> {100 * c / (every * s):.2f}%")
    ratios = []
    for _ in range(rounds):  # side by side: a run of `every` steps without the check, then one with it
        off = timed(lambda: [step(model, opt, x) for _ in range(every)])
        steps_on = timed(lambda: [step(model, opt, x) for _ in range(every)])
        check_on = timed(lambda: check(d, model, opt, every, kept))
        on = (steps_on[0] + check_on[0], steps_on[1] + check_on[1])
        ratios.append((off[0] / on[0], off[1] / on[1]))
        print(f"  steps/s off {every / off[0]:.3f}, on {every / on[0]:.3f} (CPU time; the check {check_on[0]:.3f} s "
              f"of it): ratio {ratios[-1][0]:.4f}; wall: ratio {ratios[-1][1]:.4f}")
    print(f"  median ratio on/off over {rounds} pairs of {every} steps: {statistics.median(r[0] for r in ratios):.4f}"
          f" (CPU), {statistics.median(r[1] for r in ratios):.4f} (wall)")


def timed(fn: Any) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) that `fn()` took."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[25, 150], help="millions of parameters")
    p.add_argument("--rounds", type=int, default=3)
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
