"""An unmodified torchrun FSDP2 script (examples/fsdp/plain.py: fully_shard over a device mesh, its own
torch.distributed.checkpoint every few steps) under `fleet deploy train --join` without the Trainer: kill -9 of a
worker at a random step relaunches every worker, which resume from the script's own sharded checkpoint and finish
at the requested step."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from toolkit.testing.localjob import EXAMPLES, FleetRun

JOB_TIMEOUT = 300.0  # s for the job on a loaded 2-core machine; normally ~40 s
POLL = 0.05  # s between looks at a log: no event tells that a line was appended
STEP = re.compile(r"^epoch (\d+) step (\d+) loss", re.M)
EXIT_REJOIN = 76
WORLD = 2

pytestmark = pytest.mark.timeout(600)


def last_step(run: FleetRun, rank: int) -> int:
    steps = STEP.findall(run.log(f"worker_{rank}.log"))
    return int(steps[-1][1]) if steps else 0


def until(what: str, predicate, run: FleetRun) -> None:  # noqa: ANN001 - a test helper
    deadline = time.monotonic() + JOB_TIMEOUT
    while not predicate():
        if run.runner is not None and run.runner.poll() is not None:
            raise AssertionError(f"the job ended while waiting for {what}:\n{run.join(1)[1]}\n{run.evidence()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{run.evidence()}"
        time.sleep(POLL)


def test_an_unmodified_fsdp2_script_survives_kill_9_by_restart(tmp_path: Path) -> None:
    project = tmp_path / "fsdp"
    shutil.copytree(EXAMPLES / "fsdp", project)
    epochs = 2
    total = epochs * math.ceil(math.ceil(2048 / WORLD) / 32)
    run = FleetRun(tmp_path, "fsdp", ["--project", str(project), "--script", "plain.py", "--worker-num", str(WORLD),
                                      "--workdir", str(tmp_path / "work"), "--script-args",
                                      f"--epochs {epochs} --step-delay 0.04"])
    victim = random.Random().randrange(WORLD)
    target = random.Random().randint(12, total - 20)
    try:
        run.start()
        until(f"step {target}", lambda: last_step(run, victim) >= target, run)
        pid = run.procs()[f"worker_{victim}"]["pid"]
        os.kill(pid, signal.SIGKILL)
        until("every worker relaunched and resumed from the script's checkpoint",
              lambda: all(re.search(r"^rank \d+: resumed from step [1-9]", run.log(f"worker_{r}.log"), re.M)
                          for r in range(WORLD)), run)
        assert run.procs()[f"worker_{victim}"]["exits"][0]["signal"] == "SIGKILL", run.evidence()
        for r in set(range(WORLD)) - {victim}:
            assert run.procs()[f"worker_{r}"]["exits"][0]["code"] == EXIT_REJOIN, run.evidence()
        code, output = run.join(JOB_TIMEOUT)
        assert code == 0, f"{output}\n{run.evidence()}"
    finally:
        run.stop()
    assert re.search(rf"^final checkpoint: step {total}$", run.log("worker_0.log"), re.M), run.evidence()
    assert (run.dir / "ckpt" / "latest").read_text() == str(total)
    for node, p in run.procs().items():
        assert p["state"] == "succeeded", f"{node}: {p['state']}\n{run.evidence()}"
