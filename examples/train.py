#!/usr/bin/env python3
"""Data-parallel training of a small CNN on the offline 8x8 digits, recoverable in place with no lost step.

The README's main job, on toolkit.train.Trainer. The same command line runs alone (`python examples/train.py`),
under torchrun (`torchrun --nproc-per-node 2 examples/train.py`) and under toolkit (`fleet deploy train`).

Environment: DATA_PATH (the MNIST_Data directory; default: next to this script), CKPT_DIR (default ./ckpt).
Output: `epoch: E, step: S, loss is L` every --log-every steps (S counts steps since the start, the same on every
rank); the Trainer's `rank R: resumed from step S ...` at each (re)start; at the end rank 0 writes the final
parameters to --final-out (default CKPT_DIR/final.pt) and prints `final parameters: PATH sha256 HEX`, a digest of
their names and bytes, so two runs can be compared bit for bit from their logs (with --grad-scaler also `final grad
scaler: scale X, growth tracker N`).
Exit codes: 0 done; 1 a peer is gone where the launcher cannot re-form in place (torchrun: it restarts the
world); 2 a user error (one line); 3 the scheduler stopped the job; 143 SIGTERM under toolkit (last words saved).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import toolkit.train
from toolkit.errors import UserError
from toolkit.train import determinism
from toolkit.train.ckpt import manager
from toolkit.train.data import load_mnist
from toolkit.train.faults import CheckpointError, DataError

HERE = Path(__file__).resolve().parent
WORK_SLICE = 0.005  # s: --step-delay is slept in slices this long; a slice the process was stopped in counts nothing


def interval(text: str) -> int | str:
    """--ckpt-interval: a whole number of steps >= 1, or auto."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of steps >= 1, or auto")
    return int(text)


class Continued:
    """Counts the SIGCONTs this process received, i.e. the times it was stopped (SIGSTOP) and continued."""

    def __init__(self) -> None:
        self.count = 0
        signal.signal(signal.SIGCONT, self._continued)

    def _continued(self, *_: object) -> None:
        self.count += 1


