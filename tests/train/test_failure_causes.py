"""A failed job says what really happened, the same everywhere: `fleet status`, the logs, the final error of
`--join` and the goodput ledger name the first cause (the script's own exception or exit code, then a signal from
outside, then the scheduler's fencing), never what ended the process afterwards. Each failure runs as a user runs
a job (`fleet deploy train --join`, locally, --max-restarts 0 so that the first failure fails the job), all of them
at once (tests/scripts/cause_worker.py fails as asked on its last rank; a kill and a hang come from the test).

The failures seen before: a script raising RuntimeError was reported as "killed by SIGKILL" (the scheduler had it
fenced when its connection closed, before its own exit), and one raising under the Trainer as SIGABRT (the
interpreter's teardown of its broken gloo group)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from toolkit.testing.localjob import FLEET, FleetRun, clean_env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cause_worker.py"
JOB_TIMEOUT = 300.0  # s for a job on a loaded 2-core machine (several run at once); normally ~15 s
POLL = 0.1  # s between looks at a log: no event tells that a line was appended

pytestmark = pytest.mark.timeout(900)

# name: (workers, script arguments, what the test does at step 5, the first cause every view must name)
CASES = {
    "raise": (1, "--fault raise", None, "RuntimeError: boom at step 5 (exit code 1)"),
    "raise-trainer": (2, "--fault raise --trainer", None, "RuntimeError: boom at step 5 (exit code 1)"),
    "exit3": (1, "--fault exit3", None, "exit code 3"),
    "segv": (1, "--fault segv", None, "killed by SIGSEGV"),
    "record": (1, "--fault record", None, "ValueError: bad input at step 5, as @record wrote it (exit code 1)"),
    "sigkill": (1, "--fault none", signal.SIGKILL, "killed by SIGKILL"),
    "hang": (1, "--fault none", signal.SIGSTOP, "heartbeat silence"),
}


def fleet_json(cwd: Path, *args: str) -> dict:
    done = subprocess.run([FLEET, *args, "--json"], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_view_names_the_first_cause(tmp_path: Path) -> None:
    runs: dict[str, FleetRun] = {}
    for name, (world, args, _, _) in CASES.items():
        project = tmp_path / name
        project.mkdir()
        (project / "cause_worker.py").write_text(SCRIPT.read_text())
        runs[name] = FleetRun(project, name, ["--script", "cause_worker.py", "--worker-num", str(world),
                                             "--workdir", str(tmp_path / "work"), "--max-restarts", "0",
                                             "--node-timeout", "3", "--no-warm-spare", "--script-args", args])
    try:
        for run in runs.values():
            run.start()
        for name, (_, _, sig, _) in CASES.items():
            if sig is not None:  # from outside, once it trains
                run = runs[name]
                deadline = time.monotonic() + JOB_TIMEOUT
                while not re.search(r"^rank 0 step 5$", run.log("worker_0.log"), re.M):
                    assert time.monotonic() < deadline, f"{name}: never at step 5\n{run.evidence()}"
                    time.sleep(POLL)
                os.kill(run.procs()["worker_0"]["pid"], sig)
        outputs = {name: run.join(JOB_TIMEOUT) for name, run in runs.items()}
    finally:
        for run in runs.values():
            run.stop()
    for name, (world, _, _, cause) in CASES.items():
        run, (code, output) = runs[name], outputs[name]
        victim = f"worker_{world - 1}"
        evidence = f"{name}:\n{output}\n{run.evidence()}"
        assert code == 1, evidence
        # --join's final error: the process that gave up, and why
        assert re.search(rf"{victim} on localhost \(rank {world - 1}, pid \d+\): {re.escape(cause)}", output), evidence
        # fleet status: the process's last exit
        status = fleet_json(run.cwd, "status", "--job", name)
        (proc,) = [p for p in status["processes"] if p["node_id"] == victim]
        assert cause in proc["last_exit"], f"{proc['last_exit']!r}\n{evidence}"
        # the logs: the agent's (its give-up) and the scheduler's (the failure it stopped the job for)
        assert re.search(rf"{victim}: GAVE UP: rank {world - 1}, pid \d+ .*{re.escape(cause)}", run.log("agent.log")), \
            evidence
        assert cause in run.log("scheduler.log"), evidence
        # the ledger: the incident's cause, and the job's failure
        ledger = json.loads((run.dir / "recovery" / "ledger.json").read_text())
        assert ledger["outcome"] == "failed" and cause in ledger["failure"], ledger
        assert [i["cause"] for i in ledger["incidents"]][:1] == [cause] or cause in ledger["incidents"][0]["cause"], \
            ledger["incidents"]
        if name == "raise-trainer":  # the survivor was stopped with the job, its exit no failure of its own
            assert "SIGABRT" not in run.log("agent.log"), evidence
