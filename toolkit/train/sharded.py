"""A sharded model (FSDP2's `fully_shard`, pure FSDP or HSDP) in the Trainer: the parts that replace the DDP
path's, composed in one place so that toolkit.train.trainer only asks `inspect` and calls `parts`.

- toolkit.train.shardmodel: what the sharding is (the mesh's layout) and the shardings refused, in one line each;
- toolkit.train.shardcomm: the mesh's groups rebuilt over each new default group, FSDP's iteration state reset after
  a fault, the reduce-scatter and the sum across replica groups in a fixed order;
- toolkit.train.shardstate: this rank's shard (`ShardState`: tensors / load / digest), the step commit, and the
  agreement that gives a lost rank its shard from the rank holding it in another replica group;
- toolkit.train.ckpt.shards: each rank's shard checkpointed (`checkpoints_for`), at the job's interval
  (toolkit.train.ckpt.schedule.Checkpointing, as for DDP: `ckpt_every`, fixed or "auto", last words on SIGTERM), and
  read back by a whole-job restart (ShardedTrainingState.from_checkpoint) on the same world and mesh; another world or
  mesh is refused in one line, the process ending with EXIT_FATAL (no restart can fix it);
- toolkit.train.shardrollback: for pure FSDP (one replica group), the copies of the shards in another host's memory
  (toolkit.train.shardmirror) and the recovery that goes back to them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from toolkit.contracts import ckptkey
from toolkit.train import log
from toolkit.train.ckpt import interval, schedule
from toolkit.train.ckpt.schedule import Checkpointing
from toolkit.train.ckpt.shards import CheckpointError, Manifest, ShardCheckpoints
from toolkit.train.faults import TrainerError
from toolkit.train.runtime import Runtime
from toolkit.train.shardcomm import Binding, ShardedGroup
from toolkit.train.shardmodel import Sharding, inspect
from toolkit.train.shardrollback import mirror_for
from toolkit.train.shardstate import ShardedTrainingState, ShardState

__all__ = ["ShardState", "checkpoints_for", "inspect", "parts"]


def checkpoints_for(rt: Runtime, sharding: Sharding, ckpt_dir: str | Path | None, keep: int,
                    async_ckpt: bool) -> ShardCheckpoints:
    """The rank's sharded checkpoints: under its host's directory of the checkpoint root (the DDP path's,
    toolkit.train.ckpt.schedule.where), cut for this world and the mesh the model is sharded on, each durable shard
    told to the scheduler. TrainerError, one line, for a directory that cannot be used."""
    root, placement, key = schedule.where(rt, ckpt_dir)
    manifest = Manifest(rt.world_size, tuple(int(n) for n in sharding.mesh.shape))
    try:
        key = key if key is not None else ckptkey.default_key(os.environ)
        return ShardCheckpoints(root, rt.rank, manifest, key=key, placement=placement, keep_max=keep,
                                async_write=async_ckpt, on_commit=rt.committed)
    except (ValueError, ckptkey.KeyFileError, CheckpointError) as e:
        raise TrainerError(str(e)) from None


def parts(rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, Any],
          manager: ShardCheckpoints, sharding: Sharding, deterministic: bool,
          chooser: interval.IntervalChooser | None, every: int, mirror_every: int | str = "auto"
          ) -> tuple[ShardedGroup, ShardedTrainingState, Checkpointing]:
    """The Trainer's group, state and checkpointing for `sharding`; for pure FSDP the copies of the shards in memory
    (toolkit.train.shardrollback), refreshed every `mirror_every` steps ("auto": K for at most 3% of the step time;
    0: none)."""
    binding = Binding(sharding, rt.group)
    group = ShardedGroup(model, sharding, binding, deterministic)
    state = ShardedTrainingState(rt, model, optimizer, extra, manager, sharding.layout, binding)
    ckpt = Checkpointing(rt, manager, optimizer, chooser, every, group.clock)
    layout = sharding.layout
    if rt.rank == 0:
        how = "the other replica groups" if layout.replicas > 1 else "the copies in memory below, if any"
        log.line(f"rank 0: a sharded model ({'HSDP' if layout.replicas > 1 else 'FSDP'}, {layout.replicas} replica "
                 f"group(s) of {layout.shards}): recovered in place from {how}; each rank checkpoints its shard in "
                 f"{manager.directory}")
    if layout.replicas == 1:
        state.use_mirror(mirror_for(rt, model, manager.placement.local_world, mirror_every))
    return group, state, ckpt
