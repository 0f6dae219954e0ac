"""One rank of a real gloo group bootstrapped from the job's store (toolkit.train.store) of a real scheduler, for
tests/train/test_store.py: prints the store requests torch made for the group and the allreduce's result as JSON.

Usage: python store_worker.py RANK WORLD PORT TOKEN_FILE PREFIX   (the GLOO_* variables come from the environment)
"""

import collections
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from toolkit.train.store import JobStore


class Counting(JobStore):
    """The job's store, counting the requests that go on the wire (one per call: what the scheduler serves)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.requests: collections.Counter[str] = collections.Counter()

    def _call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        self.requests[cmd] += 1
        return super()._call(cmd, **fields)


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    token, prefix = Path(sys.argv[4]).read_text().strip(), sys.argv[5]
    timeout = timedelta(seconds=60)
    store = Counting("127.0.0.1", port, token, f"worker_{rank}", timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timeout)
    built = dict(store.requests)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(json.dumps({"rank": rank, "requests": built, "after": dict(store.requests), "sum": total.item()}),
          flush=True)
    dist.destroy_process_group()
    store.close()


if __name__ == "__main__":
    main()
