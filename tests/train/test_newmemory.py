"""toolkit.train.newmemory: a tensor for bytes about to be written, allocated without deterministic mode's fill."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


DDP_CHILD = """
import json, os
import torch
import torch.distributed as dist
from torch import nn
from toolkit.train.newmemory import no_fill

torch.use_deterministic_algorithms(True)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
alone = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
alone.load_state_dict(model.state_dict())
with no_fill():
    ddp = nn.parallel.DistributedDataParallel(model, init_sync=False, bucket_cap_mb=0.01)
x = torch.randn(16, 64)
ddp(x).square().mean().backward()
alone(x).square().mean().backward()
pairs = list(zip(model.named_parameters(), alone.parameters(), strict=True))
print(json.dumps({"compared": len(pairs), "differ": [n for (n, p), q in pairs if not torch.equal(p.grad, q.grad)]}),
      flush=True)
os._exit(0)
"""
CHILD_TIMEOUT = 120.0  # s on a loaded machine; normally ~3 s


def test_a_ddp_built_without_the_fill_reduces_its_gradients_exactly() -> None:
    """Why no_fill is safe around DDP's construction (toolkit.train.ddpmodel): its gradient buckets are written whole
    before they are read, so a step gives the bits of the same model without DDP, in deterministic mode, where a
    read of unwritten memory would not. A world of one over gloo, in a process of its own that leaves with
    os._exit: freeing a gloo group joins its threads with the GIL held, and one of them may be freeing a work
    launched in a backward, which holds a Python object (torch 2.13 stashes the backward's context in the
    thread-local state a work captures) and needs the GIL. Run in the test's own process, that hung it once. The
    bitwise runs across kills are test_zero_loss.py's."""
    done = subprocess.run([sys.executable, "-c", DDP_CHILD], capture_output=True, text=True, timeout=CHILD_TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row == {"compared": 4, "differ": []}, row
