"""New tensors whose every byte is written before it is read (received off the link, summed into, gradients copied
in): allocated without the fill that deterministic mode adds.

Why: under ``torch.use_deterministic_algorithms(True)`` (toolkit.train.determinism.configure, which the Trainer's
scripts call) ``torch.empty`` fills new memory with NaN, so that a read of it gives the same bits in every run. The
fill touches every page on the calling thread before a byte arrives: a replacement's 447 MB of AdamW moments
(bench/transformer.py) took 0.22 s to allocate, half its transfer. Memory that is written whole first needs no
fill, and a receive into untouched pages lets their faults overlap the link (toolkit.train.transfer)."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch
import torch.utils.deterministic


def unfilled(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous tensor of `shape` and `dtype` on `device`, its contents undefined (never filled, whatever
    the deterministic setting). The caller writes every byte before anything reads it."""
    storage = torch.UntypedStorage(math.prod(shape) * dtype.itemsize, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, tuple(shape))


@contextlib.contextmanager
def no_fill() -> Iterator[None]:
    """Within: new tensors are not filled, for code that allocates memory it writes whole before reading it and that
    cannot be handed `unfilled` tensors. Its one use: DDP's construction, whose gradient buckets (224 MB for
    bench/transformer.py, 0.11-0.21 s of fill measured, on every rank at every recovery) receive every gradient,
    or a zeroed view for a missing one, before a bucket is reduced (outside deterministic mode, torch's default,
    they are never filled at all). The setting is process-wide while the block runs, and restored after."""
    before = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = before
