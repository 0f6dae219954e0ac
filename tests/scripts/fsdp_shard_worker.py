"""One rank of a small FSDP2 job (fully_shard over a 1-D mesh, or HSDP over a (2, W/2) mesh, AdamW, gloo on CPU) for
the sharded checkpoint (toolkit.train.ckpt.shards) and the shard mirror (toolkit.train.shardmirror) tests.

Started by the test as a plain process with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and
TOOLKIT_HOST (two simulated hosts of two ranks each). Each step's batch is a function of (rank, step). At the end,
each rank writes its final shard (parameters and optimizer state, local tensors) to OUT/final_<rank>.pt and the
line "done step N".

--ckpt-every C: a sharded checkpoint every C steps (async); at start the ranks agree on the newest one and resume
from it ("resumed from step S"). --stall S: seconds of sleep per step (a slower model, for a kill to land mid-run).
--mirror K: the shard mirror, refreshed every K steps; --lose R --lose-at N: after step N, rank R's shard is wiped
(a replacement's state), the ranks agree on the step to go back to, the survivors restore their own snapshot, R
receives its shard from its holder, and all redo the steps since ("rolled back to step S, N-S step(s) redone").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from toolkit.contracts.ckptkey import project_key
from toolkit.train.ckpt.shards import Manifest, ShardCheckpoints
from toolkit.train.shardmirror import ShardMirror, rollback_step


def build(mesh_shape: tuple[int, ...]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def shard(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shard as tensors, in a fixed order: the parameters' local shards, then their optimizer state."""
    out = [p.to_local() for p in model.parameters()]
    for p in model.parameters():
        for k in sorted(opt.state[p]):
            v = opt.state[p][k]
            out.append(v.to_local() if isinstance(v, DTensor) else v)
    return out


def shard_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    params = list(model.parameters())
    return {"step": step, "params": [p.to_local() for p in params],
            "optim": [{k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in opt.state[p].items()}
                      for p in params]}


def load_shard_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> int:
    params = list(model.parameters())
    with torch.no_grad():
        for p, t in zip(params, state["params"], strict=True):
            p.to_local().copy_(t)
    osd = opt.state_dict()
    osd["state"] = {i: {k: (DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                            if v.dim() else v.clone()) for k, v in st.items()}
                    for i, (p, st) in enumerate(zip(params, state["optim"], strict=True))}
    opt.load_state_dict(osd)
    return int(state["step"])


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hsdp", action="store_true")
    p.add_argument("--ckpt-dir", type=Path)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--stall", type=float, default=0.0)
    p.add_argument("--mirror", type=int, default=0)
    p.add_argument("--lose", type=int, default=-1)
    p.add_argument("--lose-at", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    shape = (2, world // 2) if args.hsdp else (world,)
    model, opt = build(shape)
    step = 0
    ckpt = None
    if args.ckpt_dir is not None:
        ckpt = ShardCheckpoints(args.ckpt_dir, rank, Manifest(world, shape), key=project_key(os.environ, __file__))
        try:
            found = ckpt.agree()
        except Exception as e:  # noqa: BLE001 - the test reads the one line
            print(f"refused: {e}", flush=True)
            return 3
        if found is not None:
            step = load_shard_state(model, opt, ckpt.load(found))
            print(f"resumed from step {step}", flush=True)
    mirror = None
    if args.mirror:
        mirror = ShardMirror(rank, world, per_host, 1 << 20, every=args.mirror)
        mirror.regroup()
    lost = False
    while step < args.steps:
        train_step(model, opt, rank, step + 1)
        step += 1
        if ckpt is not None and args.ckpt_every and step % args.ckpt_every == 0:
            ckpt.save(step, shard_state(model, opt, step))
        if mirror is not None and mirror.due(step):
            mirror.refresh(step, shard(model, opt))
        if mirror is not None and step == args.lose_at and not lost:
            lost = True
            if rank == args.lose:
                with torch.no_grad():
                    for t in shard(model, opt):
                        t.zero_()
            held = [torch.full((4,), -1, dtype=torch.int64) for _ in range(world)]
            mine = mirror.settle()[-4:]
            dist.all_gather(held, torch.tensor(mine + [-1] * (4 - len(mine))))
            back = rollback_step([h.tolist() for h in held], [args.lose], world, per_host)
            assert back is not None
            if rank != args.lose:
                mirror.restore(back, shard(model, opt))
            mirror.hand_over(back, [args.lose], shard(model, opt) if rank == args.lose else None)
            print(f"rolled back to step {back}, {step - back} step(s) redone", flush=True)
            step = back
        time.sleep(args.stall)
    if ckpt is not None:
        ckpt.close()
    if mirror is not None:
        mirror.close()
    torch.save([t.detach().clone() for t in shard(model, opt)], args.out / f"final_{rank}.pt")
    print(f"done step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
