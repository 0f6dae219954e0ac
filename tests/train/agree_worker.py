"""One rank of a real gloo group for the restart-agreement tests: agree on the step over CKPT_ROOT, the chosen rank
loads its host's copy, and everyone prints JSON.

Usage: python agree_worker.py RANK WORLD PORT CKPT_ROOT HOST LOCAL_RANK LOCAL_WORLD
(the ranks of a simulated host share HOST; the key is the test's fixed one.)
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from toolkit.train.ckpt import manager as checkpoint

KEY = b"agreement test key, 32 bytes!!!!"


def main() -> None:
    rank, world, port, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    placement = checkpoint.Placement(sys.argv[5], int(sys.argv[6]), int(sys.argv[7]))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    manager = checkpoint.CheckpointManager(root, keep_max=5, placement=placement, key=KEY)
    try:
        found = manager.agree()
        error = None
    except checkpoint.CheckpointError as e:
        found, error = None, str(e)
    loaded = None
    if found is not None and found.source == rank:
        loaded = int(manager.load(found.step)["step"])
    print(json.dumps({
        "rank": rank,
        "step": None if found is None else found.step,
        "source": None if found is None else found.source,
        "loaded": loaded,
        "error": error,
        "left": sorted(p.name for p in manager.directory.iterdir() if p.is_file()),
        "refused": sorted(p.name for p in (manager.directory / "refused").glob("*")),
    }), flush=True)
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
