"""The goodput ledger and `fleet report` after a run with two real faults (issue 15): the sample trainer on 3 hosts x
2 workers, `fleet deploy train --join` as a user runs it; worker_1 is killed with SIGKILL, and once the job trains
again worker_4 (on another host) is stopped with SIGSTOP until the scheduler declares it dead for its silence.

The ledger (read from the scheduler's host) must hold exactly those two incidents, with the causes, processes,
hosts and times the test brought about, recovery times no shorter than what every rank's log says its own recovery
took, and the steps resumed from and recomputed that the workers' logs print; goodput must be its parts' sum as
recomputed here from the ledger's own numbers. `fleet report` (over SSH, during and after the run) must show the
same: incidents at the steps they struck, three generations, the PNG drawn from that data."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from fault_harness import E2E, Job

from toolkit.launcher import runreport as R

KILL_AT = 6  # every worker past this step (a checkpoint every 4) when the first fault hits
# s: heartbeat silence before a worker is dead. The product's default, not the fixture's 3 s: on a machine shared by
# several test sessions, a worker's heartbeat thread has been seen starved that long, and an extra incident would
# be a fault this test did not inject.
NODE_TIMEOUT = 6.0
CLOCK_SLACK = 0.05  # s: logs print seconds to 2 decimals, the ledger rounds to 3
HEARTBEAT_LAG = 5.0  # s: bound on how long before the SIGSTOP the last heartbeat left, on a busy machine
IN_FLIGHT = 1.0  # s: a heartbeat sent just before the SIGSTOP may be read by the scheduler just after it
DETECT_BOUND = 30.0  # s: bound on how long after the kill its detection may come, on a busy machine
RESUMED = re.compile(r"rank (\d+): resumed from step (\d+) \(.*?\) out of .*? in ([0-9.]+) s .*?generation (\d+)"
                     r"(?:: (\d+) step\(s\) recomputed)?")
LEFT_AT = re.compile(r"rank (\d+): generation (\d+) -> (\d+) at step (\d+)")
FORMED = re.compile(r"generation (\d+) formed:")


def ledger_of(job: Job) -> dict[str, Any]:
    """ledger.json as the scheduler's host holds it ({} before it is written)."""
    for host in job.e2e.hosts:
        path = job.job_dir(host) / "recovery" / "ledger.json"
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                return {}  # written atomically: only before the first write
    return {}


def resumed(job: Job, generation: int) -> dict[int, tuple[int, float, int | None]]:
    """rank -> (step resumed from, seconds its recovery took, steps recomputed) in `generation`, from the logs."""
    out = {}
    for rank in range(6):
        for r, step, seconds, gen, recomputed in RESUMED.findall(job.log(f"worker_{rank}")):
            if int(gen) == generation:
                out[int(r)] = (int(step), float(seconds), int(recomputed) if recomputed else None)
    return out


def left_at(job: Job, generation: int) -> dict[int, int]:
    """rank -> the step it held when it left for `generation` (the survivors' `generation a -> b at step s`)."""
    return {int(r): int(s) for rank in range(6) for r, _, to, s in LEFT_AT.findall(job.log(f"worker_{rank}"))
            if int(to) == generation}


