#!/usr/bin/env python3
"""The shard mirror's cost (toolkit.train.shardmirror): pure FSDP2 at world 4, steps/s with the redundancy in
memory and without it, side by side in the same processes; and the steps redone after a lost shard.

    .venv/bin/python bench/shard_mirror.py [--mb 64] [--steps 30] [--blocks 3] [--repeats 3] [--budget 0.03]

Each run starts 4 processes on this machine (gloo over loopback; two simulated hosts of two ranks: TOOLKIT_HOST and
LOCAL_WORLD_SIZE as toolkit sets them) training an MLP fully sharded over a (4,) mesh with AdamW, parameters and
moments about --mb MB in all (a quarter per rank). Warm-up steps with the mirror on let it measure its refresh and
agree on K ("auto", --budget of the step time). Then blocks of max(--steps, 2 K) steps alternate, mirror on (a
refresh whenever due, in the background, its exchange waited for at the block's end so that its cost stays in the
block) and off (no refresh), --blocks of each, the first mode alternating between runs: the two modes share the
processes and the machine's load, which on a shared machine changes by the minute. The table gives the medians of
the blocks' steps/s and their ratio (target: at least 1 - budget). Then rank 1's shard is wiped at a random step
within two intervals (a replacement's state), the ranks settle and go back to the newest copy every survivor
holds: "redone" is the steps done again (at most K, the interval in force).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 1800.0  # s for one run on a loaded machine
WORLD, PER_HOST = 4, 2


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from toolkit.train.shardmirror import ShardMirror, rollback_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    layers = 4
    width = max(64, int((args.mb * 1e6 / 12 / layers) ** 0.5) // 4 * 4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def shard() -> list[torch.Tensor]:
        out = [p.to_local() for p in model.parameters()]
        for p in model.parameters():
            out += [v.to_local() if isinstance(v, DTensor) else v for _, v in sorted(opt.state[p].items())]
        return out

    def step(n: int) -> None:
        g = torch.Generator().manual_seed(1000 * n + rank)
        opt.zero_grad()
        model(torch.randn(16, width, generator=g)).square().mean().backward()
        opt.step()

    step(1)
    nbytes = sum(t.nbytes for t in shard())
    mirror = ShardMirror(rank, WORLD, PER_HOST, nbytes, every="auto", budget=args.budget)
    mirror.regroup()
    n, times = 1, []

    def block(steps: int, on: bool) -> float:
        """Run `steps` steps, refreshing when due if `on`; their steps/s."""
        nonlocal n
        began = time.monotonic()
        for _ in range(steps):
            n += 1
            t0 = time.monotonic()
            step(n)
            if on and mirror.due(n):
                mirror.refresh(n, shard(), statistics.median(times[-20:]) if times else None)
            times.append(time.monotonic() - t0)
        mirror.wait()  # the exchange's cost is the block's own
        return steps / (time.monotonic() - began)

    block(args.warmup, True)  # K measured and agreed
    while mirror.every > 1 and n % mirror.every:
        block(1, True)  # blocks start on a refresh boundary
    length = max(args.steps, 2 * mirror.every)
    rates = {True: [], False: []}
    for b in range(2 * args.blocks):
        on = b % 2 == (args.seed % 2)  # which mode goes first alternates between runs
        rates[on].append(block(length, on))
    dist.barrier()
    result = {"on": rates[True], "off": rates[False], "step_time": statistics.median(times), "mb": nbytes * WORLD / 1e6,
              "every": mirror.every, "cost": mirror.last_cost, "stall": mirror.last_stall, "length": length}
    extra = random.Random(args.seed).randint(1, 2 * mirror.every)  # the fault lands anywhere in two intervals
    for k in range(n + 1, n + 1 + extra):
        step(k)
        if mirror.due(k):
            mirror.refresh(k, shard())
    at = n + extra
    held = [torch.full((4,), -1, dtype=torch.int64) for _ in range(WORLD)]
    mine = mirror.settle()[-4:]
    dist.all_gather(held, torch.tensor(mine + [-1] * (4 - len(mine))))
    if rank == 1:
        with torch.no_grad():
            for t in shard():
                t.zero_()
    back = rollback_step([h.tolist() for h in held], [1], WORLD, PER_HOST)
    if rank != 1:
        mirror.restore(back, shard())
    mirror.hand_over(back, [1], shard() if rank == 1 else None)
    result |= {"redone": at - back}
    mirror.close()
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace, seed: int) -> dict:
    from toolkit.freeports import free_port

    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank % PER_HOST),
               "LOCAL_WORLD_SIZE": str(PER_HOST), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TOOLKIT_HOST": f"host{rank // PER_HOST}", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", "--mb", str(args.mb), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--budget", str(args.budget), "--seed", str(seed), "--blocks", str(args.blocks)]
        logs.append(tempfile.TemporaryFile("w+"))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=logs[-1], text=True, cwd=ROOT))
    outs = [p.communicate(timeout=RUN_TIMEOUT)[0] for p in procs]
    if any(p.returncode for p in procs):
        tails = []
        for rank, log in enumerate(logs):
            log.seek(0)
            tails.append(f"--- rank {rank} (exit {procs[rank].returncode})\n" + "".join(log.readlines()[-15:]))
        raise SystemExit("a run failed:\n" + "\n".join(tails))
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64.0)
    p.add_argument("--steps", type=int, default=30, help="steps per block at least (and 2 K)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--blocks", type=int, default=3)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rng = random.Random()
    runs = []
    for i in range(args.repeats):
        r = run(args, rng.randrange(1 << 30))
        runs.append(r)
        print(f"run {i + 1}: {r['mb']:.0f} MB, step {r['step_time'] * 1e3:.1f} ms, K {r['every']} (refresh cost "
              f"{r['cost'] * 1e3:.1f} ms, stall {r['stall'] * 1e3:.2f} ms), blocks of {r['length']} steps: off "
              f"{' '.join(f'{x:.2f}' for x in r['off'])}, on {' '.join(f'{x:.2f}' for x in r['on'])} steps/s; "
              f"a fault redid {r['redone']} step(s)", flush=True)
    off = statistics.median(x for r in runs for x in r["off"])
    on = statistics.median(x for r in runs for x in r["on"])
    pairs = [b / a for r in runs for a, b in zip(r["off"], r["on"], strict=True)]
    print(f"\npure FSDP2, world 4, {runs[0]['mb']:.0f} MB of state, {args.repeats} run(s) of {args.blocks} blocks "
          "each way, medians")
    print("| mirror | steps/s | K (chosen) | refresh cost | steps redone after a fault (max) |")
    print("|--------|---------|------------|--------------|----------------------------------|")
    print(f"| off    | {off:.2f} | - | - | - (a restart from the checkpoint) |")
    print(f"| on     | {on:.2f} | {statistics.median(r['every'] for r in runs):.0f} | "
          f"{statistics.median(r['cost'] for r in runs) * 1e3:.1f} ms | "
          f"{statistics.median(r['redone'] for r in runs):.0f} ({max(r['redone'] for r in runs)}) |")
    print(f"ratio on/off: {on / off:.3f} (median of block pairs {statistics.median(pairs):.3f}; target >= "
          f"{1 - args.budget:.2f})")

if __name__ == "__main__":
    main()
