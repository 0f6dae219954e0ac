#!/usr/bin/env python3
"""The shard mirror's cost (toolkit.train.shardmirror): pure FSDP2 at world 4, steps/s with the redundancy in
memory and without it, side by side; and the steps redone after a lost shard.

    .venv/bin/python bench/shard_mirror.py [--mb 64] [--steps 60] [--repeats 3] [--budget 0.03]

Each run starts 4 processes on this machine (gloo over loopback; two simulated hosts of two ranks: TOOLKIT_HOST and
LOCAL_WORLD_SIZE as toolkit sets them) training an MLP fully sharded over a (4,) mesh with AdamW, parameters and
moments about --mb MB in all (a quarter per rank). After --warmup steps it times --steps steps. "off": no mirror;
"on": the mirror with K chosen from its measured cost ("auto", --budget of the step time), refreshed in the
background. Runs alternate off/on --repeats times; the table gives the medians and the ratio of steps/s (target:
at least 1 - budget). After the timed steps of an "on" run, rank 1's shard is wiped at a random step (a
replacement's state) and the ranks go back to the copy's step: "redone" is the steps done again (target: at most
K), "K" the interval the mirror chose.
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
    mirror = ShardMirror(rank, WORLD, PER_HOST, nbytes, every="auto", budget=args.budget) if args.on else None
    if mirror is not None:
        mirror.regroup()
    n, times = 1, []
    for n in range(2, args.warmup + args.steps + 2):
        began = time.monotonic()
        step(n)
        if mirror is not None and mirror.due(n):
            mirror.refresh(n, shard(), statistics.median(times[-20:]) if times else None)
        times.append(time.monotonic() - began)
    timed = times[args.warmup:]
    dist.barrier()
    result = {"steps_per_s": len(timed) / sum(timed), "step_time": statistics.median(timed), "mb": nbytes * WORLD / 1e6}
    if mirror is not None:
        result |= {"every": mirror.every, "cost": mirror.last_cost, "stall": mirror.last_stall}
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


def run(args: argparse.Namespace, on: bool, seed: int) -> dict:
    from toolkit.testing.ports import free_port

    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank % PER_HOST),
               "LOCAL_WORLD_SIZE": str(PER_HOST), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TOOLKIT_HOST": f"host{rank // PER_HOST}", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", "--mb", str(args.mb), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--budget", str(args.budget), "--seed", str(seed)] + (["--on"] if on else [])
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
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--on", action="store_true")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rng = random.Random()
    off, on = [], []
    for i in range(args.repeats):
        off.append(run(args, False, 0))
        on.append(run(args, True, rng.randrange(1 << 30)))
        print(f"repeat {i + 1}: off {off[-1]['steps_per_s']:.2f} steps/s, on {on[-1]['steps_per_s']:.2f} steps/s "
              f"(K {on[-1]['every']}, refresh cost {on[-1]['cost'] * 1e3:.1f} ms of which stall "
              f"{on[-1]['stall'] * 1e3:.1f} ms, step {on[-1]['step_time'] * 1e3:.1f} ms; a fault redid "
              f"{on[-1]['redone']} step(s))", flush=True)
    a = statistics.median(r["steps_per_s"] for r in off)
    b = statistics.median(r["steps_per_s"] for r in on)
    print(f"\npure FSDP2, world 4, {off[0]['mb']:.0f} MB of state, {args.repeats} runs each, medians")
    print("| mirror | steps/s | K (chosen) | refresh cost | steps redone after a fault (max) |")
    print("|--------|---------|------------|--------------|----------------------------------|")
    print(f"| off    | {a:.2f} | - | - | - (a checkpoint restart) |")
    print(f"| on     | {b:.2f} | {statistics.median(r['every'] for r in on):.0f} | "
          f"{statistics.median(r['cost'] for r in on) * 1e3:.1f} ms | "
          f"{statistics.median(r['redone'] for r in on):.0f} ({max(r['redone'] for r in on)}) |")
    print(f"ratio on/off: {b / a:.3f} (target >= {1 - args.budget:.2f})")


if __name__ == "__main__":
    main()
