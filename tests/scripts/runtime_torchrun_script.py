"""A training script written for torchrun and nothing else: env:// init, DDP on a tiny model, no toolkit import.
The toolkit launcher must run it unchanged (its store is the scheduler's). Prints a checksum of the final
parameters, which must be the same on every rank.

usage: runtime_torchrun_script.py --steps N [--delay S] [--fail-at STEP --fail-rank R]

--fail-at: rank R raises, before step STEP's collective, an error that reads like a collective's (a bug of its own
that looks like a peer's death).
"""

import argparse
import hashlib
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int, default=None)
    parser.add_argument("--fail-rank", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        if step == args.fail_at and rank == args.fail_rank:
            raise RuntimeError(f"rank {rank}: Connection reset by peer, or so this script says at step {step}")
        x = torch.randn(16, 8, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank}/{world} step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(args.delay)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"rank {rank} params {digest}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
