"""When the Trainer checkpoints and what it costs: the interval (fixed, or `ckpt_every="auto"`: chosen from the job's
own data by toolkit.train.ckpt.interval and agreed at every step boundary, the largest proposal winning), one save per
step timed as a stall for the goodput ledger and the interval, the optimizer held until the checkpoint in flight
copied what it changes, and the rank's CheckpointManager (toolkit.train.ckpt.manager) built from the environment."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from toolkit.contracts import ckptkey
from toolkit.contracts.protocol import is_int
from toolkit.train.ckpt import interval
from toolkit.train.ckpt import manager as checkpoint
from toolkit.train.ckpt.manager import CheckpointManager
from toolkit.train.ddpmodel import StepClock
from toolkit.train.faults import TrainerError
from toolkit.train.runtime import Runtime


def parse_every(ckpt_every: int | str, bounds: tuple[int, int],
                prior_mtbf: float) -> tuple[interval.IntervalChooser | None, int]:
    """The Trainer's `ckpt_every` checked: (the chooser for "auto", else None; the interval to start with).
    TrainerError, one line, for anything else than a number of steps of at least 1 or "auto"."""
    if ckpt_every == "auto":
        try:
            chooser = interval.IntervalChooser(bounds, prior_mtbf)
        except ValueError as e:
            raise TrainerError(str(e)) from None
        return chooser, chooser.current.steps
    if not is_int(ckpt_every) or ckpt_every < 1:
        raise TrainerError(f"ckpt_every={ckpt_every!r}: give a number of steps of at least 1, or \"auto\"")
    return None, ckpt_every


class RankCheckpoints(Protocol):
    """What the Trainer needs of what writes a rank's checkpoints: toolkit.train.ckpt.manager.CheckpointManager (its
    share of its host's copy of a replicated state) or toolkit.train.ckpt.shards.ShardCheckpoints (its own shard)."""

    directory: Path
    last_bytes: int  # bytes of the newest save (the heartbeat's)
    skipped: int  # saves skipped in a row for a full disk
    skip_why: str  # the line that said why
    copies_later: bool  # it takes `stable` tensors to copy while the next step runs (else it copies all in save)

    def save(self, step: int, state: dict[str, Any], stable: frozenset[int] = frozenset()) -> None: ...

    def wait_staged(self, timeout: float | None = None) -> float: ...

    def flush(self, timeout: float | None = None) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


