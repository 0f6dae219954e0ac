"""Extra state that a safe load cannot read back (issue 25, item 8): an LR scheduler whose state_dict() holds a numpy
scalar saves fine, and then neither moves to a replacement after a fault nor resumes from a checkpoint, since toolkit
reads states only with torch.load(weights_only=True). The Trainer refuses it when it is made, in one line naming the
entry, the value and the fix; the same state with Python numbers trains, checkpoints and resumes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

RUN_TIMEOUT = 120.0
SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    import toolkit.train

    class Warmup:
        def __init__(self, numpy_scalars):
            self.factor, self.numpy_scalars = 1.0, numpy_scalars
        def state_dict(self):
            return {"factor": np.float64(self.factor) if self.numpy_scalars else self.factor, "steps": [0, 1]}
        def load_state_dict(self, state):
            self.factor = float(state["factor"])

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    rt = toolkit.train.init()
    try:
        trainer = toolkit.train.Trainer(rt, model, optimizer, loader, state={"warmup": Warmup(sys.argv[2] == "numpy")},
                                        ckpt_dir=sys.argv[1], ckpt_every=2)
    except toolkit.train.TrainerError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    for x, y in trainer.batches(1):
        with trainer.step():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(trainer.model(x), y).backward()
            optimizer.step()
    trainer.finish()
""")


def run(ckpt: Path, kind: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "MS_ROLE", "TOOLKIT_TOKEN_FILE", "CKPT_DIR")}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt), kind], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, cwd=ckpt.parent)  # its ./tb (TensorBoard scalars) there


def test_extra_state_with_numpy_scalars_is_refused_at_construction_naming_it(tmp_path):
    refused = run(tmp_path / "ckpt", "numpy")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith("state['warmup'].state_dict() holds a numpy.float64 at ['factor'], which a safe load")
    assert "float(x)" in lines[0]
    assert not (tmp_path / "ckpt").exists(), "nothing is started"

    fine = run(tmp_path / "ckpt", "python")
    assert fine.returncode == 0, fine.stderr
    again = run(tmp_path / "ckpt", "python")
    assert again.returncode == 0 and "rank 0: resumed from step 4 " in again.stdout, again.stdout + again.stderr
