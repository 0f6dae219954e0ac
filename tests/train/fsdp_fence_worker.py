"""One rank of a real gloo group (world 2) for tests/train/test_fence.py's test of FSDP's own collectives under
the fence (toolkit.train.shardcomm.FencedComms).

Usage: python fsdp_fence_worker.py RANK PORT GROUP_TIMEOUT

Both ranks shard a small model with `fully_shard` over a mesh of the two, install FencedComms (FSDP's all-gather and
torch's own reduce-scatter, waited on through the fence) and train one step: it must complete. Then rank 1 stays
alive without joining anything (until its stdin closes), and rank 0 trips its fence *before* its next forward, as a
rank does whose forward reaches the next parameter group's all-gather after a fault: the all-gather must raise
Abandoned at once (gloo would have waited for the group's timeout). Rank 0 prints (JSON) the first step's loss, what
the second forward raised and how long it took.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from toolkit.train.fence import Fence
from toolkit.train.shardcomm import FencedComms
from toolkit.train.shardmodel import inspect


def main(rank: int, port: int, group_timeout: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=group_timeout))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fence = Fence(timeout=group_timeout)
    fence.arm(1)
    sharding = inspect(model, 2)
    assert sharding is not None
    FencedComms(SimpleNamespace(device=torch.device("cpu"), fence=fence)).install(sharding, reduce_scatter=True)
    x = torch.full((4, 8), float(rank + 1))
    loss = model(x).sum()
    loss.backward()
    if rank == 1:
        print(json.dumps({"rank": 1, "loss": float(loss)}), flush=True)
        sys.stdin.read()  # alive, never joining rank 0's next all-gather
        return
    fence.abandon(1)  # the fault: the group is abandoned before the next collective is entered
    began = time.monotonic()
    try:
        model(x)
        outcome = "returned"
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {e}"
    print(json.dumps({"rank": 0, "loss": float(loss), "outcome": outcome, "seconds": time.monotonic() - began}),
          flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
