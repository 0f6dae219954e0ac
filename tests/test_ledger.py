"""The goodput ledger (toolkit.scheduler.ledger) driven with membership Notes and a fake clock (wall seconds passed
in), and its persistence through the journal (toolkit.scheduler.journal) across a scheduler restart."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from toolkit.contracts import rundoc
from toolkit.scheduler.journal import Journal
from toolkit.scheduler.ledger import Ledger
from toolkit.scheduler.membership import CAUSE_CLOSED, CAUSE_NOT_BACK, CAUSE_SILENCE, Note
from toolkit.testing.clock import JournalClock

T0 = 1_000.0  # the job's start, wall-clock s


def death(rank: int, cause: str, generation: int, begins: bool = True, silent_for: float = 0.0,
          host: str = "h1", step: int | None = None, recovery: str = "in-place") -> dict[str, Any]:
    return {"node_id": f"worker_{rank}", "rank": rank, "host": host, "pid": 100 + rank, "cause": cause,
            "reason": "test", "silent_for": silent_for, "step": step, "recovery": recovery, "begins": begins,
            "generation": generation}


def pace(rank: int, step: int, **figures: Any) -> dict[str, Any]:
    return {"rank": rank, "node_id": f"worker_{rank}", "host": "h1", "pid": 100 + rank, "step": step, **figures}


def recovered(rank: int, generation: int, step: int, recomputed: int) -> dict[str, Any]:
    return {"node_id": f"worker_{rank}", "rank": rank, "generation": generation, "step": step, "source": "peer",
            "recomputed": recomputed, "seconds": 1.0}


def started(world: int = 2) -> Ledger:
    """Generation 0 formed at T0+10, the first step at T0+12 with a step time of 0.5 s, both ranks at step 10 by
    T0+20."""
    led = Ledger("job", world, T0)
    led.note("formed", {"generation": 0, "seconds": 10.0}, T0 + 10)
    for r in range(world):
        led.note("pace", pace(r, 1), T0 + 12)
    for r in range(world):
        led.note("pace", pace(r, 10, step_time=0.5, ckpt_stall=0.0), T0 + 20)
    return led


def test_a_kill_recovered_in_place() -> None:
    led = started()
    led.note("death", death(1, CAUSE_CLOSED, 1), T0 + 21)  # the connection closed first
    led.note("exited", {"node_id": "worker_1", "rank": 1, "host": "h1", "pid": 101, "code": None,
                        "signal": "SIGKILL"}, T0 + 21.1)
    (inc,) = led.faults.incidents
    assert inc.cause == "killed by SIGKILL" and inc.processes[0]["cause"] == "killed by SIGKILL"
    assert (inc.failed_at, inc.detected_at, inc.step, inc.generation) == (T0 + 21, T0 + 21, 10, 1)
    led.note("formed", {"generation": 1, "seconds": 3.0}, T0 + 24)
    led.note("recovered", recovered(0, 1, 10, 0), T0 + 25)
    assert inc.recovered_at is None and inc.time_to_recover is None  # one rank of two trains again
    led.note("recovered", recovered(1, 1, 10, 0), T0 + 26)
    assert (inc.formed_at, inc.recovered_at, inc.time_to_recover) == (T0 + 24, T0 + 26, 5.0)
    assert (inc.resumed_from, inc.recomputed, sorted(inc.recovered_ranks)) == (10, 0, [0, 1])
    led.note("finished", {}, T0 + 40)
    assert led.goodput(T0 + 99) == {"wall": 40.0, "startup": 12.0, "recovery": 5.0, "recomputed": 0.0,
                                    "checkpoint": 0.0, "productive": 23.0, "goodput": 0.575, "basis": "steps",
                                    "note": None}


def test_heartbeat_silence_dates_the_failure_from_the_last_heartbeat() -> None:
    led = started()
    led.note("death", death(0, CAUSE_SILENCE, 1, silent_for=3.5), T0 + 24)
    led.note("exited", {"node_id": "worker_0", "rank": 0, "host": "h1", "pid": 100, "code": None,
                        "signal": "SIGKILL"}, T0 + 24.2)  # its agent killed it: silence stays the cause
    (inc,) = led.faults.incidents
    assert inc.cause == CAUSE_SILENCE and (inc.failed_at, inc.detected_at) == (T0 + 20.5, T0 + 24)
    led.note("formed", {"generation": 1}, T0 + 26)
    for r in (0, 1):
        led.note("recovered", recovered(r, 1, 10, 0), T0 + 27)
    assert inc.time_to_recover == 6.5
    assert led.goodput(T0 + 30)["recovery"] == 6.5


def test_deaths_while_gathering_join_the_incident_and_a_lost_host_is_named() -> None:
    led = started(world=4)
    led.note("death", death(2, CAUSE_CLOSED, 1, host="h2"), T0 + 21)
    led.note("death", death(3, CAUSE_CLOSED, 1, begins=False, host="h2"), T0 + 21.2)
    led.note("agent_lost", {"host": "h2", "reason": "closed"}, T0 + 21.3)
    (inc,) = led.faults.incidents
    assert [p["node_id"] for p in inc.processes] == ["worker_2", "worker_3"]
    assert inc.cause == "host lost (h2: its agent went too)"
    assert {p["cause"] for p in inc.processes} == {inc.cause}
    led.note("formed", {"generation": 1}, T0 + 30)
    led.note("death", death(0, CAUSE_CLOSED, 2, host="h1"), T0 + 31)  # a new fault once formed: a new incident
    assert led.faults.count == 2 and led.faults.incidents[0].recovered_at is None
    # The first never recovered: its recovery time runs until the second began, without counting time twice.
    led.note("formed", {"generation": 2}, T0 + 33)
    for r in range(4):
        led.note("recovered", recovered(r, 2, 10, 0), T0 + 34)
    assert led.faults.incidents[1].recovered_at == T0 + 34
    assert led.goodput(T0 + 40)["recovery"] == (31 - 21) + (34 - 31)


def test_recovery_from_a_checkpoint_counts_the_steps_lost() -> None:
    led = started()
    led.note("pace", pace(0, 13, step_time=0.5), T0 + 22)
    led.note("pace", pace(1, 12, step_time=0.5), T0 + 22)
    led.note("death", death(0, CAUSE_CLOSED, 1, step=13), T0 + 23)
    led.note("death", death(1, CAUSE_CLOSED, 1, begins=False, step=12), T0 + 23)
    inc = led.faults.incidents[0]
    assert inc.step == 13  # the newest step any rank was heard at
    led.note("formed", {"generation": 1}, T0 + 30)
    for r in (0, 1):  # the workers do not know how far the job had got: the ledger does
        led.note("recovered", recovered(r, 1, 8, -1), T0 + 31)
    assert (inc.resumed_from, inc.recomputed) == (8, 5)
    assert led.goodput(T0 + 40)["recomputed"] == 5 * 0.5


def test_restart_recovery_ends_at_the_first_step_after_the_formation() -> None:
    led = started()
    led.note("death", death(1, CAUSE_CLOSED, 1, recovery="restart"), T0 + 21)
    led.note("formed", {"generation": 1}, T0 + 25)
    led.note("pace", pace(0, 10), T0 + 24)  # an old heartbeat, before the formation: not yet
    inc = led.faults.incidents[0]
    assert inc.recovered_at is None
    led.note("pace", pace(0, 9), T0 + 27)
    assert inc.recovered_at == T0 + 27 and inc.time_to_recover == 6
    assert (inc.resumed_from, inc.recomputed) == (8, 2)  # its first step is 9: it resumed from 8; 10 was heard


def test_the_healthy_ranks_relaunched_with_a_restart_are_listed_apart_and_open_no_incident() -> None:
    led = started()
    led.note("death", death(1, "killed by SIGKILL", 1, recovery="restart"), T0 + 21)
    led.note("death", {**death(0, CAUSE_CLOSED, 1, begins=False, recovery="restart"), "relaunched": True}, T0 + 21.1)
    led.note("formed", {"generation": 1}, T0 + 23)
    led.note("death", {**death(0, CAUSE_CLOSED, 1, begins=True, recovery="restart"), "relaunched": True}, T0 + 24)
    assert led.faults.count == 1  # a relaunch is never a fault of its own, even when noted as beginning one
    (inc,) = led.faults.incidents
    assert [p["node_id"] for p in inc.processes] == ["worker_1"] and inc.cause == "killed by SIGKILL"
    assert [p["node_id"] for p in inc.relaunched] == ["worker_0", "worker_0"]
    assert Ledger.from_json(led.to_json(T0 + 30)).faults.incidents[0].relaunched == inc.relaunched


def test_a_torchrun_style_script_reporting_steps_and_checkpoints_is_measured_like_any_other() -> None:
    """toolkit.train.report(step, checkpoint=True) from rank 0 only (it saves the one checkpoint): reported every 5th
    step, the incident resumes from that checkpoint (it lies in the 5 steps before the first reported after)."""
    led = Ledger("job", 2, T0)
    led.note("formed", {"generation": 0, "seconds": 9.0, "recovery": ["restart"]}, T0 + 10)
    led.note("pace", pace(0, 5, step_time=0.5, stride=5), T0 + 12)
    led.note("pace", pace(0, 20, step_time=0.5, ckpt_step=20, stride=5), T0 + 18)
    led.note("pace", pace(1, 25, step_time=0.5, stride=5), T0 + 20)
    led.note("death", death(1, CAUSE_CLOSED, 1, step=25, recovery="restart"), T0 + 21)
    led.note("death", death(0, CAUSE_CLOSED, 1, begins=False, step=25, recovery="restart"), T0 + 21.5)
    led.note("formed", {"generation": 1, "recovery": ["restart"]}, T0 + 26)
    led.note("pace", pace(1, 25), T0 + 29)  # every 5th step reported: the checkpoint says where it resumed
    (inc,) = led.faults.incidents
    assert (inc.checkpoint, inc.resumed_from, inc.recomputed, inc.time_to_recover) == (20, 20, 5, 8.0)
    led.note("finished", {}, T0 + 40)
    gp = led.goodput(T0 + 40)
    assert (gp["basis"], gp["startup"], gp["recovery"], gp["recomputed"]) == ("steps", 12.0, 8.0, 2.5)
    # every step reported: the step before the first after the restart, even past a checkpoint heard before the
    # fault (the survivors may save a newer one before they leave)
    dense = Ledger("job", 2, T0)
    dense.note("formed", {"generation": 0, "recovery": ["restart"]}, T0 + 10)
    dense.note("pace", pace(0, 44, ckpt_step=40, stride=1), T0 + 20)
    dense.note("death", death(1, CAUSE_CLOSED, 1, step=44, recovery="restart"), T0 + 21)
    dense.note("formed", {"generation": 1, "recovery": ["restart"]}, T0 + 26)
    dense.note("pace", pace(0, 53, first_step=51), T0 + 29)  # a heartbeat carries the latest step, and the first
    assert (dense.faults.incidents[0].resumed_from, dense.faults.incidents[0].recomputed) == (50, 0)
    doc = led.to_json(T0 + 40)
    assert doc["recovery"] == "restart" and doc["checkpoint_step"] == 20
    assert Ledger.from_json(json.loads(json.dumps(doc))).to_json(T0 + 40) == doc


def test_a_script_that_reports_no_steps_gets_a_goodput_from_its_formations() -> None:
    """An unmodified torchrun-style script: no step ever. Its time after each formation of its group counts as
    training, an upper bound that says so; never "productive 0 s, goodput 0%"."""
    led = Ledger("job", 2, T0)
    led.note("formed", {"generation": 0, "seconds": 9.0, "recovery": ["restart"]}, T0 + 10)
    for r in (0, 1):
        led.note("pace", {"rank": r, "node_id": f"worker_{r}", "host": "h1", "pid": 100 + r, "step": None}, T0 + 15)
    led.note("death", death(1, CAUSE_CLOSED, 1, recovery="restart"), T0 + 21)
    led.note("formed", {"generation": 1, "recovery": ["restart"]}, T0 + 25)
    led.note("finished", {}, T0 + 40)
    (inc,) = led.faults.incidents
    assert (inc.step, inc.formed_at, inc.recovered_at) == (None, T0 + 25, None)
    gp = led.goodput(T0 + 40)
    assert (gp["wall"], gp["startup"], gp["recovery"], gp["productive"], gp["goodput"]) == (40.0, 10.0, 4.0, 26.0,
                                                                                           0.65)
    assert gp["basis"] == "formations" and "upper bound" in gp["note"] and "toolkit.train.report" in gp["note"]
    # the Trainer's job before its first step is in start-up, not guessed from its formation
    trainer = Ledger("job", 2, T0)
    trainer.note("formed", {"generation": 0, "recovery": ["in-place"]}, T0 + 10)
    assert trainer.goodput(T0 + 20)["startup"] == 20.0 and trainer.goodput(T0 + 20)["basis"] == "steps"


def test_a_stop_and_a_start_again_is_no_incident_but_a_member_missing_after_it_is() -> None:
    """After `fleet stop` and `fleet train`, the restarted scheduler waits for the members it restored; none comes
    back (the operator stopped them all): no incident, the wait is start-up. If some came back, those that did not
    are a fault, dated from when they were declared dead."""
    for back in (0, 1):
        led = started()
        led.stopped("stopped by SIGTERM", T0 + 30)
        led = Ledger.from_json(json.loads(json.dumps(led.to_json(T0 + 30))))
        led.resume(T0 + 100)
        led.note("restored", {"generation": 0, "members": 2}, T0 + 100)
        for r in range(back, 2):
            led.note("death", death(r, CAUSE_NOT_BACK, 1, begins=r == back), T0 + 106 + r)
        assert led.faults.count == 0  # not yet decided
        led.note("formed", {"generation": 1, "recovery": ["in-place"]}, T0 + 110)
        led.note("pace", pace(0, 11), T0 + 112)
        if back == 0:
            assert led.faults.count == 0 and led.faults.incidents == []
            assert led.goodput(T0 + 112)["startup"] == 12.0 + 12.0  # the first start, and this one until it stepped
        else:
            (inc,) = led.faults.incidents
            assert [p["node_id"] for p in inc.processes] == ["worker_1"] and inc.cause == CAUSE_NOT_BACK
            assert (inc.detected_at, inc.formed_at) == (T0 + 107, T0 + 110)


def test_checkpoint_stalls_are_summed_over_restarts_and_averaged_over_ranks() -> None:
    led = started()
    led.note("pace", pace(0, 11, ckpt_stall=2.0), T0 + 21)
    led.note("pace", pace(1, 11, ckpt_stall=1.0), T0 + 21)
    led.note("pace", pace(1, 12, ckpt_stall=0.5), T0 + 22)  # a new process of rank 1: its counter started again
    led.note("finished", {}, T0 + 40)
    assert led.goodput(T0 + 40)["checkpoint"] == (2.0 + 1.5) / 2


def test_interval_changes_and_stragglers_are_kept() -> None:
    led = started()
    led.note("pace", pace(0, 11, ckpt_every=10, ckpt_why="10 steps: floor"), T0 + 21)
    led.note("pace", pace(0, 12, ckpt_every=10, ckpt_why="10 steps: floor"), T0 + 22)
    led.note("pace", pace(0, 13, ckpt_every=25, ckpt_why="25 steps: Young"), T0 + 23)
    assert [(i["steps"], i["at"]) for i in led.accounting.intervals] == [(10, T0 + 21), (25, T0 + 23)]
    led.straggler(1, "worker_1", "h1", 2.0, 0.2, 0.1, T0 + 24)
    led.straggler_cleared(1, T0 + 30)
    assert led.stragglers == [{"rank": 1, "node_id": "worker_1", "host": "h1", "since": T0 + 24, "until": T0 + 30,
                               "factor": 2.0, "busy": 0.2, "median": 0.1}]


def test_round_trip_and_resume_after_a_stop() -> None:
    led = started()
    led.note("death", death(1, CAUSE_SILENCE, 1, silent_for=2.0), T0 + 24)
    led.note("formed", {"generation": 1}, T0 + 25)
    for r in (0, 1):
        led.note("recovered", recovered(r, 1, 10, 0), T0 + 26)
    led.note("pace", pace(0, 12, ckpt_stall=1.0), T0 + 27)
    led.note("pace", pace(1, 12, ckpt_stall=1.0), T0 + 27)
    led.stopped("the scheduler was stopped by SIGTERM", T0 + 30)
    doc = json.loads(json.dumps(led.to_json(T0 + 30)))
    assert rundoc.read_ledger(json.dumps(doc)) == doc
    back = Ledger.from_json(doc)
    assert back.to_json(T0 + 30) == doc
    assert doc["goodput"]["wall"] == 30.0 and doc["outcome"] == "stopped"
    # `train` again 100 s later: the stop is paused time, the time until the first step start-up.
    back.resume(T0 + 130)
    assert back.outcome is None and back.accounting.paused == 100.0
    back.note("pace", pace(0, 13, ckpt_stall=0.2), T0 + 140)  # a new process: its stall counter starts again
    back.note("finished", {}, T0 + 150)
    gp = back.goodput(T0 + 150)
    assert (gp["wall"], gp["startup"], gp["recovery"], gp["checkpoint"]) == (50.0, 12.0 + 10.0, 4.0, 1.1)
    assert gp["productive"] == pytest.approx(50.0 - 22.0 - 4.0 - 1.1)


def test_from_json_refuses_another_version() -> None:
    doc = started().to_json(T0 + 20)
    with pytest.raises(ValueError, match="version"):
        Ledger.from_json({**doc, "version": 99})
    assert rundoc.read_ledger(json.dumps({**doc, "version": 99})) is None


def test_the_journal_persists_the_ledger_across_a_scheduler_restart(tmp_path: Path) -> None:
    clock = JournalClock(T0)
    journal = Journal(tmp_path, "job", 2, 0.75, clock=clock.mono, wall=clock.wall)
    clock.t = 10
    journal.note(Note("formed", {"generation": 0, "seconds": 10.0}))
    clock.t = 12
    for r in (0, 1):
        journal.note(Note("pace", pace(r, 5, step_time=0.5, loss=2.0)))
    clock.t = 15
    logs = journal.note(Note("death", death(1, CAUSE_CLOSED, 1)))
    assert "incident 1: connection closed (worker_1)" in logs[0].text
    journal.tick()  # an incident is written at once
    assert json.loads((tmp_path / "ledger.json").read_text())["incident_count"] == 1
    assert rundoc.read_metrics((tmp_path / "metrics.jsonl").read_text())[-1]["ranks"]["0"][:2] == [5, 2.0]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {  # not 0666 less the umask
        "ledger.json": 0o600, "live.json": 0o600, "metrics.jsonl": 0o600}
    journal.stopped("the scheduler was stopped by SIGKILL")
    journal.close()

    clock.t = 20  # a new scheduler process: the same ledger goes on, the time it was down paused
    again = Journal(tmp_path, "job", 2, 0.75, clock=clock.mono, wall=clock.wall)
    assert "1 incident(s) so far" in again.restore()[0].text
    assert again.ledger.faults.count == 1 and again.ledger.accounting.paused == 5.0
    assert again.history()["faults"] == 1

    other = Journal(tmp_path, "another", 2, 0.75, clock=clock.mono, wall=clock.wall)
    (warning,) = other.restore()  # another job's ledger is moved aside, never mixed in
    assert "not this run's" in warning.text and not (tmp_path / "ledger.json").exists()
    assert list(tmp_path.glob("ledger.json.*.unused"))


def test_the_records_writes_stay_bounded_at_thousands_of_ranks(tmp_path: Path) -> None:
    """Issue 24: at 4096 ranks a heartbeat that changes nothing marks nothing changed (before: the ledger was dirty
    on every heartbeat and, past MAX_EPISODES, appended an interval change per heartbeat), live.json (a row per
    rank) is rewritten every world/1024 s instead of every second, and metrics.jsonl keeps world-bounded samples,
    taken every world/1024 s at first."""
    from toolkit.scheduler import journal as J
    from toolkit.scheduler.ledger import MAX_EPISODES

    world = 4096
    clock = JournalClock(T0)
    journal = Journal(tmp_path, "job", world, 0.75, clock=clock.mono, wall=clock.wall)
    journal.note(Note("formed", {"generation": 0, "seconds": 1.0}))
    clock.t = 2.0
    for r in range(world):
        journal.note(Note("pace", pace(r, 5, step_time=0.5, ckpt_every=50, ckpt_stall=0.0)))
    assert len(journal.ledger.accounting.intervals) == MAX_EPISODES  # one change per rank, the list capped
    journal.tick()
    journal.ledger.dirty = False  # as after the ledger's write
    kept = list(journal.ledger.accounting.intervals)
    for t in (3.0, 4.0):
        clock.t = t
        for r in range(world):
            journal.note(Note("pace", pace(r, int(t), step_time=0.5, ckpt_every=50, ckpt_stall=0.0)))
    assert journal.ledger.accounting.intervals == kept and not journal.ledger.dirty  # nothing changed: nothing to write
    journal.note(Note("pace", pace(7, 5, step_time=0.5, ckpt_every=25, ckpt_stall=0.0)))  # rank 7 changed: said
    assert journal.ledger.accounting.intervals[-1]["rank"] == 7 and journal.ledger.dirty

    live = tmp_path / "live.json"
    stamps = set()
    for tenth in range(50, 250):  # 20 s of loop passes, one every 0.1 s
        clock.t = tenth / 10
        journal.tick()
        stat = live.stat()  # each rewrite is a new file (atomic replace): its inode and time tell it apart
        stamps.add((stat.st_ino, stat.st_mtime_ns))
    assert len(json.loads(live.read_text())["ranks"]) == world
    assert 4 <= len(stamps) <= 6, sorted(stamps)  # every 4 s at 4096 ranks (LIVE_RANKS_PER_S 1024), not 20 times

    # metrics.jsonl: a line per sample of every rank's figures; kept to MAX_METRIC_VALUES // world lines. A journal
    # of the same world where two ranks report keeps the file small here: the cap is the world's.
    sparse = Journal(tmp_path / "sparse", "sparse", world, 0.75, clock=clock.mono, wall=clock.wall)
    assert sparse.max_metrics == J.MAX_METRIC_VALUES // world and sparse.metrics_interval == 4.0  # 4096 / 1024
    for r in range(2):
        sparse.note(Note("pace", pace(r, 5, step_time=0.5)))
    for _ in range(3 * sparse.max_metrics):
        clock.t = sparse.metrics_at
        sparse.tick()
    lines = (tmp_path / "sparse" / "metrics.jsonl").read_text().splitlines()
    assert sparse.max_metrics // 2 <= len(lines) <= sparse.max_metrics + 1 and sparse.metrics_interval > 4.0

    small = Journal(tmp_path / "small", "small", 2, 0.75, clock=clock.mono, wall=clock.wall)
    assert (small.live_interval, small.metrics_interval, small.max_metrics) == (  # small jobs as before
        J.LIVE_INTERVAL, J.METRICS_INTERVAL, J.MAX_METRICS)


def test_a_corruption_report_is_an_incident_and_a_malformed_one_is_ignored() -> None:
    """The replica check's report (protocol `corruption`, toolkit.train.replicas): checked as a peer's input, then an
    incident dealt with at once whose redone steps count as recomputed; it survives a scheduler restart."""
    from toolkit.contracts import messages as wire
    from toolkit.contracts.protocol import ProtocolError

    def corruption_fields(msg: dict, world: int) -> dict | None:
        """The report as the scheduler notes it for the ledger, None when it is refused (membership.corrupted)."""
        try:
            report = wire.Corruption.from_msg(msg)
        except ProtocolError:
            return None
        return report.encode() if report.within(world) else None

    good = {"generation": 0, "step": 16, "since": 12, "ranks": [2], "hosts": ["h2\nEVIL"], "action": "healed"}
    assert corruption_fields(good, 4) == {**good, "hosts": ["h2"]}  # one line of a host name
    for bad in ({"ranks": [4]}, {"ranks": [True]}, {"since": 17}, {"action": "ignored"}, {"hosts": []},
                {"step": -1}, {"ranks": [0, 1, 2, 3, 0], "hosts": ["h"] * 5}):
        assert corruption_fields({**good, **bad}, 4) is None, bad
    led = started()
    led.note("corruption", corruption_fields(good, 4), T0 + 30)
    (inc,) = led.to_json(T0 + 31)["incidents"]
    assert inc["cause"] == "corruption: rank 2 on h2, started in steps 13-16: healed"
    assert (inc["resumed_from"], inc["recomputed"], inc["time_to_recover"]) == (12, 4, 0.0)
    assert inc["corruption"] == {"ranks": [2], "hosts": ["h2"], "window": [13, 16], "action": "healed"}
    assert Ledger.from_json(json.loads(json.dumps(led.to_json(T0 + 31)))).faults.incidents[0].corruption == \
        inc["corruption"]
    led.note("corruption", {**corruption_fields(good, 4), "action": "fenced"}, T0 + 40)
    assert led.faults.incidents[-1].recovered_at is None  # fenced: the job's end follows


def test_checkpoints_skipped_for_a_full_disk_are_a_run_per_rank_kept_across_a_restart_closed_once_written() -> None:
    led = started()
    full = "cannot write checkpoint of step 20 in /ckpt/job/host_h1: no space left on device"
    led.note("pace", pace(1, 20, ckpt_skipped=0, ckpt_full=""), T0 + 21)  # writing: nothing to say
    assert led.accounting.skipped == []
    led.note("pace", pace(1, 25, ckpt_skipped=1, ckpt_full=full), T0 + 25)
    led.note("pace", pace(1, 26, ckpt_skipped=1, ckpt_full=full), T0 + 26)  # every heartbeat says it again
    led.note("pace", pace(1, 30, ckpt_skipped=2, ckpt_full=full), T0 + 30)
    (run,) = led.accounting.skipped
    assert run == {"rank": 1, "node_id": "worker_1", "host": "h1", "since": T0 + 25, "until": None, "skipped": 2,
                   "why": full}
    back = Ledger.from_json(json.loads(json.dumps(led.to_json(T0 + 31))))  # a scheduler restart
    assert back.accounting.skipped == [run] and back.accounting.skipping == {1: run}
    back.note("pace", pace(1, 35, ckpt_skipped=0, ckpt_full=""), T0 + 35)  # one is written again
    assert back.accounting.skipped == [{**run, "until": T0 + 35}] and back.accounting.skipping == {}
    assert back.to_json(T0 + 36)["skipped_checkpoints"][0]["until"] == T0 + 35
