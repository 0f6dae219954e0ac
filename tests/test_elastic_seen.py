"""What an operator sees of a shrink and a grow (issue 42, item 4), from the scheduler's own notes on a fake clock:
`fleet status` / `--watch`'s lines (live.json's `elastic`), the ledger's shrinks and grows with each world size's
period and throughput, `fleet report`'s world-size panel and table, and the Prometheus gauges. The notes are the
membership's (tests/test_elastic_membership.py drives those decisions); the flow on hosts is
tests/e2e/test_elastic_on_hosts.py."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from toolkit.launcher import runreport as R
from toolkit.launcher.jobhosts.tables import elastic_lines
from toolkit.scheduler.actions import Note, NoteKind
from toolkit.scheduler.exposition import JobCollector, take
from toolkit.scheduler.journal import Journal
from toolkit.scheduler.roster import Roster
from toolkit.testing.clock import JournalClock

T0 = 1_700_000_000.0


def paced(journal: Journal, clock: JournalClock, ranks: range, steps: range) -> None:
    """Every rank of `ranks` reports each step of `steps`, one step a second."""
    for step in steps:
        clock.t += 1.0
        for r in ranks:
            journal.note(Note(NoteKind.PACE, {"rank": r, "node_id": f"worker_{r}", "host": f"h{r // 2}",
                                              "pid": 100 + r, "step": step, "step_time": 1.0}))


def shrunk_and_grown() -> tuple[Journal, JournalClock, dict[str, Any]]:
    """6 workers train steps 1-10 at 1 step/s; hostC (worker_4, worker_5) is lost; 4 workers train 11-16 at
    0.5 steps/s (2 s a step); hostC is back and 6 train 17-20. Returns the journal, its clock and live.json's
    document while shrunk."""
    clock = JournalClock(T0)
    journal = Journal(None, "el", 6, 0.75, clock.mono, clock.wall)
    journal.note(Note(NoteKind.FORMED, {"generation": 0, "seconds": 1.0, "recovery": ["in-place"], "workers": 6,
                                        "logical_world": 6}))
    paced(journal, clock, range(6), range(1, 11))
    journal.note(Note(NoteKind.SHRINK, {"host": "hostC", "slots": [4, 5], "workers": 4, "world_size": 6,
                                        "generation": 1}))
    journal.note(Note(NoteKind.FORMED, {"generation": 1, "seconds": 0.5, "recovery": ["in-place"], "workers": 4,
                                        "logical_world": 6, "logical": {"worker_0": [0, 4], "worker_1": [1, 5],
                                                                        "worker_2": [2], "worker_3": [3]}}))
    for step in range(11, 17):
        paced(journal, clock, range(4), range(step, step + 1))
        clock.t += 1.0
    live = journal.live(clock.mono(), clock.wall())
    journal.note(Note(NoteKind.GROW, {"host": "hostC", "slots": [4, 5], "workers": 6, "world_size": 6,
                                      "generation": 2}))
    journal.note(Note(NoteKind.FORMED, {"generation": 2, "seconds": 0.5, "recovery": ["in-place"], "workers": 6,
                                        "logical_world": 6}))
    paced(journal, clock, range(6), range(17, 21))
    return journal, clock, live


def test_status_says_degraded_and_who_serves_which_logical_ranks_then_nothing_once_grown() -> None:
    journal, clock, live = shrunk_and_grown()
    assert elastic_lines(json.loads(json.dumps(live))["elastic"]) == [
        "degraded: 4 of 6 workers, serving 6 logical ranks",
        "logical ranks: worker_0 0,4; worker_1 1,5; worker_2 2; worker_3 3"]
    assert journal.live(clock.mono(), clock.wall())["elastic"] is None  # grown back: the plain world
    assert elastic_lines({"workers": "4", "world_size": 6}) == [] and elastic_lines(None) == []  # hostile or none


def test_the_ledger_and_the_report_show_each_world_size_with_its_throughput(tmp_path: Path) -> None:
    journal, clock, _ = shrunk_and_grown()
    doc = json.loads(json.dumps(journal.ledger.to_json(clock.wall())))
    assert [(e["kind"], e["host"], e["workers"], e["step"]) for e in doc["elastic"]] == [
        ("shrink", "hostC", 4, 10), ("grow", "hostC", 6, 16)]
    periods = [(p["workers"], p["steps_per_s"]) for p in doc["world_periods"]]
    assert periods == [(6, 1.0), (4, 0.5), (6, 1.0)]  # steps 1-10 in 10 s (from the first), 10-16 in 12 s, 16-20
    data = R.report_data(doc, [])
    assert [(p["workers"], p["steps_per_s"]) for p in data["world"]] == periods
    fig = R.draw(data, tmp_path / "r.png")
    world = fig.axes[3]
    assert sorted(ln.get_gid().split("-")[0] for ln in world.lines) == ["grow", "shrink"]
    assert [c.get_gid() for c in world.collections] == [f"world-{p['start']}" for p in data["world"]]
    out = io.StringIO()
    for table in R.summary_tables(data):
        Console(file=out, width=160).print(table)
    text = out.getvalue()
    assert "shrinks and grows" in text and "shrink (hostC, generation 1)" in text and "grow (hostC" in text
    assert len(R.draw(R.report_data({**doc, "elastic": []}, []), tmp_path / "p.png").axes) == 3  # never shrank


def test_the_metrics_carry_the_degraded_world() -> None:
    clock = JournalClock(T0)
    journal = Journal(None, "el", 6, 0.75, clock.mono, clock.wall)
    journal.note(Note(NoteKind.FORMED, {"generation": 1, "seconds": 0.5, "recovery": ["in-place"], "workers": 4,
                                        "logical_world": 6}))
    registry = CollectorRegistry()
    snap = take(journal, Roster({}), 1, 3, clock.mono(), clock.wall())
    registry.register(JobCollector(lambda: snap))
    text = generate_latest(registry).decode()
    assert 'toolkit_job_workers{job="el"} 4.0' in text and 'toolkit_job_logical_ranks{job="el"} 6.0' in text
    assert 'toolkit_job_world_size{job="el"} 6.0' in text
