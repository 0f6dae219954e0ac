#!/usr/bin/env python3
"""The README's main job: the sample trainer run on this machine by toolkit, with a real fault in the middle.

Two workers train examples/train.py (`fleet deploy train --join`, no hosts: no SSH). Once both have passed step
KILL_AFTER_STEP, one of them is killed with SIGKILL. Its agent relaunches it, the other worker re-forms the group in
place and hands the replacement the current state (no step is done twice, no checkpoint is read), and the job
finishes. Then the same job runs again without the fault, and the demo compares the two final parameter digests: a
fault must change nothing in the result. Everything goes through the `fleet` command a user types; exit 0 only if
both runs succeed and the digests match. The job files (in a temporary directory) are removed at the end, or kept
for reading when something failed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLEET = str(Path(sys.executable).parent / "fleet")
WORKERS = 2
KILL_AFTER_STEP = 10  # both workers past this step (a checkpoint every 4) when the fault hits
STATUS_INTERVAL = 1.0  # s between `fleet status --json` looks: a remote step count cannot be waited on
STEP_TIMEOUT = 300.0  # s for the job to reach KILL_AFTER_STEP
JOB_TIMEOUT = 900.0  # s for a whole run
FINAL = re.compile(r"final parameters: \S+ sha256 ([0-9a-f]{64})")


def say(text: str) -> None:
    print(f"\n=== demo: {text}", flush=True)


def fleet_args(job: str, workdir: Path) -> list[str]:
    return ["--project", str(REPO / "examples"), "--job", job, "--worker-num", str(WORKERS), "--workdir",
            str(workdir), "--script-args", "--epochs 3 --ckpt-interval 4 --step-delay 0.05"]


def status(job: str, workdir: Path) -> dict:
    done = subprocess.run([FLEET, "status", "--json", *fleet_args(job, workdir)], capture_output=True, text=True,
                          timeout=60)
    return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}


def wait_for_step(job: str, workdir: Path, runner: subprocess.Popen) -> dict[str, dict]:
    deadline = time.monotonic() + STEP_TIMEOUT
    while time.monotonic() < deadline and runner.poll() is None:
        # Running with a pid: until `deploy` has written this run's job record, status may show an earlier run's.
        workers = {p["node_id"]: p for p in status(job, workdir).get("processes", [])
                   if p["role"] == "worker" and p.get("state") == "running" and p.get("pid")}
        if len(workers) == WORKERS and all((p.get("step") or 0) >= KILL_AFTER_STEP for p in workers.values()):
            return workers
        time.sleep(STATUS_INTERVAL)
    raise SystemExit(f"demo: the job did not reach step {KILL_AFTER_STEP} (see `fleet logs --job {job}`)")


def run(job: str, workdir: Path, fault: bool) -> str:
    """One `fleet deploy train --join`; with `fault`, kill -9 a worker mid-training. The final digest."""
    runner = subprocess.Popen([FLEET, "deploy", "train", "--join", *fleet_args(job, workdir)],
                              start_new_session=True)
    try:
        if fault:
            victim = wait_for_step(job, workdir, runner)["worker_1"]
            os.kill(victim["pid"], signal.SIGKILL)
            say(f"kill -9 worker_1 (pid {victim['pid']}) at step {victim['step']}")
        code = runner.wait(JOB_TIMEOUT)
    except BaseException:
        subprocess.run([FLEET, "stop", *fleet_args(job, workdir)], timeout=120)
        runner.kill()
        raise
    if code != 0:
        raise SystemExit(f"demo: `fleet train --join` exited {code}; the logs are under {workdir / job}/logs")
    subprocess.run([FLEET, "status", *fleet_args(job, workdir)], timeout=60)
    log = workdir / job / "logs" / "worker_0.log"
    found = FINAL.findall(log.read_text())
    if not found:
        raise SystemExit(f"demo: no 'final parameters' line in {log}")
    return found[-1]


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="toolkit-demo-"))
    say(f"2 workers on this machine, one killed mid-training (job files under {workdir})")
    same = False
    try:
        faulted = run("demo", workdir, fault=True)
        resumed = re.findall(r"rank \d+: resumed from step \d+.*",
                             (workdir / "demo" / "logs" / "worker_0.log").read_text())
        say(f"recovered in place: {resumed[-1] if resumed else 'no rollback seen'}")
        say("the same job without the fault, for comparison")
        reference = run("demo-reference", workdir, fault=False)
        same = faulted == reference
        say(f"final parameters with the fault    sha256 {faulted}")
        say(f"final parameters without the fault sha256 {reference}")
        say("bitwise equal: the fault changed nothing in the result" if same else "DIFFERENT: this is a bug")
    finally:
        if same:  # both jobs ended (fleet train --join returned): nothing of them runs; their files can go
            shutil.rmtree(workdir, ignore_errors=True)
            say(f"removed the job files ({workdir})")
        else:
            say(f"the job files are kept for reading: {workdir}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