def model_time(seconds: float, continued: Continued) -> None:
    """Stand in for `seconds` of device work, as --step-delay asks: short sleeps, each counted unless the process
    was stopped during it, so a process stopped again and again (a straggler made on purpose with SIGSTOP bursts)
    takes longer, as a slow device would, instead of finding its sleep over when it wakes. A busy machine's late
    wake-ups count: they are not the process being slow."""
    left = seconds
    while left > 0:
        seen = continued.count
        began = time.monotonic()
        time.sleep(min(WORK_SLICE, left))
        if continued.count == seen:
            left -= time.monotonic() - began


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small CNN on 8x8 digits, data parallel, recoverable.")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ckpt-interval", type=interval, default=10,
                   help="steps between checkpoints, or 'auto': chosen from the measured stall and the job's faults")
    p.add_argument("--keep-max", type=int, default=3, help="checkpoints kept per rank (>= 2)")
    p.add_argument("--async", dest="async_ckpt", action=argparse.BooleanOptionalAction, default=True,
                   help="write checkpoints in the background (default) or synchronously (--no-async)")
    p.add_argument("--final-out", type=Path, default=None, help="final parameters (default CKPT_DIR/final.pt)")
    p.add_argument("--log-every", type=int, default=1, help="print the loss every N steps")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (fixed, for reproducibility)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may block")
    p.add_argument("--plain-allreduce", action="store_true",
                   help="DDP's default allreduce instead of the rank-ordered one (faster, not bit-reproducible)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="extra seconds of work per step (a slower model; not done while the process is stopped)")
    p.add_argument("--grad-scaler", action="store_true",
                   help="scale the loss with a torch.amp.GradScaler, as mixed precision does (the model stays fp32)")
    p.add_argument("--clip-norm", type=float, default=None,
                   help="clip the gradient's norm to this (after the GradScaler's unscale_ with --grad-scaler)")
    p.add_argument("--inf-loss-at", type=int, default=None, metavar="STEP",
                   help="with --grad-scaler: multiply step STEP's scaled loss by inf (its optimizer step is skipped "
                        "and the scale backed off: a test of the overflow path)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model trains (cuda: the GPU of LOCAL_RANK modulo the GPUs there are)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="the process group's backend (auto: nccl where CUDA is available under a launcher, else "
                        "gloo; gloo lets several workers share one GPU)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "log_every", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.keep_max < manager.MIN_KEEP:
        p.error(f"--keep-max must be >= {manager.MIN_KEEP}: one checkpoint leaves nothing to fall back to")
    if args.clip_norm is not None and not args.clip_norm > 0:
        p.error("--clip-norm must be > 0")
    if args.inf_loss_at is not None and not args.grad_scaler:
        p.error("--inf-loss-at needs --grad-scaler (without one an inf loss would train the model into NaN)")
    if args.step_delay < 0:
        p.error("--step-delay must be >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch has no usable CUDA device (torch.cuda.is_available() is False)")
    return args


class Net(nn.Module):
    """Two convolutions, a pooling, dropout (so that the step's randomness matters) and two linear layers."""

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


def write_final(path: Path, model: nn.Module) -> str:
    """The final parameters (a {name: tensor} dict) and the sha256 of their names, types, shapes and bytes."""
    params = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(params, buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    manager.write_atomic(path, buf.getbuffer(), what="final parameters")
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def train(args: argparse.Namespace) -> int:
    data = load_mnist(Path(os.environ.get("DATA_PATH") or HERE / "MNIST_Data"), "train")
    ckpt_dir = Path(os.environ.get("CKPT_DIR") or "ckpt")
    images = torch.from_numpy(data.images.astype("float32") / 255.0).unsqueeze(1)
    dataset = TensorDataset(images, torch.from_numpy(data.labels.astype("int64")))
    determinism.configure(args.threads)
    determinism.seed_all(args.seed)
    model = Net(images.shape[2], images.shape[3])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    rt = toolkit.train.init(backend=None if args.backend == "auto" else args.backend, timeout=args.timeout)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rt.local_rank % torch.cuda.device_count())
        model.to(device)  # before the optimizer's state exists: its moments follow the parameters
    sampler = DistributedSampler(dataset, rt.world_size, rt.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    continued = Continued()  # for --step-delay: time stopped is not work done
    # disabled (no --grad-scaler), each call passes through: scale() returns the loss, step() calls optimizer.step()
    scaler = torch.amp.GradScaler(device.type, enabled=args.grad_scaler)
    trainer = toolkit.train.Trainer(rt, model, optimizer, loader, ckpt_dir=ckpt_dir, ckpt_every=args.ckpt_interval,
                                    keep=args.keep_max, seed=args.seed, async_ckpt=args.async_ckpt,
                                    deterministic=not args.plain_allreduce,
                                    state={"scaler": scaler} if args.grad_scaler else None)
    for x, y in trainer.batches(args.epochs):
        with trainer.step() as step:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(trainer.model(x.to(device)), y.to(device))
            scaler.scale(loss if step != args.inf_loss_at else loss * math.inf).backward()
            if args.clip_norm is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            scaler.step(optimizer)
            scaler.update()
            trainer.report(loss)  # for fleet status and fleet report (read at most once a second)
            if step % args.log_every == 0:
                print(f"epoch: {trainer.epoch}, step: {step}, loss is {loss.item():.6f}", flush=True)
        model_time(args.step_delay, continued)
    trainer.finish()
    if rt.rank == 0:
        final = args.final_out or ckpt_dir / "final.pt"
        print(f"final parameters: {final} sha256 {write_final(final, model)}", flush=True)
        if args.grad_scaler:
            kept = scaler.state_dict()
            print(f"final grad scaler: scale {kept['scale']!r}, growth tracker {kept['_growth_tracker']}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    try:
        return train(args)
    except (DataError, CheckpointError, UserError) as e:
        print(f"train.py rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except toolkit.train.JobStopped as e:
        print(f"train.py rank {rank}: the scheduler stopped the job: {e}", file=sys.stderr, flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