def check_incident(job: Job, inc: dict[str, Any], generation: int, victim: dict[str, Any], seen_step: int) -> None:
    """What both incidents must show: the process and host the test hit, every rank recovered, a recovery time no
    shorter than any rank's own, the step resumed from and the steps recomputed as the logs print them."""
    evidence = f"\n{json.dumps(inc, indent=1)}\n{job.evidence()}"
    assert inc["generation"] == generation, evidence
    assert [(p["node_id"], p["host"], p["pid"]) for p in inc["processes"]] == \
        [(victim["node_id"], victim["host"], victim["pid"])], evidence
    assert sorted(inc["recovered_ranks"]) == list(range(6)), evidence
    assert inc["time_to_recover"] == inc["recovered_at"] - inc["failed_at"], evidence
    logs = resumed(job, generation)
    assert sorted(logs) == list(range(6)), f"not every rank logged its recovery in generation {generation}{evidence}"
    steps = {step for step, _, _ in logs.values()}
    assert steps == {inc["resumed_from"]}, f"the logs resumed from {steps}{evidence}"
    assert inc["resumed_from"] >= seen_step, evidence  # the test saw every worker past this step before the fault
    survivors = left_at(job, generation)
    assert survivors and max(survivors.values()) == inc["resumed_from"], f"survivors held {survivors}{evidence}"
    assert inc["recomputed"] == max(n for _, _, n in logs.values() if n is not None), evidence
    assert inc["time_to_recover"] >= max(seconds for _, seconds, _ in logs.values()) - CLOCK_SLACK, evidence


def recompute_goodput(ledger: dict[str, Any]) -> dict[str, float]:
    """The goodput breakdown from the ledger's own parts, as its documentation defines it."""
    end = ledger["ended_at"]
    first = ledger["first_step_at"]
    wall = end - ledger["started_at"] - ledger["paused"]
    startup = first - ledger["started_at"] + ledger["restarting"]
    recovery = sum(min(i["recovered_at"], end) - max(i["failed_at"], first) for i in ledger["incidents"])
    recomputed = sum((i["recomputed"] or 0) * (i["step_time"] or 0) for i in ledger["incidents"])
    stalls = [base + last for base, last in ledger["checkpoint_stall"].values()]
    checkpoint = sum(stalls) / len(stalls)
    productive = wall - startup - recovery - recomputed - checkpoint
    return {"wall": wall, "startup": startup, "recovery": recovery, "recomputed": recomputed,
            "checkpoint": checkpoint, "productive": productive, "goodput": productive / wall}


def test_two_faults_in_the_ledger_and_the_report(e2e: E2E, tmp_path: Path) -> None:
    job = e2e.job("ledger", "--node-timeout", f"{NODE_TIMEOUT:g}")
    job.start()
    try:
        run_two_faults(e2e, job, tmp_path)
    finally:
        if job.runner is not None and job.runner.poll() is None:
            job.fleet("stop", timeout=60, check=False)
    job.wait_no_leftovers()


