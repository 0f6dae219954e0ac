"""This rank's shard of a sharded training state, and the agreement that recovers it in place (HSDP, zero loss).

`ShardState` is the one interface to a rank's shard (the other sharded parts use only it): `tensors()` the shard as
plain tensors (this rank's slices of the parameters, the optimizer state of those slices, the buffers, the
optimizer's hyperparameters and the extra state handed over: references to the live storage, not copies), `load(s)`
puts such a state back in place (a tensor already in its place is left alone: the transfer receives into the live
storage), `digest()` is toolkit.train.digest over `tensors()`.

`ShardedTrainingState` is the agreement of toolkit.train.agreement for shards. Each rank tells the step it holds,
whether its state is still the one it was built with, and whether its gradients for the next step are complete
(`StepCommit`); the plan (`plan_recovery`, pure) is per shard: the ranks of a shard's column at the newest step
give it to the others of the column (toolkit.train.transfer, point to point, several holders sharing the sending),
survivors keep theirs, nothing is recomputed.

Why the commit: ranks a step apart are fine for DDP (any survivor holds the whole state) but not for shards: if
shard 1's survivors had not applied a step that shard 0's ranks had, neither step would exist whole. So no rank
applies step k+1 before every rank's gradients for it are complete: an optimizer pre-hook runs a one-element
all-reduce over the world first (`StepCommit`). If it completed on any rank, every rank had complete gradients, and
a survivor whose own wait was cut short by the fault applies them during the recovery (`replay`): every shard
reaches k+1, bitwise as without the fault. The optimizer's hyperparameters and the extra state that the rest of
such a rank's step would have advanced (an LR scheduler) are then taken from a rank that ran the step whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import nn

from toolkit import atomicfile
from toolkit.contracts import envvars, protocol
from toolkit.train import log, transfer
from toolkit.train.agreement import FROM_CHECKPOINT, FROM_INITIAL, FROM_PEER, Agreed, Source, TrainingState
from toolkit.train.ckpt.shards import CheckpointError, ShardCheckpoints, tensors_in
from toolkit.train.faults import TrainerError
from toolkit.train.runtime import Runtime
from toolkit.train.shardcomm import Binding
from toolkit.train.shardmirror import ShardMirror
from toolkit.train.shardmodel import Layout
from toolkit.train.shardrollback import MirrorRollback

HYPER_SKIP = ("params",)  # what of a param group is not a hyperparameter


class ShardState:
    """This rank's shard of the training state (see the module docstring): `tensors`, `load`, `digest`."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, Any]) -> None:
        self.module = module
        self.optimizer = optimizer
        self.extra = extra

    def params(self) -> list[Any]:
        """The optimizer's parameters in its state_dict's index order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def tensors(self) -> dict[str, Any]:
        """The shard as plain tensors: {"model": {name: local slice}, "buffers": {name: tensor}, "optimizer":
        {"state": {index: {key: local slice or value}}, "param_groups": [hyperparameters]}, "extra": {...}}."""
        sd = self.optimizer.state_dict()
        return {"model": {name: _local(p) for name, p in self.module.named_parameters()},
                "buffers": dict(self.module.named_buffers()),
                "optimizer": {"state": {i: {k: _local(v) for k, v in per.items()} for i, per in sd["state"].items()},
                              "param_groups": [{k: v for k, v in g.items() if k not in HYPER_SKIP}
                                               for g in sd["param_groups"]]},
                "extra": {name: obj.state_dict() for name, obj in self.extra.items()}}

    def load(self, state: Mapping[str, Any]) -> None:
        """Put `state` (as `tensors` gives it, e.g. received from a peer) in place: parameter and buffer slices
        copied into the live storage unless they are it, the optimizer's state wrapped as the parameters' DTensors
        and loaded, the hyperparameters and the extra state loaded."""
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                _into(_local(p), state["model"][name])
            for name, b in self.module.named_buffers():
                _into(b, state["buffers"][name])
        params = self.params()
        sd = self.optimizer.state_dict()
        per_param = {int(i): {k: _like(v, params[int(i)]) for k, v in per.items()}
                     for i, per in state["optimizer"]["state"].items()}
        groups = [{**hyper, "params": g["params"]} for hyper, g in zip(state["optimizer"]["param_groups"],
                                                                       sd["param_groups"], strict=True)]
        self.optimizer.load_state_dict({"state": per_param, "param_groups": groups})
        for name, obj in self.extra.items():
            obj.load_state_dict(state["extra"][name])

    def load_replicated(self, state: Mapping[str, Any]) -> None:
        """Only what every rank holds alike: the optimizer's hyperparameters and the extra state."""
        for group, hyper in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in hyper.items() if k not in HYPER_SKIP})
        for name, obj in self.extra.items():
            obj.load_state_dict(state["extra"][name])

    def replicated(self) -> dict[str, Any]:
        tensors = self.tensors()
        return {"param_groups": tensors["optimizer"]["param_groups"], "extra": tensors["extra"]}


