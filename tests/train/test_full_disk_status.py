"""A full disk at checkpoint time, as the operator sees it (issue 39, round 3, finding 5): the job's checkpoints go
to a real 256 KiB tmpfs (a checkpoint of the sample is ~0.3 MB), the job trains to its end, and the skipped
checkpoints are not only in the worker's log: `fleet status` says which rank skips them, how many and why while it
lasts (its lines, from the scheduler's live.json, through the heartbeats), and the ledger keeps the run of them."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from toolkit.launcher.jobhosts.tables import live_lines
from toolkit.testing.localjob import LocalJob

JOB_TIMEOUT = 300.0  # s for the job on a loaded 2-core machine; normally ~15 s
POLL = 0.2  # s between looks at live.json (rewritten once a second; no event says it was)
SHOWN = re.compile(r"^checkpoints skipped: worker_0 \(rank 0\) on localhost: (\d+) in a row, the disk is full: cannot "
                   r"write checkpoint of step \d+ in \S+: no space left on device .*; free space there or point "
                   r"CKPT_DIR at a larger disk; .*\(training goes on from the older copies; the next checkpoint tries "
                   r"again\)$", re.M)

pytestmark = pytest.mark.timeout(600)


def recorded(j: LocalJob, name: str) -> Any:
    try:
        return json.loads((j.dir / "recovery" / name).read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-rename
        return None


def test_checkpoints_skipped_for_a_full_disk_show_in_status_and_the_ledger(tiny_tmpfs: Path, tmp_path: Path) -> None:
    job = LocalJob(tmp_path / "work", 1, ["--epochs", "2", "--ckpt-interval", "5", "--step-delay", "0.05"],
                   job="full", ckpt_dir=str(tiny_tmpfs / "ckpt"), node_timeout=3, cluster_time_out=120, grace=20)
    try:
        job.start()
        deadline = time.monotonic() + JOB_TIMEOUT
        shown = None
        while shown is None:  # while the job trains, as `fleet status` shows it
            assert job.agent is not None and job.agent.poll() is None, f"the job ended first\n{job.evidence()}"
            assert time.monotonic() < deadline, f"fleet status never said so\n{job.evidence()}"
            shown = SHOWN.search("\n".join(live_lines(recorded(job, "live.json"))))
            time.sleep(POLL)
        assert job.finish(JOB_TIMEOUT) == 0, job.evidence()
    finally:
        job.cleanup()
    assert not list(tiny_tmpfs.rglob("*.ckpt")), "the disk was meant to be too small for any checkpoint"
    log = job.log("worker_0.log")
    assert log.count("skipped: training goes on") == 1, log[-3000:]  # the worker said it once
    (episode,) = recorded(job, "ledger.json")["skipped_checkpoints"]
    assert episode["rank"] == 0 and episode["node_id"] == "worker_0" and episode["host"] == "localhost"
    assert episode["until"] is None  # no checkpoint was ever written again
    assert episode["skipped"] >= int(shown.group(1)) >= 1 and "no space left on device" in episode["why"]
    assert recorded(job, "ledger.json")["outcome"] == "finished"
