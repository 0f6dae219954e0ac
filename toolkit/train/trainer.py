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
rank, step) before each step's batch is drawn. The result is bitwise the one an uninterrupted run gives (with the
rank-ordered allreduce, `deterministic=True`). Checkpoints (one authenticated copy per host, its writing shared by
the host's ranks, asynchronous, every `ckpt_every` steps, their commits told to the scheduler:
toolkit.train.checkpoint) are for when no survivor holds the state: a whole-job restart, from the newest copy any
host has, or a world of one. SIGTERM: every rank agrees at the next step boundary and saves that step (last
words); the ranks that got the signal leave (exit 143), the others go on and meet the replacement. A rank whose
own SIGTERM comes later (during the agreement, or after it while its peers leave) leaves with the step it saved or
holds, at once, without waiting for a scheduler that may be stopping too.

Under torchrun or alone the same script runs: a fault there ends the process with one line and exit code 1
(EXIT_PEER_LOST) for the launcher to restart the world, which resumes from the newest checkpoint.

What a step may contain: anything, as long as every collective of the step runs inside `trainer.step()` (a
collective outside it fails like any other error when a peer dies). Extra state (an LR scheduler, a grad scaler)
must be the same on every rank, as everything replicated in data parallelism is; pass it as `state={...}`. After
a recovery the ranks compare a fingerprint of it now and then (toolkit.train.divergence): forgotten state stops the
job with one line naming it, rather than letting the ranks train on apart.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from toolkit.train import checkpoint, ckptfile, determinism, interval, transfer
from toolkit.train.checkpoint import CheckpointManager
from toolkit.train.divergence import DivergenceCheck
from toolkit.train.faults import first_line, looks_collective
from toolkit.train.loader import Positioner, Replay
from toolkit.train.runtime import MODE_TOOLKIT, GenerationChanged, JobStopped, Runtime

EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_PEER_LOST = 1  # under torchrun or alone: a peer is gone, the launcher restarts the world
FROM_PEER, FROM_CHECKPOINT, FROM_INITIAL = "peer", "checkpoint", "initial"


class Terminated(SystemExit):
    """SIGTERM: the last-words checkpoint is durable (or there was no group to save with); the process ends."""


class TrainerError(RuntimeError):
    """The training loop uses the Trainer wrongly; the message says how to fix it."""


