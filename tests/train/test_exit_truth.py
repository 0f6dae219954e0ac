"""Issue 41: a job's outcome is its workers' exit status, and the operator's acts are recorded as such. Through the
real CLI (`fleet deploy train --join`, `fleet stop`, `fleet restart`) on the ported example (examples/ddp/ported.py):

- a port that keeps the torchrun ending, `dist.destroy_process_group()` after `trainer.finish()`, succeeds;
- a worker that exits 1 after the job finished fails the job: --join exits 1 and prints the cause, never
  "succeeded";
- `fleet restart --node` and `fleet stop` with DataLoader workers (num_workers 0 and 2): the SIGTERM reaches the
  training process only, so its last words (the final checkpoint) are written; the exits are recorded as the
  operator's restart and stop, not as what they did to a DataLoader worker; --join and `status --watch` say
  `stopped` and exit 3;
- 20 single kills of a plain script reporting its steps (examples/ddp/plain.py with toolkit.train.report; two jobs
  at once, 10 kills each) are 20 incidents, each naming the killed rank, with the healthy one listed apart as
  relaunched (no phantom `exit code 76` incident), and `status` counts the relaunches apart from the restarts.

(A plain torchrun script ending with `dist.destroy_process_group()` is examples/ddp/plain.py, which every
test_own_scripts.py run of it ends 0.)
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_own_scripts import JOB_TIMEOUT, REPORTING, last_step, project, reporting_script, until

from toolkit.contracts import rundoc
from toolkit.contracts.ckptkey import job_key
from toolkit.testing.localjob import EXAMPLES, FLEET, FleetRun, clean_env
from toolkit.train.ckpt.manager import CheckpointManager, Placement

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
    """Two jobs at once (one's start-up overlaps the other's): `kept` ends as the torchrun port does and succeeds;
    `late` is the same, but rank 1 then exits 1: the job has failed, with that exit as its cause."""
    kept = "import torch.distributed as dist\nprint(f'after the end: rank {dist.get_rank()} of " \
           "{dist.get_world_size()}', flush=True)\ndist.destroy_process_group()"
    project_with(tmp_path, "kept.py", kept)
    project_with(tmp_path, "late.py", kept + "\nif rt.rank == 1:\n    raise SystemExit(1)")
    runs = [job(tmp_path, name, f"{name}.py", "--epochs 1 --workers 0") for name in ("kept", "late")]
    try:
        for run in runs:
            run.start()
        (code, output), (late_code, late_output) = [run.join(JOB_TIMEOUT) for run in runs]
    finally:
        for run in runs:
            run.stop()
    run = runs[0]
    assert code == 0 and "job kept succeeded: every worker exited 0" in output, f"{output}\n{run.evidence()}"
    for r in range(2):
        p = run.procs()[f"worker_{r}"]
        assert p["state"] == "succeeded" and p["exits"][-1]["code"] == 0 and p["restarts"] == 0, run.evidence()
        assert f"after the end: rank {r} of 2" in run.log(f"worker_{r}.log")  # the group was still there
        assert "Process group cannot be None" not in run.log(f"worker_{r}.log")

    run = runs[1]  # rank 1 exited 1 after the end
    assert late_code == 1, f"{late_output}\n{run.evidence()}"
    assert "job late succeeded" not in late_output, late_output
    assert re.search(r"^worker_1 on localhost \(rank 1, pid \d+\): exit code 1 at the end of the job after 0 "
                     r"restart\(s\); last lines of .*worker_1\.log:$", late_output, re.M), late_output
    procs = run.procs()
    assert procs["worker_1"]["state"] == "failed" and procs["worker_1"]["restarts"] == 0, run.evidence()
    assert procs["worker_0"]["state"] == "succeeded", run.evidence()
    assert run.doc()["state"] == "failed"


def test_restart_and_stop_are_the_operators_and_the_last_words_are_written(tmp_path: Path) -> None:
    """With DataLoader workers and without (num_workers 2 and 0): two jobs at once, one per thread (each mostly
    waits on its start-up and its steps); every assertion of each is raised, the first failure first."""
    project_with(tmp_path, "long.py", "")
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(restart_and_stop, tmp_path, workers) for workers in (0, 2)]
    for future in done:
        future.result()


def restart_and_stop(tmp_path: Path, workers: int) -> None:
    """`fleet restart --node worker_1`, then `fleet stop`, of a job of long.py with `workers` DataLoader workers."""
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
    watched = fleet(tmp_path, "status", "--watch", "--interval", "0.5", "--job", name)  # the stopped job: at once
    assert watched.returncode == EXIT_STOPPED, f"{watched.stdout}\n{watched.stderr}"
    assert re.search(rf"^job {name} stopped \(stopped by fleet stop\): 'fleet train' resumes it", watched.stderr,
                     re.M), watched.stderr
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


# --- one fault, one incident ---------------------------------------------------------------------------------


KILLS = 10  # per job, in each of two jobs at once: 20 single kills in all


def live(run: FleetRun) -> dict[str, Any]:
    """The scheduler's live.json of the job (read straight from its directory: a status per look costs a Python)."""
    for path in run.dir.rglob(rundoc.LIVE_FILE):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}  # mid-rename: the next look has it
    return {}