def run_two_faults(e2e: E2E, job: Job, tmp_path: Path) -> None:
    first = job.wait_step(KILL_AT)["worker_1"]
    killed_at = time.time()
    os.kill(first["pid"], signal.SIGKILL)
    mid = job.wait_for("the first incident recovered in the ledger", lambda: (
        (doc := ledger_of(job)).get("incidents") and doc["incidents"][0].get("recovered_at") and doc))

    # During the run, over SSH: `fleet report` shows it.
    live = json.loads(job.fleet("report", "--json").stdout)
    assert live["outcome"] is None and [i["cause"] for i in live["incidents"]] == ["killed by SIGKILL"], live

    seen = job.wait_step(mid["incidents"][0]["resumed_from"] + 2)
    second = seen["worker_4"]
    assert second["host"] != first["host"]
    stopped_at = time.time()
    os.kill(second["pid"], signal.SIGSTOP)
    job.wait_for("the stopped worker fenced and replaced",
                 lambda: job.processes()["worker_4"]["pid"] not in (None, second["pid"]), timeout=90)
    code, output = job.join()
    assert code == 0, f"fleet train --join exited {code}:\n{output}\n{job.evidence()}"

    ledger = ledger_of(job)
    evidence = f"\n{json.dumps(ledger, indent=1)}\n{job.evidence()}"
    assert ledger["outcome"] == "finished", evidence
    assert ledger["incident_count"] == 2 and len(ledger["incidents"]) == 2, evidence
    one, two = ledger["incidents"]

    # The kill: the agent's report names the signal; it failed when it was seen to, within a bound of the kill.
    assert one["cause"] == "killed by SIGKILL", evidence
    assert one["processes"][0]["cause"] == "killed by SIGKILL", evidence
    assert killed_at <= one["failed_at"] == one["detected_at"] <= killed_at + DETECT_BOUND, evidence
    check_incident(job, one, 1, first, KILL_AT)

    # The stop: silence, dated from the last heartbeat before the SIGSTOP, detected a node timeout later.
    assert two["cause"] == "heartbeat silence", evidence
    assert stopped_at - HEARTBEAT_LAG <= two["failed_at"] <= stopped_at + IN_FLIGHT, evidence
    assert two["detected_at"] - two["failed_at"] >= NODE_TIMEOUT, evidence
    check_incident(job, two, 2, second, mid["incidents"][0]["resumed_from"] + 2)
    assert "sent no heartbeat" in " ".join(job.declared_dead()["worker_4"]), job.declared_dead()

    # Three generations formed, as the scheduler's log says.
    formed = [int(g) for g in FORMED.findall(job.log("sched"))]
    assert [g["generation"] for g in ledger["generations"]] == formed == [0, 1, 2], evidence

    # Goodput from those numbers: the recovery part is the two times to recover.
    ours = recompute_goodput(ledger)
    theirs = ledger["goodput"]
    for part, value in ours.items():
        assert abs(theirs[part] - value) <= 0.01, f"{part}: ledger {theirs[part]}, recomputed {value}{evidence}"
    assert abs(ours["recovery"] - one["time_to_recover"] - two["time_to_recover"]) <= 0.01, evidence
    assert 0 < theirs["goodput"] < 1, evidence

    # After the run, over SSH: the data the PNG is drawn from, and the PNG.
    png = tmp_path / "ledger.png"
    data = json.loads(job.fleet("report", "--json", "--out", str(png)).stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["outcome"] == "finished" and data["goodput"] == {k: theirs[k] for k in data["goodput"]}, data
    assert [(i["number"], i["cause"], i["step"], i["hosts"]) for i in data["incidents"]] == [
        (1, "killed by SIGKILL", one["resumed_from"] + one["recomputed"], [first["host"]]),
        (2, "heartbeat silence", two["resumed_from"] + two["recomputed"], [second["host"]])], data["incidents"]
    gens = data["generations"]
    assert [g["generation"] for g in gens] == [0, 1, 2], gens
    assert [(g["first_step"], g["last_step"]) for g in gens] == [
        (0, data["incidents"][0]["step"]), (one["resumed_from"], data["incidents"][1]["step"]),
        (two["resumed_from"], ledger["last_step"])], gens
    assert sorted(data["loss"]) == [str(r) for r in range(6)], data["loss"].keys()
    for rank, series in data["loss"].items():
        assert series["step"] and max(series["step"]) <= ledger["last_step"], (rank, series)
    assert sorted(data["rate"]) == [str(r) for r in range(6)], data["rate"].keys()

    # The figure's artists: a shaded span per generation, a line per rank, each incident at its step.
    fig = R.draw(data, tmp_path / "again.png")
    ax_loss = fig.axes[0]
    spans = [p for p in ax_loss.patches if (p.get_gid() or "").startswith("generation-")]
    assert len(spans) == 3
    marks = {line.get_gid(): line.get_xdata()[0] for line in ax_loss.lines if (line.get_gid() or "")
             .startswith("incident-")}
    assert marks == {"incident-1": data["incidents"][0]["step"], "incident-2": data["incidents"][1]["step"]}, marks
    assert len([ln for ln in ax_loss.lines if (ln.get_gid() or "").startswith("loss-rank-")]) == 6

    # The terminal summary names both incidents.
    tables = job.fleet("report", "--out", str(tmp_path / "third.png")).stdout
    assert "killed by SIGKILL" in tables and "heartbeat silence" in tables and "goodput" in tables, tables