class Checkpointing:
    """The checkpoints of one rank: `manager` writes them (replicated or sharded: RankCheckpoints); `every` is the
    interval every rank agreed on in the current step; `chooser` (None for a fixed interval) proposes the next. A
    save's stall is not the next step's work: `clock` is told."""

    def __init__(self, rt: Runtime, manager: RankCheckpoints, optimizer: torch.optim.Optimizer,
                 chooser: interval.IntervalChooser | None, every: int, clock: StepClock) -> None:
        self.rt = rt
        self.manager = manager
        self.optimizer = optimizer
        self.chooser = chooser
        self.every = every
        self.clock = clock
        self._published: int | None = None  # the agreed interval last published (auto), with its reason
        self._saved = -1
        self._staging_wait = 0.0  # s the optimizer waited for the last checkpoint's staging (part of its stall)
        self._pre_hook = optimizer.register_step_pre_hook(self._before_optimizer_step)

    @property
    def proposal(self) -> int:
        """This rank's proposal for the interval at the next step boundary."""
        return self.chooser.current.steps if self.chooser is not None else self.every

    def agreed(self, every: int, proposal: int) -> None:
        """The ranks agreed on `every` at a step boundary (this rank proposed `proposal`): with "auto", a new
        interval is published in the heartbeats with its reason."""
        self.every = every
        if self.chooser is not None and every != self._published:
            self._published = every
            own = self.chooser.current.why
            why = own if every == proposal else (
                f"{every} steps: the largest of the ranks' proposals (this rank's: {own})")
            self.rt.publish_pace(ckpt_every=every, ckpt_why=why)

    def due(self, step: int) -> bool:
        """Whether `step` is one to checkpoint at (the interval every rank agreed on in this step)."""
        return step % self.every == 0

    def save(self, step: int, capture: Callable[[int], dict[str, Any]]) -> None:
        """Checkpoint `step` (once; `capture(step)` gives the state), timing the stall for the goodput ledger and the
        interval."""
        if self._saved == step:
            return
        began = time.monotonic()
        stable = self._optimizer_storages() if self.manager.copies_later else frozenset()
        self.manager.save(step, capture(step), stable=stable)
        stalled = time.monotonic() - began + self._staging_wait
        self._staging_wait = 0.0
        self._saved = step
        self.rt.checkpoint_stalled(stalled, self.manager.last_bytes)
        self._publish_skipped()
        if self.chooser is not None:
            self.chooser.stalled(stalled)
        self._choose_interval()
        self.clock.rest()  # the stall is not the next step's work

    def _publish_skipped(self) -> None:
        """Tell the scheduler (heartbeat `ckpt_skipped`, `ckpt_full`) how many checkpoints in a row the disk had no
        room for, and why, for `fleet status` and the ledger; 0 once one is written. With asynchronous writes the
        outcome of a write is known at the next save, so it is said one interval late. Said at every save, so that a
        relaunched rank that writes again closes the run its predecessor left open."""
        skipped = self.manager.skipped
        self.rt.publish_pace(ckpt_skipped=skipped, ckpt_full=self.manager.skip_why if skipped else "")

    def redo(self) -> None:
        """The ranks went back to an earlier step (toolkit.train.replicas): the steps saved since are saved again
        when they are redone (what was saved held the fault)."""
        self._saved = -1

    def close(self) -> None:
        """Stop holding the optimizer, then complete the checkpoints in flight (CheckpointManager.close)."""
        self._pre_hook.remove()
        self.manager.close()

    def _before_optimizer_step(self, *_: Any) -> None:
        """The optimizer changes parameters and its state in place: the checkpoint in flight must have copied them."""
        self._staging_wait += self.manager.wait_staged()

    def _optimizer_storages(self) -> frozenset[int]:
        """The storages only optimizer.step() changes (parameters, optimizer state): a checkpoint copies them while
        the next step's forward and backward run, and the optimizer waits for that copy (_before_optimizer_step)."""
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors += [v for per_param in self.optimizer.state.values() for v in per_param.values()
                    if isinstance(v, torch.Tensor)]
        # a DTensor (a sharded model's) has no storage of its own: its local shard's is what the checkpoint copies
        return frozenset(getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in tensors)

    def _choose_interval(self) -> None:
        """After a checkpoint: when the next is due, and what the heartbeats tell the scheduler about it."""
        if self.chooser is None:
            self.rt.publish_pace(ckpt_every=self.every, ckpt_why=f"{self.every} steps: fixed (ckpt_every)")
            return
        history = self.rt.fault_history()
        if history is not None:
            self.chooser.history(history[0], history[1])
        self.chooser.update(self.rt.pace.summary().get("step_time"))  # proposed at the next step's agreement
        self._published = None  # the reason changed: publish the agreed interval with it


def manager_for(rt: Runtime, ckpt_dir: str | Path | None, keep: int, async_ckpt: bool) -> CheckpointManager:
    """The rank's checkpoint manager: its host's copy under the root (`where`), its share from the environment
    (checkpoint.Placement), the job's key. TrainerError, one line, for a layout or directory that cannot be used."""
    root, placement, key = where(rt, ckpt_dir)
    try:
        return CheckpointManager(root, keep_max=keep, placement=placement, key=key, async_write=async_ckpt,
                                 on_commit=rt.committed)
    except ValueError as e:
        raise TrainerError(str(e)) from None


def where(rt: Runtime, ckpt_dir: str | Path | None) -> tuple[Path, checkpoint.Placement, bytes | None]:
    """Where the rank's checkpoints go, whichever kind (replicated or sharded): the root (ckpt_dir, else CKPT_DIR,
    else ./ckpt), the placement from the environment, the job's key (from its token; None: the project's).
    TrainerError, one line, for a layout that cannot be right."""
    root = Path(ckpt_dir) if ckpt_dir is not None else Path(os.environ.get("CKPT_DIR") or "ckpt")
    try:
        placement = checkpoint.Placement.from_env(os.environ, world_size=rt.world_size)
    except ValueError as e:
        raise TrainerError(f"checkpoint layout: {e}") from None
    return root, placement, ckptkey.job_key(rt.cfg.token) if rt.cfg.token else None