def trained_again(run: FleetRun, incidents: int) -> bool:
    """Both ranks run and the scheduler has seen every rank train again since incident number `incidents` (or
    since the start); AssertionError at once when it counts more incidents (a phantom one)."""
    doc = live(run)
    count = doc.get("incidents")
    assert count is None or count <= incidents, f"{count} incidents after {incidents} kill(s): {doc}"
    last = doc.get("last_incident") or {}
    if count != incidents or (incidents and last.get("time_to_recover") is None) or not doc.get("formed"):
        return False
    if not incidents and not all(isinstance(r.get("step"), int) for r in (doc.get("ranks") or {}).values()):
        return False  # not training yet: a kill now is before the job formed, no incident
    procs = run.procs()
    return all(procs[f"worker_{r}"]["pid"] and procs[f"worker_{r}"]["state"] == "running" for r in range(2))


def test_single_kills_of_a_plain_script_are_one_incident_each_naming_the_killed_rank(tmp_path: Path) -> None:
    """Issue 41: after a kill -9 of a plain script reporting its steps, the healthy rank that leaves to be
    relaunched (exit 76) never makes a second incident (it did in about 1 of 5 kills), the incident names the
    killed rank as failed and the other as relaunched with it, and `status` does not count the relaunch as a
    restart of the healthy rank. Two jobs at once, one per thread, KILLS each: each mostly waits on its
    relaunched ranks' start-up, which the other's overlaps."""
    reporting_script(project(tmp_path))
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(single_kills, tmp_path, f"kills{n}") for n in range(2)]
    for future in done:
        future.result()


def single_kills(tmp_path: Path, name: str) -> None:
    """KILLS kill -9s of a rank chosen at random of job `name`, each once every rank trains again, then the checks."""
    run = FleetRun(tmp_path, name, ["--project", str(tmp_path / "ddp"), "--script", REPORTING, "--worker-num", "2",
                                    "--workdir", str(tmp_path / "work"), "--script-args",
                                    "--epochs 1000 --step-delay 0.05 --workers 0"])
    rng = random.Random()
    victims: list[int] = []
    try:
        run.start()
        for k in range(KILLS):
            until(f"{name}: every rank training again after {k} kill(s) {victims}",
                  lambda k=k: trained_again(run, k), run)
            victim = rng.randrange(2)
            os.kill(run.procs()[f"worker_{victim}"]["pid"], signal.SIGKILL)
            victims.append(victim)
        until(f"{name}: every rank training again after {KILLS} kills {victims}", lambda: trained_again(run, KILLS),
              run)
        status = fleet(tmp_path, "status", "--job", name, "--json")
        stopped = fleet(tmp_path, "stop", "--job", name)
        assert stopped.returncode == 0, stopped.stderr
        assert run.join(JOB_TIMEOUT)[0] == EXIT_STOPPED, run.evidence()
    finally:
        run.stop()
    incidents = json.loads(fleet(tmp_path, "report", "--json", "--job", name).stdout)["incidents"]
    assert [(i["cause"], i["processes"], i["relaunched"]) for i in incidents] == [
        ("killed by SIGKILL", [f"worker_{v}"], [f"worker_{1 - v}"]) for v in victims], (name, incidents)
    shown = {p["node_id"]: p for p in json.loads(status.stdout)["processes"]}
    for r in range(2):  # its own kills are its restarts; the others' are its relaunches
        assert (shown[f"worker_{r}"]["restarts"], shown[f"worker_{r}"]["relaunched"]) == \
            (victims.count(r), victims.count(1 - r)), (name, shown[f"worker_{r}"], victims)
