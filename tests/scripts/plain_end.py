"""A plain torchrun-style script (env:// init, DDP, its own checkpoint, no toolkit import) that ends as such scripts
do: `dist.barrier(); dist.destroy_process_group()`, with what may follow a last step, on purpose.

usage: plain_end.py --steps N [--ckpt-every K] [--step-delay S]
                    [--linger-rank R --linger-file PATH] [--gil-rank R --gil-block S]

Rank 0 checkpoints CKPT_DIR/plain_end.pt every K steps and at the end; every rank resumes from it. Then each rank
prints `DONE rank R step N`; --linger-file: rank R, while PATH exists (at most LINGER s), waits before the final
barrier (its peers wait in it); --gil-block: rank R's last act, after destroying its group, is a C call that holds
the GIL for S seconds (libc sleep through ctypes.PyDLL): no thread of the interpreter runs meanwhile, its heartbeat
thread included.
"""

import argparse
import ctypes
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

LINGER = 120.0  # s at most a rank lingers before its final barrier (a test that does not come to kill it failed)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--linger-rank", type=int, default=-1)
    p.add_argument("--linger-file", type=Path, default=None)
    p.add_argument("--gil-rank", type=int, default=-1)
    p.add_argument("--gil-block", type=int, default=0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Path(os.environ.get("CKPT_DIR", "ckpt")) / "plain_end.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"rank {rank}: resumed from step {step}", flush=True)
    ddp = DDP(model)

    def save() -> None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, f"{ckpt}.tmp")
        os.replace(f"{ckpt}.tmp", ckpt)

    while step < args.steps:
        gen = torch.Generator().manual_seed(step * 100 + rank)
        loss = ddp(torch.randn(16, 8, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        if rank == 0 and step % args.ckpt_every == 0:
            save()
        time.sleep(args.step_delay)
    if rank == 0:
        save()
    print(f"DONE rank {rank} step {step}", flush=True)
    if rank == args.linger_rank and args.linger_file is not None and args.linger_file.exists():
        print(f"rank {rank}: lingering before the final barrier while {args.linger_file} exists", flush=True)
        deadline = time.monotonic() + LINGER
        while args.linger_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    if rank == args.gil_rank and args.gil_block > 0:
        print(f"rank {rank}: blocking {args.gil_block} s in C, holding the GIL", flush=True)
        ctypes.PyDLL(None).sleep(args.gil_block)
    print(f"rank {rank}: the end", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
