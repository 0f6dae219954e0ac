"""New tensors whose every byte is written before it is read (received off the link, summed into): allocated
without the fill that deterministic mode adds.

Why: under ``torch.use_deterministic_algorithms(True)`` (toolkit.train.determinism.configure, which the Trainer's
scripts call) ``torch.empty`` fills new memory with NaN, so that a read of it gives the same bits in every run. The
fill touches every page on the calling thread before a byte arrives: a replacement's 447 MB of AdamW moments
(bench/transformer.py) took 0.22 s to allocate, half its transfer. Memory that is written whole first needs no
fill, and a receive into untouched pages lets their faults overlap the link (toolkit.train.transfer)."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def unfilled(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous tensor of `shape` and `dtype` on `device`, its contents undefined (never filled, whatever
    the deterministic setting). The caller writes every byte before anything reads it."""
    storage = torch.UntypedStorage(math.prod(shape) * dtype.itemsize, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, tuple(shape))
