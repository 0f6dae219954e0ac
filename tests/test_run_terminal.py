"""`fleet run` in a terminal, as a torchrun user types it (the real CLI under a pseudo-terminal, jobs on this
machine): Ctrl-C stops what it started, with last words (a toolkit.train script saves a final checkpoint), and a
second Ctrl-C stops it at once; a second job with no port typed runs beside the first; the recorded job is the
default (`fleet run train.py` again keeps its 2 workers, and a size change is refused before anything is
redeployed); `--detach` leaves the job running."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from toolkit.contracts.protocol import RECOVERY_RESTART
from toolkit.launcher.jobhosts.output import table_console
from toolkit.launcher.jobhosts.tables import recovery_lines
from toolkit.launcher.jobhosts.view import RECOVERY_WHY, ProcStatus, recovery_mode
from toolkit.procs import is_running
from toolkit.testing.terminal import Terminal
from toolkit.testing.waits import wait_for

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "scripts" / "resume_worker.py"
EXAMPLE = REPO / "examples" / "train.py"
BOUND = 240.0  # s for a job to start, train a few steps or end, on a loaded machine
EXIT_STOPPED = 130
PROGRESS = re.compile(r"progress: step (?P<step>\d+)/(?P<total>\d+) \[[#-]{20}\] [\d.]+%, ETA [^\r\n]+")

pytestmark = pytest.mark.timeout(900)

# A worker that will not stop on SIGTERM: only SIGKILL ends it (the second Ctrl-C's case).
STUBBORN = """\
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("stubborn up", flush=True)
while True:
    time.sleep(0.2)
"""


def fleet_in_terminal(*args: str, cwd: Path) -> Terminal:
    return Terminal([str(BIN / "fleet"), *args], cwd=cwd)


def finish(term: Terminal, code: int) -> str:
    """Wait for the command's end; its output, asserting its exit code and that no traceback was printed."""
    got = term.wait(BOUND)
    assert got == code and "Traceback" not in term.output, f"exit {got}\n{term.output}"
    return term.output


def job_pids(job_dir: Path) -> list[tuple[int, int | None]]:
    """(pid, start ticks) of the job's agent and of every process it recorded running."""
    doc = json.loads((job_dir / "state" / "agent.json").read_text())
    pid, ticks = (int(w) for w in (job_dir / "state" / "agent.pid").read_text().split())
    return [(pid, ticks)] + [(p["pid"], p["start_ticks"]) for p in doc["processes"] if p.get("pid")]


def agent_doc(job_dir: Path) -> dict[str, Any]:
    return json.loads((job_dir / "state" / "agent.json").read_text())


def running_workers(job_dir: Path, count: int) -> list[tuple[int, int | None]]:
    """Wait until the job's `count` workers run; their and the agent's (pid, start ticks)."""
    def up() -> list[tuple[int, int | None]]:
        try:
            doc = agent_doc(job_dir)
        except (OSError, ValueError):
            return []
        workers = [p for p in doc["processes"] if p["rank"] is not None and p["state"] == "running"]
        return job_pids(job_dir) if len(workers) == count else []
    return wait_for(f"{count} running workers in {job_dir}", up, BOUND)


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    """The jobs' workdir; whatever job a failed test left running there is killed at the end."""
    yield tmp_path / "w"
    for stop in (tmp_path / "w").glob("*/stop.sh"):
        subprocess.run([str(stop), "--timeout", "0"], capture_output=True, timeout=BOUND)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    d = tmp_path / "proj"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    (d / "stubborn.py").write_text(STUBBORN)
    return d


