"""Checkpoint directories no restart can fix (issue 43 item 7), end to end through the real agent: a read-only one
(a real tmpfs remounted read-only), a full one (a real 256 KiB tmpfs filled up) and one every user may write (mode
1777). A torchrun-style script (examples/ddp/plain.py, its own torch.save) fails on its first save; before, its
agent relaunched it with backoff, three times, to fail the same way (10-19 s). Now the worker's wrapper finds the
directory unusable and says so in one line, first, and the agent gives up at once: no restart, the line as the
cause. The Trainer (examples/train.py) refuses such a directory itself, in one line, exit 2, given up at once too.
(A full disk costs the Trainer its checkpoints, not the run: tests/train/test_full_disk_status.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from toolkit.contracts import protocol
from toolkit.testing.localjob import EXAMPLES, LocalJob

JOB_TIMEOUT = 300.0  # s for the job to end on a loaded 2-core machine; normally ~10 s
FIX = "choose a --ckpt-dir of your own on a disk with room, or fix this one, then run the job again"

pytestmark = pytest.mark.timeout(600)


def fill(mount: Path) -> None:
    """Write a file until the disk is full (a real ENOSPC)."""
    fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == 28, e
    finally:
        os.close(fd)


def ended(job: LocalJob) -> dict:
    """Run the job to its end: it must fail; worker_0's record in agent.json."""
    try:
        job.start()
        assert job.finish(JOB_TIMEOUT) == 1, job.evidence()
    finally:
        job.cleanup()
    return job.procs()["worker_0"]


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_torchrun_style_script_on_a_directory_no_restart_can_fix_is_given_up_at_once_with_one_line(
        tiny_tmpfs: Path, tmp_path: Path, fault: str) -> None:
    job_dir = tiny_tmpfs / "ckpt" / "plain"
    job_dir.mkdir(parents=True, mode=0o700)
    if fault == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True, timeout=30)
        want = f"checkpoint directory {job_dir} is on a read-only file system; {FIX}"
    else:
        fill(tiny_tmpfs)
        want = f"checkpoint directory {job_dir} is on a full disk (0 KiB free); {FIX}"
    job = LocalJob(tmp_path / "work", 1, ["--epochs", "1", "--ckpt-every", "2"], job="plain", project=EXAMPLES / "ddp",
                   script="plain.py", ckpt_dir=str(tiny_tmpfs / "ckpt"), node_timeout=3, cluster_time_out=120)
    proc = ended(job)
    log = job.log("worker_0.log")
    assert "epoch 0 step 2 loss" in log, log[-3000:]  # it trained, then failed at its first save: the fault took effect
    assert proc["restarts"] == 0, proc  # given up at once: no relaunch, no backoff
    cause = proc["last_exit"]["cause"]
    assert cause.startswith(f"{want} (no restart can fix that; the script failed: ") and \
        cause.endswith(f"(exit code {protocol.EXIT_FATAL})"), cause
    assert log.count(f"toolkit.train: {want}") == 1, log[-3000:]  # one line in the log too
    assert cause in job.doc()["failure"]["cause"]


@pytest.mark.parametrize("fault", ["1777", "read-only"])
def test_the_trainer_refuses_such_a_directory_in_one_line_and_is_given_up_at_once(
        tiny_tmpfs: Path, tmp_path: Path, fault: str) -> None:
    root = tiny_tmpfs / "ckpt"
    (root / "local").mkdir(parents=True, mode=0o700)
    if fault == "1777":
        (root / "local").chmod(0o1777)  # noqa: S103 - the fault: a directory every user may write
        want = f"checkpoint directory {root / 'local'} is writable by other users (mode 1777)"
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True, timeout=30)
        want = "read-only file system"
    job = LocalJob(tmp_path / "work", 1, ["--epochs", "1"], ckpt_dir=str(root), node_timeout=3,
                   cluster_time_out=120)
    proc = ended(job)
    assert proc["restarts"] == 0, proc
    cause = proc["last_exit"]["cause"]  # the Trainer's line, as the agent reports it (no error file: its last word)
    assert want in cause and cause.endswith("(exit code 2)") and "\n" not in cause, cause
    said = [line for line in job.log("worker_0.log").splitlines() if want in line]
    assert len(said) == 1 and "Traceback" not in job.log("worker_0.log"), job.log("worker_0.log")[-3000:]
    assert job.doc()["failure"]["cause"] == cause
