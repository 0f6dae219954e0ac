#!/usr/bin/env python3
"""What the check right after a recovery adds to it (toolkit.train.replicas: the state a rank took from a peer is
compared with every other rank's before a step trains on it), side by side with the recovery's state handoff alone.

Why: the check lengthens every in-place recovery (MTTR) by one digest of the state on every rank, one all_gather of
five integers and the verified copy kept in host memory; what matters is how that compares with what the recovery
moves anyway. The handoff measured here is the part of an in-place recovery that grows with the state: the
replacement (a fresh model, no optimizer state yet) receives the survivors' state over gloo
(toolkit.train.transfer.share, as toolkit.train.agreement does) and loads it. Detection and the re-formation of the
group come on top of both and do not depend on the check (bench/recovery_at_size.py, bench/compare_torchrun.py
measure whole recoveries). Not a test: it prints medians and ratios.

    .venv/bin/python bench/recovery_verify.py [--sizes 25 150] [--rounds 3] [--world 3]

Each round, for each size: every rank builds the model (SGD with momentum, one step taken on the survivors: the state
is twice the parameters), the last rank fresh; then, timed on rank 0 between barriers, the handoff (share + load) and
the verify (every rank's fingerprint, the all_gather, the verified copy). World 3 processes on this machine (gloo over
loopback); wall time, so run it on an idle machine for stable numbers (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from toolkit.freeports import free_port
from toolkit.train import transfer
from toolkit.train.digest import Digester
from toolkit.train.replicas import Verified, fingerprint

WIDTH = 2048  # a Linear(WIDTH, WIDTH) holds 4.2 M parameters (as bench/replica_check.py)
TIMEOUT = timedelta(seconds=600)  # one collective, on a loaded machine at 150 M parameters


def model_of(millions: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers = max(1, round(millions * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
    return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def trained(millions: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A survivor's model after one step: its momentum buffers exist."""
    model, opt = model_of(millions, 0)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    return model, opt


def capture(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"step": 1, "model": model.state_dict(), "optimizer": opt.state_dict(), "extra": {}}


def one_round(rank: int, world: int, millions: int) -> tuple[float, float, float, float, int]:
    """(handoff s, verify s, this process's CPU s in each, bytes received by the replacement), timed between
    barriers."""
    fresh = rank == world - 1
    model, opt = model_of(millions, 1) if fresh else trained(millions)
    holders = list(range(world - 1))
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    received, nbytes = transfer.share(capture(model, opt), holders, rank=rank, world=world,
                                      device=torch.device("cpu"))
    if fresh:
        model.load_state_dict(received["model"])
        opt.load_state_dict(received["optimizer"])
    c1 = time.process_time()
    dist.barrier()
    t1 = time.perf_counter()
    mine = torch.tensor(fingerprint(Digester(), model, opt, {}, True, 0), dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    Verified(1, capture(model, opt))
    c2 = time.process_time()
    dist.barrier()
    t2 = time.perf_counter()
    assert len({tuple(t.tolist()) for t in every}) == 1, "the replicas differ after the handoff"
    return t1 - t0, t2 - t1, c1 - c0, c2 - c1, nbytes


def worker(rank: int, world: int, port: int, sizes: list[int], rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        for millions in sizes:
            out.put((rank, millions, [one_round(rank, world, millions) for _ in range(rounds)]))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[25, 150], help="millions of parameters")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=3)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args.sizes, args.rounds, out))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
    by: dict[int, dict[int, list[Any]]] = {}
    while not out.empty():
        rank, millions, rows = out.get()
        by.setdefault(millions, {})[rank] = rows
    print(f"world {args.world}, {args.rounds} rounds per size, medians; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs. Wall: rank 0's, between barriers; CPU: the busiest rank's own (what an idle host "
          "of one core per rank would take: the ranks verify in parallel)")
    print(f"{'params':>7} {'state MB':>9} {'handoff s':>10} {'verify s':>9} {'with/without':>13}   "
          f"{'handoff CPU s':>14} {'verify CPU s':>13} {'with/without':>13}")
    for millions, ranks in sorted(by.items()):
        rounds = list(zip(*(ranks[r] for r in sorted(ranks)), strict=True))  # per round, every rank's row
        wall = [statistics.median(rows[0][i] for rows in rounds) for i in (0, 1)]
        cpu = [statistics.median(max(row[i] for row in rows) for rows in rounds) for i in (2, 3)]
        nbytes = max(row[4] for rows in rounds for row in rows)
        print(f"{millions:>6}M {nbytes / 1e6:>9.0f} {wall[0]:>10.3f} {wall[1]:>9.3f} {sum(wall) / wall[0]:>13.3f}   "
              f"{cpu[0]:>14.3f} {cpu[1]:>13.3f} {sum(cpu) / cpu[0]:>13.3f}")


if __name__ == "__main__":
    main()