def _local(value: Any) -> Any:
    """A DTensor's local tensor (its live storage); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return value._local_tensor if isinstance(value, DTensor) else value


def _into(dest: torch.Tensor, src: torch.Tensor) -> None:
    if dest.data_ptr() != src.data_ptr() or dest.shape != src.shape:
        dest.copy_(src)


def _like(value: Any, param: Any) -> Any:
    """An optimizer state value received as a local tensor, as the DTensor its parameter is (same placement)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param._local_tensor.shape \
            and value.dim() > 0:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return value


class StepCommit:
    """The optimizer pre-hook that makes a step all-or-nothing across shards (module docstring). `ready`: this
    rank's gradients for the next step are complete (it reached the commit) and it has not applied them."""

    def __init__(self, rt: Runtime, optimizer: torch.optim.Optimizer) -> None:
        self.rt = rt
        self.ready = False
        self.replaying = False
        self._pre = optimizer.register_step_pre_hook(self._before)
        self._post = optimizer.register_step_post_hook(self._after)

    def _before(self, *_: Any) -> None:
        self.ready = True
        if self.replaying or self.rt.world_size == 1:
            return
        self.rt.fence.wait(dist.all_reduce(torch.zeros(1, device=self.rt.device), async_op=True),
                           "the commit of the step")

    def _after(self, *_: Any) -> None:
        self.ready = False

    def close(self) -> None:
        self._pre.remove()
        self._post.remove()


@dataclass(frozen=True)
class Plan:
    """What the ranks do: go on from `step`; `replay` apply their complete gradients first; per shard, the ranks
    that hold it at `step` (`holders`, lowest first) give it to the rest of its column; `stepped`: the ranks that
    ran the last step whole (whose replicated state the replaying ranks take); `kind`: FROM_PEER or FROM_INITIAL."""

    step: int
    replay: tuple[int, ...]
    holders: tuple[tuple[int, ...], ...]
    stepped: tuple[int, ...]
    kind: str


def plan_recovery(table: Sequence[tuple[int, int, int]], layout: Layout) -> Plan:
    """The plan from each rank's (held step or -1, 1 if its state is still the one it was built with, 1 if
    `StepCommit.ready`), in rank order. Pure. TrainerError when a shard exists nowhere (every rank of its column
    lost at once) or, with no state held anywhere, a rank lost its built state."""
    best = max(held for held, _, _ in table)
    if best < 0:
        holders = tuple(tuple(r for r in layout.column(s) if table[r][1])[:1] for s in range(layout.shards))
        _check_every_shard(holders, layout, "built")
        return Plan(-1, (), holders, (), FROM_INITIAL)
    replay = tuple(r for r, (held, _, ready) in enumerate(table) if held == best - 1 and ready)
    behind = [r for r, (held, _, ready) in enumerate(table) if 0 <= held < best and r not in replay]
    if behind:
        raise TrainerError(f"ranks {behind} hold steps before {best} without the gradients of the step after: the "
                           "step commit was not kept (a bug): restart the job")
    at = {r for r, (held, _, _) in enumerate(table) if held == best} | set(replay)
    holders = tuple(tuple(r for r in layout.column(s) if r in at) for s in range(layout.shards))
    _check_every_shard(holders, layout, f"at step {best}")
    stepped = tuple(r for r, (held, _, _) in enumerate(table) if held == best)
    return Plan(best, replay, holders, stepped, FROM_PEER)