class Trainer:
    """See the module docstring. `model` and `optimizer` are the user's (the Trainer never replaces them);
    `loader` a DataLoader over a map-style dataset; `state` extra objects with state_dict/load_state_dict
    that are part of the training state (everything must load with `torch.load(weights_only=True)`: checked here).
    Checkpoints go to `ckpt_dir`/host_<host>/ (default: CKPT_DIR from the environment, else ./ckpt; a directory
    only this user can change), one copy per host, every `ckpt_every` steps, `keep` copies (`async_ckpt`: written in
    the background, the parameters and optimizer state copied during the next forward and backward, so they must
    change only in optimizer.step()); `ckpt_every="auto"` chooses the interval from the job's own data
    (toolkit.train.interval: the measured stall and the observed MTBF, within `ckpt_bounds` steps, `prior_mtbf` s
    assumed until a fault). `seed` makes each step's randomness a function of
    the step (None: leave the generators alone; then a recovered run is not bitwise the same). `ddp` holds extra
    DistributedDataParallel arguments.

    Each step is timed for the scheduler (toolkit.train.pace): its wall time, and the time this rank worked before
    handing its last gradient bucket to the allreduce, which names a straggler; `report(loss=...)` adds the loss
    to what `fleet status` and `fleet report` show."""

    def __init__(self, runtime: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, *,
                 state: Mapping[str, Any] | None = None, ckpt_dir: str | Path | None = None,
                 ckpt_every: int | str = 100, keep: int = 3, seed: int | None = 0, deterministic: bool = True,
                 async_ckpt: bool = True, ddp: Mapping[str, Any] | None = None,
                 ckpt_bounds: tuple[int, int] = interval.DEFAULT_BOUNDS,
                 prior_mtbf: float = interval.DEFAULT_PRIOR_MTBF) -> None:
        self._chooser: interval.IntervalChooser | None = None
        if ckpt_every == "auto":
            try:
                self._chooser = interval.IntervalChooser(ckpt_bounds, prior_mtbf)
            except ValueError as e:
                raise TrainerError(str(e)) from None
            ckpt_every = self._chooser.current.steps
        elif isinstance(ckpt_every, bool) or not isinstance(ckpt_every, int) or ckpt_every < 1:
            raise TrainerError(f"ckpt_every={ckpt_every!r}: give a number of steps of at least 1, or \"auto\"")
        extra = dict(state or {})
        for name, obj in extra.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TrainerError(f"state[{name!r}] has no state_dict()/load_state_dict(): hand over objects that "
                                   "can be saved and restored (an LR scheduler, a GradScaler, a module)")
        _check_loadable({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "extra": {name: obj.state_dict() for name, obj in extra.items()}})
        self.rt = runtime
        self.module = model
        self.optimizer = optimizer
        self.extra = extra
        self.seed = seed
        self.deterministic = deterministic
        self.ckpt_every = ckpt_every
        self._published: int | None = None  # the agreed interval last published (auto), with its reason
        self.ddp_args = dict(ddp or {})
        self.position = Positioner(loader)
        self.manager = _manager(runtime, ckpt_dir, keep, async_ckpt)
        self.step_count = 0  # optimizer steps done: the job's global step, the same on every rank
        self._live = False  # this process holds a training state of its own (it has trained or received one)
        self._saved = -1
        self._ddp: nn.Module | None = None
        self._batches: Iterator[Any] | None = None
        self._batches_at: tuple[int, int] | None = None  # (epoch, batch) the iterator yields next
        self._replay = Replay(loader)  # the batch last given out, for a step redone after a fault
        self._need_sync = True
        self._entered = True  # the previous batch went through step(): nothing to complain about at the start
        self._applied = 0  # optimizer steps seen by the post-hook (a step that ran before a fault still counts)
        self._hook = optimizer.register_step_post_hook(self._on_optimizer_step)
        self._buckets = _BucketClock()  # when this rank handed its last gradient bucket to the allreduce
        self._step_began: float | None = None  # the end of the previous step: where this step's own work starts
        self._loss: Any = None
        self._pristine = True  # the state is still the one the user built (no transfer was received into it)
        self._wrapped = False  # a DDP wrapper was built in this process
        self._staging_wait = 0.0  # s the optimizer waited for the last checkpoint's staging (part of its stall)
        self._pre_hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._stop = threading.Event()
        self._interrupt = False  # SIGTERM raises Terminated at once (while blocked forming a group)
        self._previous_handler = _install_sigterm(self._on_sigterm)
        self._finished = False
        self._divergence = DivergenceCheck(runtime.world_size)  # after a recovery: do the ranks still agree?

    # -- what the loop sees

    @property
    def model(self) -> nn.Module:
        """The model to call in a step: the DistributedDataParallel wrapper of the current group (the module
        itself in a world of one). It changes when the group is re-formed: use it inside the step."""
        if self._ddp is None:
            raise TrainerError("trainer.model is only there inside the loop over trainer.batches()")
        return self._ddp

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
        while True:
            if not self._entered:
                raise TrainerError("each batch from trainer.batches() must be trained inside `with trainer.step():` "
                                   "(it is what makes a fault in the step recoverable)")
            if self._need_sync:
                self._sync()
                self._divergence.arm(self.rt.generation, self.step_count)
            if self.step_count >= total:
                return
            if self._divergence.due(self.step_count) and not self._divergence.check(
                    self.rt, self.module, self.optimizer, self.step_count, guard=self._guarded):
                self._need_sync = True  # a fault during the check: re-form, as after one in a step
                continue
            batch = self._next_batch()
            self._entered = False
            yield batch

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """One training step; `as` gives its number (step_count + 1). A collective that fails because a peer
        died, or a new generation announced, ends the step without an error: the state it reached is kept or
        discarded and the loop goes on from there. What the block does after optimizer.step() (printing the
        loss) happens once per step whatever the faults."""
        self._entered = True
        applied = self._applied
        began = self._step_began if self._step_began is not None else time.monotonic()
        self._buckets.last = None
        try:  # not rt.guard(): a context manager must run its block, even in a generation already left
            yield self.step_count + 1
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
            if self.rt.mode != MODE_TOOLKIT and looks_collective(e):
                self._end_for_restart(f"rank {self.rt.rank}: a collective failed, a peer is gone ({first_line(e)}); "
                                      "this launcher cannot re-form the group in place: exiting for a restart")
            raise
        self.step_count += 1
        self._live = True
        ended = time.monotonic()
        busy = ended - began if self._ddp is self.module else (
            self._buckets.last - began if self._buckets.last is not None and self._buckets.last >= began else None)
        self.rt.report(self.step_count, self.epoch, loss=self._loss, busy=busy)
        self._loss = None
        self._step_began = ended
        if self._checkpoint_due():
            self._save()
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
                with self._guarded():
                    self._save()
                    self.manager.flush()
                    if self.rt.world_size > 1:
                        dist.barrier()  # nobody says done while a peer may still need the state
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

    def _on_optimizer_step(self, *_: Any) -> None:
        self._applied += 1

    def _before_optimizer_step(self, *_: Any) -> None:
        """The optimizer changes parameters and its state in place: the checkpoint in flight must have copied them."""
        self._staging_wait += self.manager.wait_staged()

    def _abandoned(self, applied_before: int, generation: int | None) -> None:
        """The step ended by a fault (`generation`: the one announced; None: SIGTERM came before the word). If this
        rank's optimizer step ran, its allreduce had completed (a complete sum of every rank's gradients), so the
        state it holds is the next step's: keep it, the others may need it. A rank that got SIGTERM leaves now with
        that state (`_last_words`): its peers may be leaving too, and nobody would re-form with it."""
        kept = self._applied != applied_before
        if kept:
            self.step_count += 1
        self._live = True
        self._need_sync = True
        how = 'the step was complete here' if kept else 'the step in flight is redone'
        if generation is None:
            print(f"rank {self.rt.rank}: the group broke at step {self.step_count} ({how})", flush=True)
        else:
            print(f"rank {self.rt.rank}: generation {self.rt.generation} -> {generation} at step {self.step_count} "
                  f"({how}): re-forming the group", flush=True)
        if self._stop.is_set() and self.rt.mode == MODE_TOOLKIT:
            self._last_words()

    def _word_on(self, error: Exception, applied: int | None = None) -> GenerationChanged | None:
        """After `error` ended a step (`applied`: the optimizer steps seen before it) or a recovery (None): the
        GenerationChanged to act on if the job moved on, None if the error is the loop's own (Runtime.changed_by,
        which waits a bounded time for the scheduler's word). SIGTERM, come before or during that wait, ends the
        wait and the process with last words: when every rank is told to stop, the peers are leaving and the
        scheduler too, so no word would come (the wait would outlast the agent's grace and end in SIGKILL)."""
        if self.rt.mode != MODE_TOOLKIT or not looks_collective(error):
            return self.rt.changed_by(error)
        try:
            with self._interruptible():
                return self.rt.changed_by(error)
        except Terminated:
            pass
        if applied is not None:
            self._abandoned(applied, None)  # SIGTERM came: ends in _last_words
        self._last_words()

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """Runtime.guard() for the Trainer's own collectives (agreement, final barrier): a collective broken by a
        new generation raises GenerationChanged, and SIGTERM ends the wait for the scheduler's word (`_word_on`)."""
        self.rt.check()
        try:
            yield
        except (GenerationChanged, JobStopped):
            raise
        except Exception as e:
            changed = self._word_on(e)
            if changed is None:
                raise
            raise changed from e
        self.rt.check()

    def _sync(self) -> None:
        """(Re-)form the group, agree on the newest state any rank holds and give it to every rank, wrap the model
        for the group, position the data. Repeats, bounded by the runtime's timeouts, while faults keep coming."""
        while True:
            started = time.monotonic()
            self.manager.wait_staged()  # restoring a state writes the tensors being staged
            self._drop_ddp()
            try:
                with self._interruptible():
                    self.rt.reform()
            except Terminated:
                self._last_words()
            try:
                with self._guarded():
                    source, from_rank, nbytes, before = self._agree_state()
                    self._wrap()
                break
            except GenerationChanged:
                continue
        self._need_sync = False
        # Only a survivor's memory tells how far the job had got; a restart from a checkpoint leaves it to the
        # scheduler, which heard every rank's step (-1: not known here).
        recomputed = max(0, before - self.step_count) if source == FROM_PEER else -1 if source == FROM_CHECKPOINT \
            else 0
        seconds = time.monotonic() - started
        self.rt.recovered(self.step_count, source, from_rank, recomputed, seconds, nbytes)
        what = {FROM_PEER: f"rank {from_rank}'s memory", FROM_CHECKPOINT: f"rank {from_rank}'s checkpoint",
                FROM_INITIAL: "the initial state"}[source]
        if source == FROM_INITIAL:
            print(f"rank {self.rt.rank}: starting fresh", flush=True)
        else:
            epoch, batch = self.position.where(self.step_count)
            print(f"rank {self.rt.rank}: resumed from step {self.step_count} (epoch {epoch}, batch {batch} of "
                  f"{self.position.per_epoch}) out of {what} in {seconds:.2f} s ({nbytes / 1e6:.2f} MB), generation "
                  f"{self.rt.generation}" + (f": {recomputed} step(s) recomputed" if recomputed >= 0 else ""),
                  flush=True)

    def _agree_state(self) -> tuple[str, int, int, int]:
        """Collective. Returns (source, the rank this rank's state came from, bytes this rank moved, the newest step
        any rank had reached).

        The ranks at the newest step held in memory give it to the others (toolkit.train.transfer); only when no
        rank holds a state (a whole-job start) do the checkpoints serve: the newest copy complete and authentic on
        some host is read by the rank the agreement names and given to the others; with none, the state one rank
        was built with is."""
        held = self.step_count if self._live else -1
        table = self._gather([held, int(self._pristine)])
        best = max(h for h, _ in table)
        found = self.manager.agree(device=self.rt.device) if best < 0 else None  # collective
        reached = max(best, found.step if found is not None else -1)
        if best >= 0:
            source, holders = FROM_PEER, [r for r, (h, _) in enumerate(table) if h == best]
        elif found is not None:
            source, holders = FROM_CHECKPOINT, [found.source]
            if self.rt.rank == found.source:
                self._restore(self.manager.load(found.step))
                self._pristine = False
        else:
            pristine = [r for r, (_, p) in enumerate(table) if p]
            if not pristine:
                raise TrainerError("no rank holds a training state (every one was lost in transfers) and there is no "
                                   "checkpoint: restart the job")
            source, holders = FROM_INITIAL, pristine[:1]
        receiving = self.rt.rank not in holders
        if receiving:
            self._live = self._pristine = False  # until the whole state is here, this rank holds no step's
        received, nbytes = transfer.share(self._capture(), holders, rank=self.rt.rank, world=self.rt.world_size,
                                          device=self.rt.device, fence=self.rt.fence)
        if receiving:
            self._restore(received)
        self._live = True
        origin = transfer.assign(holders, self.rt.world_size)[self.rt.rank] if receiving else self.rt.rank
        return source, origin, nbytes, reached

    def _gather(self, mine: list[int]) -> list[tuple[int, ...]]:
        """Every rank's `mine` (a few integers), in rank order."""
        if self.rt.world_size == 1:
            return [tuple(mine)]
        t = torch.tensor(mine, dtype=torch.int64, device=self.rt.device)
        every = [torch.empty_like(t) for _ in range(self.rt.world_size)]
        dist.all_gather(every, t)
        return [tuple(int(v) for v in x.tolist()) for x in every]

    def _drop_ddp(self) -> None:
        """Let go of the DDP wrapper of the broken group: its reducer holds that group and hooks the parameters,
        so it must be gone before the next one is built. Dropping the last reference frees it at once; a full
        gc.collect() (0.25-0.42 s in a process with a DataLoader, measured) runs only if something still holds it."""
        ddp, self._ddp = self._ddp, None
        inner, self._buckets.state = self._buckets.state, None
        if isinstance(inner, determinism.OrderedReducer):
            inner.close()  # its thread's exchanges on the broken group have failed or end now
        if ddp is None or ddp is self.module:
            return
        alive = weakref.ref(ddp)
        del ddp
        if alive() is not None:
            gc.collect()

    def _wrap(self) -> None:
        if self.rt.world_size == 1:
            self._ddp = self.module
            return
        # Every rank holds the same state (_agree_state): DDP's own broadcast of it at construction is not needed.
        ddp = nn.parallel.DistributedDataParallel(self.module, process_group=self.rt.group,
                                                  **{"init_sync": False, **self.ddp_args})
        if not self._wrapped:
            # The first DDP of a process imports torch._dynamo, whose import leaves cyclic garbage that refers to
            # the wrapper: collected now (young, ~1 ms) the wrapper is freed by _drop_ddp without a full collection.
            self._wrapped = True
            gc.collect(1)
        if self.deterministic:
            self._buckets.state, self._buckets.inner = determinism.OrderedReducer(self.rt.group, self.rt.fence), \
                determinism.ordered_allreduce_hook
        elif self.rt.cfg.pace:
            self._buckets.state, self._buckets.inner = self.rt.group, default_hooks.allreduce_hook
        if self.deterministic or self.rt.cfg.pace:
            ddp.register_comm_hook(self._buckets, _timed_hook)
        self._ddp = ddp
        self._step_began = None  # a new group: the time since the last step is a recovery, not this rank's work

    # -- state

    def _capture(self) -> dict[str, Any]:
        return {"step": self.step_count, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "extra": {name: obj.state_dict() for name, obj in self.extra.items()}}

    def _restore(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.extra.items():
            obj.load_state_dict(state["extra"][name])
        self.step_count = int(state["step"])

    def _save(self) -> None:
        """Checkpoint the current step (once), timing the stall for the goodput ledger and the interval."""
        if self._saved != self.step_count:
            began = time.monotonic()
            self.manager.save(self.step_count, self._capture(), stable=self._optimizer_storages())
            stalled = time.monotonic() - began + self._staging_wait
            self._staging_wait = 0.0
            self._saved = self.step_count
            self.rt.checkpoint_stalled(stalled)
            if self._chooser is not None:
                self._chooser.stalled(stalled)
            self._choose_interval()
            self._step_began = None  # the stall is not the next step's work

    def _optimizer_storages(self) -> frozenset[int]:
        """The storages only optimizer.step() changes (parameters, optimizer state): a checkpoint copies them while
        the next step's forward and backward run, and the optimizer waits for that copy (_before_optimizer_step)."""
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors += [v for per_param in self.optimizer.state.values() for v in per_param.values()
                    if isinstance(v, torch.Tensor)]
        return frozenset(t.untyped_storage().data_ptr() for t in tensors)

    def _checkpoint_due(self) -> bool:
        return self.step_count % self.ckpt_every == 0  # the interval every rank agreed on in this step

    def _choose_interval(self) -> None:
        """After a checkpoint: when the next is due, and what the heartbeats tell the scheduler about it."""
        if self._chooser is None:
            self.rt.publish_pace(ckpt_every=self.ckpt_every, ckpt_why=f"{self.ckpt_every} steps: fixed (ckpt_every)")
            return
        history = self.rt.fault_history()
        if history is not None:
            self._chooser.history(*history)
        self._chooser.update(self.rt.pace.summary().get("step_time"))  # proposed at the next step's agreement
        self._published = None  # the reason changed: publish the agreed interval with it

    # -- data and randomness

    def _next_batch(self) -> Any:
        at = self.position.where(self.step_count)
        again = self._replay.get(at)
        if again is not None:  # the step redone after a fault: its batch, and the iterator stays where it is
            self._seed("step", self.step_count + 1)
            return again[0]
        if self._batches is None or self._batches_at != at:
            self._batches = None  # a worker pool of the old iterator goes before the next one starts
            self._seed("epoch", at[0])  # the epoch's order and the workers' seeds, the same for a resumed epoch
            self._batches = self.position.iterate(*at)
        self._seed("step", self.step_count + 1)
        batch = next(self._batches)
        self._batches_at = (at[0], at[1] + 1)  # past the epoch's end this matches no step: a new iterator then
        self._replay.keep(at, batch)
        return batch

    def _seed(self, what: str, number: int) -> None:
        if self.seed is None:
            return
        value = _mix(self.seed, self.rt.rank, 0 if what == "step" else 1, number)
        torch.manual_seed(value)
        random.seed(value)
        np.random.seed(value % (1 << 32))

    def _end_for_restart(self, why: str) -> NoReturn:
        """Under torchrun or alone a peer is gone: the checkpoint in flight made durable, `why` on stderr, exit code 1
        at once, for the launcher to restart the world. os._exit, not SystemExit: the interpreter's teardown would
        destroy the broken gloo group, whose transport thread may then throw (std::terminate: SIGABRT instead of
        exit 1, seen in CI)."""
        try:
            self.manager.flush()
        except Exception as e:  # noqa: BLE001 - the restart resumes from the newest checkpoint that is whole
            print(f"rank {self.rt.rank}: the checkpoint in flight was not saved: {first_line(e)}", file=sys.stderr)
        print(why, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_PEER_LOST)

    # -- SIGTERM

    def _on_sigterm(self, _signum: int, _frame: Any) -> None:
        self._stop.set()
        if self._interrupt:
            self._interrupt = False
            raise Terminated(EXIT_TERMINATED)

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[None]:
        """While blocked forming a group or waiting for the scheduler's word there is nothing to agree with:
        SIGTERM (come already, or while blocked) raises Terminated at once; the caller leaves with `_last_words`."""
        if self._stop.is_set():
            raise Terminated(EXIT_TERMINATED)
        self._interrupt = True
        try:
            yield
        finally:
            self._interrupt = False

    def _agree_stop(self) -> bool | None:
        """Collective at the end of every step: did any rank get SIGTERM? None if not; else whether this rank
        is one that leaves (outside toolkit every rank does: the launcher restarts the world).

        The same collective agrees on the checkpoint interval: each rank proposes its own (with `ckpt_every="auto"`
        each measures its own stall) and all take the largest, so every rank checkpoints at the same steps (a
        replacement that starts at the lower bound takes the survivors' interval at its first step)."""
        mine = 1 if self._stop.is_set() else 0
        proposal = self._chooser.current.steps if self._chooser is not None else self.ckpt_every
        if self.rt.world_size > 1:
            flag = torch.tensor([mine, proposal], dtype=torch.int64, device=self.rt.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            anyone, self.ckpt_every = bool(flag[0].item()), int(flag[1].item())
        else:
            anyone, self.ckpt_every = bool(mine), proposal
        if self._chooser is not None and self.ckpt_every != self._published:
            self._published = self.ckpt_every
            own = self._chooser.current.why
            why = own if self.ckpt_every == proposal else (
                f"{self.ckpt_every} steps: the largest of the ranks' proposals (this rank's: {own})")
            self.rt.publish_pace(ckpt_every=self.ckpt_every, ckpt_why=why)
        if not anyone:
            return None
        return self.rt.mode != MODE_TOOLKIT or bool(mine)

    def _leave(self, leaving: bool) -> None:
        """A rank got SIGTERM by this step's agreement: every rank saves this step. Those that got it leave, and
        so does one whose own SIGTERM came during or after the agreement (when every rank is told to stop, the
        signals need not all land before the same boundary); the others go on and meet the replacements."""
        self._save()
        self.manager.flush()
        if leaving or self._stop.is_set():
            self._last_words()
        print(f"rank {self.rt.rank}: a peer stops by SIGTERM at step {self.step_count}, checkpoint saved; training "
              "goes on", flush=True)

    def _last_words(self) -> NoReturn:
        """Leave on SIGTERM: the state this rank holds saved (once: its share of the host's copy, whole when the
        host's other ranks saved the same step, as at an agreement) and durable, then Terminated (exit 143 under
        toolkit). Reached at a step boundary's agreement (`_leave`), or where no agreement can be had: the step
        failed because peers left (their last words were the step this rank saved when they agreed, or the one it
        holds), or the group is being re-formed. A rank that holds no state yet (a replacement still joining) has
        nothing to save."""
        if self._live:
            self._save()
            self.manager.flush()
            print(f"rank {self.rt.rank}: stopped by SIGTERM at step {self.step_count}, checkpoint saved", flush=True)
        else:
            print(f"rank {self.rt.rank}: stopped by SIGTERM before it held a training state: nothing to save",
                  flush=True)
        self.close()
        raise Terminated(EXIT_TERMINATED if self.rt.mode == MODE_TOOLKIT else 0)

    def _close(self) -> None:
        self._finished = True
        self._hook.remove()
        self._pre_hook.remove()
        self._drop_ddp()
        self._batches = None
        try:
            self.manager.close()
        finally:
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)


class _BucketClock:
    """DDP comm hook state: the inner hook to call (with its own state) and when this rank handed a step's last
    bucket to it."""

    def __init__(self) -> None:
        self.state: Any = None
        self.inner: Any = None
        self.last: float | None = None


def _timed_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects the annotations as strings
    """Note the time of the last bucket (this rank's backward is done: what follows is waiting for peers), then
    reduce as the inner hook does. Unannotated: this module's postponed annotations are strings, and DDP's
    ``register_comm_hook`` refuses a ``bucket`` annotation that is not ``dist.GradBucket`` itself."""
    if bucket.is_last():
        state.last = time.monotonic()
    return state.inner(state.state, bucket)


def _mix(*numbers: int) -> int:
    """A 63-bit seed from a few integers (splitmix64 steps): neighbouring steps and ranks get unrelated seeds."""
    x = 0x9E3779B97F4A7C15
    for n in numbers:
        x = (x ^ (n & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x >> 1


def _env_ckpt_dir() -> str:
    return os.environ.get("CKPT_DIR") or "ckpt"


def _manager(runtime: Runtime, ckpt_dir: str | Path | None, keep: int, async_ckpt: bool) -> CheckpointManager:
    """The rank's checkpoint manager: its host's copy under the root (ckpt_dir, else CKPT_DIR, else ./ckpt), its
    share from the environment (checkpoint.Placement), the job's key (from its token; this user's key without one).
    TrainerError, one line, for a layout or directory that cannot be used."""
    root = Path(ckpt_dir) if ckpt_dir is not None else Path(_env_ckpt_dir())
    try:
        placement = checkpoint.Placement.from_env(os.environ, world_size=runtime.world_size)
    except ValueError as e:
        raise TrainerError(f"checkpoint layout: {e}") from None
    key = ckptfile.job_key(runtime.cfg.token) if runtime.cfg.token else None
    try:
        return CheckpointManager(root, keep_max=keep, placement=placement, key=key, async_write=async_ckpt,
                                 on_commit=runtime.committed)
    except ValueError as e:
        raise TrainerError(str(e)) from None


def _check_loadable(state: dict[str, Any]) -> None:
    """Every value of the training state must load with torch.load(weights_only=True), the only way toolkit reads
    a state (from a peer after a fault, from a checkpoint): TrainerError naming the first that would not, now,
    instead of a failed recovery later."""
    found = checkpoint.first_unloadable(state)
    if found is None:
        return
    where, kind = found
    owner = {"model": "the model's state_dict()", "optimizer": "the optimizer's state_dict()"}.get(
        where[0], f"state[{where[1]!r}].state_dict()" if where[0] == "extra" and len(where) > 1 else "the state")
    inner = "".join(f"[{k!r}]" for k in where[2 if where[0] == "extra" else 1:])
    raise TrainerError(f"{owner} holds a {kind} at {inner or 'its top'}, which a safe load (torch.load with "
                       "weights_only=True) refuses: the state could not move to a replacement after a fault, nor be "
                       "resumed from a checkpoint; return a Python number (float(x), int(x)) or a tensor instead")


def _install_sigterm(handler: Any) -> Any:
    """Take SIGTERM where nobody else did (the default action), from the main thread only; returns what to put
    back, or None if the Trainer did not take it."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        print("toolkit.train.Trainer: SIGTERM already has a handler: no last-words checkpoint", file=sys.stderr,
              flush=True)
        return None
    return signal.signal(signal.SIGTERM, handler)
