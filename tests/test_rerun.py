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

from toolkit.freeports import free_port_pair

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


def test_a_finished_job_run_again_is_refused_before_anything_is_deployed(project: Path, tmp_path: Path) -> None:
    """`fleet run` of a finished job with new arguments: refused as `train` refuses it, and before deploy, so the
    job's record and its hosts' files keep the arguments of the run that finished (it re-deployed them, then
    refused)."""
    work = tmp_path / "w"
    flags = ["--job", "fin", "--workdir", str(work), "--master-port", str(free_port_pair()), "--no-warm-spare",
             "--grace", "3"]
    ok(fleet("run", "--nproc-per-node", "1", *flags, "train.py", "--steps", "2", cwd=project))
    deployed = {p: p.read_bytes() for p in [*(project / ".toolkit").rglob("*"), *(work / "fin").glob("*")]
                if p.is_file()}
    r = fleet("run", "--nproc-per-node", "1", *flags, "train.py", "--steps", "7", cwd=project)
    refused(r, "error: job fin already finished at step 2")
    assert "deployed job" not in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in deployed} == deployed


def test_two_jobs_sharing_a_ckpt_dir_keep_apart_and_fresh_moves_only_its_own(project: Path, tmp_path: Path) -> None:
    """Two jobs given the same --ckpt-dir: each checkpoints in its own subdirectory, and `--fresh` on one moves
    only that one aside (it moved the whole shared directory); the other resumes from its own."""
    shared = tmp_path / "shared"
    work = tmp_path / "w"
    common = ["--workdir", str(work), "--no-warm-spare", "--grace", "3", "--ckpt-dir", str(shared)]
    for job in ("ja", "jb"):
        ok(fleet("run", "--nproc-per-node", "1", "--job", job, "--master-port", str(free_port_pair()), *common,
                 "train.py", "--steps", "2", "--in-ckpt-dir", cwd=project))
        assert json.loads((shared / job / "checkpoints" / "last-0.pt").read_text()) == {"step": 2}
    r = ok(fleet("train", "--job", "ja", "--fresh", "--join", cwd=project))
    assert f"moved {shared / 'ja'} to {shared / 'ja'}.previous-" in r.stderr, r.stderr
    assert sorted(p.name for p in shared.iterdir() if not p.name.startswith("ja.previous-")) == ["ja", "jb"]
    assert json.loads((shared / "jb" / "checkpoints" / "last-0.pt").read_text()) == {"step": 2}
    ok(fleet("train", "--job", "jb", "--again", "--join", cwd=project))
    assert "resumed from " in (work / "jb" / "logs" / "worker_0.log").read_text()


def test_fresh_leaves_a_checkpoint_directory_another_jobs_key_id_names(tmp_path: Path) -> None:
    """ARCHIVE_SCRIPT as --fresh runs it on a host: a checkpoint directory whose key-id is another job's (two
    projects' jobs of one name given one --ckpt-dir) stays where it is, and the line says so; the job's own moves."""
    from toolkit.contracts import ckptkey
    from toolkit.launcher.jobhosts.scripts import ARCHIVE_SCRIPT

    mine = ckptkey.key_id(ckptkey.job_key("ab" * 32))
    for owner, moved in ((ckptkey.key_id(ckptkey.job_key("cd" * 32)), False), (mine, True)):
        job_dir, ckpt = tmp_path / f"job-{moved}", tmp_path / f"ckpt-{moved}"
        (job_dir / "recovery").mkdir(parents=True)
        ckpt.mkdir()
        (ckpt / "key-id").write_text(owner + "\n")
        out = subprocess.run(["sh", "-c", ARCHIVE_SCRIPT, "sh", str(job_dir), str(ckpt), "STAMP", mine],
                             capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=True).stdout
        assert ckpt.exists() != moved and (tmp_path / f"ckpt-{moved}.previous-STAMP").exists() == moved, out
        said = "moved" if moved else "left"
        assert f"{said} {ckpt}" in out and not (job_dir / "recovery").exists(), out


