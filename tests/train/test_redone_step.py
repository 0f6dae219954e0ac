"""A step redone after a fault starts without the gradients of the step it replaces. A script that clears its
gradients after its optimizer step (tests/scripts/zero_at_end.py) is killed in the middle of a backward: the
survivors hold that step's gradients, partial or whole, and the replacement none. Kept, they would be added to by
the redone step's backward, and the run would differ from an uninterrupted one; it must end bitwise equal."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from toolkit.testing.localjob import LocalJob

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "zero_at_end.py"
WORLD = 3
DIE_AT = 5  # the step in whose backward the last rank dies
JOB_TIMEOUT = 300.0  # s for one job on a loaded 2-core machine; normally ~20 s
FINAL = re.compile(r"^final parameters: \S+ sha256 ([0-9a-f]{64})$", re.M)

pytestmark = pytest.mark.timeout(900)


def job(root: Path, args: list[str]) -> LocalJob:
    project = root / "project"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / SCRIPT.name)
    return LocalJob(root / "work", WORLD, args, job="redo", project=project, script=SCRIPT.name, node_timeout=3,
                    cluster_time_out=120, grace=20)


def test_a_kill_in_the_backward_of_a_script_that_clears_gradients_last_ends_bitwise_equal(tmp_path: Path) -> None:
    reference = job(tmp_path / "reference", [])
    faulted = job(tmp_path / "faulted", ["--die-in-backward", str(DIE_AT)])
    try:  # both at once: two small jobs share the machine
        reference.start()
        faulted.start()
        assert reference.finish(JOB_TIMEOUT) == 0, reference.evidence()
        assert faulted.finish(JOB_TIMEOUT) == 0, faulted.evidence()
    finally:
        reference.cleanup()
        faulted.cleanup()
    # The fault took effect where it was meant to: the last rank died once, in step DIE_AT, which the survivors
    # had under way and redid.
    assert len(re.findall(r"worker_2 \(pid \d+ on \S+\) is dead", faulted.log("scheduler.log"))) == 1, \
        faulted.evidence()
    for rank in range(WORLD - 1):
        assert f"rank {rank}: generation 0 -> 1 at step {DIE_AT - 1} (the step in flight is redone): abandoned, " \
            "re-forming the group" in \
            faulted.log(f"worker_{rank}.log"), faulted.evidence()
    (want,) = FINAL.findall(reference.log("worker_0.log"))
    (got,) = FINAL.findall(faulted.log("worker_0.log"))
    assert got == want, "the run with the fault differs from the uninterrupted one"
