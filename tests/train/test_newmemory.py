"""toolkit.train.newmemory: a tensor for bytes about to be written, allocated without deterministic mode's fill."""

from __future__ import annotations

import os

import torch

from toolkit.testing.simjob import Usage
from toolkit.train.newmemory import no_fill, unfilled

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


def test_no_fill_lifts_the_fill_within_and_restores_it_after_even_on_error() -> None:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        before = resident()
        with no_fill():
            fresh = torch.empty(SIZE // 4, dtype=torch.float32)
        untouched = resident() - before
        try:
            with no_fill():
                raise KeyError("inside")
        except KeyError:
            pass
        filled = torch.empty(SIZE // 4, dtype=torch.float32)
        touched = resident() - before - untouched
    finally:
        torch.use_deterministic_algorithms(was)
    assert untouched < 0.1 * SIZE, f"torch.empty within no_fill touched {untouched} of {SIZE} bytes"
    assert touched >= 0.9 * SIZE, "the fill was not restored after no_fill"
    assert torch.utils.deterministic.fill_uninitialized_memory
    assert fresh.numel() == filled.numel()


def test_a_ddp_built_without_the_fill_reduces_its_gradients_exactly(new_port) -> None:
    """Why no_fill is safe around DDP's construction (toolkit.train.ddpmodel): its gradient buckets are written whole
    before they are read, so a step gives the bits of the same model without DDP, in deterministic mode, where a
    read of unwritten memory would not. A world of one over gloo; the bitwise runs across kills are
    test_zero_loss.py's."""
    import torch.distributed as dist
    from torch import nn

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    store = dist.TCPStore("127.0.0.1", new_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        alone = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        alone.load_state_dict(model.state_dict())
        with no_fill():
            ddp = nn.parallel.DistributedDataParallel(model, init_sync=False, bucket_cap_mb=0.01)
        x = torch.randn(16, 64)
        ddp(x).square().mean().backward()
        alone(x).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), alone.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
    finally:
        dist.destroy_process_group()
        torch.use_deterministic_algorithms(was)
