"""The model a step calls: the user's module wrapped in a DistributedDataParallel of the current group (the module
itself in a world of one), built after each agreement on the state and dropped before the next group, with a comm
hook that times this rank's own work (the time until it handed its last gradient bucket to the allreduce, which names
a straggler) and, with `deterministic`, reduces in rank order (toolkit.train.determinism)."""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any, Mapping

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from toolkit.train import determinism
from toolkit.train.logicalgrad import LogicalGrad
from toolkit.train.newmemory import no_fill
from toolkit.train.runtime import Runtime
from toolkit.train.trainererror import TrainerError


class StepClock:
    """DDP comm hook state: the inner hook to call (with its own state) and when this rank handed a step's last
    bucket to it (`last`); and where this rank's work on the next step starts (`since`: the end of the previous
    step, None after a recovery or a checkpoint, whose time is not the step's work)."""

    def __init__(self) -> None:
        self.state: Any = None
        self.inner: Any = None
        self.last: float | None = None
        self.since: float | None = None

    def begin(self) -> float:
        """A step begins: where its work started (the end of the previous step, or now)."""
        self.last = None
        return self.since if self.since is not None else time.monotonic()

    def rest(self) -> None:
        """What comes before the next step (a recovery, a checkpoint's stall) is not its work."""
        self.since = None


class GroupModel:
    """The DDP wrapper of `module` for the current group (`current`, None between groups). `ddp_args`: the user's
    extra DistributedDataParallel arguments."""

    def __init__(self, module: nn.Module, ddp_args: Mapping[str, Any], deterministic: bool) -> None:
        self.module = module
        self.ddp_args = dict(ddp_args)
        self.deterministic = deterministic
        self.current: nn.Module | None = None
        self.logical: LogicalGrad | None = None  # a process serving several logical ranks: their gradients
        self.clock = StepClock()
        self._wrapped = False  # a DDP wrapper was built in this process

    def drop(self) -> None:
        """Let go of the DDP wrapper of the broken group: its reducer holds that group and hooks the parameters,
        so it must be gone before the next one is built. Dropping the last reference frees it at once; a full
        gc.collect() (0.25-0.42 s in a process with a DataLoader, measured) runs only if something still holds it.

        The gradients go too, so that every rank of the next group starts without: a replacement has none, and a
        survivor's are those of a step abandoned (partial, redone from its start) or complete (applied already);
        kept, the next backward of a script that clears them after its optimizer step would add to them, and the
        ranks would differ. (They may also be views of the old wrapper's buckets, which they would keep alive.)"""
        for p in self.module.parameters():
            p.grad = None
        self.logical = None
        ddp, self.current = self.current, None
        inner, self.clock.state = self.clock.state, None
        if isinstance(inner, determinism.OrderedReducer):
            inner.close()  # its thread's exchanges on the broken group have failed or end now
        if ddp is None or ddp is self.module:
            return
        alive = weakref.ref(ddp)
        del ddp
        if alive() is not None:
            gc.collect()

    def wrap(self, rt: Runtime) -> None:
        """Wrap the module for `rt`'s current group (every rank holds the same state already). Where a process
        serves several logical ranks (rt.assignment), no DDP: the module itself, and the logical ranks' gradients
        reduced by toolkit.train.logicalgrad. Where each serves one, DDP as ever, its rank-ordered reduction
        summing in the order of the logical ranks (the identity, unless a shrink and grow reordered them)."""
        if any(len(lrs) > 1 for lrs in rt.assignment):
            try:
                self.logical = LogicalGrad(self.module, rt.group, rt.rank, rt.logical_world, rt.assignment, rt.backend,
                                           broadcast_buffers=self.ddp_args.get("broadcast_buffers", True))
            except ValueError as e:
                raise TrainerError(str(e)) from None
            self.current = self.module
            self.clock.rest()
            return
        if rt.world_size == 1:
            self.current = self.module
            return
        with no_fill():  # its buckets are written whole before they are read (newmemory.no_fill)
            ddp = nn.parallel.DistributedDataParallel(self.module, process_group=rt.group,
                                                      **ddp_arguments(self.ddp_args, self.deterministic, rt.backend))
        if not self._wrapped:
            # The first DDP of a process imports torch._dynamo, whose import leaves cyclic garbage that refers to
            # the wrapper: collected now (young, ~1 ms) the wrapper is freed by drop() without a full collection.
            self._wrapped = True
            gc.collect(1)
        if self.deterministic:
            order = sorted(range(rt.world_size), key=lambda r: rt.assignment[r][0])
            self.clock.state, self.clock.inner = determinism.OrderedReducer(
                rt.group, rt.fence, None if order == list(range(rt.world_size)) else order), \
                determinism.ordered_allreduce_hook
        elif rt.cfg.pace:
            self.clock.state, self.clock.inner = rt.group, default_hooks.allreduce_hook
        if self.deterministic or rt.cfg.pace:
            ddp.register_comm_hook(self.clock, _timed_hook)
        self.current = ddp
        self.clock.rest()  # a new group: the time since the last step is a recovery, not this rank's work

    def reduce_logical(self, *_: Any) -> None:
        """The optimizer's pre-hook: in a process serving several logical ranks, the step's gradient is the mean of
        theirs, reduced in logical-rank order before the optimizer runs (toolkit.train.logicalgrad)."""
        if self.logical is not None:
            self.logical.reduce()

    def end_step(self, began: float) -> float | None:
        """A step that began at `began` ended now: the time this rank worked on it (until its last gradient bucket
        went to the allreduce; the whole step in a world of one), or None if not known. A process serving several
        logical ranks: the whole step over their number (its work per logical rank: serving two is not being slow,
        for the straggler detection)."""
        ended = time.monotonic()
        last = self.clock.last
        busy = ended - began if self.current is self.module else (
            last - began if last is not None and last >= began else None)
        if busy is not None and self.logical is not None:
            busy /= self.logical.lanes
        self.clock.since = ended
        return busy


