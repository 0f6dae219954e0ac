"""A step's gradient when a process serves several logical ranks (toolkit.contracts.logical): each logical rank's
micro-batch gradient is computed in turn, kept, and the step's gradient is the mean of all L of them summed in
logical-rank order, with the arithmetic of the rank-ordered allreduce (toolkit.train.determinism): element by
element `(g0 + g1) + g2 ... + g(L-1)`, then divided by L. So the result is bitwise that of L processes each serving
one logical rank, whoever serves which.

Why not DDP: its reducer allreduces once per backward, and here the processes run different numbers of backwards
per step. The Trainer runs the script's step body once per logical rank served (`deferred`: the script's
`optimizer.step()` and `zero_grad()` do nothing but on the last, as gradient accumulation wrappers do); after each
body but the last, `keep` moves the gradients into that logical rank's copy; the script's `optimizer.step()` on the
last calls `reduce` first (an optimizer pre-hook), which leaves the mean in the parameters' `.grad`. A GradScaler
handed over as extra state keeps and reduces the gradients earlier, still scaled (toolkit.train.lossscale).

Memory: one flat gradient copy per logical rank served beyond the first (the last one's gradients stay in `.grad`),
and the exchange's scratch: one bucket (determinism.GLOO_BUCKET_MB) and the slices received for it.

The exchange, bucket by bucket of the flat gradient: process p owns the p-th of N near-equal slices of the bucket,
receives every logical rank's copy of that slice (point-to-point, tagged by logical rank), sums them in logical
order and divides by L, and sends its result to every other process: what a reduce-scatter and an all-gather move.

Buffers (BatchNorm's running statistics), as DDP's broadcast_buffers: at each step's start the process serving
logical rank 0 sends its buffers to all; each logical rank's forward starts from them, and the process keeps the
buffers its lowest logical rank's forward left (on the one serving logical rank 0, those of logical rank 0).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from toolkit.train.determinism import GLOO_BUCKET_MB
from toolkit.train.newmemory import unfilled

_MISSING = object()


class LogicalGrad:
    """The gradients of the logical ranks `assignment[rank]` of `logical_world` (index = rank) for `module`'s
    parameters on `group`; `broadcast_buffers` as DDP's. Lanes are indexed 0..k-1 in the ascending order of the
    logical ranks this process serves."""

    def __init__(self, module: nn.Module, group: Any, rank: int, logical_world: int,
                 assignment: Sequence[Sequence[int]], backend: str, broadcast_buffers: bool = True) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError("a process serving several logical ranks needs the parameters in one dtype and on one "
                             f"device (found {sorted(str(k) for k in kinds)})")
        self.group, self.rank, self.world = group, rank, len(assignment)
        self.logical_world = logical_world
        self.mine = tuple(assignment[rank])
        self.owner = {lr: r for r, lrs in enumerate(assignment) for lr in lrs}
        self.numel = sum(p.numel() for p in self.params)
        like = self.params[0] if self.params else torch.empty(0)
        self.link = torch.device("cpu") if backend != "nccl" else like.device  # gloo moves host memory only
        self.copies = [unfilled((self.numel,), like.dtype, like.device) for _ in self.mine[:-1]]
        self.bucket = max(1, GLOO_BUCKET_MB * 2**20 // max(1, like.element_size()))
        self._scratch: torch.Tensor | None = None
        self.buffers = [b for b in module.buffers()] if broadcast_buffers else []
        self._start: list[torch.Tensor] = []  # the buffers at the step's start (several lanes)
        self._kept: list[torch.Tensor] = []  # the buffers the first lane's forward left
        self._held = False  # the lane's gradients are in its copy already (a GradScaler's unscale_: lossscale)
        self._reduced = False  # the step's gradients are reduced already (a GradScaler's unscale_ or step)

    @property
    def lanes(self) -> int:
        return len(self.mine)

    def begin(self, lane: int) -> None:
        """Lane `lane` of a step begins: no gradient yet; its buffers those of the step's start (at the first
        lane: sent by the process serving logical rank 0, as DDP's broadcast_buffers does before a forward)."""
        for p in self.params:
            p.grad = None
        self._held = self._reduced = False
        if lane == 0:
            if self.buffers and self.world > 1:
                src = self.owner[0]
                for b in self.buffers:
                    dist.broadcast(b, src, group=self.group)
            if self.buffers and self.lanes > 1:
                self._start = [b.detach().clone() for b in self.buffers]
        elif self._start:
            with torch.no_grad():
                for b, s in zip(self.buffers, self._start, strict=True):
                    b.copy_(s)

    def keep(self, lane: int) -> None:
        """Lane `lane` (not the last) is done: its gradients into its copy, the parameters' `.grad` cleared. Once a
        lane: a GradScaler's `unscale_` keeps them early (toolkit.train.lossscale), the lane's end then finds them
        kept."""
        if self._held:
            return
        self._held = True
        flat = self.copies[lane]
        at = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                if p.grad is None:
                    flat[at:at + n].zero_()  # not used by this micro-batch: DDP would count it as zeros
                else:
                    flat[at:at + n].copy_(p.grad.reshape(-1))
                at += n
                p.grad = None
        if lane == 0 and self._start:
            self._kept = [b.detach().clone() for b in self.buffers]

    def finish(self) -> None:
        """The step's last lane ended: the buffers are those the first lane's forward left."""
        if self._kept:
            with torch.no_grad():
                for b, k in zip(self.buffers, self._kept, strict=True):
                    b.copy_(k)
        self._start, self._kept = [], []

    def reduce(self) -> None:
        """Replace the parameters' `.grad` (the last lane's gradients) by the mean of every logical rank's, summed
        in logical-rank order (see the module docstring), bucket by bucket. Once a step: a GradScaler's `unscale_` or
        `step` reduces before the optimizer's pre-hook would (toolkit.train.lossscale)."""
        if self._reduced:
            return
        self._reduced = True
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
        for start in range(0, self.numel, self.bucket):
            self._reduce_bucket(start, min(self.numel, start + self.bucket))

    def _reduce_bucket(self, a: int, b: int) -> None:
        size = b - a
        bounds = [size * i // self.world for i in range(self.world + 1)]
        mine = bounds[self.rank + 1] - bounds[self.rank]
        received = self.logical_world - self.lanes
        last = self._take(size + (received + 1) * mine)
        scratch_last, rest = last[:size], last[size:]
        self._gather_grads(scratch_last, a, b)
        lanes = [c[a:b] if c.device == self.link else c[a:b].to(self.link) for c in self.copies] + [scratch_last]
        data = dict(zip(self.mine, lanes, strict=True))
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        room = iter(rest[i * mine:(i + 1) * mine] for i in range(received))
        parts: dict[int, torch.Tensor] = {lr: (data[lr][lo:hi] if lr in data else next(room))
                                          for lr in range(self.logical_world)}
        total = rest[received * mine:]
        ops = []
        for q in range(self.world):
            if q == self.rank:
                continue
            for lr in self.mine:
                ops.append(dist.P2POp(dist.isend, data[lr][bounds[q]:bounds[q + 1]], q, group=self.group, tag=lr))
            for lr in range(self.logical_world):
                if self.owner[lr] == q:
                    ops.append(dist.P2POp(dist.irecv, parts[lr], q, group=self.group, tag=lr))
        _wait(ops)
        order = [parts[lr] for lr in range(self.logical_world)]
        if len(order) > 1:
            torch.add(order[0], order[1], out=total)
        else:
            total.copy_(order[0])
        for part in order[2:]:
            total.add_(part)
        torch.div(total, self.logical_world, out=scratch_last[lo:hi])
        ops = []
        for q in range(self.world):
            if q != self.rank:
                ops.append(dist.P2POp(dist.isend, scratch_last[lo:hi], q, group=self.group, tag=self.logical_world))
                ops.append(dist.P2POp(dist.irecv, scratch_last[bounds[q]:bounds[q + 1]], q, group=self.group,
                                      tag=self.logical_world))
        _wait(ops)
        self._scatter_grads(scratch_last, a, b)

    def _take(self, n: int) -> torch.Tensor:
        """`n` elements of scratch on the link device, kept and grown from bucket to bucket."""
        like = self.params[0]
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = unfilled((n,), like.dtype, self.link)  # written whole before it is read
        return self._scratch[:n]

    def _gather_grads(self, out: torch.Tensor, a: int, b: int) -> None:
        """The flat range [a, b) of the parameters' `.grad` into `out`."""
        for p, at, lo, hi in self._pieces(a, b):
            out[lo - a:hi - a].copy_(p.grad.view(-1)[lo - at:hi - at])

    def _scatter_grads(self, src: torch.Tensor, a: int, b: int) -> None:
        """`src` (the flat range [a, b)) back into the parameters' `.grad`."""
        with torch.no_grad():
            for p, at, lo, hi in self._pieces(a, b):
                p.grad.view(-1)[lo - at:hi - at].copy_(src[lo - a:hi - a])

    def _pieces(self, a: int, b: int) -> Iterator[tuple[nn.Parameter, int, int, int]]:
        """(parameter, its offset in the flat gradient, lo, hi) of each parameter overlapping [a, b) ([lo, hi)
        the overlap, in flat coordinates)."""
        at = 0
        for p in self.params:
            n = p.numel()
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                yield p, at, lo, hi
            at += n


@contextlib.contextmanager
def deferred(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The script's `optimizer.step()` and `zero_grad()` do nothing inside (a lane that is not the step's last):
    shadowed on the instance, whatever was there before (an LR scheduler's wrapper of step) put back after."""
    saved = {name: optimizer.__dict__.get(name, _MISSING) for name in ("step", "zero_grad")}
    for name in saved:
        setattr(optimizer, name, _nothing)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(optimizer, name)
            else:
                setattr(optimizer, name, value)


def _nothing(*_: Any, **__: Any) -> None:
    return None


def _wait(ops: list[Any]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
