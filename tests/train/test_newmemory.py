"""toolkit.train.newmemory: a tensor for bytes about to be written, allocated without deterministic mode's fill."""

from __future__ import annotations

import os

import torch

from toolkit.testing.simjob import Usage
from toolkit.train.newmemory import unfilled

SIZE = 96 << 20  # bytes: above glibc's largest mmap threshold, so new pages stay untouched until written


def resident() -> int:
    return Usage.of(os.getpid()).rss


def test_unfilled_is_a_contiguous_tensor_of_the_shape_and_dtype_asked() -> None:
    t = unfilled((2, 3, 4), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (2, 3, 4) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 2 * 3 * 4 * 2
    t.copy_(torch.arange(24, dtype=torch.bfloat16).view(2, 3, 4))
    assert t[1, 2, 3] == 23
    assert unfilled((0, 5), torch.float32, torch.device("cpu")).shape == (0, 5)


def test_deterministic_mode_does_not_fill_it() -> None:
    """What deterministic mode costs torch.empty (every page touched, on the calling thread) and not unfilled: a
    replacement's new optimizer state is allocated without touching it, so that its receive can overlap the page
    faults with the link (toolkit.train.transfer)."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        before = resident()
        fresh = unfilled((SIZE // 4,), torch.float32, torch.device("cpu"))
        untouched = resident() - before
        filled = torch.empty(SIZE // 4, dtype=torch.float32)
        touched = resident() - before - untouched
    finally:
        torch.use_deterministic_algorithms(was)
    assert touched >= 0.9 * SIZE, "deterministic mode no longer fills torch.empty: the contrast is gone"
    assert untouched < 0.1 * SIZE, f"unfilled touched {untouched} of {SIZE} bytes"
    assert fresh.numel() == filled.numel()
