"""The scale harness in the suite, quick and about correctness, not time: 256 simulated ranks (32 hosts of an agent
and 8 workers, each host from its own address, in 2 processes) against the real scheduler speaking the real
protocol (toolkit.testing.simjob). Every formation runs a gloo bootstrap (multi_get of every rank's address) and an
NCCL one (N - 1 ranks wait on rank 0's id), then NCCL's once-a-second store check in the steady state; one worker
is SIGKILLed and relaunched by its agent. bench/scheduler_scale.py runs the same harness for the numbers."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.contracts import rundoc
from toolkit.testing.simjob import SimJob
from toolkit.testing.waits import wait_for

WORLD = 256
VICTIM = 131
BOUND = 300.0  # s for any one phase: generous, CI's machine is shared


def test_256_ranks_form_lose_one_re_form_and_finish_with_nothing_refused(tmp_path: Path) -> None:
    with SimJob(WORLD, tmp_path, patterns=("gloo", "nccl")) as job:
        job.start()
        first, _ = job.form(BOUND)
        assert sorted(first.ranks) == list(range(WORLD))
        assert all(formed is not None and built >= formed for formed, _, built in first.ranks.values())
        job.steady(3.0)  # heartbeats with every pace field, commits, the NCCL monitor's checks

        loss = job.lose(VICTIM, bound=BOUND)
        assert loss.killed == [VICTIM]
        # the fault took effect: every survivor was told of generation 1, and the ledger has the incident
        survivors = [r for r in range(WORLD) if r != VICTIM]
        assert [r for r in survivors if loss.built.ranks[r][1] is None] == []
        assert loss.built.ranks[VICTIM][1] is None  # the replacement registered into generation 1: no notice
        incident = loss.incident
        assert incident["cause"] == "killed by SIGKILL", incident
        assert [(p["node_id"], p["rank"], p["host"]) for p in incident["processes"]] == \
            [(f"worker_{VICTIM}", VICTIM, f"sim{VICTIM // 8}")]
        assert incident["generation"] == 1 and sorted(incident["recovered_ranks"]) == list(range(WORLD))
        # every survivor and the replacement formed generation 1 and built its groups again
        assert sorted(loss.built.ranks) == list(range(WORLD))
        assert all(formed is not None and built >= formed >= loss.at
                   for formed, _, built in loss.built.ranks.values())

        stats = job.stats()
        counts = stats["counts"]
        assert counts.get("errors", 0) == 0, stats["samples"]
        # every store reply was checked: 2 multi_gets of 128 values and 1 NCCL id per rank and formation
        assert counts.get("multi_get values checked") == 2 * 2 * WORLD, counts
        assert counts.get("get values checked") == 2 * (WORLD - 1), counts
        assert counts.get("checks answered", 0) >= WORLD, counts  # the monitor ran on every rank
        assert counts.get("refused", 0) == 0 and counts.get("unproven", 0) == 0, counts
        wait_for("live.json to show every rank's pace figures", lambda: _paced(job.recovery / rundoc.LIVE_FILE),
                 BOUND, evidence=job.evidence)

        assert job.finish(BOUND) == 0
        log = job.log()
        assert log.errors == [], "\n".join(log.errors[:10])
        assert log.refusals == [], "\n".join(log.refusals[:10])


def _paced(live: Path) -> bool:
    """Whether live.json (rewritten every second) shows every rank with the own-work figure of its heartbeats."""
    try:
        ranks = json.loads(live.read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        return False
    return len(ranks) == WORLD and all(isinstance(r["busy"], float) and r["step"] is not None for r in ranks.values())
