"""Issue 41: a job's outcome is its workers' exit status, and the operator's acts are recorded as such. Through the
real CLI (`fleet deploy train --join`, `fleet stop`, `fleet restart`) on the ported example (examples/ddp/ported.py):

- a port that keeps the torchrun ending, `dist.destroy_process_group()` after `trainer.finish()`, succeeds;
- a worker that exits 1 after the job finished fails the job: --join exits 1 and prints the cause, never
  "succeeded";
- `fleet restart --node` and `fleet stop` with DataLoader workers (num_workers 0 and 2): the SIGTERM reaches the
  training process only, so its last words (the final checkpoint) are written; the exits are recorded as the
  operator's restart and stop, not as what they did to a DataLoader worker; --join says `stopped` and exits 3.

(A plain torchrun script ending with `dist.destroy_process_group()` is examples/ddp/plain.py, which every
test_own_scripts.py run of it ends 0.)
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_own_scripts import JOB_TIMEOUT, last_step, until

from toolkit.testing.localjob import EXAMPLES, FLEET, FleetRun, clean_env
from toolkit.train.checkpoint import CheckpointManager, Placement
from toolkit.train.ckptfile import job_key

pytestmark = pytest.mark.timeout(900)
EXIT_STOPPED = 3
LAST_WORDS = re.compile(r"^rank (\d): stopped by SIGTERM at step (\d+), checkpoint saved$", re.M)


def project_with(tmp_path: Path, name: str, ending: str) -> Path:
    """A copy of examples/ddp with `name`: ported.py whose `trainer.finish()` is followed by `ending` (lines of
    main's body)."""
    project = tmp_path / "ddp"
    if not project.exists():
        shutil.copytree(EXAMPLES / "ddp", project)
    text = (project / "ported.py").read_text()
    old = "    trainer.finish()\n"
    assert text.count(old) == 1
    (project / name).write_text(text.replace(old, old + "".join(f"    {line}\n" for line in ending.splitlines())))
    return project


def job(tmp_path: Path, name: str, script: str, args: str) -> FleetRun:
    return FleetRun(tmp_path, name, ["--project", str(tmp_path / "ddp"), "--script", script, "--worker-num", "2",
                                     "--workdir", str(tmp_path / "work"), "--script-args", args])


def fleet(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([FLEET, *args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_destroy_after_finish_succeeds_and_a_nonzero_exit_after_the_end_fails_the_job(tmp_path: Path) -> None:
    kept = "import torch.distributed as dist\nprint(f'after the end: rank {dist.get_rank()} of " \
           "{dist.get_world_size()}', flush=True)\ndist.destroy_process_group()"
    project_with(tmp_path, "kept.py", kept)
    run = job(tmp_path, "kept", "kept.py", "--epochs 1 --workers 0")
    try:
        run.start()
        code, output = run.join(JOB_TIMEOUT)
    finally:
        run.stop()
    assert code == 0 and "job kept succeeded: every worker exited 0" in output, f"{output}\n{run.evidence()}"
    for r in range(2):
        p = run.procs()[f"worker_{r}"]
        assert p["state"] == "succeeded" and p["exits"][-1]["code"] == 0 and p["restarts"] == 0, run.evidence()
        assert f"after the end: rank {r} of 2" in run.log(f"worker_{r}.log")  # the group was still there
        assert "Process group cannot be None" not in run.log(f"worker_{r}.log")

    # the same, but rank 1 then exits 1: the job has failed, with that exit as its cause
    project_with(tmp_path, "late.py", kept + "\nif rt.rank == 1:\n    raise SystemExit(1)")
    run = job(tmp_path, "late", "late.py", "--epochs 1 --workers 0")
    try:
        run.start()
        code, output = run.join(JOB_TIMEOUT)
    finally:
        run.stop()
    assert code == 1, f"{output}\n{run.evidence()}"
    assert "job late succeeded" not in output, output
    assert re.search(r"^worker_1 on localhost \(rank 1, pid \d+\): exit code 1 at the end of the job after 0 "
                     r"restart\(s\); last lines of .*worker_1\.log:$", output, re.M), output
    procs = run.procs()
    assert procs["worker_1"]["state"] == "failed" and procs["worker_1"]["restarts"] == 0, run.evidence()
    assert procs["worker_0"]["state"] == "succeeded", run.evidence()
    assert run.doc()["state"] == "failed"


@pytest.mark.parametrize("workers", [0, 2])
def test_restart_and_stop_are_the_operators_and_the_last_words_are_written(tmp_path: Path, workers: int) -> None:
    project_with(tmp_path, "long.py", "")
    name = f"stop{workers}"
    run = job(tmp_path, name, "long.py", f"--epochs 40 --step-delay 0.05 --workers {workers}")
    try:
        run.start()
        until("both ranks past their first checkpoint", lambda: min(last_step(run, r) for r in range(2)) > 12, run)
        pid = run.procs()["worker_1"]["pid"]
        restarted = fleet(tmp_path, "restart", "--job", name, "--node", "worker_1")
        assert restarted.returncode == 0, restarted.stderr
        until("worker_1 relaunched and training", lambda: run.procs()["worker_1"]["restarts"] == 1 and
              last_step(run, 1) > 0 and run.procs()["worker_1"]["pid"] not in (None, pid), run)
        first = run.procs()["worker_1"]["exits"][0]
        assert first["pid"] == pid and first["cause"].startswith("restarted by fleet restart --node ("), first
        assert LAST_WORDS.search(run.log("worker_1.log")), run.evidence()  # it left with its last words
        resumed = last_step(run, 0)
        until("training on after the restart", lambda: min(last_step(run, r) for r in range(2)) > resumed + 5, run)
        stopped = fleet(tmp_path, "stop", "--job", name)
        assert stopped.returncode == 0, stopped.stderr
        code, output = run.join(JOB_TIMEOUT)
    finally:
        run.stop()
    assert code == EXIT_STOPPED, f"{output}\n{run.evidence()}"
    assert re.search(rf"^job {name} stopped after [\d.]+ s \(stopped by fleet stop\): 'fleet train' resumes it",
                     output, re.M), output
    assert "failed" not in output, output
    said = {}
    for r in range(2):
        p = run.procs()[f"worker_{r}"]
        assert p["last_exit"]["cause"] == "stopped by fleet stop (exit code 143)", f"worker_{r}: {p['last_exit']}"
        words = LAST_WORDS.findall(run.log(f"worker_{r}.log"))
        assert words, f"worker_{r} wrote no last words\n{run.evidence()}"
        said[r] = int(words[-1][1])
        assert "DataLoader worker" not in run.log(f"worker_{r}.log"), run.evidence()
    # every rank saved the same last step, and it is the newest checkpoint the job resumes from
    assert said[0] == said[1], said
    (host,) = (run.dir / "ckpt").glob("host_*")
    found = CheckpointManager(host.parent, keep_max=3, placement=Placement(host.name[len("host_"):]),
                              key=job_key((run.dir / "token").read_text().strip())).load_latest()
    assert found is not None and found[0] == said[0], (found and found[0], said)