def test_ctrl_c_stops_the_job_with_a_final_checkpoint(tmp_path: Path, work: Path) -> None:
    project = tmp_path / "ex"
    project.mkdir()
    shutil.copy(EXAMPLE, project / "train.py")
    with fleet_in_terminal("run", "--nproc-per-node", "2", "--workdir", str(work), "--no-warm-spare",
                           "--data-path", str(REPO / "examples" / "MNIST_Data"), "--grace", "60",
                           "train.py", "--epochs", "100", "--ckpt-interval", "100000", "--step-delay", "0.05",
                           cwd=project) as term:
        pids = running_workers(work / "ex", 2)
        term.wait_for_text("job ex started on 1 host(s)", BOUND)
        log = work / "ex" / "logs" / "worker_0.log"
        wait_for("step 3 in worker_0's log", lambda: log.exists() and "step: 3," in log.read_text(), BOUND,
                 evidence=lambda: term.output[-3000:])
        # `run` prints the job's progress (the Trainer knows its total): step/total, a bar, the ETA at its pace
        term.wait_for_text("progress: step ", BOUND)
        term.ctrl_c()
        out = finish(term, EXIT_STOPPED)
    progress = PROGRESS.search(out)
    assert progress, out
    step, total = int(progress["step"]), int(progress["total"])
    assert 0 < step < total and total % 100 == 0, out  # 100 epochs of the same number of steps
    assert "Ctrl-C: stopping job ex" in out and "job ex stopped (Ctrl-C)" in out, out
    assert [pid for pid, ticks in pids if is_running(pid, ticks)] == []  # nothing of the job is left
    doc = agent_doc(work / "ex")
    assert doc["state"] == "stopped", doc["state"]
    # the last words: rank 0 saved the step it stopped at, though no checkpoint interval was reached
    said = [line for line in log.read_text().splitlines() if "stopped by SIGTERM at step" in line]
    assert said and said[-1].endswith("checkpoint saved"), log.read_text()[-2000:]
    assert [p for p in (work / "ex" / "ckpt").rglob("*") if p.is_file()], f"no checkpoint in {work / 'ex' / 'ckpt'}"


def test_a_second_ctrl_c_stops_at_once(project: Path, work: Path) -> None:
    with fleet_in_terminal("run", "--job", "stub", "--workdir", str(work), "--no-warm-spare", "--grace", "600",
                           "stubborn.py", cwd=project) as term:
        pids = running_workers(work / "stub", 1)
        term.wait_for_text("job stub started on 1 host(s)", BOUND)
        term.ctrl_c()
        term.wait_for_text("Ctrl-C again stops it at once", BOUND)
        term.ctrl_c()
        out = finish(term, EXIT_STOPPED)  # well before the 600 s of grace
    assert "job stub killed (second Ctrl-C)" in out, out
    assert [pid for pid, ticks in pids if is_running(pid, ticks)] == []


