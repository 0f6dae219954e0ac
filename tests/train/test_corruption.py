"""Silent corruption in real jobs (issue 44): bits flipped by the fault injector (TOOLKIT_INJECT_CORRUPTION in a
worker's env file, toolkit.train.inject) in one rank's parameters or optimizer state; the replica check
(toolkit.train.replicas) must name the rank and the steps the fault started in, heal it, and the run must end
bitwise equal to an uninterrupted one. With two replicas there is no majority: both go back and redo the steps.
The same rank corrupt twice is fenced: with no spare to take its host the job stops with one line naming it (a spare
taking it is tests/e2e/test_corruption_on_hosts.py). A state taken in a recovery that changed after the transfer's
own check is caught by the check right after the recovery."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from rich.console import Console

from toolkit.launcher.jobhosts.tables import live_lines
from toolkit.launcher.runreport import report_data, summary_tables
from toolkit.testing.localjob import LocalJob

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "corrupt_worker.py"
JOB_TIMEOUT = 300.0  # s for one job on a loaded 2-core machine; normally ~5 s
FINAL = re.compile(r"^final parameters: \S+ sha256 ([0-9a-f]{64})$", re.M)

pytestmark = pytest.mark.timeout(900)


def job(root: Path, world: int, inject: str = "", *args: str) -> LocalJob:
    """A job of the small script, checking every 4 steps, with the script's `args`; `inject` written into every
    worker's env file."""
    project = root / "project"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / SCRIPT.name)
    j = LocalJob(root / "work", world, ["--verify-every", "4", *args], job="corrupt", project=project,
                 script=SCRIPT.name, node_timeout=3, cluster_time_out=120, grace=20)
    if inject:
        for r in range(world):
            with open(j.dir / "env" / f"worker_{r}.env", "a") as f:
                f.write(f"export TOOLKIT_INJECT_CORRUPTION='{inject}'\n")
    return j


def run(*jobs: LocalJob) -> list[int]:
    """Run the jobs at once (small jobs share the machine); their agents' exit codes."""
    try:
        for j in jobs:
            j.start()
        return [j.finish(JOB_TIMEOUT) for j in jobs]
    finally:
        for j in jobs:
            j.cleanup()


def final(j: LocalJob) -> str:
    (digest,) = FINAL.findall(j.log("worker_0.log"))
    return digest


def recorded(j: LocalJob, name: str) -> Any:
    """The scheduler's ledger.json or live.json, as `fleet report` and `fleet status` read them."""
    return json.loads((j.dir / "recovery" / name).read_text())


def corruption_causes(j: LocalJob) -> list[str]:
    return [i["cause"] for i in recorded(j, "ledger.json")["incidents"] if i["cause"].startswith("corruption")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], str]:
    """The final digest of an uninterrupted run per world size (computed once each)."""
    digests: dict[int, str] = {}

    def get(world: int) -> str:
        if world not in digests:
            j = job(tmp_path_factory.mktemp(f"reference{world}"), world)
            assert run(j) == [0], j.evidence()
            digests[world] = final(j)
        return digests[world]

    return get


def test_world_3_a_flipped_parameter_and_optimizer_state_are_named_healed_and_change_nothing(
        tmp_path: Path, reference: Callable[[int], str]) -> None:
    faulted = job(tmp_path, 3, "rank=1,step=5,bit=20;rank=2,step=14,in=optimizer,bit=22")
    want = reference(3)
    assert run(faulted) == [0], faulted.evidence()
    logs = [faulted.log(f"worker_{r}.log") for r in range(3)]
    # the faults took effect where they were meant to
    assert "rank 1: injected corruption after step 5: flipped bit 20 of params 0.weight[0]" in logs[1]
    assert "rank 2: injected corruption after step 14: flipped bit 22 of optimizer state[0][momentum_buffer][0]" \
        in logs[2]
    for r in range(3):  # every rank names the odd one, the window, and goes back to the last good check
        assert (f"rank {r}: corruption found at step 8: rank 1 on localhost differs from the majority (ranks 0, 2); "
                "it started in steps 5-8; every rank goes back to step 4 (the last good check), rank 1 on localhost "
                "receiving it from rank 0") in logs[r], faulted.evidence()
        assert (f"rank {r}: corruption found at step 16: rank 2 on localhost differs from the majority (ranks 0, 1); "
                "it started in steps 13-16; every rank goes back to step 12") in logs[r], faulted.evidence()
    assert "MB received)" in logs[1] and "MB received)" in logs[2]  # the named ranks took the state from a peer
    assert final(faulted) == want, "the healed run differs from the uninterrupted one"
    # seen: the ledger's incidents, `fleet status`'s last incident, `fleet report`'s table
    ledger = recorded(faulted, "ledger.json")
    first, second = (i for i in ledger["incidents"] if i["corruption"])
    assert first["cause"] == "corruption: rank 1 on localhost, started in steps 5-8: healed"
    assert (first["corruption"], first["resumed_from"], first["recomputed"]) == (
        {"ranks": [1], "hosts": ["localhost"], "window": [5, 8], "action": "healed"}, 4, 4)
    assert second["cause"] == "corruption: rank 2 on localhost, started in steps 13-16: healed"
    status = live_lines(recorded(faulted, "live.json"))
    assert any(line.startswith("last incident (#2 of 2): corruption: rank 2 on localhost, started in steps 13-16: "
                               "healed: worker_2 on localhost at step 16; recovered in") and
               line.endswith("4 step(s) recomputed") for line in status), status
    console = Console(record=True, width=300)
    for table in summary_tables(report_data(ledger, [])):
        console.print(table)
    assert "corruption: rank 1 on localhost, started in steps 5-8: healed" in console.export_text()


