"""What a worker tells the scheduler of its memory (toolkit.train.headroom): one more logical rank per gradient
copy its free memory holds, read from this machine's real /proc and memory cgroup."""

from __future__ import annotations

import torch

from toolkit.train import headroom


def test_capacity_is_the_logical_ranks_served_plus_one_per_gradient_copy_that_fits() -> None:
    model = torch.nn.Linear(100, 10)  # 1010 float32 parameters: 4040 bytes a gradient copy
    model.bias.requires_grad_(False)  # no gradient, no copy
    per_copy = headroom.grad_bytes(model.parameters())
    assert per_copy == 4000
    assert headroom.capacity(2, per_copy, 12_500) == 5  # 3 more copies fit
    assert headroom.capacity(1, per_copy, 100) == 1
    assert headroom.capacity(1, per_copy, None) is None and headroom.capacity(1, 0, 10**9) is None
    free = headroom.free_bytes()
    assert free is not None and free > 0  # this machine's MemAvailable (or its cgroup's headroom) is readable
