"""One rank of a real gloo group for the rank-ordered allreduce tests (tests/train/test_determinism.py).

Usage: python determinism_worker.py RANK WORLD PORT [abandoned | midway]

Each rank computes its own gradients of a small model (sizes that do not divide by the world) on its own batch,
for two iterations. Printed (JSON): whether DDP with the rank-ordered hook gives, bit for bit, the rank-ordered
mean computed by hand from every rank's gradients (all-gathered), with one large bucket and with many small ones,
in the first iteration (DDP's initial bucket layout) and the second (after it rebuilt its buckets); the largest
difference from DDP's own allreduce; and the bytes this rank wrote to its sockets per reduction with each.

abandoned (world 2): DDP with the rank-ordered hook watching a fence that records none of the group's sockets (so
only the fence's watchers can end a wait); rank 0 stops itself (SIGSTOP) before its second backward, so rank 1's
reduction waits on it; a thread of rank 1 trips the fence when the test says so on stdin (as the runtime's control
thread does), and rank 1 prints how its backward ended, how long after the trip.

midway (world 2): the same, with a bucket per parameter, and rank 1's fence trips as its second backward has
accumulated its first gradient; rank 1 prints how its backward ended and how many of the model's parameters had
their gradient accumulated (the backward should end at the next bucket, not run to its end).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from toolkit.train import determinism
from toolkit.train.ddpmodel import ddp_arguments
from toolkit.train.fence import Fence


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 101), nn.Tanh(), nn.Linear(101, 53), nn.Tanh(), nn.Linear(53, 5))


def batch(rank: int, it: int) -> torch.Tensor:
    return torch.randn(8, 37, generator=torch.Generator().manual_seed(100 * rank + it))


def local_grads(rank: int, it: int) -> list[torch.Tensor]:
    m = model()
    m(batch(rank, it)).square().sum().backward()
    return [p.grad.clone() for p in m.parameters()]


def ordered_mean(grads: list[torch.Tensor], world: int, order: list[int] | None = None) -> list[torch.Tensor]:
    """The reference: every rank's gradients, summed in rank order (or `order`) and divided by the world size."""
    out = []
    for g in grads:
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        parts = parts if order is None else [parts[r] for r in order]
        total = parts[0].clone()
        for p in parts[1:]:
            total.add_(p)
        out.append(total.div_(world))
    return out


