"""One rank of a real gloo group (world 2) for tests/train/test_fence.py's `Fence.wait` test.

Usage: python fence_worker.py RANK PORT GROUP_TIMEOUT

Both ranks all-gather once through `Fence.wait` (it must give the collective's result). Then rank 1 stays alive
without joining the next collective (until its stdin closes), so rank 0's all_reduce can end only by a trip or by
the group's timeout; the fence records no socket, so nothing but `wait` itself can end it early. A thread of rank 0
trips the fence once the all_reduce is under way. Rank 0 prints (JSON) what the wait raised, whether the collective
was still pending then and after `destroy_process_group()` returned (the stranded collective holds its group, so the
destroy does not wait for it), and whether the fence let the group go once gloo ended the collective.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from toolkit.train.fence import Fence

RELEASE_BOUND = 120.0  # s past the group's timeout for gloo to end the stranded collective (loaded machine)


def main(rank: int, port: int, group_timeout: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=group_timeout))
    fence = Fence(timeout=group_timeout)
    fence.arm(1)  # no sockets recorded: only `wait` itself can end a wait at the trip
    mine = torch.tensor([rank + 10], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(2)]
    fence.wait(dist.all_gather(every, mine, async_op=True), "the first all_gather")
    gathered = [int(t) for t in every]
    if rank == 1:
        print(json.dumps({"rank": 1, "gathered": gathered}), flush=True)
        sys.stdin.read()  # alive, never joining rank 0's all_reduce
        return
    work = dist.all_reduce(torch.ones(1), async_op=True)
    threading.Thread(target=lambda: fence.overtaken(2), daemon=True).start()  # as the control thread trips it
    try:
        fence.wait(work, "the test's all_reduce")
        outcome = "completed"
    except RuntimeError as e:
        outcome = str(e)
    pending_at_raise = not work.is_completed()
    stranded_at_raise = fence.stranded
    fence.disarm()
    dist.destroy_process_group()
    pending_after_destroy = not work.is_completed()
    deadline = time.monotonic() + group_timeout + RELEASE_BOUND
    while fence.stranded and time.monotonic() < deadline:
        time.sleep(0.2)
    print(json.dumps({"rank": 0, "gathered": gathered, "outcome": outcome, "pending_at_raise": pending_at_raise,
                      "stranded_at_raise": stranded_at_raise, "pending_after_destroy": pending_after_destroy,
                      "released": fence.stranded == 0}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
