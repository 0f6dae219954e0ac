"""A sharded model (FSDP2's `fully_shard`, pure FSDP or HSDP) in the Trainer: the parts that replace the DDP
path's, composed in one place so that toolkit.train.trainer only asks `inspect` and calls `parts`.

- toolkit.train.shardmodel: what the sharding is (the mesh's layout) and the shardings refused, in one line each;
- toolkit.train.shardcomm: the mesh's groups rebuilt over each new default group, FSDP's iteration state reset after
  a fault, the reduce-scatter and the sum across replica groups in a fixed order;
- toolkit.train.shardstate: this rank's shard (`ShardState`: tensors / load / digest), the step commit, and the
  agreement that gives a lost rank its shard from the rank holding it in another replica group;
- toolkit.train.shardrollback: for pure FSDP (one replica group), the copies of the shards in another host's memory
  (toolkit.train.shardmirror) and the recovery that goes back to them.

Checkpoints of sharded state are not written by this part (`InMemoryOnly`): it says so once at the start, and a
whole-job restart starts from the initial state.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from toolkit.train import log
from toolkit.train.ckpt import interval
from toolkit.train.ckpt.manager import CheckpointManager
from toolkit.train.ckpt.schedule import Checkpointing
from toolkit.train.runtime import Runtime
from toolkit.train.shardcomm import Binding, ShardedGroup
from toolkit.train.shardmodel import Sharding, inspect
from toolkit.train.shardrollback import mirror_for
from toolkit.train.shardstate import ShardedTrainingState, ShardState

__all__ = ["InMemoryOnly", "ShardState", "inspect", "parts"]


class InMemoryOnly(Checkpointing):
    """No checkpoint of a sharded state is written: each rank's shard differs, and the host copy the DDP path
    shares between a host's ranks holds one replicated state."""

    def due(self, step: int) -> bool:
        return False

    def save(self, step: int, capture: Any) -> None:
        return None


def parts(rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, Any],
          manager: CheckpointManager, sharding: Sharding, deterministic: bool,
          chooser: interval.IntervalChooser | None, every: int, mirror_every: int | str = "auto"
          ) -> tuple[ShardedGroup, ShardedTrainingState, Checkpointing]:
    """The Trainer's group, state and checkpointing for `sharding`; for pure FSDP the copies of the shards in memory
    (toolkit.train.shardrollback), refreshed every `mirror_every` steps ("auto": K for at most 3% of the step time;
    0: none)."""
    binding = Binding(sharding, rt.group)
    group = ShardedGroup(model, sharding, binding, deterministic)
    state = ShardedTrainingState(rt, model, optimizer, extra, manager, sharding.layout, binding)
    ckpt = InMemoryOnly(rt, manager, optimizer, chooser, every, group.clock)
    layout = sharding.layout
    if rt.rank == 0:
        how = "the other replica groups" if layout.replicas > 1 else "the copies in memory below, if any"
        log.line(f"rank 0: a sharded model ({'HSDP' if layout.replicas > 1 else 'FSDP'}, {layout.replicas} replica "
                 f"group(s) of {layout.shards}): recovered in place from {how}; no checkpoints are written")
    if layout.replicas == 1:
        state.use_mirror(mirror_for(rt, model, manager.placement.local_world, mirror_every))
    return group, state, ckpt