def _check_every_shard(holders: Sequence[Sequence[int]], layout: Layout, what: str) -> None:
    lost = [s for s, h in enumerate(holders) if not h]
    if lost:
        ranks = [list(layout.column(s)) for s in lost]
        raise TrainerError(f"shard(s) {lost} {what} are held by no live rank (ranks {ranks} were all lost): with "
                           f"{layout.replicas} replica group(s) the state cannot be recovered in memory; restart the "
                           "job")


class ShardedTrainingState(TrainingState):
    """TrainingState for a sharded model (module docstring): the same fields and `agree`'s contract."""

    def __init__(self, rt: Runtime, module: nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, Any],
                 manager: ShardCheckpoints, layout: Layout, binding: Binding) -> None:
        super().__init__(rt, module, optimizer, extra, manager)
        self.layout = layout
        self.binding = binding
        self.shard = ShardState(module, optimizer, extra)
        self.commit = StepCommit(rt, optimizer)
        self.rollback: MirrorRollback | None = None  # pure FSDP's copies in memory (toolkit.train.shardrollback)

    def use_mirror(self, mirror: ShardMirror | None) -> None:
        """Recover a lost rank of the one replica group from `mirror` (None: no copies; such a loss is refused)."""
        self.rollback = MirrorRollback(self.rt, mirror, self.shard, self.commit) if mirror is not None else None

    def after_step(self, step: int) -> None:
        """At each step boundary (every rank alike): the mirror's refresh when due (the steps' mean time: for K)."""
        if self.rollback is not None and self.rollback.mirror.due(step):
            self.rollback.refresh(step, self.rt.pace.summary().get("step_time"))

    def capture(self, step: int) -> dict[str, Any]:
        return {"step": step, **self.shard.tensors()}

    def restore(self, state: dict[str, Any]) -> int:
        self.shard.load(state)
        return int(state["step"])

    def agree(self, step: int) -> Agreed:
        rt = self.rt
        self.binding.bind(rt)
        table = self._gather3([step if self.live else -1, int(self.pristine), int(self.commit.ready and self.live)])
        if all(held < 0 for held, _, _ in table):  # nobody holds a state: a whole-job (re)start
            resumed = self.from_checkpoint()
            if resumed is not None:
                return resumed
        if self.rollback is not None and self.rollback.applies(table):
            return self._agree_from_mirror(self.rollback, table)
        plan = plan_recovery(table, self.layout)
        if rt.rank in plan.replay:
            self._replay()
            step = plan.step
        column = self.layout.column(self.layout.shard_of(rt.rank))
        holders = plan.holders[self.layout.shard_of(rt.rank)]
        receiving = rt.rank not in holders
        if receiving:
            self.live = self.pristine = False
        received, nbytes = transfer.share(self.capture(step), holders, rank=rt.rank, world=rt.world_size,
                                          device=rt.device, fence=rt.fence, members=column)
        if receiving:
            step = self.restore(received)
        if plan.replay:
            self._share_replicated(plan)
        self.live = True
        self.commit.ready = False
        if rt.world_size > 1:
            rt.fence.wait(dist.all_reduce(torch.zeros(1, device=rt.device), async_op=True),
                          "the wait for every rank to hold its shard")
        senders = transfer.assign(holders, rt.world_size, members=column)
        origin = senders[rt.rank] if receiving else rt.rank
        every = tuple(r for h in plan.holders for r in h)
        if self.rollback is not None:
            self.rollback.regroup()
            self.rollback.refresh(max(step, plan.step))
        return Agreed(Source(plan.kind, every, plan.step), origin, nbytes, max(step, plan.step))

    def _agree_from_mirror(self, rollback: MirrorRollback, table: Sequence[tuple[int, int, int]]) -> Agreed:
        """Pure FSDP, a rank lost: every rank goes back to the mirror's newest common step (toolkit.train
        .shardrollback); a torn step's gradients are dropped with the rest of the steps since."""
        agreed, received = rollback.recover(table)
        self.live = True
        self.pristine = self.pristine and not received
        self.commit.ready = False
        return agreed

    def _replay(self) -> None:
        """Apply the gradients this rank completed before the fault cut its step short (module docstring)."""
        self.commit.replaying = True
        try:
            self.optimizer.step()
        finally:
            self.commit.replaying = False

    def _share_replicated(self, plan: Plan) -> None:
        """The hyperparameters and extra state of a rank that ran the last step whole, to every other rank."""
        rt = self.rt
        received, _ = transfer.share(self.shard.replicated(), plan.stepped, rank=rt.rank, world=rt.world_size,
                                     device=rt.device, fence=rt.fence)
        if rt.rank not in plan.stepped:
            self.shard.load_replicated(received)

    def _gather3(self, mine: list[int]) -> list[tuple[int, int, int]]:
        """Every rank's `mine` (three integers), in rank order."""
        if self.rt.world_size == 1:
            return [(mine[0], mine[1], mine[2])]
        t = torch.tensor(mine, dtype=torch.int64, device=self.rt.device)
        every = [torch.empty_like(t) for _ in range(self.rt.world_size)]
        self.rt.fence.wait(dist.all_gather(every, t, async_op=True), "the agreement on the newest shards")
        return [(int(a), int(b), int(c)) for a, b, c in (x.tolist() for x in every)]

    def close(self) -> None:
        self.commit.close()
        if self.rollback is not None:
            self.rollback.close()

    def checkpoint(self, step: int) -> dict[str, Any]:
        """The shard at `step` as a checkpoint holds it (toolkit.train.ckpt.shards records its digest itself)."""
        return self.capture(step)

    def from_checkpoint(self) -> Agreed | None:
        """Collective: every rank loads its own shard of the newest step every rank's checkpoints hold
        (toolkit.train.ckpt.shards: ShardCheckpoints.agree, then load); None when no rank holds one (a fresh
        start). A whole-job restart comes here, and any recovery in which every rank gives up the state it holds. A
        checkpoint this run cannot resume (another world size or mesh, no step common to every rank, a shard whose
        state does not match its recorded digest) ends the process with one line (`_refuse_restart`): no restart of
        it could go on."""
        rt = self.rt
        try:
            step = self.manager.agree(fence=rt.fence)
            if step is None:
                return None
            state = self.manager.load(step)
        except CheckpointError as e:
            _refuse_restart(f"rank {rt.rank}: {e}")
        nbytes = sum(t.nbytes for t in tensors_in(state))
        step = self.restore(state)
        self.live, self.pristine, self.commit.ready = True, False, False
        return Agreed(Source(FROM_CHECKPOINT, tuple(range(rt.world_size)), step), rt.rank, nbytes, step)


def _refuse_restart(line: str) -> NoReturn:
    """A sharded checkpoint this run cannot resume: `line` on stderr and as the error file's message (what the agent
    reports as the cause), then EXIT_FATAL, at once (os._exit: no traceback, and no teardown of a group whose peers
    leave too). Its agent gives up: a restart would refuse the same again."""
    log.line(line, sys.stderr)
    path = os.environ.get(envvars.TORCHELASTIC_ERROR_FILE)
    if path:
        with contextlib.suppress(OSError):  # the cause is extra: the status says the job cannot go on anyway
            atomicfile.write(Path(path), json.dumps({"message": line}).encode(), mode=0o600)
    sys.stdout.flush()
    os._exit(protocol.EXIT_FATAL)