def test_fresh_moves_nothing_aside_when_the_start_cannot_pass(project: Path, tmp_path: Path) -> None:
    """`--fresh` on a busy port: the start's own check (the scheduler's ports) refuses it before the previous run
    is moved aside, so its checkpoints and state stay where the next start finds them."""
    work = tmp_path / "w"
    port = free_port_pair()
    flags = ["--job", "busy", "--workdir", str(work), "--master-port", str(port), "--no-warm-spare", "--grace", "3"]
    ok(fleet("run", *flags, "train.py", "--steps", "2", cwd=project))
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the finished run's connections may linger
        taken.bind(("127.0.0.1", port))
        taken.listen()
        r = fleet("train", "--fresh", "--join", cwd=project)
    assert r.returncode == 2 and f"port {port}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "moved" not in r.stderr and not list(work.glob("busy/*previous*")), r.stderr
    assert json.loads((project / "checkpoints" / "last-0.pt").read_text()) == {"step": 2}  # left where it was
    assert agent_doc(work, "busy")["state"] == "succeeded"


def test_what_fresh_takes_for_a_checkpoint() -> None:
    from toolkit.launcher.jobhosts.rerun import checkpoint_like

    for path in ("./checkpoints/last.pt", "./model.PTH", "./out/step_10.ckpt", "./my_ckpt/rank_0/state",
                 "./Checkpoints/epoch3/weights.safetensors", "./run/checkpoint_opt.pkl", "./ckpt/moments.npy"):
        assert checkpoint_like(path), path
    for path in ("./train.py", "./ckpt_utils/io.py", "./results.csv", "./logs/events.out.tfevents.1", "./notes.txt",
                 "./data/tokens.npy", "./data/vocab.bin", "./run/opt.pkl", "./MNIST_Data/train.pt",
                 "./datasets/features.h5"):
        assert not checkpoint_like(path), path


def test_fresh_leaves_environments_and_data_and_moves_odd_names_all_or_nothing(tmp_path: Path) -> None:
    """What the red team saw moved (round 3, item 6): files a run wrote under a virtualenv's .../checkpoint/, and
    data/tokens.npy, data/vocab.bin; and a directory name ending in a newline stopped the move half way. Real
    files, the host scripts run as on a host (this machine, LocalHost): the environment and the data stay, the
    odd name moves with the others, and a move that cannot complete puts back what it moved."""
    from toolkit.launcher.jobhosts.rerun import MOVE_SCRIPT, written_files
    from toolkit.launcher.remote import LocalHost

    proj, since = tmp_path / "proj", tmp_path / "since"
    since.write_text("")
    hour_ago = time.time() - 3600
    os.utime(since, (hour_ago, hour_ago))
    made = {"venv/pyvenv.cfg": "home = /usr/bin", "venv/lib/python3/site-packages/torch/utils/checkpoint/_c.so": "",
            "venv/lib/python3/site-packages/torch/utils/checkpoint/__init__.pyi": "",
            "env2/lib/site-packages/pkg/checkpoint.pt": "", "data/tokens.npy": "corpus", "data/vocab.bin": "vocab",
            "checkpoints/last.pt": "step 3", "odd\n/ckpt/step_3.pt": "step 3, odd", "model.pth": "weights"}
    for name, text in made.items():
        (proj / name).parent.mkdir(parents=True, exist_ok=True)
        (proj / name).write_text(text)
    host = LocalHost()
    found = written_files(host, sys.executable, str(proj), str(since), "")
    assert sorted(found) == ["./checkpoints/last.pt", "./model.pth", "./odd\n/ckpt/step_3.pt"], found

    dest = tmp_path / "job" / "project.previous-1"
    (dest / "model.pth").parent.mkdir(parents=True)
    (dest / "model.pth").write_text("moved by an earlier --fresh of this stamp")  # the last move cannot be done
    r = host.run([sys.executable, "-I", "-c", MOVE_SCRIPT, str(proj), str(dest), *sorted(found)],
                 timeout=COMMAND_TIMEOUT)
    assert r.exit_code == 1 and "nothing was moved" in r.stderr and "model.pth" in r.stderr, r.stderr
    assert all((proj / name).read_text() == text for name, text in made.items())  # everything is back
    assert (dest / "model.pth").read_text() == "moved by an earlier --fresh of this stamp"

    (dest / "model.pth").unlink()
    r = host.run([sys.executable, "-I", "-c", MOVE_SCRIPT, str(proj), str(dest), *sorted(found)],
                 timeout=COMMAND_TIMEOUT)
    assert r.exit_code == 0, r.stderr
    assert (dest / "odd\n" / "ckpt" / "step_3.pt").read_text() == "step 3, odd"
    assert not (proj / "odd\n" / "ckpt" / "step_3.pt").exists() and (proj / "data" / "tokens.npy").exists()
