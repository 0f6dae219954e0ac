"""A small FSDP2 script ported to the Trainer as docs/porting.md shows: the mesh built from what
`toolkit.train.init()` returns, `fully_shard` on each block and the root, AdamW, an LR scheduler handed over as
extra state. Prints `epoch: E, step: S, loss is L` every step and, at the end, `final parameters: - sha256 HEX` (the
full parameters, gathered) on rank 0.

--mesh R,S: HSDP over R replica groups of S ranks; --mesh N: pure FSDP (--mirror-every: the copies of the shards
in memory, the Trainer's shard_mirror). --refuse KIND builds a sharding the Trainer
must refuse (tp, offload, mesh3d, partial) and prints the Trainer's line (exit 2). --width sizes the model (the
benchmark's ~600 MB of state at 4 workers)."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import toolkit.train
from toolkit.train import determinism


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="2,2")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--ckpt-every", default="1000", help="steps between checkpoints, or auto")
    p.add_argument("--plain-reduction", action="store_true", help="torch's own reduce-scatter and all-reduce")
    p.add_argument("--mirror-every", default="auto", help="pure FSDP: the Trainer's shard_mirror (steps, auto, 0)")
    p.add_argument("--refuse", choices=["tp", "offload", "mesh3d", "partial"], default=None)
    return p.parse_args(argv)


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1))
                                    for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def shard(model: Net, rt: toolkit.train.Runtime, args: argparse.Namespace) -> None:
    dims = tuple(int(d) for d in args.mesh.split(","))
    kind = rt.device.type
    if args.refuse == "mesh3d":
        mesh = init_device_mesh(kind, (1, 1, rt.world_size), mesh_dim_names=("a", "b", "c"))
        fully_shard(model, mesh=mesh["c"])
        return
    if args.refuse == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh(kind, (rt.world_size, 1), mesh_dim_names=("dp", "tp"))
        parallelize_module(model.out, mesh["tp"], ColwiseParallel())
        fully_shard(model, mesh=mesh["dp"])
        return
    mesh = init_device_mesh(kind, dims, mesh_dim_names=("replicate", "shard") if len(dims) == 2 else ("shard",))
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if args.refuse == "offload" else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **extra)
    if args.refuse != "partial":
        fully_shard(model, mesh=mesh, **extra)


def final_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        h.update(f"{name}:{tuple(full.shape)}\n".encode())
        h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    args = parse(argv)
    determinism.configure(1)
    determinism.seed_all(0)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 16, generator=gen), torch.randint(0, 4, (args.samples,),
                                                                                    generator=gen))
    model = Net(args.width, args.depth)
    rt = toolkit.train.init()
    shard(model, rt, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, rt.world_size, rt.rank, seed=0))
    every = args.ckpt_every if args.ckpt_every == "auto" else int(args.ckpt_every)
    try:
        trainer = toolkit.train.Trainer(rt, model, optimizer, loader, state={"scheduler": scheduler}, ckpt_every=every,
                                        deterministic=not args.plain_reduction,
                                        shard_mirror=int(args.mirror_every) if args.mirror_every.isdigit()
                                        else args.mirror_every)
    except toolkit.train.TrainerError as e:
        print(f"fsdp_train.py rank {rt.rank}: {e}", file=sys.stderr, flush=True)
        rt.close()
        return 2
    began = None  # after the first step: the steady steps' rate, for bench/shard_mirror.py
    for x, y in trainer.batches(args.epochs):
        if began is None and trainer.step_count == 1:
            began = (time.monotonic(), trainer.step_count)
        with trainer.step() as step:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(trainer.model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            print(f"epoch: {trainer.epoch}, step: {step}, loss is {loss.item():.6f}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    if began is not None and rt.rank == 0:
        print(f"steady steps/s: {(trainer.step_count - began[1]) / (time.monotonic() - began[0]):.3f}", flush=True)
    trainer.finish()
    digest = final_digest(model)  # collective: every rank gathers
    if rt.rank == 0:
        print(f"final parameters: - sha256 {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
