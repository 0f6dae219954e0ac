"""An unmodified torchrun DDP script (examples/ddp/plain.py) on 3 namespace hosts with toolkit's default recovery
settings: kill -9 of a random worker (rank 0 included), then the host of rank 0 (which also runs the scheduler)
cut off the network past the node timeout and plugged back in. The job finishes, and its own final checkpoint
holds the requested step count."""

from __future__ import annotations

import math
import os
import random
import re
import signal

import torch
from fault_harness import E2E, HOSTS

STEP = re.compile(r"^epoch (\d+) step (\d+) loss", re.M)
TOTAL = 3 * math.ceil(math.ceil(2048 / HOSTS) / 32)  # 3 epochs of ceil(683 / 32) batches


def test_an_unmodified_torchrun_script_survives_a_kill_and_its_rank_0_host_cut_off(ddp_e2e: E2E, tmp_path) -> None:
    ckpt = tmp_path / "shared-ckpt"
    job = ddp_e2e.job("plain", "--script", "plain.py", "--ckpt-dir", str(ckpt), "--script-args",
                      "--epochs 3 --step-delay 0.05")

    def step(node: str) -> int:
        found = STEP.findall(job.log(node))
        return int(found[-1][1]) if found else 0

    def all_past(k: int) -> bool:
        return all(step(f"worker_{r}") > k for r in range(HOSTS))

    job.start()
    job.wait_for("every rank past its first checkpoint", lambda: all_past(12))
    victim = f"worker_{random.Random().randrange(HOSTS)}"
    pid = job.processes()[victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    job.wait_for("every worker relaunched and resumed from the checkpoint",
                 lambda: all(re.search(r"^rank \d+: resumed from step [1-9]", job.log(f"worker_{r}"), re.M)
                             for r in range(HOSTS)))
    assert any(e["pid"] == pid and e["signal"] == "SIGKILL" for e in job.processes()[victim]["exits"])

    resumed = max(step(f"worker_{r}") for r in range(HOSTS))
    job.wait_for("training again", lambda: all_past(resumed + 5))
    host = job.host_of("worker_0")
    pids = {node: p["pid"] for node, p in job.processes().items() if p["host"] != host}  # workers elsewhere
    before = job.generation()
    with ddp_e2e.cluster.partitioned(host):  # past the node timeout, the cut-off workers are dead to the scheduler
        job.wait_for("the scheduler to declare the cut-off workers dead for their silence",
                     lambda: all(any("heartbeat" in why for why in job.declared_dead().get(n, ())) for n in pids))
    silent = {n for n, whys in job.declared_dead().items() if any("heartbeat" in why for why in whys)}
    assert silent == set(pids), job.declared_dead()  # only they
    assert job.generation() > before
    job.wait_for("the fenced workers replaced",
                 lambda: all(job.processes()[n]["pid"] != old for n, old in pids.items()))
    code, output = job.join()
    assert code == 0, f"{output}\n{job.evidence()}"
    assert torch.load(ckpt / job.name / "plain.pt", weights_only=True)["step"] == TOTAL  # the job's own subdirectory
    job.wait_no_leftovers()
