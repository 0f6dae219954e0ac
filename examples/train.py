#!/usr/bin/env python3
"""Data-parallel training of a small CNN on the IDX digits, resumable to the exact sample and bit.

The README's main job. Runs three ways with the same command line:

    python examples/train.py                                  # alone: one process, world size 1
    torchrun --nproc-per-node 2 examples/train.py             # any torchrun-style environment (env://, gloo)
    fab train ... examples/train.py                           # under toolkit's launcher

Environment: DATA_PATH (the MNIST_Data directory; default: the one next to this script), CKPT_DIR (default
./ckpt; rank r writes CKPT_DIR/rank_<r>/), and torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT when WORLD_SIZE > 1.

Output (stdout, flushed): ``epoch: E, step: S, loss is L`` every --log-every steps, E counting from 0 and S the
global step (steps done since the start of training, the same number on every rank); ``resumed from step S ...``
or ``starting fresh``; at the end rank 0 writes the final parameters (a ``{name: tensor}`` dict, torch.save) to
--final-out (default CKPT_DIR/final.pt) and prints ``final parameters: PATH sha256 HEX``, the digest of the
parameters' names and raw bytes, so two runs can be compared bit for bit from their logs.

Faults: a checkpoint every --ckpt-interval steps; on start every rank resumes from the newest step all ranks have
intact. SIGTERM: at the next step boundary all ranks agree to stop, save a last-words checkpoint of that same
step, and exit 0. A peer that dies makes the collectives fail: this process says so in one line and exits 1 for
its supervisor to restart the group (exit 2: a user error, e.g. a missing dataset).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from toolkit.train import checkpoint, determinism
from toolkit.train.checkpoint import CheckpointError, CheckpointManager
from toolkit.train.data import DataError, SamplerStateError, ShardedSampler, load_mnist

HERE = Path(__file__).resolve().parent
EXIT_LOST_PEER = 1
EXIT_USER_ERROR = 2
LOST_PEER = re.compile(r"gloo|Connection (closed|reset|refused)|remote worker|peer|timed out|Timeout", re.I)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small CNN on IDX digits, data parallel, resumable.")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ckpt-interval", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--keep-max", type=int, default=3, help="checkpoints kept per rank (>= 2)")
    p.add_argument("--async", dest="async_ckpt", action=argparse.BooleanOptionalAction, default=True,
                   help="write checkpoints in the background (default) or synchronously (--no-async)")
    p.add_argument("--final-out", type=Path, default=None, help="final parameters (default CKPT_DIR/final.pt)")
    p.add_argument("--log-every", type=int, default=1, help="print the loss every N steps")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (fixed, for reproducibility)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for group formation and collectives")
    p.add_argument("--plain-allreduce", action="store_true",
                   help="DDP's default allreduce instead of the rank-ordered one (faster, not bit-reproducible)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="extra seconds per step, to stand in for a slower model in fault-injection demos")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "ckpt_interval", "log_every", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.keep_max < checkpoint.MIN_KEEP:
        p.error(f"--keep-max must be >= {checkpoint.MIN_KEEP}: one checkpoint leaves nothing to fall back to")
    return args


class Net(nn.Module):
    """Two convolutions, a pooling, dropout (so that restoring the RNG state matters) and two linear layers."""

    def __init__(self, rows: int, cols: int, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * (rows // 2) * (cols // 2), 64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(self.drop(torch.flatten(x, 1)))))


# --- the two pieces a runtime session will replace: forming the group, and agreeing where to resume ---------


@dataclass(frozen=True)
class Cluster:
    """Who this process is in the job. ``group`` None: alone, no collectives at all."""

    rank: int
    world_size: int
    group: Any


def init_cluster(env: dict[str, str], timeout: float) -> Cluster:
    """World size 1 (or no WORLD_SIZE): a single process. Otherwise env:// with gloo, as torchrun sets it up."""
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Cluster(rank=0, world_size=1, group=None)
    rank = int(env["RANK"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    return Cluster(rank=rank, world_size=world, group=dist.group.WORLD)


def restore(manager: CheckpointManager, cluster: Cluster, model: nn.Module, optimizer: torch.optim.Optimizer,
            sampler: ShardedSampler) -> int:
    """Load the newest step every rank has intact into model, optimizer, sampler and RNGs; the step (0: fresh)."""
    found = checkpoint.resume(manager, cluster.group)
    if found.step is None or found.state is None:
        print(f"rank {cluster.rank}: starting fresh", flush=True)
        return 0
    state = found.state
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    checkpoint.restore_rng_state(state["rng"])
    print(f"rank {cluster.rank}: resumed from step {found.step} (epoch {sampler.epoch}, sample {sampler.position} "
          f"of {sampler.num_samples})", flush=True)
    return int(state["step"])


def capture(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ShardedSampler) -> dict:
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "sampler": sampler.state_dict(), "rng": checkpoint.capture_rng_state()}


def stop_agreed(requested: threading.Event, cluster: Cluster) -> bool:
    """True on every rank if any rank got SIGTERM, so all of them stop after the same step."""
    if cluster.group is None:
        return requested.is_set()
    flag = torch.tensor([1 if requested.is_set() else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cluster.group)
    return bool(flag.item())


def parameters_digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def write_final(path: Path, model: nn.Module) -> str:
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(params, buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_atomic(path, buf.getbuffer(), what="final parameters")
    return parameters_digest(params)


# --- the run --------------------------------------------------------------------------------------------------


def train(args: argparse.Namespace, env: dict[str, str], stop: threading.Event) -> int:
    data_root = Path(env.get("DATA_PATH") or HERE / "MNIST_Data")
    ckpt_root = Path(env.get("CKPT_DIR") or "ckpt")
    final_out = args.final_out or ckpt_root / "final.pt"
    train_set = load_mnist(data_root, "train")
    images = torch.from_numpy(train_set.images.astype("float32") / 255.0).unsqueeze(1)
    labels = torch.from_numpy(train_set.labels.astype("int64"))

    determinism.configure(args.threads)
    determinism.seed_all(args.seed)
    model = Net(images.shape[2], images.shape[3])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    cluster = init_cluster(env, args.timeout)
    determinism.seed_all(args.seed * 1000 + cluster.rank)  # dropout masks differ per rank, replay per rank
    sampler = ShardedSampler(len(labels), cluster.world_size, cluster.rank, seed=args.seed)
    manager = CheckpointManager(ckpt_root / f"rank_{cluster.rank}", keep_max=args.keep_max,
                                async_write=args.async_ckpt)
    with manager:
        step = restore(manager, cluster, model, optimizer, sampler)
        net: nn.Module = model
        if cluster.group is not None:
            net = DistributedDataParallel(model, process_group=cluster.group)
            if not args.plain_allreduce:
                net.register_comm_hook(cluster.group, determinism.ordered_allreduce_hook)
        saved = step
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            for idx in sampler.iter_batches(args.batch_size):
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(net(images[idx]), labels[idx])
                loss.backward()
                optimizer.step()
                step += 1
                if step % args.log_every == 0:
                    print(f"epoch: {epoch}, step: {step}, loss is {loss.item():.6f}", flush=True)
                if step % args.ckpt_interval == 0:
                    manager.save(step, capture(step, model, optimizer, sampler))
                    saved = step
                if stop_agreed(stop, cluster):
                    if saved != step:
                        manager.save(step, capture(step, model, optimizer, sampler))
                    manager.flush()
                    print(f"rank {cluster.rank}: stopped by SIGTERM at step {step}, checkpoint saved", flush=True)
                    return 0
                if args.step_delay:
                    time.sleep(args.step_delay)
        if saved != step:
            manager.save(step, capture(step, model, optimizer, sampler))
    if cluster.rank == 0:
        digest = write_final(final_out, model)
        print(f"final parameters: {final_out} sha256 {digest}", flush=True)
    if cluster.group is not None:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    env = dict(os.environ)
    rank = env.get("RANK", "0")
    try:
        return train(args, env, stop)
    except (DataError, SamplerStateError, CheckpointError) as e:
        print(f"train.py rank {rank}: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except RuntimeError as e:  # gloo reports a dead peer as a bare RuntimeError
        if not (isinstance(e, dist.DistError) or LOST_PEER.search(str(e))):
            raise
        first = str(e).strip().splitlines()[0]
        print(f"train.py rank {rank}: collective failed, a peer is gone ({first}); exiting for a restart",
              file=sys.stderr, flush=True)
        return EXIT_LOST_PEER


if __name__ == "__main__":
    sys.exit(main())
