"""The README's main job (scripts/demo.sh runs it after the install): it must keep working as written."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"


@pytest.mark.timeout(600)
def test_the_demo_recovers_from_kill_9_and_ends_bitwise_equal() -> None:
    done = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=540)
    out = done.stdout + done.stderr
    workdir = re.search(r"\(job files under (/\S+)\)", out)
    assert workdir and Path(workdir.group(1)).name.startswith("toolkit-demo-"), out[-4000:]
    if done.returncode != 0:  # kept for the user to read: a test run leaves none
        shutil.rmtree(workdir.group(1), ignore_errors=True)
    assert done.returncode == 0, out[-4000:]
    assert not Path(workdir.group(1)).exists() and f"removed the job files ({workdir.group(1)})" in out
    assert "=== demo: kill -9 worker_1 (pid " in out
    assert "1 restart(s), last exit: killed by SIGKILL" in out
    assert "=== demo: bitwise equal: the fault changed nothing in the result" in out
