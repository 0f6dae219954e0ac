"""The groups a sharded model's collectives run on, and its gradient reduction in a fixed order.

Why: after a fault the job's default group is a new one (toolkit.train.runtime.reform), and every group of the
mesh the script built died with the old one; FSDP2 keeps the mesh (its parameters are DTensors on it) and the groups
it took from it. `Binding.bind` builds the mesh's groups again over the new default group and points the mesh and
FSDP's mesh infos at them, so the script's model goes on as it was; the sockets the build opens are given to the
group's fence (toolkit.train.fence), so that a fault abandons them too.

The reduction (`OrderedReduction`): FSDP2 reduce-scatters each parameter group's gradients within a replica group,
then (HSDP) all-reduces the result across replica groups. Both are replaced here by the same arithmetic on every
rank whatever the transport's algorithm: rank i of a group receives every member's copy of its slice and sums them
in member order, (HSDP) the replica groups' sums are then summed in replica order by the same scheme, and FSDP
divides by the world once (force_sum_reduction_for_comms, gradient_divide_factor). A run resumed in place after a
fault then computes bitwise what the uninterrupted run computed. Messages are point-to-point on the default group,
waited on through the fence (a receive gloo would never wake ends at the trip).

FSDP's own collectives (`FencedComms`): its all-gather, and with torch's own reduction its reduce-scatter, are
waited on through the fence too, and the mesh's groups get the job's collective timeout: a collective a rank enters
after a fault ends at once instead of at a group timeout of 30 minutes.

`ShardedGroup` is the Trainer's view of all this (the counterpart of toolkit.train.ddpmodel.GroupModel): `drop`
resets FSDP's iteration state after a fault (a forward or backward cut short leaves parameters unsharded and
reductions half done), `wrap` binds the groups of the new generation and clears the gradients.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from toolkit.train import fence as fence_mod
from toolkit.train.ddpmodel import StepClock
from toolkit.train.runtime import Runtime
from toolkit.train.shardmodel import Layout, Sharding

TAG_SCATTER, TAG_REPLICAS, TAG_GATHER = 101, 102, 103  # the reduction's messages (the transfer uses 0..N)


class Binding:
    """The sharded model's mesh, bound to the current default group (`bind`, once per group).

    The script built the mesh over the default group of its first generation (`bound`), and a replacement's script
    does so in the generation it joins: groups the fence does not know (their sockets opened before the Trainer
    existed). So every rank builds them again under the fence at its first agreement in a group; a survivor, whose
    script built nothing in the new group, first builds the mesh once more to meet the replacement's script build
    (the same sequence of builds on the same fresh group counter: destroying the default group resets it)."""

    def __init__(self, sharding: Sharding, bound: Any) -> None:
        self.sharding = sharding
        self._bound = bound  # the default group the mesh's groups were built over
        self._fenced: Any = None  # the default group over which they were built under the fence

    def bind(self, rt: Runtime) -> bool:
        """Collective (every rank, the same moment of the agreement): build the mesh's groups over the current
        default group unless they are built already; True if they were built now."""
        if rt.world_size == 1 or self._fenced is rt.group:
            return False
        from torch.distributed.device_mesh import init_device_mesh

        mesh = self.sharding.mesh
        if self._bound is not rt.group:  # the build a replacement's script did in this generation, met
            init_device_mesh(mesh.device_type, tuple(mesh.mesh.shape), mesh_dim_names=mesh.mesh_dim_names)
        before = fence_mod.tcp_sockets()
        fresh = init_device_mesh(mesh.device_type, tuple(mesh.mesh.shape), mesh_dim_names=mesh.mesh_dim_names)
        rt.fence.add_sockets(fence_mod.opened_since(before))
        for group in fresh.get_all_groups():
            # the job's collective timeout, as the default group's (torch gives a new group its own 30 min)
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=rt.timeout), group)
            if rt.backend == "nccl":
                rt.fence.add_group(group)
        mesh._dim_group_names = fresh._dim_group_names
        mesh._pg_registry = fresh._pg_registry
        mesh._flatten_mapping = {}
        infos = {id(i): i for g in self.sharding.groups for i in (g.mesh_info, g.post_forward_mesh_info)
                 if i is not None}
        infos.update({id(p.mesh_info): p.mesh_info for g in self.sharding.groups for p in g.fsdp_params})
        for info in infos.values():
            info.__post_init__()  # the groups it took from the mesh, taken again
        self._bound = self._fenced = rt.group
        return True


class OrderedReduction:
    """FSDP2's ReduceScatter (its custom-comm interface) summing in member order, plus (HSDP) the sum across
    replica groups in replica order as the all-reduce hook. `install` puts it on every parameter group."""

    def __init__(self, layout: Layout, rt: Runtime) -> None:
        self.layout = layout
        self.rt = rt

    def install(self, sharding: Sharding) -> None:
        """Every parameter group reduces through this object; HSDP's own all-reduce is turned off (the group is
        given a shard-only mesh info, so FSDP calls the hook where it would all-reduce)."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

        for group in sharding.groups:
            if isinstance(group.mesh_info, HSDPMeshInfo):
                group.mesh_info = FSDPMeshInfo(mesh=group.mesh_info.mesh, shard_mesh_dim=1)
            group._reduce_scatter_comm = _ReduceScatter(self)
            group._all_reduce_hook = self.across_replicas if self.layout.replicas > 1 else None
            group.force_sum_reduction_for_comms = True
            group.gradient_divide_factor = float(self.layout.world)

    def across_replicas(self, shard_sum: torch.Tensor) -> None:
        """The replica groups' sums of this rank's shard, summed in replica order, in place."""
        rank = self.rt.rank
        column = self.layout.column(self.layout.shard_of(rank))
        self._run(lambda: _ordered_allreduce(shard_sum, column, column.index(rank)), "the sum across replicas")

    def scatter(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
        members = dist.get_process_group_ranks(group)
        me = members.index(self.rt.rank)
        self._run(lambda: _ordered_reduce_scatter(output, input, members, me), "the reduce-scatter")

    def _run(self, fn: Any, what: str) -> None:
        if self.rt.device.type != "cpu":
            fn()
        else:
            self.rt.fence.call(fn, what)


class FencedComms:
    """FSDP2's own collectives (its all-gather; with torch's own reduction, its reduce-scatter) issued as they are
    but waited on through the fence, so that a fault ends them at once. Why: gloo ends a collective on a connection
    the fence shut down only if the collective was already waiting on it; one a rank enters after the trip (its
    forward reached the next parameter group's all-gather) waited for the group's whole timeout, and its peers for
    it (found with 30 random-moment kills of bench/hsdp_recovery.py: a rank in FSDP's all-gather, every connection of
    its group closed). Through the fence, a collective entered after the trip raises Abandoned before it waits.
    NCCL's are aborted with the group (the fence's add_group): left as they are."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def install(self, sharding: Sharding, reduce_scatter: bool) -> None:
        """On every parameter group: the all-gather, and with `reduce_scatter` the reduce-scatter too (the
        rank-ordered one is fenced already)."""
        if self.rt.device.type != "cpu":
            return
        for group in sharding.groups:
            group._all_gather_comm = _AllGather(self.rt)
            if reduce_scatter:
                group._reduce_scatter_comm = _PlainReduceScatter(self.rt)


def _comm_base(kind: str) -> type:
    """FSDP2's custom-comm interface `kind` ("AllGather", "ReduceScatter") with torch's own allocation of its
    buffers (DefaultAllocMixin, what FSDP's default comms use)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_api
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

    return type(f"_{kind}Base", (DefaultAllocMixin, getattr(_fsdp_api, kind)), {})


class _AllGather(_comm_base("AllGather")):  # type: ignore[misc]
    """FSDP2's all-gather, waited on through the fence (FencedComms); always complete when it returns."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)
        self.rt.fence.wait(work, "the all-gather", group)


class _ReduceScatter(_comm_base("ReduceScatter")):  # type: ignore[misc]
    """FSDP2's custom reduce-scatter: OrderedReduction.scatter (SUM: the division is FSDP's)."""

    def __init__(self, owner: OrderedReduction) -> None:
        self.owner = owner

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.RedOpType.SUM):
            raise RuntimeError(f"the rank-ordered reduce-scatter sums; FSDP asked for {op}")
        self.owner.scatter(output_tensor, input_tensor, group)


class _PlainReduceScatter(_comm_base("ReduceScatter")):  # type: ignore[misc]
    """torch's own reduce-scatter (its algorithm, its order), waited on through the fence (FencedComms)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        # through a helper thread: gloo's reduce-scatter work has no future for the fence to wait on
        self.rt.fence.call(lambda: dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group),
                           "the reduce-scatter")


