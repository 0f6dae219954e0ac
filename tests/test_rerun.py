"""Jobs on this machine as a user runs them (`fleet run`, `fleet train` as real subprocesses): `fleet run` with
torchrun's spellings and the script's arguments last, then the same job run again: --fresh with a plain script
that keeps its checkpoint in the project (the workers' working directory), and a change of the worker count
between runs. The worker is tests/scripts/resume_worker.py (plain Python, no torch)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from toolkit.testing.ports import free_port_pair

BIN = Path(sys.executable).parent
WORKER = Path(__file__).resolve().parent / "scripts" / "resume_worker.py"
COMMAND_TIMEOUT = 180.0

pytestmark = pytest.mark.timeout(600)


def fleet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "fleet"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT)


def ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0 and "Traceback" not in r.stderr, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def refused(r: subprocess.CompletedProcess[str], message: str) -> str:
    """The one error line of a command that exited 2 (what came before it is deploy's progress)."""
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert message in errors[0], errors[0]
    return errors[0]


def agent_doc(work: Path, job: str) -> dict[str, Any]:
    return json.loads((work / job / "state" / "agent.json").read_text())


@pytest.fixture
def project(tmp_path: Path) -> Path:
    d = tmp_path / "proj"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    return d


def test_run_locally_then_fresh_moves_aside_the_checkpoints_the_script_wrote(project: Path, tmp_path: Path) -> None:
    work = tmp_path / "w"
    flags = ["--job", "fr", "--workdir", str(work), "--master-port", str(free_port_pair()), "--no-warm-spare",
             "--grace", "3"]
    (project / "pretrained.pt").write_text("the user's, from before the job")
    hour_ago = time.time() - 3600
    os.utime(project / "pretrained.pt", (hour_ago, hour_ago))
    # `fleet run` as torchrun takes it: torchrun's flag spellings, the script and its arguments last
    ok(fleet("run", "--nproc_per_node", "2", "--max-restarts", "1", *flags, "train.py", "--steps", "3", "--name",
             "a b", "--", "--x=1", cwd=project))
    contract = json.loads(next(line for line in (work / "fr" / "logs" / "worker_1.log").read_text().splitlines()
                               if line.startswith("contract "))[len("contract "):])
    assert contract["argv"] == ["--steps", "3", "--name", "a b", "--", "--x=1"]
    port = int(flags[flags.index("--master-port") + 1])
    assert contract["env"] == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port + 1), "MS_SCHED_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "fr", "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert json.loads((project / "checkpoints" / "last-1.pt").read_text()) == {"step": 3}
    (project / "later.pt").write_text("the user's, added after the run")  # after the run's end: not the job's
    later = time.time() + 60
    os.utime(project / "later.pt", (later, later))

    r = ok(fleet("train", "--again", "--join", cwd=project))  # --again: it resumes from the script's checkpoint
    log = (work / "fr" / "logs" / "worker_0.log").read_text()
    assert "resumed from checkpoints/last-0.pt at step 3" in log

    r = ok(fleet("train", "--fresh", "--join", cwd=project))
    assert "moved 8 checkpoint file(s) the last runs wrote in the project to " in r.stderr, r.stderr
    # each start began new logs: logs/ holds the third run only (from step 0), the earlier ones are kept by number
    log = (work / "fr" / "logs" / "worker_0.log").read_text()
    assert log.count("starting at step 0") == 1 and "resumed from" not in log and "step 3" in log, log
    assert "resumed from checkpoints/last-0.pt at step 3" in (work / "fr" / "logs" / "runs" / "2" / "worker_0.log"
                                                            ).read_text()
    assert "starting at step 0" in (work / "fr" / "logs" / "runs" / "1" / "worker_0.log").read_text()
    moved = next(work.glob("fr/project.previous-*"))
    assert json.loads((moved / "checkpoints" / "last-0.pt").read_text()) == {"step": 3}  # aside, not deleted
    assert sorted(p.name for p in (moved / "my_ckpt" / "rank_1").iterdir()) == [
        "step_0001.ckpt", "step_0002.ckpt", "step_0003.ckpt"]
    assert (project / "pretrained.pt").exists() and (project / "later.pt").exists()  # the user's files stay
    assert json.loads((project / "checkpoints" / "last-0.pt").read_text()) == {"step": 3}  # the fresh run's own


def test_a_new_worker_count_is_refused_before_anything_starts(project: Path, tmp_path: Path) -> None:
    work = tmp_path / "w"
    flags = ["--job", "sz", "--workdir", str(work), "--master-port", str(free_port_pair()), "--no-warm-spare",
             "--grace", "3"]
    ok(fleet("run", "--nproc-per-node", "2", *flags, "train.py", "--steps", "2", cwd=project))
    before = agent_doc(work, "sz")
    assert before["state"] == "succeeded"

    ok(fleet("deploy", "--worker-num", "1", *flags, "--", "--steps", "2", cwd=project))
    r = fleet("train", "--again", "--join", cwd=project)
    line = refused(r, "error: job sz last ran with 2 worker(s) and is deployed now with 1: a run cannot change its "
                      "size")
    assert "'fleet train --fresh' starts it over with 1" in line and "MS_RECOVERY_PATH" not in line
    r = fleet("run", "--nproc-per-node", "1", "--again", *flags, "train.py", "--steps", "2", cwd=project)
    refused(r, "'fleet run --fresh' starts it over with 1")
    assert agent_doc(work, "sz") == before  # nothing was started: the last run's agent document as it was

    ok(fleet("train", "--fresh", "--join", cwd=project))
    after = agent_doc(work, "sz")
    assert after["state"] == "succeeded" and [p["node_id"] for p in after["processes"]] == ["sched", "worker_0"]
    assert all(p["restarts"] == 0 for p in after["processes"])


def test_fresh_moves_nothing_aside_when_the_start_cannot_pass(project: Path, tmp_path: Path) -> None:
    """`--fresh` on a busy port: the start's own check (the scheduler's ports) refuses it before the previous run
    is moved aside, so its checkpoints and state stay where the next start finds them."""
    work = tmp_path / "w"
    port = free_port_pair()
    flags = ["--job", "busy", "--workdir", str(work), "--master-port", str(port), "--no-warm-spare", "--grace", "3"]
    ok(fleet("run", *flags, "train.py", "--steps", "2", cwd=project))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        r = fleet("train", "--fresh", "--join", cwd=project)
    assert r.returncode == 2 and f"port {port}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "moved" not in r.stderr and not list(work.glob("busy/*previous*")), r.stderr
    assert json.loads((project / "checkpoints" / "last-0.pt").read_text()) == {"step": 2}  # left where it was
    assert agent_doc(work, "busy")["state"] == "succeeded"


def test_what_fresh_takes_for_a_checkpoint() -> None:
    from toolkit.jobhosts.rerun import checkpoint_like

    for path in ("./checkpoints/last.pt", "./model.PTH", "./out/step_10.ckpt", "./my_ckpt/rank_0/state",
                 "./Checkpoints/epoch3/weights.safetensors", "./run/opt.pkl"):
        assert checkpoint_like(path), path
    for path in ("./train.py", "./ckpt_utils/io.py", "./results.csv", "./logs/events.out.tfevents.1", "./notes.txt"):
        assert not checkpoint_like(path), path
