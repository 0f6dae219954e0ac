"""Bit-reproducible data-parallel training on CPU, so that a run interrupted and resumed from a checkpoint ends
with exactly the parameters of an uninterrupted one.

Why each piece is needed:

- DDP's default gradient allreduce is not bit-reproducible across a restart. A freshly built DDP reduces its
  first iteration with buckets in parameter order, then rebuilds them in the order gradients became ready;
  and gloo's ring allreduce adds each element's contributions in an order that depends on where the element
  sits in the bucket (its chunk). Resume at step k and step k+1 runs with the initial layout where the
  uninterrupted run had the rebuilt one; with 3+ ranks the float sums differ in the last bits.
  ``ordered_allreduce_hook`` all-gathers the bucket and sums the contributions in rank order 0..n-1 on every
  rank: each element's result depends only on the ranks' values, never on bucket layout or chunking.
- Thread count changes how CPU kernels split their reductions: ``configure`` pins it.
- ``torch.use_deterministic_algorithms`` rejects (rather than silently runs) kernels with no deterministic
  implementation.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as real objects.
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def configure(threads: int = 1) -> None:
    """Pin intra-op threads and demand deterministic kernels. Inter-op threads can only be set before any
    parallel work has started; if that moment has passed the previous setting stays (it does not affect the
    arithmetic of a single op)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass
    torch.use_deterministic_algorithms(True)


def seed_all(seed: int) -> None:
    """Seed torch, Python and numpy's global generators (the ones ``checkpoint.capture_rng_state`` saves)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


def ordered_allreduce_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the mean of the ranks' gradients, summed in rank order on every rank.

    Register with ``ddp.register_comm_hook(group, ordered_allreduce_hook)`` (``group`` None = the default
    group). Costs an all-gather (world_size x the bucket in memory and traffic) instead of a ring allreduce:
    fine for the small worlds where bitwise reproducibility is checked; leave it off where throughput matters
    more than bit equality.
    """
    pg = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(pg)
    buf = bucket.buffer()
    parts = [torch.empty_like(buf) for _ in range(world)]
    fut = dist.all_gather(parts, buf, group=pg, async_op=True).get_future()

    def reduce(gathered: torch.futures.Future[Any]) -> torch.Tensor:
        # A failed all-gather (a peer died) must fail the bucket, not sum the half-filled buffers: then() runs
        # this callback on an errored future too, and value() is what re-raises its error.
        gathered.value()
        total = parts[0].clone()
        for p in parts[1:]:
            total.add_(p)
        total.div_(world)
        buf.copy_(total)
        return buf

    return fut.then(reduce)
