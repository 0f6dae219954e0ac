"""`fleet run` on the namespace cluster, as a torchrun user types it: hosts, torchrun's flag spellings, then the
script and its arguments last. The worker is tests/scripts/resume_worker.py (plain Python, no torch): it prints
the arguments it got and the launch contract's variables it sees (`contract {...}`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from toolkit.testing import waits
from toolkit.testing.cluster import Cluster, format_workload

BIN = Path(sys.executable).parent
WORKER = Path(__file__).resolve().parent / "scripts" / "resume_worker.py"
COMMAND_TIMEOUT = 240.0
LEFTOVER_WAIT = 90.0  # s for every process of the finished job to be gone, on a busy machine

pytestmark = pytest.mark.timeout(600)


def fleet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "fleet"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT)


def contract(log: str) -> dict[str, Any]:
    """The last `contract {...}` line a worker printed."""
    return json.loads([line for line in log.splitlines() if line.startswith("contract ")][-1][len("contract "):])


def test_fleet_run_with_torchrun_spellings_on_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(WORKER, project / "train.py")
    hosts = cluster.hosts[:2]
    job = f"r{uuid.uuid4().hex[:6]}"
    reach = ["--hosts", ",".join(h.address for h in hosts), "--ssh-config", str(cluster.ssh_config), "--known-hosts",
             str(cluster.known_hosts), "--python", cluster.python, "--job", job]
    try:
        r = fleet("run", *reach, "--nproc-per-node", "2", "--nnodes=2", "--max_restarts", "1", "--master-port",
                  "9750", "--no-warm-spare", "--dry-run", "train.py", cwd=project)
        assert r.returncode == 2 and "error: run: unknown flag --dry-run" in r.stderr, r.stderr
        assert not any((h.home / "toolkit-jobs" / job).exists() for h in hosts)  # nothing deployed, nothing run

        r = fleet("run", *reach, "--nproc-per-node", "2", "--nnodes=2", "--max_restarts", "1", "--master-port",
                  "9750", "--no-warm-spare", "train.py", "--steps", "2", "--name", "a b", "--", "--x=1", cwd=project)
        assert r.returncode == 0 and f"job {job} succeeded: every worker exited 0" in r.stderr, r.stdout + r.stderr
        seen = {}
        for rank in range(4):
            out = fleet("logs", "--rank", str(rank), "-n", "100", cwd=project)
            assert out.returncode == 0, out.stderr
            seen[rank] = contract(out.stdout.replace(f"{hosts[rank // 2].address}:worker:{rank} | ", ""))
        for rank, c in seen.items():
            assert c["argv"] == ["--steps", "2", "--name", "a b", "--", "--x=1"]  # word for word, after the script
            assert c["env"] == {
                "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": str(rank // 2), "GROUP_WORLD_SIZE": "2", "ROLE_NAME": "default", "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": hosts[0].address, "MASTER_PORT": "9751", "MS_SCHED_PORT": "9750",
                "TORCHELASTIC_RUN_ID": job, "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}
        waits.wait_for("no process of the job left on the hosts", lambda: not cluster.workload([h.name for h in hosts]),
                       LEFTOVER_WAIT, evidence=lambda: format_workload(cluster.workload([h.name for h in hosts])))
    finally:
        fleet("stop", "--job", job, cwd=project)
        for h in hosts:  # the homes are shared by the whole session: leave them as they were
            shutil.rmtree(h.home / "toolkit-jobs", ignore_errors=True)
