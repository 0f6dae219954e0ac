"""In-place recovery for a data-parallel training loop, in about ten changed lines of the user's script.

    rt = toolkit.train.init()                         # instead of dist.init_process_group()
    ...                                               # model, optimizer, sampler and loader as before
    trainer = toolkit.train.Trainer(rt, model, optimizer, loader, ckpt_dir=CKPT_DIR, ckpt_every=50)
    for x, y in trainer.batches(epochs):              # instead of both loops and set_epoch
        with trainer.step():                          # one training step: a fault inside it is not an error
            optimizer.zero_grad()
            loss = loss_fn(trainer.model(x), y)       # trainer.model: the DDP wrapper of the current group
            loss.backward()
            optimizer.step()
    trainer.finish()                                  # final checkpoint, then tell the scheduler

What it gives, under toolkit's launcher: a worker that dies costs no restart of the others and no lost step. The
survivors abandon the broken group at once (toolkit.train.fence), re-form it with the replacement, and every rank
not at the newest step any survivor holds takes the state (model, optimizer, the extra state handed over) from a
survivor at that step, tensor by tensor into its own storage (toolkit.train.transfer); a fault inside a collective
can leave ranks a step apart (a collective completed on one rank is a complete sum there). Data position and
randomness are functions of the step, so the replacement needs nothing else: the loader is positioned at the
step's batch (toolkit.train.loader) and torch's, Python's and numpy's global generators are seeded from (seed,
logical rank, step) before each step's batch is drawn (toolkit.train.stepdata; a process serving several logical
ranks runs the step once for each: toolkit.train.logicalgrad). The result is bitwise the one an uninterrupted run
gives (with the rank-ordered allreduce, `deterministic=True`). Checkpoints (one authenticated copy per host, its
writing shared by the host's ranks, asynchronous, every `ckpt_every` steps, their commits told to the scheduler:
toolkit.train.ckpt.manager) are for when no survivor holds the state: a whole-job restart, from the newest copy any
host has, or a world of one. SIGTERM: every rank agrees at the next step boundary and saves that step (last
words); the ranks that got the signal leave (exit 143), the others go on and meet the replacement. A rank whose
own SIGTERM comes later (during the agreement, or after it while its peers leave) leaves with the step it saved or
holds, at once, without waiting for a scheduler that may be stopping too.

Under torchrun or alone the same script runs: a fault there ends the process with one line and exit code 1
(EXIT_PEER_LOST) for the launcher to restart the world, which resumes from the newest checkpoint.

What a step may contain: anything, as long as every collective of the step runs inside `trainer.step()` (a
collective outside it fails like any other error when a peer dies). Extra state (an LR scheduler, a grad scaler)
must be the same on every rank, as everything replicated in data parallelism is; pass it as `state={...}`. Every
`verify_every` steps (and after a recovery) the ranks compare a digest of every byte of their state
(toolkit.train.replicas; a sharded model's: each shard's replicas under HSDP, none under pure FSDP): forgotten state
stops the job with one line naming it; a rank whose state was corrupted (a bit flipped in memory) is named by the
majority and every rank goes back to the last good check and redoes the steps, bitwise.

The Trainer composes its parts, one concern each: which state the ranks go on from, and its transfer
(toolkit.train.agreement); SIGTERM, interruptible waits, the stop agreement, the end for a restart
(toolkit.train.stopping); the checkpoint interval and saves (toolkit.train.ckpt.schedule); the DDP wrapper of the
current group and the step's timing (toolkit.train.ddpmodel); each step's batch and randomness
(toolkit.train.stepdata). What stays here is the loop itself: the step, its faults, and the order of recovery.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any, ContextManager, Iterator, Mapping, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from toolkit.contracts import envvars
from toolkit.train import headroom, log, progress, replicas, sharded
from toolkit.train.agreement import FROM_CHECKPOINT, FROM_INITIAL, FROM_PEER, TrainingState, recomputed_steps
from toolkit.train.ckpt import interval, manager
from toolkit.train.ckpt.schedule import Checkpointing, RankCheckpoints, manager_for, parse_every
from toolkit.train.ddpmodel import GroupModel
from toolkit.train.faults import GenerationChanged, TrainerError, first_line, looks_collective
from toolkit.train.inject import Injector
from toolkit.train.lifecycle import Phase
from toolkit.train.logicalgrad import deferred
from toolkit.train.lossscale import in_step, scalers_in
from toolkit.train.replicas import ReplicaCheck
from toolkit.train.runtime import MODE_TOOLKIT, JobStopped, Runtime
from toolkit.train.stepdata import StepData
from toolkit.train.stopping import EXIT_PEER_LOST, EXIT_TERMINATED, Stopping, Terminated, end_for_restart
from toolkit.train.tbscalars import open_scalars

__all__ = ["EXIT_PEER_LOST", "EXIT_TERMINATED", "Terminated", "Trainer", "TrainerError"]


class Trainer:
    """See the module docstring. `model` and `optimizer` are the user's (the Trainer never replaces them);
    `loader` a DataLoader over a map-style dataset; `state` extra objects with state_dict/load_state_dict
    that are part of the training state (everything must load with `torch.load(weights_only=True)`: checked here).
    Checkpoints go to `ckpt_dir`/host_<host>/ (default: CKPT_DIR from the environment, else ./ckpt; a directory
    only this user can change), one copy per host (a sharded model: each rank its own shard, toolkit.train.sharded),
    every `ckpt_every` steps, `keep` copies (`async_ckpt`: written in
    the background, the parameters and optimizer state copied during the next forward and backward, so they must
    change only in optimizer.step()); `ckpt_every="auto"` chooses the interval from the job's own data
    (toolkit.train.ckpt.interval: the measured stall and the observed MTBF, within `ckpt_bounds` steps, `prior_mtbf` s
    assumed until a fault). `seed` makes each step's randomness a function of
    the step (None: leave the generators alone; then a recovered run is not bitwise the same). `ddp` holds extra
    DistributedDataParallel arguments. `verify_every`: steps between the replica checks (toolkit.train.replicas), 0
    for none, "auto" for checks within 1% of the step time; None: TOOLKIT_VERIFY_EVERY (fleet's --verify-every),
    else "auto". `shard_mirror` (pure FSDP): steps between refreshes of the copy of each rank's shard that
    another host's rank keeps in memory, "auto" for at most 3% of the step time, 0 for none
    (toolkit.train.shardrollback).

    Each step is timed for the scheduler (toolkit.train.pace): its wall time, and the time this rank worked before
    handing its last gradient bucket to the allreduce, which names a straggler; `report(loss=...)` adds the loss
    to what `fleet status` and `fleet report` show. Rank 0 writes TensorBoard scalars (loss, steps/s, recoveries as
    text) to `tensorboard_dir` (default $CKPT_DIR/../tb) when tensorboard is installed (toolkit.train.tbscalars).
    The total of steps that `batches(epochs)` will run goes to the scheduler: `fleet status` shows a progress bar
    and an ETA."""

    def __init__(self, runtime: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, *,
                 state: Mapping[str, Any] | None = None, ckpt_dir: str | Path | None = None,
                 ckpt_every: int | str = 100, keep: int = 3, seed: int | None = 0, deterministic: bool = True,
                 async_ckpt: bool = True, ddp: Mapping[str, Any] | None = None,
                 ckpt_bounds: tuple[int, int] = interval.DEFAULT_BOUNDS,
                 prior_mtbf: float = interval.DEFAULT_PRIOR_MTBF, tensorboard_dir: str | Path | None = None,
                 verify_every: int | str | None = None, shard_mirror: int | str = "auto") -> None:
        chooser, every = parse_every(ckpt_every, ckpt_bounds, prior_mtbf)
        try:
            verify = replicas.parse_every(runtime.cfg.verify_every if verify_every is None else verify_every)
        except ValueError as e:
            raise TrainerError(str(e)) from None
        extra = _check_extra(state)
        sharding = sharded.inspect(model, runtime.world_size)  # None: not sharded; TrainerError: not recoverable
        if sharding is not None:
            _check_sharded(runtime, ddp)
        _check_loadable({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "extra": {name: obj.state_dict() for name, obj in extra.items()}} if sharding is None else
                        sharded.ShardState(model, optimizer, extra).tensors())
        self.rt = runtime
        self.module = model
        self.optimizer = optimizer
        self.extra = extra
        self._scalers = scalers_in(extra)  # its GradScalers (toolkit.train.lossscale)
        self._built_for = (runtime.world_size, runtime.rank)  # the world the script built its loader for
        self._data = StepData(loader, seed, runtime.logical_world, runtime.logical_ranks,
                              as_built(runtime, self._built_for))
        self.position = self._data.position
        self.manager: RankCheckpoints = manager_for(runtime, ckpt_dir, keep, async_ckpt) if sharding is None else \
            sharded.checkpoints_for(runtime, sharding, ckpt_dir, keep, async_ckpt)  # its host's copy, or its shard
        self.step_count = 0  # optimizer steps done: the job's global step, the same on every rank
        self._sharded = sharding is not None
        if sharding is None:
            self._group: Any = GroupModel(model, ddp or {}, deterministic)
            self._state = TrainingState(runtime, model, optimizer, extra, self.manager)
            self._ckpt = Checkpointing(runtime, self.manager, optimizer, chooser, every, self._group.clock)
        else:  # toolkit.train.sharded
            self._group, self._state, self._ckpt = sharded.parts(runtime, model, optimizer, extra, self.manager,
                                                                 sharding, deterministic, chooser, every,
                                                                 shard_mirror)
        self._need_sync = True
        self._entered = True  # the previous batch went through step(): nothing to complain about at the start
        self._applied = _Applied()  # optimizer steps and scaler updates run (one that ran before a fault counts)
        self._hook = optimizer.register_step_post_hook(self._applied)
        self._lane = 0  # which of this process's logical ranks the next batch is for (toolkit.train.logicalgrad)
        self._grad_bytes = headroom.grad_bytes(model.parameters())  # one more logical rank's cost (headroom)
        self._began, self._applied_before = 0.0, 0  # the step in progress: when it began, optimizer steps before it
        self._pre_hook = optimizer.register_step_pre_hook(self._group.reduce_logical)
        self._loss: Any = None
        self._stopping = Stopping(runtime)
        self._finished = False
        broadcast = (ddp or {}).get("broadcast_buffers", True)  # DDP's default: rank 0's buffers go to all
        host = (os.environ.get(envvars.TOOLKIT_HOST) or "").strip() or socket.gethostname()
        self._replicas = ReplicaCheck(runtime, self._state, verify, buffers=not broadcast, host=host,
                                      layout=sharding.layout if sharding is not None else None)  # HSDP: by column
        self._inject = Injector.from_env(os.environ, runtime.rank, runtime.mode == MODE_TOOLKIT)
        self._tb = open_scalars(runtime.rank, tensorboard_dir)  # rank 0's TensorBoard scalars (toolkit.train.tbscalars)

    # -- what the loop sees

    @property
    def model(self) -> nn.Module:
        """The model to call in a step: the DistributedDataParallel wrapper of the current group (the module
        itself in a world of one). It changes when the group is re-formed: use it inside the step."""
        if self._group.current is None:
            raise TrainerError("trainer.model is only there inside the loop over trainer.batches()")
        return self._group.current

    @property
    def epoch(self) -> int:
        """The epoch the next step trains in: a function of `step_count` and the loader's batches per epoch."""
        return self.position.where(self.step_count)[0]

    def batches(self, epochs: int) -> Iterator[Any]:
        """The batches of `epochs` epochs from where the job stands: after a fault, the interrupted batch again
        (or the next one, if the state taken over already includes it). Each must be trained inside step()."""
        if epochs < 1:
            raise TrainerError(f"epochs={epochs}: give at least 1")
        total = epochs * self.position.per_epoch
        self.rt.pace.total = total  # the progress bar and ETA of fleet status
        while True:
            if not self._entered:
                raise TrainerError("each batch from trainer.batches() must be trained inside `with trainer.step():` "
                                   "(it is what makes a fault in the step recoverable)")
            if self._need_sync:
                self._sync()
                self._replicas.arm(self.rt.generation, self.step_count)
                for line in self._inject.after_recovery(self.rt.generation, self.step_count, self.module,
                                                        self.optimizer) if self._inject is not None else ():
                    log.line(f"rank {self.rt.rank}: {line}")  # a test's fault (toolkit.train.inject)
            if self._lane == 0:  # a step boundary
                if self.step_count >= total:
                    if self._replicas.due(self.step_count, end=True) and not self._verify():
                        continue
                    return
                if self._replicas.due(self.step_count) and not self._verify():
                    continue
            batch = self._data.batch(self.step_count, self.rt.logical_ranks[self._lane])
            self._entered = False
            yield batch

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """One training step; `as` gives its number (step_count + 1). A collective that fails because a peer
        died, or a new generation announced, ends the step without an error: the state it reached is kept or
        discarded and the loop goes on from there. What the block does after optimizer.step() (printing the
        loss) happens once per step whatever the faults.

        A process serving several logical ranks runs the block once for each (one batch each from `batches`):
        `optimizer.step()` and `zero_grad()` do nothing but in the last, whose `optimizer.step()` first reduces
        every logical rank's gradient (toolkit.train.logicalgrad); a GradScaler handed over in `state=` unscales,
        checks and updates once, on the reduced gradient (toolkit.train.lossscale)."""
        self._entered = True
        logical = self._group.logical
        last = logical is None or self._lane == logical.lanes - 1
        if self._lane == 0:
            self._began, self._applied_before = self._group.clock.begin(), self._applied.count
        applied = self._applied_before
        try:  # not rt.guard(): a context manager must run its block, even in a generation already left
            if logical is not None:
                logical.begin(self._lane)
            with contextlib.nullcontext() if last else deferred(self.optimizer), \
                    in_step(self._scalers, logical, self._lane, last, self._applied):
                yield self.step_count + 1
            if not last:
                logical.keep(self._lane)
                self._lane += 1
                return
            self._lane = 0
            if logical is not None:
                logical.finish()
            leaving = self._agree_stop()
            self.rt.check()
        except GenerationChanged as e:
            self._abandoned(applied, e.new)
            return
        except JobStopped:
            raise
        except Exception as e:
            changed = self._word_on(e, applied)
            if changed is not None:
                self._abandoned(applied, changed.new)
                return
            raise
        self.step_count += 1
        self._state.live = True
        if self._inject is not None:
            for line in self._inject.after_step(self.step_count, self.module, self.optimizer):
                log.line(f"rank {self.rt.rank}: {line}")
        self.rt.report(self.step_count, self.epoch, loss=self._loss, busy=self._group.end_step(self._began))
        self._state.after_step(self.step_count)  # pure FSDP's copies of the shards in memory, when due
        if self._tb is not None:
            step_time = self.rt.pace.summary().get("step_time")
            self._tb.step(self.step_count, self._loss, 1.0 / step_time if step_time else None)
        self._loss = None
        if self._ckpt.due(self.step_count):
            with progress.long_phase("checkpoint"):  # the progress watchdog waits for it
                self._ckpt.save(self.step_count, self._state.checkpoint)
        if leaving is not None:
            self._leave(leaving)

    def report(self, loss: Any) -> None:
        """The loss of the step in progress (a float or a one-element tensor), for `fleet status` and `fleet
        report`. Cheap: it is read (which waits for the device) at most once per second."""
        self._loss = loss

    def finish(self) -> None:
        """The end of training: the final checkpoint durable on every rank, then `done` for the scheduler (a
        peer dying meanwhile is recovered like any fault, then finishing goes on)."""
        if self._finished:
            return
        while True:
            try:
                with self._guarded(), progress.long_phase("the final checkpoint"):
                    self._ckpt.save(self.step_count, self._state.checkpoint)
                    self.manager.flush()
                    if self.rt.world_size > 1:
                        # nobody says done while a peer may still need the state
                        self.rt.fence.wait(dist.barrier(async_op=True), "the final barrier")
                break
            except GenerationChanged:
                self._need_sync = True
                self._sync()
        self._close()
        self.rt.done()

    def close(self) -> None:
        """Release without finishing (an error ends the loop): checkpoints in flight are completed."""
        if not self._finished:
            self._close()
            self.rt.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    # -- faults

    def _verify(self) -> bool:
        """The replica check (toolkit.train.replicas) at a due step: True to go on with the next batch; False when
        the loop must look again (a new generation cut the check short: re-form; or the ranks went back to the
        last good check's step, whose batches are drawn again)."""
        self.manager.wait_staged()  # a roll-back writes the tensors a checkpoint in flight may be copying
        went = self._replicas.run(self.step_count, guard=self._guarded)
        if went is None:
            self._need_sync = True  # a fault during the check: re-form, as after one in a step
            return False
        if went == self.step_count:
            return True
        self.step_count = went
        self._ckpt.redo()
        self._group.clock.rest()  # the roll-back is not the next step's work
        return False

    def _abandoned(self, applied_before: int, generation: int | None) -> None:
        """The step ended by a fault (`generation`: the one announced; None: SIGTERM came before the word). If this
        rank's optimizer step ran (or its GradScaler's update, after a step skipped for an overflow), its allreduce
        had completed (a complete sum of every rank's gradients), so the state it holds is the next step's: keep it,
        the others may need it. A rank that got SIGTERM leaves now with that state (`_last_words`): its peers may be
        leaving too, and nobody would re-form with it."""
        kept = self._applied.count != applied_before
        self._lane = 0  # the step is redone (or the next one begins) from this process's first logical rank
        if kept:
            self.step_count += 1
            if self._tb is not None:  # its loss, printed by the script, is the step's as any other's
                self._tb.step(self.step_count, self._loss, None)
        self._loss = None  # a step redone reports its loss again
        self._state.live = True
        self._need_sync = True
        how = 'the step was complete here' if kept else 'the step in flight is redone'
        if generation is None:
            log.line(f"rank {self.rt.rank}: the group broke at step {self.step_count} ({how})")
        else:
            log.line(f"rank {self.rt.rank}: generation {self.rt.generation} -> {generation} at step {self.step_count} "
                     f"({how}): {self.rt.life.phase.value}, re-forming the group")
        if self._stopping.requested and self.rt.mode == MODE_TOOLKIT:
            self._last_words()

    def _word_on(self, error: Exception, applied: int | None = None) -> GenerationChanged | None:
        """After `error` ended a step (`applied`: the optimizer steps seen before it) or a recovery (None): the
        GenerationChanged to act on if the job moved on, None if the error is the loop's own (Runtime.changed_by,
        which waits a bounded time for the scheduler's word). SIGTERM, come before or during that wait, ends the
        wait and the process with last words: when every rank is told to stop, the peers are leaving and the
        scheduler too, so no word would come (the wait would outlast the agent's grace and end in SIGKILL). Under
        torchrun or alone a collective that failed (a step's, or the Trainer's own: agreement, replica check, final
        barrier) means a peer is gone, and no one re-forms the group: the process ends for the launcher's restart."""
        if not looks_collective(error):
            return self.rt.changed_by(error)
        if self.rt.mode != MODE_TOOLKIT:
            end_for_restart(self.manager, self.rt.rank, f"rank {self.rt.rank}: a collective failed, a peer is gone "
                            f"({first_line(error)}); this launcher cannot re-form the group in place: exiting for a "
                            "restart")
        try:
            with self._stopping.interruptible():
                return self.rt.changed_by(error)
        except Terminated:
            pass
        if applied is not None:
            self._abandoned(applied, None)  # SIGTERM came: ends in _last_words
        self._last_words()

    def _guarded(self) -> ContextManager[Runtime]:
        """Runtime.guard() for the Trainer's own collectives (agreement, final barrier, replica check), with
        `_word_on` deciding: SIGTERM ends the wait for the scheduler's word."""
        return self.rt.guard(word=self._word_on)

    def _sync(self) -> None:
        """(Re-)form the group, agree on the newest state any rank holds and give it to every rank
        (toolkit.train.agreement), wrap the model for the group, position the data. Repeats, bounded by the
        runtime's timeouts, while faults keep coming."""
        while True:
            started = time.monotonic()
            self.manager.wait_staged()  # restoring a state writes the tensors being staged
            self._group.drop()
            try:
                with self._stopping.interruptible():
                    self.rt.reform()
            except Terminated:
                self._last_words()
            try:
                with self._guarded():
                    self.rt.life.move(Phase.RECEIVING)  # until Runtime.recovered: formed again
                    agreed = self._state.agree(self.step_count)
                    self.step_count = agreed.step
                    self._group.wrap(self.rt)
                    self._data.serve(self.rt.logical_world, self.rt.logical_ranks,
                                     as_built(self.rt, self._built_for))
                    self._lane = 0
                break
            except GenerationChanged:
                continue
        self._need_sync = False
        # how many logical ranks this memory holds, for the scheduler's shrink decisions (toolkit.train.headroom)
        self.rt.publish_pace(capacity=headroom.reported(self._sharded, len(self.rt.logical_ranks), self._grad_bytes,
                                                        headroom.free_bytes()))
        source = agreed.source.kind
        recomputed = recomputed_steps(agreed.source, self.step_count)
        seconds = time.monotonic() - started
        self.rt.recovered(self.step_count, source, agreed.origin, recomputed, seconds, agreed.nbytes)
        history = self.rt.fault_history()
        if self._tb is not None and history is not None:
            self._tb.goodput(self.step_count, history[2])
        what = {FROM_PEER: f"rank {agreed.origin}'s memory", FROM_CHECKPOINT: f"rank {agreed.origin}'s checkpoint",
                FROM_INITIAL: "the initial state"}[source]
        if source == FROM_INITIAL:
            log.line(f"rank {self.rt.rank}: starting fresh")
        else:
            epoch, batch = self.position.where(self.step_count)
            tail = f": {recomputed} step(s) recomputed" if recomputed >= 0 else ""
            log.line(f"rank {self.rt.rank}: resumed from step {self.step_count} (epoch {epoch}, batch {batch} of "
                     f"{self.position.per_epoch}) out of {what} in {seconds:.2f} s ({agreed.nbytes / 1e6:.2f} MB), "
                     f"generation {self.rt.generation}{tail}")
            if self._tb is not None:  # here, not where a step broke: a fault between steps breaks none
                self._tb.incident(self.step_count, f"generation {self.rt.generation}: resumed from step "
                                                   f"{self.step_count} out of {what} in {seconds:.2f} s{tail}")

    # -- SIGTERM

    def _agree_stop(self) -> bool | None:
        """Collective at the end of every step: did any rank get SIGTERM? None if not; else whether this rank
        is one that leaves (toolkit.train.stopping). The same collective agrees on the checkpoint interval: each
        rank proposes its own (with `ckpt_every="auto"` each measures its own stall) and all take the largest, so
        every rank checkpoints at the same steps (a replacement that starts at the lower bound takes the survivors'
        interval at its first step)."""
        proposal = self._ckpt.proposal
        leaving, every = self._stopping.agree(self.rt, proposal)
        self._ckpt.agreed(every, proposal)
        return leaving

    def _leave(self, leaving: bool) -> None:
        """A rank got SIGTERM by this step's agreement: every rank saves this step. Those that got it leave, and
        so does one whose own SIGTERM came during or after the agreement (when every rank is told to stop, the
        signals need not all land before the same boundary); the others go on and meet the replacements."""
        self._ckpt.save(self.step_count, self._state.checkpoint)
        self.manager.flush()
        if leaving or self._stopping.requested:
            self._last_words()
        log.line(f"rank {self.rt.rank}: a peer stops by SIGTERM at step {self.step_count}, {self._saved_or_not()}; "
                 "training goes on")

    def _saved_or_not(self) -> str:
        """What became of the checkpoint just flushed: saved, or skipped for a full disk (CheckpointManager.skipped)."""
        return "checkpoint saved" if not self.manager.skipped else "checkpoint skipped (the disk is full, see above)"

    def _last_words(self) -> NoReturn:
        """Leave on SIGTERM: the state this rank holds saved (once: its share of the host's copy, whole when the
        host's other ranks saved the same step, as at an agreement) and durable, then Terminated (exit 143 under
        toolkit). Reached at a step boundary's agreement (`_leave`), or where no agreement can be had: the step
        failed because peers left (their last words were the step this rank saved when they agreed, or the one it
        holds), or the group is being re-formed. A rank that holds no state yet (a replacement still joining) has
        nothing to save."""
        if self._state.live:
            self._ckpt.save(self.step_count, self._state.checkpoint)
            self.manager.flush()
            log.line(f"rank {self.rt.rank}: stopped by SIGTERM at step {self.step_count}, {self._saved_or_not()}")
        else:
            log.line(f"rank {self.rt.rank}: stopped by SIGTERM before it held a training state: nothing to save")
        self.close()
        raise Terminated(EXIT_TERMINATED if self.rt.mode == MODE_TOOLKIT else 0)

    def _close(self) -> None:
        self._finished = True
        self._hook.remove()
        self._pre_hook.remove()
        if self._sharded:
            self._state.close()
        if self._tb is not None:
            self._tb.close()
        self._group.drop()
        self._data.close()
        try:
            self._ckpt.close()
        finally:
            self._stopping.release()


def _check_sharded(rt: Runtime, ddp: Mapping[str, Any] | None) -> None:
    """What a sharded model cannot be given: DDP arguments, or several logical ranks per worker (its shards are
    one per rank: toolkit.train.sharded)."""
    if not as_built(rt, (rt.world_size, rt.rank)):
        raise TrainerError(f"this model is sharded with fully_shard and the job has {rt.logical_world} logical "
                           f"ranks on {rt.world_size} workers: a sharded model is served one logical rank per worker "
                           "(drop --logical-ranks and --min-workers for it)")
    if ddp:
        raise TrainerError("ddp=... holds DistributedDataParallel arguments, and this model is sharded with "
                           "fully_shard (no DDP wrapper): drop ddp=")


def as_built(rt: Runtime, built_for: tuple[int, int]) -> bool:
    """Whether the script's loader serves this process's logical rank as the script built it: one logical rank per
    rank, rank r serving r (L = N, nothing lost: a job as without logical ranks), in the world the script built it
    for (`built_for`: the world size and rank when the Trainer was made). Why the last: a process that started while
    the job was shrunk built its sampler for the smaller world (4 replicas, rank 2); once the job has grown back and
    it serves logical rank 2 of 6 alone, that sampler as built is another shard: it must be set to (6, 2) instead."""
    return (rt.logical_world == rt.world_size and rt.logical_ranks == (rt.rank,)
            and (rt.world_size, rt.rank) == built_for)


class _Applied:
    """The optimizer's post-hook: the optimizer steps run in this process (a step that ran before a fault counts);
    called too by a GradScaler's update() (a step skipped for an overflow moved the scaler: toolkit.train.lossscale)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *_: Any) -> None:
        self.count += 1


def _check_extra(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """The script's extra state (`state=`), each object one that can be saved and restored; TrainerError naming the
    first that cannot."""
    extra = dict(state or {})
    for name, obj in extra.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TrainerError(f"state[{name!r}] has no state_dict()/load_state_dict(): hand over objects that "
                               "can be saved and restored (an LR scheduler, a GradScaler, a module)")
    return extra


def _check_loadable(state: dict[str, Any]) -> None:
    """Every value of the training state must load with torch.load(weights_only=True), the only way toolkit reads
    a state (from a peer after a fault, from a checkpoint): TrainerError naming the first that would not, now,
    instead of a failed recovery later."""
    found = manager.first_unloadable(state)
    if found is None:
        return
    where, kind = found
    owner = {"model": "the model's state_dict()", "optimizer": "the optimizer's state_dict()"}.get(
        where[0], f"state[{where[1]!r}].state_dict()" if where[0] == "extra" and len(where) > 1 else "the state")
    inner = "".join(f"[{k!r}]" for k in where[2 if where[0] == "extra" else 1:])
    raise TrainerError(f"{owner} holds a {kind} at {inner or 'its top'}, which a safe load (torch.load with "
                       "weights_only=True) refuses: the state could not move to a replacement after a fault, nor be "
                       "resumed from a checkpoint; return a Python number (float(x), int(x)) or a tensor instead")