def ddp_grads(rank: int, its: int, kwargs: dict, ordered: bool,
              order: list[int] | None = None) -> tuple[list[list[torch.Tensor]], int, list[int]]:
    """Each iteration's gradients of DDP built with `kwargs` (with the rank-ordered hook if `ordered`), the bytes
    sent per iteration, and the buckets each iteration reduced."""
    m = model()
    ddp = nn.parallel.DistributedDataParallel(m, **kwargs)
    reducer = determinism.OrderedReducer(None, order=order) if ordered else None
    buckets = [0] * its
    it = 0

    def counted(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        buckets[it] += 1
        return determinism.ordered_allreduce_hook(state, bucket)

    if reducer is not None:
        ddp.register_comm_hook(reducer, counted)
    out = []
    written = 0
    for it in range(its):
        m.zero_grad()
        before = sent_bytes()
        ddp(batch(rank, it)).square().sum().backward()
        written += sent_bytes() - before
        out.append([p.grad.clone() for p in m.parameters()])
    if reducer is not None:
        reducer.close()
    return out, written // its, buckets


def sent_bytes() -> int:
    """Bytes this process has written (gloo writes its sockets with writev: counted in wchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("wchar"))


def abandoned(rank: int) -> None:
    fence = Fence()
    fence.arm(1)  # no sockets recorded: a trip can only act through its watchers
    m = model()
    ddp = nn.parallel.DistributedDataParallel(m)
    ddp.register_comm_hook(determinism.OrderedReducer(None, fence), determinism.ordered_allreduce_hook)
    tripped: list[float] = []

    def trip() -> None:  # as the runtime's control thread trips it: from another thread, when told (stdin)
        if sys.stdin.readline().strip() == "trip":
            tripped.append(time.monotonic())
            fence.overtaken(2)

    threading.Thread(target=trip, daemon=True).start()
    ddp(batch(rank, 0)).square().sum().backward()
    loss = ddp(batch(rank, 1)).square().sum()
    print(json.dumps({"rank": rank, "backward": True}), flush=True)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it
    try:
        loss.backward()
        outcome = "completed"
    except RuntimeError as e:
        outcome = str(e).splitlines()[0][:200]
    print(json.dumps({"rank": rank, "outcome": outcome,
                      "after_trip": time.monotonic() - tripped[0] if tripped else None}), flush=True)
    os._exit(0)  # the reducer's thread is still blocked on the stopped peer: leave without joining it


def midway(rank: int) -> None:
    fence = Fence()
    fence.arm(1)
    m = model()
    ddp = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.0001)  # a bucket per parameter
    ddp.register_comm_hook(determinism.OrderedReducer(None, fence), determinism.ordered_allreduce_hook)
    ddp(batch(rank, 0)).square().sum().backward()
    loss = ddp(batch(rank, 1)).square().sum()
    if rank == 0:
        print(json.dumps({"rank": rank, "backward": True}), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it
    accumulated: list[int] = []

    def seen(p: torch.Tensor) -> None:
        accumulated.append(1)
        if len(accumulated) == 1:
            fence.overtaken(2)  # a new generation, announced while the backward runs

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(seen)
    try:
        loss.backward()
        outcome = "completed"
    except RuntimeError as e:
        outcome = str(e).splitlines()[0][:200]
    print(json.dumps({"rank": rank, "outcome": outcome, "accumulated": len(accumulated),
                      "parameters": len(list(m.parameters()))}), flush=True)
    os._exit(0)


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    if sys.argv[4:] == ["abandoned"]:
        abandoned(rank)
    if sys.argv[4:] == ["midway"]:
        midway(rank)
    refs = [ordered_mean(local_grads(rank, it), world) for it in range(2)]
    big, ordered_bytes, _ = ddp_grads(rank, 2, {}, True)
    small, _, _ = ddp_grads(rank, 2, {"bucket_cap_mb": 0.001}, True)  # a bucket per parameter or so
    # as the Trainer builds it (bucket sizes from the first iteration, gradients as views of the buckets), small
    trainers, _, trainers_buckets = ddp_grads(rank, 2, ddp_arguments({"bucket_cap_mb_list": [0.01]}, True, "gloo"),
                                              True)
    plain, plain_bytes, _ = ddp_grads(rank, 2, {}, False)
    order = [world - 1, *range(world - 1)]  # logical ranks served in another order than the ranks (after a grow)
    permuted_refs = [ordered_mean(local_grads(rank, it), world, order) for it in range(2)]
    permuted, _, _ = ddp_grads(rank, 2, {"bucket_cap_mb": 0.001}, True, order)

    def same(a: list[list[torch.Tensor]]) -> list[bool]:
        return [all(torch.equal(x, y) for x, y in zip(a[it], refs[it], strict=True)) for it in range(2)]

    diff = max(float((x - y).abs().max()) for it in range(2) for x, y in zip(plain[it], refs[it], strict=True))
    scale = max(float(y.abs().max()) for it in range(2) for y in refs[it])
    print(json.dumps({"rank": rank, "one_bucket": same(big), "many_buckets": same(small), "trainers": same(trainers),
                      "trainers_buckets": trainers_buckets, "plain_diff": diff,
                      "scale": scale, "ordered_bytes": ordered_bytes, "plain_bytes": plain_bytes,
                      "grad_bytes": sum(g.numel() * 4 for g in refs[0]),
                      "permuted": [all(torch.equal(x, y) for x, y in zip(permuted[it], permuted_refs[it], strict=True))
                                   for it in range(2)]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
