"""The operator's figures from a local job run by the real agent and scheduler: a rank slowed on purpose (SIGSTOP /
SIGCONT bursts) is named a straggler with its host and rank after an even stretch that names nobody, and the
checkpoint interval chosen with `--ckpt-interval auto` is one interval for every rank, with its reason."""

from __future__ import annotations

import json
import re
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from toolkit.contracts import rundoc
from toolkit.testing import waits
from toolkit.testing.localjob import LocalJob
from toolkit.testing.slowdown import bursts

WORLD = 3
ARGS = ["--epochs", "10", "--batch-size", "16", "--ckpt-interval", "auto", "--step-delay", "0.1"]
EVEN_STEPS = 40  # steps before the slowing: ~5 s of straggler evaluations that must name nobody
TIMEOUT = 240.0  # s for each wait on a loaded 2-core machine
POLL = 0.1
until = partial(waits.until, bound=TIMEOUT, poll=POLL)

pytestmark = pytest.mark.timeout(600)


def live(job: LocalJob) -> dict[str, Any]:
    try:
        return rundoc.read_live((job.dir / "recovery" / rundoc.LIVE_FILE).read_text()) or {}
    except OSError:
        return {}


def test_a_slowed_rank_is_named_and_the_auto_interval_is_shared(tmp_path: Path) -> None:
    job = LocalJob(tmp_path, WORLD, ARGS, job="observe", node_timeout=5, cluster_time_out=120, grace=5)
    job.start()
    stop = threading.Event()
    slower = threading.Thread(target=bursts, args=(lambda: job.procs().get("worker_2", {}).get("pid"), stop),
                              daemon=True)
    try:
        until(f"every rank past step {EVEN_STEPS}", lambda: all(job.last_step(r) >= EVEN_STEPS for r in range(WORLD)),
              job)
        sched = job.log("scheduler.log")
        assert "straggler: " not in sched, sched
        figures = live(job)
        assert figures["stragglers"] == [] and all(r["score"] for r in figures["ranks"].values()), figures
        chosen = {r["ckpt_every"] for r in figures["ranks"].values()}
        assert len(chosen) == 1 and chosen.pop() > 10, figures  # Young's interval, above the lower bound

        slower.start()
        named = until("worker_2 named a straggler", lambda: re.search(
            r"straggler: worker_2 \(rank 2\) on localhost works (\S+)x", job.log("scheduler.log")), job)
        assert float(named.group(1)) >= 1.5
        assert not re.search(r"straggler: worker_[01] ", job.log("scheduler.log"))
        flagged = until("live.json naming it", lambda: live(job).get("stragglers"), job)
        assert [(s["rank"], s["host"]) for s in flagged] == [(2, "localhost")]
        stop.set()
        slower.join(10)
        # The ledger records each rank's changes of interval as its heartbeats bring them (one a second, the file
        # every few seconds), so just after a change the ranks' latest entries can differ; read it while the job
        # runs until one snapshot shows every rank's latest. The job's stop could cut off a change in flight.
        intervals = until("the ledger's latest interval of every rank, one interval", lambda: shared_interval(job),
                          job)
        assert all("Young" in i["why"] for i in intervals.values()), intervals
    finally:
        stop.set()
        if slower.is_alive():
            slower.join(10)
        job.cleanup()
    ledger = json.loads((job.dir / "recovery" / rundoc.LEDGER_FILE).read_text())
    assert [(s["rank"], s["host"]) for s in ledger["stragglers"]] == [(2, "localhost")]


def shared_interval(job: LocalJob) -> dict[int, dict[str, Any]] | None:
    """Each rank's latest change of interval (with its reason) in the ledger on disk, if every rank has one and
    they are one interval; else None."""
    try:
        ledger = json.loads((job.dir / "recovery" / rundoc.LEDGER_FILE).read_text())
    except (OSError, ValueError):
        return None
    latest = {i["rank"]: i for i in ledger["intervals"]}
    if set(latest) != set(range(WORLD)) or len({i["steps"] for i in latest.values()}) != 1:
        return None
    return latest