def test_two_jobs_without_a_port_and_the_recorded_job_as_default(project: Path, tmp_path: Path, work: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(WORKER, other / "train.py")
    (project / "hold").write_text("")
    # the first job, left running (--detach), with 2 workers and no port typed
    with fleet_in_terminal("run", "--detach", "--nproc-per-node", "2", "--workdir", str(work), "--no-warm-spare",
                           "--grace", "3", "train.py", "--steps", "2", "--hold", "hold", cwd=project) as term:
        out = finish(term, 0)
    assert "job proj started on 1 host(s)" in out, out
    first = running_workers(work / "proj", 2)
    # a second job in another project, no port typed either: it runs and ends beside the first
    with fleet_in_terminal("run", "--workdir", str(work), "--no-warm-spare", "train.py", "--steps", "2",
                           cwd=other) as term:
        out = finish(term, 0)
    assert "job other succeeded" in out and "[rank0]: done" in out, out  # its output, as torchrun's --tee shows it
    assert all(is_running(pid, ticks) for pid, ticks in first)  # the first one still runs
    ports = {json.loads((d / ".toolkit" / "jobs" / f"{d.name}.json").read_text())["sched_port"]
             for d in (project, other)}
    assert len(ports) == 2, ports

    (project / "hold").unlink()  # the first job ends
    wait_for("the first job's end", lambda: agent_doc(work / "proj")["state"] == "succeeded", BOUND)
    record = (project / ".toolkit" / "jobs" / "proj.json").read_text()
    # a size change is refused before anything is redeployed: the record still says 2 workers
    with fleet_in_terminal("run", "--nproc-per-node", "1", "--again", "train.py", "--steps", "3",
                           cwd=project) as term:
        out = finish(term, 2)
    assert "last ran with 2 worker(s) and this run asks for 1" in out and "deployed job" not in out, out
    assert (project / ".toolkit" / "jobs" / "proj.json").read_text() == record
    # no flag at all: the recorded job (2 workers, its workdir, its port) runs again
    with fleet_in_terminal("run", "--again", "--local-ranks-filter", "1", "train.py", "--steps", "3",
                           cwd=project) as term:
        out = finish(term, 0)
    assert "job proj succeeded" in out, out
    # its output: rank 1's alone, and only this run's (each start begins new logs)
    assert "[rank1]: resumed from checkpoints/last-1.pt at step " in out and "[rank0]" not in out, out
    assert "[rank1]: starting at step 0" not in out, out
    doc = agent_doc(work / "proj")
    assert [p["node_id"] for p in doc["processes"]] == ["sched", "worker_0", "worker_1"]
    assert json.loads((project / ".toolkit" / "jobs" / "proj.json").read_text())["sched_port"] in ports


def test_a_module_and_a_program_run_as_torchrun_runs_them(project: Path, work: Path) -> None:
    """`fleet run -m pkg.mod` runs a module as `python -m` does (from the project, with its arguments), and
    `--no-python PROGRAM` a program that is not Python, with the same environment."""
    (project / "pkg").mkdir()
    (project / "pkg" / "__init__.py").write_text("")
    shutil.copy(WORKER, project / "pkg" / "mod.py")
    with fleet_in_terminal("run", "--job", "mod", "--workdir", str(work), "--no-warm-spare", "-m", "pkg.mod",
                           "--steps", "2", cwd=project) as term:
        out = finish(term, 0)
    assert "[rank0]: step 2" in out and "job mod succeeded" in out, out
    contract = next(line for line in (work / "mod" / "logs" / "worker_0.log").read_text().splitlines()
                    if line.startswith("contract "))
    assert json.loads(contract[len("contract "):])["argv"] == ["--steps", "2"]
    # a module that is not there: the set-up error fails the job at once, not after 3 restarts with backoff
    with fleet_in_terminal("run", "--job", "nomod", "--workdir", str(work), "--no-warm-spare", "-m", "pkg.nothere",
                           cwd=project) as term:
        out = finish(term, 1)
    assert "-m pkg.nothere: no such module" in out and "after 0 restart(s)" in out, out
    (project / "prog.sh").write_text('#!/bin/sh\necho "rank $RANK of $WORLD_SIZE: $*"\n')
    (project / "prog.sh").chmod(0o755)
    with fleet_in_terminal("run", "--job", "prog", "--workdir", str(work), "--no-warm-spare", "--nproc-per-node",
                           "2", "--no-python", "./prog.sh", "a b", cwd=project) as term:
        out = finish(term, 0)
    assert "[rank1]: rank 1 of 2: a b" in out and "[rank0]: rank 0 of 2: a b" in out, out
    # the status table in an 80-column terminal: its compact layout, nothing cut to `loc…`
    with Terminal([str(BIN / "fleet"), "status", "--job", "prog"], cwd=project, columns=80) as term:
        out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", finish(term, 0)).replace("\r", "")
    rows = [line for line in out.splitlines() if line.startswith("localhost ")]
    assert [row.split()[:4] for row in rows] == [["localhost", "sched", "-", "succeeded"],
                                                 ["localhost", "worker_0", "-", "succeeded"],
                                                 ["localhost", "worker_1", "-", "succeeded"]], out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80, out


def test_the_recovery_note_under_the_status_table_wraps_to_an_80_column_terminal() -> None:
    """`fleet status`'s `recovery:` line (up to 160 characters) wraps on words in an 80-column terminal, its words
    all kept; through a pipe (table_console's own width) it stays one line."""
    whys = [*RECOVERY_WHY.values()]
    worker = ProcStatus("h", "worker_0", "worker", 0, 1, "running", 0, None, None, None, RECOVERY_RESTART)
    whys.append((recovery_mode([worker], forced=True) or {})["why"])  # --torchrun-script's
    for why in whys:
        lines = recovery_lines(why, 80)
        assert len(f"recovery: {why}") > 80 and len(lines) > 1, why
        assert max(map(len, lines)) <= 80 and " ".join(line.strip() for line in lines) == f"recovery: {why}"
        assert recovery_lines(why, table_console().width) == [f"recovery: {why}"]
