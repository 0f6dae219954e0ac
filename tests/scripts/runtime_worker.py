"""A deterministic data-parallel "training" for the runtime tests, written the way a user's loop uses
toolkit.train: every step all-reduces a rank-dependent gradient and updates a float64 weight vector; each rank
checkpoints every step (atomically) and, at start and after every generation change, all ranks roll back to the
newest step they all have. Any number of faults must end in exactly the weights of an uninterrupted run
(runtime_harness.expected_weights).

usage: runtime_worker.py --steps N --out DIR [--delay S] [--timeout S] [--no-done] [--say-init]

--say-init prints "init" just before toolkit.train.init(), once torch is imported: a test that needs the worker
at the scheduler's door (not still importing) waits for it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit import train

DIM = 4
KEEP = 3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--no-done", action="store_true")
    parser.add_argument("--say-init", action="store_true")
    args = parser.parse_args()
    if args.say_init:
        print("init", flush=True)

    rt = train.init(timeout=args.timeout)
    ckpt = Path(os.environ.get("CKPT_DIR", args.out)) / f"rank_{rt.rank}"
    ckpt.mkdir(parents=True, exist_ok=True)

    def save(step: int, w: torch.Tensor) -> None:
        path = ckpt / f"step_{step:06d}.json"
        tmp = ckpt / f".tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"step": step, "w": w.tolist()}))
        os.replace(tmp, path)
        for old in sorted(ckpt.glob("step_*.json"))[:-KEEP]:
            old.unlink(missing_ok=True)
        rt.committed(step)

    def rollback() -> tuple[int, torch.Tensor]:
        steps = [int(p.stem[5:]) for p in ckpt.glob("step_*.json")]
        newest = torch.tensor([max(steps, default=-1)], dtype=torch.int64)
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        common = int(newest.item())
        if common < 0:
            return 0, torch.zeros(DIM, dtype=torch.float64)
        data = json.loads((ckpt / f"step_{common:06d}.json").read_text())
        return common + 1, torch.tensor(data["w"], dtype=torch.float64)

    step, w = 0, torch.zeros(DIM, dtype=torch.float64)
    need_rollback = True
    reforms = 0
    while True:
        try:
            with rt.guard():
                if need_rollback:
                    step, w = rollback()
                    need_rollback = False
                    print(f"rank {rt.rank} generation {rt.generation} starts at step {step}", flush=True)
                if step >= args.steps:
                    break
                g = torch.full((DIM,), float((rt.rank + 1) * (step + 1)), dtype=torch.float64)
                dist.all_reduce(g)
                w = w * 0.999 + g * 0.001
            save(step, w)
            rt.report(step, 0)
            print(f"rank {rt.rank} step {step}", flush=True)
            step += 1
            if args.delay:
                time.sleep(args.delay)
        except train.GenerationChanged as e:
            print(f"rank {rt.rank}: {e}", flush=True)
            reforms += 1
            rt.reform()
            need_rollback = True

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank_{rt.rank}.json").write_text(json.dumps(
        {"rank": rt.rank, "world_size": rt.world_size, "generation": rt.generation, "w": w.tolist(),
         "reforms": reforms, "mode": rt.mode}))
    print(f"rank {rt.rank} finished at generation {rt.generation}", flush=True)
    if args.no_done:
        rt.close()
    else:
        rt.done()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
