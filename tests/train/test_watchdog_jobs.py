"""The progress watchdog in real jobs (tests/scripts/stuck_worker.py run by the real agent and scheduler): a rank stuck
in its own code, in a C call holding its GIL and in one without it is named, its every thread's stack is in its
log before it is killed, it is replaced, and the healthy rank is neither blamed nor counted as crashed; a slow
first step and a pause of every rank trip nothing, and the pause shows as a stall. Two jobs, run side by side: a
port to toolkit.train (in-place recovery) and a torchrun-style script with toolkit.train.report() (restart
recovery). The decision itself: tests/test_watchdog.py."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from toolkit.launcher.jobhosts.tables import live_lines
from toolkit.testing.localjob import LocalJob

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stuck_worker.py"
JOB_TIMEOUT = 400.0  # s for one job on a loaded 2-core machine; normally ~40 s
POLL = 0.1  # s between looks at live.json (rewritten every second; no event says when)
DEATH = re.compile(r"^\S+ sched WARNING (worker_\d) \(pid (\d+) on \S+\) is dead: (.*)$", re.M)
STUCK = re.compile(r"^stuck (\d) at step (\d+) \((\w+)\) at [\d.]+$", re.M)

pytestmark = pytest.mark.timeout(900)


def job(root: Path, mode: str, *args: str) -> LocalJob:
    project = root / "project"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / SCRIPT.name)
    return LocalJob(root / "work", 2, ["--mode", mode, "--marks", str(root / "marks"), *args], job=f"wd-{mode}",
                    project=project, script=SCRIPT.name, node_timeout=3, cluster_time_out=120, grace=10,
                    warm_spare=False)


def deaths(j: LocalJob) -> list[tuple[str, int, str]]:
    return [(node, int(pid), why) for node, pid, why in DEATH.findall(j.log("scheduler.log"))]


def dumped_after_stuck(log: str, how: str) -> bool:
    """Whether the log has the stuck line for `how`, then faulthandler's dump of every thread with the training
    thread in stuck_worker.py's `stuck` (the control thread's stack too: every thread)."""
    at = log.find(f"({how}) at ")
    if at < 0:
        return False
    dump = log[at:]
    return ("Current thread 0x" in dump and re.search(r'File "stuck_worker.py", line \d+ in stuck', dump) is not None
            and "toolkit/train/channel.py" in dump)


def live(j: LocalJob) -> dict[str, Any]:
    try:
        return json.loads((j.dir / "recovery" / "live.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_stuck_rank_is_named_dumped_and_replaced_and_its_healthy_peer_left_alone(tmp_path: Path) -> None:
    ported = job(tmp_path / "ported", "ported", "--steps", "90", "--slow-first", "1:8", "--stuck", "1:20:sleep",
                 "--stuck", "0:45:gil", "--stuck", "1:70:c")
    # `plain`: rank 1 stuck at step 20; after the restart (from step 1: no checkpoint) every rank pauses at step 40
    # while `hold` exists (after the fault: a pause of 10 s among 40 steps would be the p99 step time)
    hold = tmp_path / "pause"
    hold.touch()
    plain = job(tmp_path / "report", "report", "--steps", "50", "--stuck", "1:20:sleep", "--pause", f"40:{hold}")
    try:
        ported.start()
        plain.start()
        # the pause of every rank (nobody waits in a collective) shows as a stall, and trips nothing
        deadline = time.monotonic() + JOB_TIMEOUT
        while not (all("pause at step 40" in plain.log(f"worker_{r}.log") for r in (0, 1))
                   and (live(plain).get("stalled_for") or 0) >= 6):
            assert time.monotonic() < deadline and plain.agent and plain.agent.poll() is None, plain.evidence()
            time.sleep(POLL)
        shown = live(plain)
        assert {r["steps_per_s"] for r in shown["ranks"].values()} == {0.0}, shown
        assert all(r["no_step_for"] >= 6 for r in shown["ranks"].values()), shown
        assert re.search(r"^stalled: no step for \d+ s", "\n".join(live_lines(shown)), re.M), shown
        assert shown["goodput"]["stalled"] >= 5.9, shown["goodput"]  # unrounded
        hold.unlink()
        assert ported.finish(JOB_TIMEOUT) == 0, ported.evidence()
        assert plain.finish(JOB_TIMEOUT) == 0, plain.evidence()
    finally:
        ported.cleanup()
        plain.cleanup()

    # ported: each fault took effect (its line, in the order given), each stuck rank and only it was named
    faults = [(f"worker_{r}", int(s), how) for r, s, how in
              sorted(STUCK.findall(ported.log("worker_0.log") + ported.log("worker_1.log")), key=lambda f: int(f[1]))]
    assert faults == [("worker_1", 20, "sleep"), ("worker_0", 45, "gil"), ("worker_1", 70, "c")], ported.evidence()
    named = deaths(ported)
    assert [node for node, _, _ in named] == [node for node, _, _ in faults], named
    for (node, step, how), (_, _, why) in zip(faults, named, strict=True):
        assert why.startswith("stuck: no step for ") and f" after step {step - 1} " in why, why
        assert ("sent no heartbeat" in why) == (how == "gil"), why  # held its GIL: silent, its agent vouching
        assert "waited for it in a collective" in why and "generation" in why, why
        assert dumped_after_stuck(ported.log(f"{node}.log"), how), ported.log(f"{node}.log")[-3000:]
    procs = ported.procs()
    for node, stuck_times in (("worker_0", 1), ("worker_1", 2)):  # each killed only for its own hangs
        causes = [e["cause"] for e in procs[node]["exits"][:-1]]
        assert len(causes) == stuck_times and all(c.startswith("stuck (no progress while its peers waited): "
                                                               "fenced by the scheduler (killed by SIGKILL)")
                                                  for c in causes), procs[node]["exits"]
        assert procs[node]["state"] == "succeeded", procs[node]
    assert "slow first step on rank 1: 8 s" in ported.log("worker_1.log")  # and it tripped nothing (above)
    assert ported.log("agent.log").count("its stacks to its log (SIGUSR1), SIGKILL (fencing) in 1 s") == 3

    # plain with report(): the pause blamed nobody; the stuck rank is named, its healthy peer relaunched with it,
    # not counted as crashed
    assert "pause at step 40" in plain.log("worker_0.log") and "pause at step 40" in plain.log("worker_1.log")
    (death, *others) = deaths(plain)
    assert death[0] == "worker_1" and death[2].startswith("stuck: no step for ") and " after step 19 " in death[2]
    assert all(why.startswith("connection closed") and node == "worker_0" for node, _, why in others), others
    assert dumped_after_stuck(plain.log("worker_1.log"), "sleep"), plain.log("worker_1.log")[-3000:]
    procs = plain.procs()
    assert [e["code"] for e in procs["worker_0"]["exits"]] == [76, 0] and procs["worker_0"]["counted_restarts"] == 0
    assert procs["worker_1"]["exits"][0]["signal"] == "SIGKILL" and procs["worker_1"]["exits"][0]["cause"].startswith(
        "stuck (no progress while its peers waited)")


def test_a_script_without_report_is_judged_by_its_collectives(tmp_path: Path) -> None:
    """A torchrun-style script that never calls report(): rank 1 spins in its own Python code at step 120 while rank
    0 waits in the step's gradient allreduce. It is named (the rank behind its peer's collective count, not the
    healthy one), its stacks dumped, killed; rank 0 relaunched with it, not counted as crashed; the job ends 0. A
    healthy slow script of the same kind (rank 1 works 7 s more at every step: rank 0 waits for it longer than the
    5 s floor) trips nothing: its bound is learned from the intervals between its collectives."""
    stuck = job(tmp_path / "plain", "plain", "--steps", "160", "--stuck", "1:120:spin")
    slow = job(tmp_path / "slow", "plain", "--steps", "7", "--slow", "1:7")
    try:
        stuck.start()
        slow.start()
        assert stuck.finish(JOB_TIMEOUT) == 0, stuck.evidence()
        assert slow.finish(JOB_TIMEOUT) == 0, slow.evidence()
    finally:
        stuck.cleanup()
        slow.cleanup()

    assert "stuck 1 at step 120 (spin) at " in stuck.log("worker_1.log")  # the fault took effect
    (death, *others) = deaths(stuck)
    node, pid, why = death
    assert node == "worker_1" and why.startswith("stuck: entered no collective for ") and "(not in any collective) " \
        "while worker_0 waited for it in a collective (theirs: " in why, why
    behind, ahead = map(int, re.search(r"after its collective (\d+) .*\(theirs: (\d+);", why).groups())
    assert behind < ahead, why
    assert all(why.startswith("connection closed") and node == "worker_0" for node, _, why in others), others
    assert dumped_after_stuck(stuck.log("worker_1.log"), "spin"), stuck.log("worker_1.log")[-3000:]
    procs = stuck.procs()
    first = procs["worker_1"]["exits"][0]
    assert first["pid"] == pid and first["signal"] == "SIGKILL", first
    assert first["cause"].startswith("stuck (no progress while its peers waited): fenced by the scheduler"), first
    assert [e["code"] for e in procs["worker_0"]["exits"]] == [76, 0] and procs["worker_0"]["counted_restarts"] == 0
    ledger = json.loads((stuck.dir / "recovery" / "ledger.json").read_text())
    assert ledger, ledger

    assert "step 7" in slow.log("worker_0.log") and "step 7" in slow.log("worker_1.log")
    assert deaths(slow) == [], deaths(slow)
    assert all(len(p["exits"]) == 1 and p["exits"][0]["code"] == 0 for p in slow.procs().values()), slow.procs()
