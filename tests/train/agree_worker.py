"""One rank of a real gloo group for the rollback-agreement tests: resume from CKPT_ROOT/rank_<r>, print JSON.

Usage: python agree_worker.py RANK WORLD PORT CKPT_ROOT
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from toolkit.train import checkpoint


def main() -> None:
    rank, world, port, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    manager = checkpoint.CheckpointManager(root / f"rank_{rank}", keep_max=5)
    found = checkpoint.resume(manager)
    print(json.dumps({
        "rank": rank,
        "step": found.step,
        "loaded": None if found.state is None else int(found.state["step"]),
        "damaged": [d.path.name for d in found.damaged],
        "discarded": list(found.discarded),
        "left": manager.steps_on_disk(),
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