def test_world_2_rolls_back_and_redoes_bitwise_and_a_rank_corrupt_twice_is_fenced(
        tmp_path: Path, reference: Callable[[int], str]) -> None:
    pair = job(tmp_path / "pair", 2, "rank=0,step=6,in=optimizer,bit=22")
    twice = job(tmp_path / "twice", 3, "rank=1,step=5,bit=20;rank=1,step=14,in=optimizer,bit=22")
    want = reference(2)
    assert run(pair, twice) == [0, 1], pair.evidence() + twice.evidence()
    for r in range(2):
        assert (f"rank {r}: corruption found at step 8: the replicas' states differ with no majority (ranks 0 "
                "(localhost); ranks 1 (localhost)); it started in steps 5-8: every rank goes back to step 4") \
            in pair.log(f"worker_{r}.log"), pair.evidence()
    assert final(pair) == want, "the rolled-back run differs from the uninterrupted one"
    assert corruption_causes(pair) == [
        "corruption: rank 0 on localhost, rank 1 on localhost, started in steps 5-8: rolled back"]
    # twice: fenced; the scheduler, told, cannot hand the host to a spare (none, and it is the scheduler's host): the
    # job stops with one line naming it, which the fenced rank, waiting for that word, repeats as it leaves
    stopped = ("host localhost is fenced: found corrupt twice by the replica check (rank 1 on localhost; the second "
               "time in steps 13-16), and host localhost runs the scheduler: it cannot be replaced while the job runs")
    sched = twice.log("scheduler.log")
    assert f"job corrupt failed: {stopped}" in sched, twice.evidence()
    assert ("rank 1: toolkit.train: rank 1 on localhost found corrupt twice: fenced (its host is not to be trusted "
            f"with the job's state), and the scheduler stopped the job: {stopped}") in twice.log("worker_1.log")
    assert ("rank 0: rank 1 on localhost found corrupt twice: fenced (its host is not to be trusted with the job's "
            "state): the scheduler hands its host's ranks to a spare, shrinks the job without it, or stops the job") \
        in twice.log("worker_0.log")
    assert corruption_causes(twice) == ["corruption: rank 1 on localhost, started in steps 5-8: healed",
                                        "corruption: rank 1 on localhost, started in steps 13-16: fenced"]


def test_world_4_a_flipped_parameter_is_healed_and_a_state_corrupted_after_its_transfer_is_caught_at_once(
        tmp_path: Path, reference: Callable[[int], str]) -> None:
    """At world 4 the majority of three names the odd rank. Then rank 2 dies after step 10 and its new process takes
    the state from a peer, a bit of which flips right after the transfer checked it (in=recovered): the check right
    after the recovery, before a step trains on it, names rank 2 and sends it the state again."""
    faulted = job(tmp_path, 4, "rank=1,step=5,bit=20;rank=2,step=1,in=recovered,bit=20", "--die-rank", "2",
                  "--die-at", "10")
    want = reference(4)
    assert run(faulted) == [0], faulted.evidence()
    logs = [faulted.log(f"worker_{r}.log") for r in range(4)]
    assert "rank 1: injected corruption after step 5: flipped bit 20 of params 0.weight[0]" in logs[1]
    assert "rank 2: injected corruption after the recovery at step 10: flipped bit 20 of params 0.weight[0]" in logs[2]
    assert "rank 2: resumed from step 10" in logs[2] and "out of rank 0's memory" in logs[2], faulted.evidence()
    for r in range(4):
        assert (f"rank {r}: corruption found at step 8: rank 1 on localhost differs from the majority (ranks 0, 2, 3); "
                "it started in steps 5-8; every rank goes back to step 4 (the last good check), rank 1 on localhost "
                "receiving it from rank 0") in logs[r], faulted.evidence()
        assert (f"rank {r}: corruption found at step 10: rank 2 on localhost differs from the majority (ranks 0, 1, "
                "3); it started in the recovery at step 10 (the state taken then changed in or after the transfer); "
                "every rank goes on from step 10, rank 2 on localhost receiving rank 0's state again") in logs[r], \
            faulted.evidence()
    assert final(faulted) == want, "the healed run differs from the uninterrupted one"
    assert corruption_causes(faulted) == ["corruption: rank 1 on localhost, started in steps 5-8: healed",
                                          "corruption: rank 2 on localhost, started in at or before step 10: healed"]