def _ordered_reduce_scatter(output: torch.Tensor, input: torch.Tensor, members: list[int], me: int) -> None:
    """output = sum over members m, in order, of member m's input slice `me` (equal slices, one per member)."""
    n = len(members)
    size = output.numel()
    slices = [input[i * size:(i + 1) * size] for i in range(n)]
    received = [torch.empty_like(output) for _ in range(n - 1)]
    parts = [slices[me] if i == me else received[i if i < me else i - 1] for i in range(n)]
    ops = [dist.P2POp(op, t, members[i], tag=TAG_SCATTER) for i in range(n) if i != me
           for op, t in ((dist.irecv, parts[i]), (dist.isend, slices[i]))]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    _sum_in_order(parts, output)


def _ordered_allreduce(buf: torch.Tensor, members: tuple[int, ...], me: int) -> None:
    """buf = sum over members, in order, of their buf: each member sums one slice (in order) and sends it to all."""
    n = len(members)
    flat = buf.view(-1)
    bounds = [flat.numel() * i // n for i in range(n + 1)]
    slices = [flat[bounds[i]:bounds[i + 1]] for i in range(n)]
    mine = slices[me]
    received = [torch.empty_like(mine) for _ in range(n - 1)]
    parts = [mine if i == me else received[i if i < me else i - 1] for i in range(n)]
    peers = [i for i in range(n) if i != me]
    ops = [dist.P2POp(op, t, members[i], tag=TAG_REPLICAS) for i in peers
           for op, t in ((dist.irecv, parts[i]), (dist.isend, slices[i]))]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    total = torch.empty_like(mine)
    _sum_in_order(parts, total)
    mine.copy_(total)
    ops = [dist.P2POp(op, t, members[i], tag=TAG_GATHER) for i in peers
           for op, t in ((dist.irecv, slices[i]), (dist.isend, mine))]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _sum_in_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


class ShardedGroup:
    """The Trainer's model for a sharded module (what ddpmodel.GroupModel is for DDP): the module itself, its
    mesh bound to the current group, its reduction rank-ordered (with `deterministic`)."""

    def __init__(self, module: nn.Module, sharding: Sharding, binding: Binding, deterministic: bool) -> None:
        self.module = module
        self.sharding = sharding
        self.binding = binding
        self.deterministic = deterministic
        self.current: nn.Module | None = None
        self.clock = StepClock()
        self._installed = False
        self.logical = None  # a sharded model is served one logical rank per process (the Trainer refuses more)

    def reduce_logical(self, *_: Any) -> None:
        """The optimizer's pre-hook the Trainer installs for several logical ranks per process: nothing to do here
        (FSDP's own reduce-scatter, rank-ordered, is the step's reduction)."""

    def drop(self) -> None:
        """After a fault (or before the first group): FSDP's iteration state reset (parameters resharded,
        half-done reductions discarded). The gradients stay: a rank whose step was cut short after its gradients
        were complete may still apply them (toolkit.train.shardstate)."""
        self.current = None
        for root in self.sharding.roots:
            if hasattr(root._get_fsdp_state()._comm_ctx, "all_gather_state"):  # set by FSDP's first forward
                root.reset_iter_state()

    def wrap(self, rt: Runtime) -> None:
        """The groups of `rt`'s current generation bound (every rank holds the agreed state already), the
        gradients cleared (a replacement has none; a survivor's belong to a step applied or abandoned)."""
        self.binding.bind(rt)
        if not self._installed and rt.world_size > 1:
            FencedComms(rt).install(self.sharding, reduce_scatter=not self.deterministic)
            if self.deterministic:
                OrderedReduction(self.sharding.layout, rt).install(self.sharding)
            self._installed = True
        for p in self.module.parameters():
            p.grad = None
        for group in self.sharding.groups:  # a backward cut short leaves gradients on the unsharded parameters
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                fsdp_param.unsharded_accumulated_grad = None
        self.current = self.module
        self.clock.rest()

    def end_step(self, began: float) -> float | None:
        """The whole step is this rank's work as far as known here (FSDP's reductions are inside it)."""
        ended = time.monotonic()
        busy = ended - began if self.clock.since is not None else None
        self.clock.since = ended
        return busy
