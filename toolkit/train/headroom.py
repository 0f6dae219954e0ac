"""How many logical ranks this process's memory holds (issue 42): what a worker tells the scheduler with its
heartbeats (`capacity`), so that a shrink that would leave it more logical ranks than that is refused and the job
waits instead (toolkit.scheduler.elastic.shrink_refusal).

The rule, kept simple on purpose: each logical rank a process serves beyond its first costs one more flat copy of
the gradients (toolkit.train.logicalgrad), `grad_bytes` bytes; everything else it holds (parameters, optimizer state,
activations of one micro-batch at a time) it holds already. So it can serve the logical ranks it serves now, plus one
per `grad_bytes` of memory still free: the least of the host's MemAvailable and its memory cgroup's headroom (a
batch system's limit kills at the cgroup's limit however much the host has free). Measured when the group forms;
None when nothing can be read (no bound is then claimed).

A process training a sharded model (FSDP2: toolkit.train.sharded) holds its own rank's shard and nothing else: it
cannot serve another logical rank whatever its memory (the shards are cut for the world), so it says `SHARDED`
(holds 1, `reported`): a shrink is then refused and the job waits for the lost workers' replacements (the launcher
cannot refuse --min-workers up front: it does not know that the script shards).
"""

from __future__ import annotations

from typing import Iterable

import torch

from toolkit import memcgroup, standby

SHARDED = 1  # the logical ranks a process of a sharded model holds: its own


def grad_bytes(parameters: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of one copy of the gradients of `parameters` (those that get one)."""
    return sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)


def free_bytes() -> int | None:
    """Memory this process may still take: the least of MemAvailable and its memory cgroup's headroom; None if
    neither can be read."""
    host = standby.available_bytes()
    found = memcgroup.of_process()
    cgroup = found.headroom(memcgroup.read_text) if found is not None else None
    known = [b for b in (host if host >= 0 else None, cgroup) if b is not None]
    return min(known) if known else None


def capacity(serving: int, per_copy: int, free: int | None) -> int | None:
    """The logical ranks this process can serve: those it serves (`serving`) plus one per `per_copy` bytes of
    `free` memory; None when `free` is unknown or there are no gradients to copy."""
    if free is None or per_copy <= 0:
        return None
    return max(1, serving) + free // per_copy


def reported(sharded: bool, serving: int, per_copy: int, free: int | None) -> int | None:
    """What the worker tells the scheduler it holds (module docstring): SHARDED for a sharded model, else
    `capacity`."""
    return SHARDED if sharded else capacity(serving, per_copy, free)
