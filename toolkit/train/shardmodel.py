"""What a model sharded with FSDP2 (`fully_shard`) looks like to the Trainer, and the shardings it refuses.

The Trainer recovers sharded state in place by knowing where every shard lives: on a mesh of R replica groups of S
ranks (HSDP: `init_device_mesh(type, (R, S), mesh_dim_names=("replicate", "shard"))`; pure FSDP: a 1-D mesh, R = 1)
built over the job's default group, rank r holds shard r % S of replica group r // S, so the ranks holding the same
shard are the column {s, S + s, 2S + s, ...} (`Layout`). A sharding it cannot map that way would be recovered wrong,
so it is refused at `Trainer(...)` with one line that says what is supported (`inspect`): a mesh of another shape or
over other ranks, several meshes, tensor parallelism (a parameter sharded over more than the data-parallel mesh),
CPU offload, parameters outside every `fully_shard`, or a Shard placement other than dim 0.

FSDP2's own objects are read here (its states and parameter groups): torch 2.13's layout, the pinned version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toolkit.train.faults import TrainerError

SUPPORTED = ("supported: fully_shard over a 1-D mesh of every rank (FSDP) or a 2-D (replicate, shard) mesh of every "
             "rank in rank order (HSDP: init_device_mesh(device, (R, S), mesh_dim_names=(\"replicate\", \"shard\"))), "
             "every parameter under fully_shard, sharded on dim 0, no tensor parallelism, no CPU offload")


@dataclass(frozen=True)
class Layout:
    """R replica groups (`replicas`) of S ranks (`shards`): rank r holds shard r % S of replica group r // S."""

    replicas: int
    shards: int

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    def shard_of(self, rank: int) -> int:
        return rank % self.shards

    def replica_of(self, rank: int) -> int:
        return rank // self.shards

    def column(self, shard: int) -> tuple[int, ...]:
        """The ranks holding `shard`, one per replica group, in replica order."""
        return tuple(r * self.shards + shard for r in range(self.replicas))


@dataclass(frozen=True)
class Sharding:
    """A sharded model as the Trainer holds it: its layout, the mesh its parameters live on, and its FSDP states
    (`roots`: the FSDP modules first called in a forward, whose iteration state is reset after a fault)."""

    layout: Layout
    mesh: Any
    roots: tuple[nn.Module, ...]
    groups: tuple[Any, ...]  # every FSDPParamGroup


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` on which `fully_shard` was called (outermost first)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def inspect(model: nn.Module, world_size: int) -> Sharding | None:
    """None for a model no `fully_shard` touched (the DDP path); its Sharding if the Trainer can recover it;
    TrainerError, one line naming what is wrong and what is supported, otherwise."""
    modules = fsdp_modules(model)
    if not modules:
        _refuse_stray_dtensors(model)
        return None
    if modules[0] is not model:
        raise TrainerError(f"fully_shard was called on {type(modules[0]).__name__} inside the model but not on the "
                           f"model itself: call fully_shard(model, mesh=...) last, on the root ({SUPPORTED})")
    groups, meshes = [], []
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            _check_group(group)
            groups.append(group)
            if all(group.mesh_info.mesh is not m for m in meshes):
                meshes.append(group.mesh_info.mesh)
    if len(meshes) != 1:
        raise TrainerError(f"the model's fully_shard calls use {len(meshes)} different meshes: use one mesh for "
                           f"every fully_shard call ({SUPPORTED})")
    (mesh,) = meshes
    _check_parameters(model, mesh)
    layout = _layout(mesh, world_size)
    return Sharding(layout, mesh, (model,), tuple(groups))


def _check_group(group: Any) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    if isinstance(group.offload_policy, CPUOffloadPolicy):
        raise TrainerError(f"fully_shard(..., offload_policy=CPUOffloadPolicy()): CPU offload is not supported; "
                           f"drop the offload policy ({SUPPORTED})")
    info = group.mesh_info
    if getattr(info, "is_spmd_mesh", False) or not isinstance(info, FSDPMeshInfo):
        raise TrainerError(f"fully_shard over a mesh with dimensions beyond data parallelism (tensor parallelism, "
                           f"or a replicate-only mesh) is not supported ({SUPPORTED})")
    if isinstance(info, HSDPMeshInfo) != (info.mesh.ndim == 2) or info.mesh.ndim > 2:
        raise TrainerError(f"a {info.mesh.ndim}-D mesh is not one the Trainer knows ({SUPPORTED})")
    if isinstance(info, HSDPMeshInfo) and (info.replicate_mesh_dim, info.shard_mesh_dim) != (0, 1):
        raise TrainerError(f"an HSDP mesh whose replicate dimension is not the first is not supported ({SUPPORTED})")
    if group.post_forward_mesh_info is not None and group.post_forward_mesh_info.mesh is not info.mesh:
        raise TrainerError(f"fully_shard(..., reshard_after_forward=<int>) reshards onto a second mesh: not "
                           f"supported; use True or False ({SUPPORTED})")


def _layout(mesh: Any, world_size: int) -> Layout:
    """The mesh must be every rank in rank order, rows the replica groups (the default group's ranks, so that a
    replacement takes the place its rank had)."""
    if mesh._get_root_mesh() is not mesh:
        raise TrainerError(f"fully_shard's mesh is a slice of a {mesh._get_root_mesh().ndim}-D mesh: the Trainer "
                           f"rebuilds the mesh it knows after a fault, not slices of others ({SUPPORTED})")
    ranks = mesh.mesh
    if mesh.device_type not in ("cpu", "cuda"):
        raise TrainerError(f"a mesh on {mesh.device_type!r} is not supported ({SUPPORTED})")
    if ranks.numel() != world_size or not torch.equal(ranks.flatten().cpu(), torch.arange(world_size)):
        raise TrainerError(f"the mesh holds ranks {ranks.flatten().tolist()[:8]} of a world of {world_size}: the "
                           f"Trainer knows a mesh of every rank in order ({SUPPORTED})")
    if ranks.ndim == 1:
        return Layout(1, world_size)
    return Layout(int(ranks.shape[0]), int(ranks.shape[1]))


def _check_parameters(model: nn.Module, mesh: Any) -> None:
    """Every parameter a DTensor on the FSDP mesh, sharded on dim 0 over the shard dimension."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    want = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise TrainerError(f"parameter {name} is not under any fully_shard (its gradient would reach no other "
                               f"rank): call fully_shard on the root module too ({SUPPORTED})")
        if p.device_mesh is not mesh:
            raise TrainerError(f"parameter {name} lives on a mesh of {p.device_mesh.ndim} dimension(s) other than "
                               f"fully_shard's: tensor parallelism is not supported ({SUPPORTED})")
        if tuple(p.placements) != want:
            raise TrainerError(f"parameter {name} is placed {tuple(p.placements)}: only {want} is supported "
                               f"({SUPPORTED})")


def _refuse_stray_dtensors(model: nn.Module) -> None:
    """A model with DTensor parameters but no fully_shard (tensor parallelism alone) is no DDP model either."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise TrainerError(f"parameter {name} is a DTensor but no fully_shard was called: tensor parallelism is "
                               f"not supported ({SUPPORTED})")
