#!/usr/bin/env python3
"""Data-parallel training of a small CNN on the IDX digits, resumable to the exact sample and bit.

The README's main job. Runs three ways with the same command line (``toolkit.train.init()`` reads the mode from
the environment):

    python examples/train.py                                  # alone: one process, world size 1
    torchrun --nproc-per-node 2 examples/train.py             # any torchrun-style environment (env://, gloo)
    fleet deploy train --script train.py ...                  # under toolkit's launcher (MS_ROLE=MS_WORKER)

Environment: DATA_PATH (the MNIST_Data directory; default: the one next to this script), CKPT_DIR (default
./ckpt; rank r writes CKPT_DIR/rank_<r>/), and what the launcher sets (torchrun's RANK, WORLD_SIZE, MASTER_*; or
toolkit's MS_* set).

Output (stdout, flushed): ``epoch: E, step: S, loss is L`` every --log-every steps, E counting from 0 and S the
global step (steps done since the start of training, the same number on every rank); ``rank R: resumed from step
S ...`` or ``rank R: starting fresh`` at every (re)start and rollback; at the end rank 0 writes the final
parameters (a ``{name: tensor}`` dict, torch.save) to --final-out (default CKPT_DIR/final.pt) and prints
``final parameters: PATH sha256 HEX``, the digest of the parameters' names and raw bytes, so two runs can be
compared bit for bit from their logs.

Faults. A checkpoint every --ckpt-interval steps; whenever a group is (re)built every rank rolls back to the
newest step all ranks have intact (model, optimizer, sampler position and RNGs), or to the initial state if there
is none, so the result never depends on where a fault hit.
- Under toolkit a dead peer costs no restart here: the step fails with ``GenerationChanged``, this process
  re-forms the group with the dead rank's replacement (``rt.reform()``), rolls back and goes on. Ranks may be a
  step apart when the fault hits (a collective can complete on one rank and fail on another); the rollback to the
  common checkpoint removes the difference.
- Under torchrun (or any env:// launcher) a dead peer ends this process with one line and exit code 1, for the
  launcher to restart the whole group (which then resumes from the common checkpoint).
- SIGTERM: at the next step boundary the ranks agree (any rank's signal counts), every rank saves a last-words
  checkpoint of that same step. Alone or under torchrun every rank then exits 0. Under toolkit only the ranks that
  got the signal exit (code 143; `fleet stop` signals all of them, a restart of one node only that one), the
  others go on and meet the replacement at that very checkpoint: nothing is recomputed.
Exit codes: 0 done (or stopped by SIGTERM outside toolkit); 1 a peer is gone and this launcher cannot re-form in
place; 2 a user error (one line: missing dataset, unwritable CKPT_DIR, bad environment); 3 the scheduler stopped
the job (the reason in one line); 143 stopped by SIGTERM under toolkit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import io
import logging
import os
import queue
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import toolkit.train
from toolkit.errors import UserError
from toolkit.train import GenerationChanged, JobStopped, Runtime, checkpoint, determinism
from toolkit.train.checkpoint import CheckpointError, CheckpointManager
from toolkit.train.data import DataError, SamplerStateError, ShardedSampler, load_mnist
from toolkit.train.runtime import MODE_TOOLKIT

HERE = Path(__file__).resolve().parent
EXIT_LOST_PEER = 1
EXIT_USER_ERROR = 2
EXIT_JOB_STOPPED = 3
EXIT_TERMINATED = 128 + signal.SIGTERM
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
    if args.step_delay < 0:
        p.error("--step-delay must be >= 0")
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


# --- SIGTERM ---------------------------------------------------------------------------------------------------


class Terminated(BaseException):
    """SIGTERM while blocked forming a group: there is no group to agree or save with, so the process leaves at
    once instead of waiting out the launcher's grace period. A BaseException so no `except Exception` inside the
    runtime mistakes it for a failed attempt and retries."""


class StopFlag:
    """The SIGTERM handler. Normally it only sets the flag, acted upon at the next step boundary (where the ranks
    agree and save); inside `waiting()` (init, reform) it interrupts the wait."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._interruptible = False

    def __call__(self, _signum: int, _frame: Any) -> None:
        self.event.set()
        if self._interruptible:
            self._interruptible = False
            raise Terminated()

    def is_set(self) -> bool:
        return self.event.is_set()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        if self.event.is_set():
            raise Terminated()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False


