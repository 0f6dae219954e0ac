"""Which training state every rank goes on from after the group is (re-)formed, and giving it to the ranks that need it.

The decision is a pure function (`choose_source`) of what each rank tells: the step it holds in memory (-1 for
none) and whether its state is still the one it was built with, plus, only when no rank holds a state, the newest
checkpoint complete and authentic on some host. The ranks at the newest step held in memory give it (a fault
inside a collective can leave ranks a step apart: a rank whose optimizer step ran had completed its allreduce, so
its state is the next step's); only when nobody holds a state (a whole-job start) does a checkpoint serve; with
none, the state one rank was built with is. `TrainingState` holds what is agreed on (the model, the optimizer, the
extra state handed over), captures and restores it, and runs the agreement: the gather, the checkpoint agreement
(toolkit.train.ckpt.manager), the transfer (toolkit.train.transfer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from toolkit.train import transfer
from toolkit.train.ckpt.manager import CheckpointManager
from toolkit.train.digest import Digester
from toolkit.train.faults import TrainerError
from toolkit.train.runtime import Runtime

FROM_PEER, FROM_CHECKPOINT, FROM_INITIAL = "peer", "checkpoint", "initial"
DIGEST = "digest"  # a checkpoint's entry: the digest (toolkit.train.digest) of the rest of it, taken at the save


@dataclass(frozen=True)
class Source:
    """Where the state every rank goes on from comes from: `kind` (FROM_*), the ranks that give it (`holders`,
    lowest first: every other rank receives it), and the newest step any rank had reached (`reached`: held in
    memory, or on disk when nobody held a state; -1 for none)."""

    kind: str
    holders: tuple[int, ...]
    reached: int

    @property
    def rank(self) -> int:
        """The rank whose state wins: the lowest of the holders."""
        return self.holders[0]


def choose_source(table: Sequence[tuple[int, int]], checkpoint: tuple[int, int] | None = None) -> Source:
    """The state to go on from. `table`: per rank, in rank order, (the step it holds in memory or -1, 1 if its state
    is still the one it was built with else 0); `checkpoint`: (step, rank that reads it) of the newest checkpoint
    agreed on, None if there is none (it is only asked for when no rank holds a state, and ignored when one does).
    The ranks at the highest held step win; a checkpoint only when nobody holds a state; the first rank still holding
    its initial state when neither. TrainerError when there is nothing at all (every state was lost in transfers
    and there is no checkpoint): only a restart helps then."""
    best = max((held for held, _ in table), default=-1)
    if best >= 0:
        return Source(FROM_PEER, tuple(r for r, (held, _) in enumerate(table) if held == best), best)
    if checkpoint is not None:
        step, rank = checkpoint
        return Source(FROM_CHECKPOINT, (rank,), step)
    pristine = [r for r, (_, initial) in enumerate(table) if initial]
    if not pristine:
        raise TrainerError("no rank holds a training state (every one was lost in transfers) and there is no "
                           "checkpoint: restart the job")
    return Source(FROM_INITIAL, (pristine[0],), -1)


def recomputed_steps(source: Source, step: int) -> int:
    """The steps to do again after going on from `step`: only a survivor's memory tells how far the job had got; a
    restart from a checkpoint leaves it to the scheduler, which heard every rank's step (-1: not known here)."""
    if source.kind == FROM_PEER:
        return max(0, source.reached - step)
    return -1 if source.kind == FROM_CHECKPOINT else 0


@dataclass(frozen=True)
class Agreed:
    """This rank's end of an agreement: where the state came from, the rank this rank's own copy came from, the
    bytes it moved, and the step it now holds."""

    source: Source
    origin: int
    nbytes: int
    step: int


