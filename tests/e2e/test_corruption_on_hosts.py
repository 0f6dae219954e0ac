"""Silent corruption on real hosts (issue 44), as a user runs it: a small ported script
(tests/scripts/corrupt_worker.py) deployed with `fleet deploy` then `fleet train --join` on two worker hosts of two
workers each (world 4), a third host in the inventory's [spares]. The operator's env file on the second host flips a
bit of rank 2's parameters after step 5 and one of its optimizer state after step 14 (TOOLKIT_INJECT_CORRUPTION).

At world 4 the majority names rank 2 at the check of step 8 and heals it in place; named again at step 16, it is
fenced: the scheduler hands its host's two ranks to the spare at once (no `fleet replace`), whose workers take the
state from a peer. The job finishes with the final parameters of an uninterrupted run of world 4 (a local run of the
same script: they depend on the world size and the arguments only).

With no spare and `--min-workers` (the sample on 3 hosts x 2 workers, the shared `e2e` fixture), the same host found
corrupt twice is fenced and the job shrinks without it: the 4 survivors serve the 6 logical ranks and the run ends
bitwise equal to an uninterrupted 6-worker one."""

from __future__ import annotations

import json
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest
from fault_harness import E2E, REPO, SCRIPT_ARGS, inventory

from toolkit.testing.cluster import Cluster
from toolkit.testing.localjob import LocalJob

SCRIPT = REPO / "tests" / "scripts" / "corrupt_worker.py"
SLOTS = 2
ARGS = "--verify-every 4 --steps 24"
INJECT = "rank=2,step=5,bit=20;rank=2,step=14,in=optimizer,bit=22"
FINAL = re.compile(r"^final parameters: - sha256 ([0-9a-f]{64})$", re.M)
REFERENCE_TIMEOUT = 300.0  # s for the local run of world 4 on a loaded 2-core machine; normally ~10 s


@pytest.fixture(scope="module")
def corrupt_e2e(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> E2E:
    hosts = cluster.names[:3]
    if len(hosts) < 3:
        pytest.fail("the corruption test needs 3 cluster hosts (TOOLKIT_TEST_HOSTS >= 3)")
    project = tmp_path_factory.mktemp("corrupt-project")
    shutil.copy(SCRIPT, project / SCRIPT.name)
    (project / "inventory.ini").write_text(inventory(cluster, {"workers": hosts[:2], "spares": hosts[2:]}, SLOTS))
    (project / "fabric.yaml").write_text(
        "toolkit:\n"
        f"  inventory: {project / 'inventory.ini'}\n"
        f"  known_hosts: {cluster.known_hosts}\n"
        f"  script: {SCRIPT.name}\n"
        f"  script_args: '{ARGS}'\n"
        "  node_timeout: 3\n"
        "  cluster_time_out: 120\n"
        "  grace: 5\n"
    )
    return E2E(cluster, project, hosts, iter(range(25000, 26000, 2)))


@contextmanager
def reference(root: Path) -> Iterator[Callable[[], str]]:
    """An uninterrupted local run of the same script and arguments at world 4, started now and running alongside
    the test's job (both spend most of their time waiting on start-ups and their peers); the callable waits for its
    end and returns its final digest."""
    project = root / "project"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / SCRIPT.name)
    j = LocalJob(root / "work", 4, ARGS.split(), job="reference", project=project, script=SCRIPT.name,
                 node_timeout=3, cluster_time_out=120, grace=20)

    def digest() -> str:
        assert j.finish(REFERENCE_TIMEOUT) == 0, j.evidence()
        (found,) = FINAL.findall(j.log("worker_0.log"))
        return found

    try:
        j.start()
        yield digest
    finally:
        j.cleanup()


