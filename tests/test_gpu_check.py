"""bench/gpu_check.py, the one check of every CUDA path for the first GPU host, kept from rotting on CPU: its dry run
(`scripts/gpu-check.sh --dry`: every check's CPU twin, the same code with CPU tensors and small sizes, through the
product's real parts: checkpoint, transfer, the rank-ordered hook, the fence and the Trainer, the agent's local
jobs with a kill -9 and the warm spare) must pass, print its table and write every check `ok` to the JSON; the real
run on a machine without CUDA says so in one line and exits 2. The sample's --device cuda is refused the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit.testing.localjob import EXAMPLES, clean_env

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "bench" / "gpu_check.py"
DRY_BOUND = 900.0  # s for the dry run on a loaded 2-core machine (about 80 s there, unloaded)

def test_the_dry_run_passes_every_check_and_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    r = subprocess.run([str(REPO / "scripts" / "gpu-check.sh"), "--dry", "--json", str(out)], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=DRY_BOUND)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["dry"] is True
    names = [c["path"] for c in doc["checks"]]
    assert names == ["checkpoint", "transfer", "ordered", "nccl", "recovery", "spare"]
    assert {c["path"]: c["status"] for c in doc["checks"]} == dict.fromkeys(names, "ok"), doc
    for c in doc["checks"]:
        assert c["path"] in r.stdout and c["figure"] != "-", c
    results = {c["path"]: c["result"] for c in doc["checks"]}
    assert "bitwise" in results["checkpoint"] and "bitwise" in results["transfer"]
    assert results["recovery"] == "recovered in place, 0 steps lost, bitwise"
    assert "with the warm spare" in doc["checks"][-1]["figure"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA behaviour needs a machine without it")
def test_without_cuda_the_real_run_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(CHECK)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert "no CUDA device here" in line and "--dry" in line
    assert not (tmp_path / "gpu-check.json").exists()
    r = subprocess.run([sys.executable, str(EXAMPLES / "train.py"), "--device", "cuda"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--device cuda: this torch has no usable CUDA device" in r.stderr.splitlines()[-1]