class TrainingState:
    """The state the ranks agree on: `module`, `optimizer` and the `extra` objects (state_dict/load_state_dict),
    with `live` (this process holds a training state of its own: it has trained or received one) and `pristine`
    (the state is still the one the user built: no transfer was received into it)."""

    def __init__(self, rt: Runtime, module: nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, Any],
                 manager: CheckpointManager) -> None:
        self.rt = rt
        self.module = module
        self.optimizer = optimizer
        self.extra = extra
        self.manager = manager
        self.live = False
        self.pristine = True

    def after_step(self, step: int) -> None:
        """At each step boundary every rank reaches alike: nothing to do here (a sharded state refreshes its copies
        in memory: toolkit.train.shardstate)."""

    def capture(self, step: int) -> dict[str, Any]:
        """The state at `step`, as a checkpoint and a transfer carry it (references, not copies)."""
        return {"step": step, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "extra": {name: obj.state_dict() for name, obj in self.extra.items()}}

    def checkpoint(self, step: int) -> dict[str, Any]:
        """The state at `step` as a checkpoint holds it: `capture`, and the digest of it (DIGEST), which a restore
        checks (`verified_load`): what was written is what the ranks held, whatever happened to it in between (a
        host copy staged in memory that failed, a bug) that the file's authentication, computed later, cannot see."""
        state = self.capture(step)
        return {**state, DIGEST: Digester().state(state)}

    def restore(self, state: dict[str, Any]) -> int:
        """Load a captured state into the user's objects; returns its step."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.extra.items():
            obj.load_state_dict(state["extra"][name])
        return int(state["step"])

    def agree(self, step: int) -> Agreed:
        """Collective: agree on the source (`choose_source`) and give its state to every rank not holding it;
        returns once every rank holds it. `step`: the step this rank holds (meaningful when `live`)."""
        table = self._gather([step if self.live else -1, int(self.pristine)])
        found = None
        if all(held < 0 for held, _ in table):  # collective
            found = self.manager.agree(device=self.rt.device, fence=self.rt.fence)
        source = choose_source(table, None if found is None else (found.step, found.source))
        if source.kind == FROM_CHECKPOINT and self.rt.rank == source.rank:
            step = self.restore(verified_load(self.manager, source.reached))
            self.pristine = False
        receiving = self.rt.rank not in source.holders
        if receiving:
            self.live = self.pristine = False  # until the whole state is here, this rank holds no step's
        received, nbytes = transfer.share(self.capture(step), source.holders, rank=self.rt.rank,
                                          world=self.rt.world_size, device=self.rt.device, fence=self.rt.fence)
        if receiving:
            step = self.restore(received)
        self.live = True
        senders = transfer.assign(source.holders, self.rt.world_size)
        if senders:
            # Nobody starts the next step before every rank holds the state: a rank that did would only wait in its
            # first collective, and meanwhile take its host's CPU and memory bandwidth from the transfer (3 ranks on
            # 2 cores, bench/transformer.py: kill to every rank resumed 0.91-0.98 s without this, 0.78-0.92 s with).
            self.rt.fence.wait(dist.all_reduce(torch.zeros(1, device=self.rt.device), async_op=True),
                               "the wait for every rank to hold the state")
        origin = senders[self.rt.rank] if receiving else self.rt.rank
        return Agreed(source, origin, nbytes, step)

    def _gather(self, mine: list[int]) -> list[tuple[int, int]]:
        """Every rank's `mine` (two integers), in rank order."""
        if self.rt.world_size == 1:
            return [(mine[0], mine[1])]
        t = torch.tensor(mine, dtype=torch.int64, device=self.rt.device)
        every = [torch.empty_like(t) for _ in range(self.rt.world_size)]
        self.rt.fence.wait(dist.all_gather(every, t, async_op=True), "the agreement on the newest state")
        return [(int(held), int(initial)) for held, initial in (x.tolist() for x in every)]


def verified_load(manager: CheckpointManager, step: int) -> dict[str, Any]:
    """The checkpoint of `step`, its state checked against the digest recorded at the save (a checkpoint without
    one, written before digests were recorded, is taken as it is). TrainerError, one line naming the copy, when they
    differ: the state changed between the save's digest and the file."""
    state = dict(manager.load(step))
    recorded = state.pop(DIGEST, None)
    if recorded is not None and Digester().state(state) != recorded:
        raise TrainerError(f"checkpoint of step {step} in {manager.directory}: its state does not match the digest "
                           "recorded when it was saved (it changed in memory before it was written): refused; move "
                           "its files aside to resume from the previous checkpoint")
    return state