# --- pieces of the run -----------------------------------------------------------------------------------------


def capture(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ShardedSampler) -> dict:
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "sampler": sampler.state_dict(), "rng": checkpoint.capture_rng_state()}


def steps_of(sampler: ShardedSampler, epochs: int, batch_size: int) -> Iterator[tuple[int, list[int]]]:
    """(epoch, batch) from the sampler's saved position to the end of training."""
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for idx in sampler.iter_batches(batch_size):
            yield epoch, idx


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


class Trainer:
    """The training loop of one rank, written so that any step may be abandoned: everything it changes (model,
    optimizer, sampler, RNGs, step) is restored by `restore()` from the common checkpoint."""

    def __init__(self, args: argparse.Namespace, rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer,
                 sampler: ShardedSampler, manager: CheckpointManager, commits: queue.SimpleQueue[int],
                 images: torch.Tensor, labels: torch.Tensor, stop: StopFlag) -> None:
        self.args, self.rt, self.model, self.optimizer = args, rt, model, optimizer
        self.sampler, self.manager, self.commits = sampler, manager, commits
        self.images, self.labels, self.stop = images, labels, stop
        # Step 0 is the state every rank starts from: the rollback target while no checkpoint is common.
        self.initial = checkpoint.snapshot(capture(0, model, optimizer, sampler))
        self.net: nn.Module | None = None
        self.batches: Iterator[tuple[int, list[int]]] = iter(())
        self.step = 0
        self.saved = 0
        self.epoch = sampler.epoch

    def run(self) -> int | None:
        """Train to the end (None) or until SIGTERM tells this rank to leave (its exit code)."""
        need_restore = True
        while True:
            changed: GenerationChanged | None = None
            try:
                with self.rt.guard():
                    if need_restore:
                        self.restore()
                        need_restore = False
                    outcome = self.one_step()
            except GenerationChanged as e:
                changed = GenerationChanged(e.old, e.new)  # not `e`: its traceback holds the broken step's frames
            if changed is not None:
                print(f"rank {self.rt.rank}: generation {changed.old} -> {changed.new} at step {self.step}: "
                      "re-forming the group, then rolling back to the newest common checkpoint", flush=True)
                # The old DDP's reducer holds the broken group and hooks the parameters' gradients: it must be gone
                # before the group is destroyed (so the peers see its connections close) and before a new DDP.
                self.net = None
                gc.collect()
                with self.stop.waiting():
                    self.rt.reform()
                need_restore = True
                continue
            self.tell_commits()
            self.rt.report(self.step, self.epoch)
            if outcome == "done":
                return None
            if outcome == "stop":
                if self.leaves_on_stop():
                    print(f"rank {self.rt.rank}: stopped by SIGTERM at step {self.step}, checkpoint saved",
                          flush=True)
                    return EXIT_TERMINATED if self.rt.mode == MODE_TOOLKIT else 0
                print(f"rank {self.rt.rank}: a peer stops by SIGTERM at step {self.step}, checkpoint saved; "
                      "training goes on", flush=True)
            if self.args.step_delay:
                self.stop.event.wait(self.args.step_delay)

    def restore(self) -> None:
        """Load the newest step every rank has intact (or the initial state) and wrap the model for this group.
        Collective: runs inside `guard()`, so a peer that dies meanwhile just means another round."""
        self.net = None
        gc.collect()
        self.manager.flush()  # a write still queued would otherwise be missing from this rank's list
        found = checkpoint.resume(self.manager, self.rt.group)
        state = found.state if found.state is not None else self.initial
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.restore_rng_state(state["rng"])
        self.step = self.saved = int(state["step"])
        self.epoch = self.sampler.epoch
        self.batches = steps_of(self.sampler, self.args.epochs, self.args.batch_size)
        if found.step is None:
            print(f"rank {self.rt.rank}: starting fresh", flush=True)
        else:
            print(f"rank {self.rt.rank}: resumed from step {found.step} (epoch {self.sampler.epoch}, sample "
                  f"{self.sampler.position} of {self.sampler.num_samples})", flush=True)
        self.net = self.model
        if self.rt.world_size > 1:
            ddp = DistributedDataParallel(self.model, process_group=self.rt.group)  # broadcasts: collective
            if not self.args.plain_allreduce:
                ddp.register_comm_hook(self.rt.group, determinism.ordered_allreduce_hook)
            self.net = ddp

    def one_step(self) -> str:
        """"step", "stop" (SIGTERM agreed, last words saved) or "done" (final checkpoint durable on every rank)."""
        nxt = next(self.batches, None)
        if nxt is None:
            self.save_now()
            self.manager.flush()
            if self.rt.world_size > 1:
                dist.barrier(group=self.rt.group)  # nobody says done while a peer may still need a rollback
            return "done"
        self.epoch, idx = nxt
        assert self.net is not None
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.net(self.images[idx]), self.labels[idx])
        loss.backward()
        self.optimizer.step()
        self.step += 1
        if self.step % self.args.log_every == 0:
            print(f"epoch: {self.epoch}, step: {self.step}, loss is {loss.item():.6f}", flush=True)
        if self.step % self.args.ckpt_interval == 0:
            self.save_now()
        if self.stop_agreed():
            self.save_now()
            self.manager.flush()
            return "stop"
        return "step"

    def save_now(self) -> None:
        if self.saved != self.step:
            self.manager.save(self.step, capture(self.step, self.model, self.optimizer, self.sampler))
            self.saved = self.step

    def stop_agreed(self) -> bool:
        """True on every rank if any rank got SIGTERM, so all of them save the same step."""
        if self.rt.world_size == 1:
            return self.stop.is_set()
        flag = torch.tensor([1 if self.stop.is_set() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.rt.group)
        return bool(flag.item())

    def leaves_on_stop(self) -> bool:
        """Outside toolkit every rank stops (the launcher restarts the world anyway); under toolkit only the
        ranks that got the signal, so that restarting one node stops nothing else."""
        return self.rt.mode != MODE_TOOLKIT or self.stop.is_set()

    def tell_commits(self) -> None:
        while True:
            try:
                step = self.commits.get_nowait()
            except queue.Empty:
                return
            self.rt.committed(step)


# --- the run --------------------------------------------------------------------------------------------------


def train(args: argparse.Namespace, env: dict[str, str], stop: StopFlag) -> int:
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

    with stop.waiting():
        rt = toolkit.train.init(timeout=args.timeout)
    try:
        determinism.seed_all(args.seed * 1000 + rt.rank)  # dropout masks differ per rank, replay per rank
        sampler = ShardedSampler(len(labels), rt.world_size, rt.rank, seed=args.seed)
        # Durable steps arrive on the writer thread; the loop passes them to the runtime between steps.
        commits: queue.SimpleQueue[int] = queue.SimpleQueue()
        with CheckpointManager(ckpt_root / f"rank_{rt.rank}", keep_max=args.keep_max, async_write=args.async_ckpt,
                               on_commit=commits.put) as manager:
            trainer = Trainer(args, rt, model, optimizer, sampler, manager, commits, images, labels, stop)
            code = trainer.run()
        trainer.tell_commits()
        if code is not None:
            rt.close()  # not done(): this rank did not finish, the scheduler must expect a replacement
            return code
        if rt.rank == 0:
            digest = write_final(final_out, model)
            print(f"final parameters: {final_out} sha256 {digest}", flush=True)
    except BaseException:
        rt.close()
        raise
    rt.done()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop)
    env = dict(os.environ)
    rank = env.get("RANK", "0")
    try:
        return train(args, env, stop)
    except (DataError, SamplerStateError, CheckpointError, UserError) as e:
        print(f"train.py rank {rank}: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except JobStopped as e:
        print(f"train.py rank {rank}: the scheduler stopped the job: {e}", file=sys.stderr, flush=True)
        return EXIT_JOB_STOPPED
    except Terminated:
        print(f"train.py rank {rank}: stopped by SIGTERM while the group was forming; the newest common "
              "checkpoint is where the job resumes", file=sys.stderr, flush=True)
        return EXIT_TERMINATED
    except RuntimeError as e:  # gloo reports a dead peer as a bare RuntimeError
        if not (isinstance(e, dist.DistError) or LOST_PEER.search(str(e))):
            raise
        first = str(e).strip().splitlines()[0]
        if stop.is_set():
            print(f"train.py rank {rank}: stopped by SIGTERM; a peer left first ({first})", file=sys.stderr,
                  flush=True)
            return EXIT_TERMINATED
        print(f"train.py rank {rank}: collective failed, a peer is gone ({first}); exiting for a restart",
              file=sys.stderr, flush=True)
        return EXIT_LOST_PEER


if __name__ == "__main__":
    sys.exit(main())