def test_a_host_found_corrupt_twice_is_handed_to_a_spare_and_the_job_ends_bitwise(
        corrupt_e2e: E2E, tmp_path: Path) -> None:
    a, b, c = corrupt_e2e.hosts
    job = corrupt_e2e.job("corrupt")
    with reference(tmp_path) as uninterrupted:
        job.fleet("deploy")
        with open(job.job_dir(b) / "env" / "worker_2.env", "a") as f:  # the operator's fault, on b only
            f.write(f"export TOOLKIT_INJECT_CORRUPTION='{INJECT}'\n")
        job.start("train")
        digest = job.finish_ok()  # the spare's part is checked after the end: it trains only a few seconds
        want = uninterrupted()

    on_b = (job.job_dir(b) / "logs" / "worker_2.log").read_text()
    assert "rank 2: injected corruption after step 5: flipped bit 20 of params 0.weight[0]" in on_b
    assert "rank 2: injected corruption after step 14: flipped bit 22 of optimizer state[0][momentum_buffer][0]" \
        in on_b
    first = job.log("worker_0")
    assert (f"rank 0: corruption found at step 8: rank 2 on {b} differs from the majority (ranks 0, 1, 3); it started "
            f"in steps 5-8; every rank goes back to step 4 (the last good check), rank 2 on {b} receiving it from "
            "rank 0") in first, job.evidence()
    assert f"rank 0: rank 2 on {b} found corrupt twice: fenced" in first
    sched = job.log("sched")
    assert (f"host {b} replaced by spare {c}: fenced: found corrupt twice by the replica check (rank 2 on {b}; the "
            "second time in steps 13-16)") in sched, sched[-3000:]
    assert f"fenced by the scheduler: declared dead: its host {b} was replaced by {c}" in on_b  # it waited for it
    on_c = (job.job_dir(c) / "logs" / "worker_2.log").read_text()
    assert "rank 2: resumed from step 12" in on_c and "rank 2 step 24" in on_c, on_c[-2000:]

    assert digest == want, "the run after the spare took over differs from the uninterrupted one"
    status = json.loads(job.fleet("status", "--json").stdout)
    assert status["replaced"] == {b: c}
    assert {p["node_id"]: p["host"] for p in status["processes"] if p["node_id"] != "sched"} == {
        "worker_0": a, "worker_1": a, "worker_2": c, "worker_3": c}
    job.wait_no_leftovers()


def test_with_no_spare_an_elastic_job_shrinks_without_the_host_found_corrupt_twice_and_ends_bitwise(
        e2e: E2E, baseline: str) -> None:
    """The fence at step 16 leaves 14 steps of the 30 to the 4 survivors: the short run of the fault matrix (its
    uninterrupted baseline is computed once for the session) is long enough."""
    a, b, c = e2e.hosts[:3]
    job = e2e.job("corrupt-shrink", "--min-workers", "4",
                  "--script-args", SCRIPT_ARGS.replace("--step-delay 0.25", "--step-delay 0.05"))
    job.fleet("deploy")
    for host in (a, b, c):  # a check every 4 steps on every rank; the operator's fault on b's worker_2 only
        for env in sorted((job.job_dir(host) / "env").glob("worker_*.env")):
            with open(env, "a") as f:
                f.write("export TOOLKIT_VERIFY_EVERY=4\n")
                if host == b and env.name == "worker_2.env":
                    f.write(f"export TOOLKIT_INJECT_CORRUPTION='{INJECT}'\n")
    job.start("train")
    code, out = job.join()  # the fenced host's agent ended "stopped by the scheduler": not the job's failure
    assert code == 0 and f"it went on without {b} (elastic)" in out, out[-3000:]
    digest = job.digest()

    sched = job.log("sched")
    assert "all 4 workers finished: job corrupt-shrink done" in sched, sched[-3000:]
    assert (f"host {b} is fenced: found corrupt twice by the replica check (rank 2 on {b}; the second time in steps "
            f"13-16), and no spare is free to take over {b}") in sched, sched[-3000:]
    assert "shrinking to 4 of 6 workers, serving 6 logical ranks" in sched
    assert re.search(r"generation \d+ formed: 4 workers, serving 6 logical ranks", sched), sched[-3000:]
    on_b = (job.job_dir(b) / "logs" / "worker_2.log").read_text()
    assert "rank 2: injected corruption after step 14" in on_b, on_b[-2000:]
    assert f"its host {b} is fenced for corruption" in on_b, on_b[-2000:]  # it waited for the word, then left
    assert digest == baseline, "the run shrunk after the fence differs from the uninterrupted one"
    job.wait_no_leftovers()