def ddp_arguments(user: Mapping[str, Any], deterministic: bool, backend: str) -> dict[str, Any]:
    """The DistributedDataParallel arguments of a wrapper: the user's (`user`) over ours. Ours: no broadcast of the
    state at construction (every rank holds the same state already, agreement.py); for the rank-ordered reduction
    on gloo, buckets of determinism.GLOO_BUCKET_MB (each bucket costs that reduction a fixed exchange; see there)
    from the wrapper's first step, and gradients that are views of the buckets.

    Why from the first step: every recovery builds a new wrapper, and DDP's default puts all the gradients in one
    bucket for a wrapper's first backward (its order of readiness is not known yet), so the step redone after a
    fault would reduce nothing until its whole backward is done. A bucket size given as a list is used from the
    start, in the parameters' reverse order, then rebuilt in the order seen. DDP holds back its initial layout
    because a bucket launched early could meet another collective of the backward on another rank; the rank-ordered
    reduction's messages are tagged point-to-point messages of its own thread, which no collective can match.
    Why views: no copy of each gradient into its bucket and back each step, and no second set of gradient memory
    to fault in after a recovery. Measured at the 670 MB size (bench/recovery_at_size.py, docs/benchmarks.md): the
    step redone after a kill took 1.1-1.4 s where a step takes 0.75 s, 0.86-0.92 s with both; MTTR p50 1.82-1.88 s
    before, 1.43-1.51 s after."""
    ours: dict[str, Any] = {"init_sync": False}
    if deterministic and backend == "gloo":
        if "bucket_cap_mb" not in user and "bucket_cap_mb_list" not in user:
            ours["bucket_cap_mb_list"] = [determinism.GLOO_BUCKET_MB]
        ours["gradient_as_bucket_view"] = True
    return {**ours, **user}


def _timed_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects the annotations as strings
    """Note the time of the last bucket (this rank's backward is done: what follows is waiting for peers), then
    reduce as the inner hook does. Unannotated: this module's postponed annotations are strings, and DDP's
    ``register_comm_hook`` refuses a ``bucket`` annotation that is not ``dist.GradBucket`` itself."""
    if bucket.is_last():
        state.last = time.monotonic()
    return state.inner(state.state, bucket)
