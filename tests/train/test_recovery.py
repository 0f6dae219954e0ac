"""The headline, through the real launcher: a local job planned and rendered as `fleet` does it, run by the real
host agent (scheduler + workers + warm spare), one worker killed with SIGKILL at a random step. The survivors must
not restart (they re-form the group in place), only the dead rank is relaunched (2 workers: from the warm spare;
3 workers: the spare turned off, a cold start), every rank must go on from the newest step any survivor held
(no step recomputed), the agent must end the job with exit 0, and the final parameters must be bitwise equal to
those of an uninterrupted run of the same script under torchrun with the same seed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from toolkit.testing.localjob import EXAMPLES, STEP_LINE, LocalJob, clean_env
from toolkit.testing.ports import free_port_pair

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
INTERVAL = 4
ARGS = ["--epochs", "3", "--ckpt-interval", str(INTERVAL), "--keep-max", "3", "--timeout", "30"]
STEP_DELAY = "0.15"  # s per step in the faulted run: time for the warm spare to be ready before the kill
JOB_TIMEOUT = 240.0  # s for one job on a loaded 2-core machine; normally ~20 s
SPARE_TIMEOUT = 60.0  # s for the agent's warm spare to import torch
POLL = 0.02  # s between looks at a log or agent.json: no event tells that a line was appended
FINAL = re.compile(r"^final parameters: (\S+) sha256 ([0-9a-f]{64})$", re.M)
RESUMED = re.compile(r"^rank (\d+): resumed from step (\d+) .*out of (rank \d+'s memory|rank \d+'s checkpoint).*?"
                     r"(?:: (\d+) step\(s\) recomputed)?$", re.M)
CHANGED = re.compile(r"^rank (\d+): generation 0 -> 1 at step (\d+)", re.M)

pytestmark = pytest.mark.timeout(600)


def steps_total(world: int, epochs: int = 3, batch: int = 32, dataset: int = 1440) -> int:
    per_rank = -(-dataset // world)  # the sampler pads every shard to the same length
    return epochs * -(-per_rank // batch)


def until(what: str, predicate: Callable[[], Any], timeout: float, evidence: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{evidence()}")
        time.sleep(POLL)


def local_job(root: Path, world: int, args: list[str], **options: Any) -> LocalJob:
    """Short timeouts: a fault is noticed in seconds, and a test that goes wrong ends soon."""
    return LocalJob(root, world, args, job="rec", node_timeout=3, cluster_time_out=120, grace=5, **options)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final parameters of one uninterrupted run per world size, under the real torchrun (computed once)."""
    runs: dict[int, tuple[Path, str]] = {}

    def get(world: int) -> tuple[Path, str]:
        if world in runs:
            return runs[world]
        d = tmp_path_factory.mktemp(f"torchrun{world}")
        argv = [TORCHRUN, "--nproc-per-node", str(world), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{free_port_pair()}", "--log-dir", str(d / "logs"), "--redirects", "3",
                str(EXAMPLES / "train.py"), *ARGS]
        proc = subprocess.Popen(argv, cwd=d, env={**clean_env(), "CKPT_DIR": str(d / "ckpt"), "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"the reference run did not finish in {JOB_TIMEOUT} s:\n{out[-3000:]}") from None
        assert proc.returncode == 0, out[-3000:]
        logs = {int(p.parent.name): p.read_text() for p in (d / "logs").glob("*/attempt_0/*/stdout.log")}
        assert sorted(logs) == list(range(world)), out[-3000:]
        for r, text in logs.items():
            assert len(STEP_LINE.findall(text)) == steps_total(world), f"rank {r}:\n{text[-2000:]}"
        (m,) = FINAL.finditer(logs[0])
        runs[world] = (Path(m.group(1)), m.group(2))
        return runs[world]

    return get


def incarnations(log: str) -> list[str]:
    """A worker's log split at the agent's start markers: one part per process that ran as this worker."""
    return re.split(r"^--- toolkit agent .*: start worker_\d+ #\d+ .*---$", log, flags=re.M)[1:]


def assert_bitwise_equal(a: Path, b: Path) -> None:
    pa, pb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape, k
        assert pa[k].numpy().tobytes() == pb[k].numpy().tobytes(), f"{k} differs"


@pytest.mark.parametrize("world, warm", [(2, True), (3, False)], ids=["2-warm-spare", "3-cold"])
def test_kill9_of_a_worker_recovers_in_place_and_ends_bitwise_equal(tmp_path, world, warm, reference) -> None:
    ref_path, ref_digest = reference(world)
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    total = steps_total(world)
    victim = rng.randrange(world)
    job = local_job(tmp_path, world, ARGS + ["--step-delay", STEP_DELAY if warm else "0.05"], warm_spare=warm)
    try:
        job.start()
        spare = None
        if warm:
            spare = until("the warm spare to be ready", lambda: (job.doc().get("warm_spare") or {}).get("ready")
                          and job.doc()["warm_spare"]["pid"], SPARE_TIMEOUT, job.evidence)
        if warm:
            target = max(job.last_step(victim), INTERVAL) + rng.randint(1, 4)  # after >= 1 checkpoint
        else:
            target = rng.randint(INTERVAL + 1, total - 4)
        why = f"(seed {seed}: {world} workers, kill worker_{victim} at step {target} of {total})"
        assert target < total - 2, f"training nearly over before the spare was ready {why}\n{job.evidence()}"
        until(f"worker_{victim} at step {target}", lambda: job.last_step(victim) >= target, JOB_TIMEOUT,
              job.evidence)
        before = job.procs()
        pids = {r: before[f"worker_{r}"]["pid"] for r in range(world)}
        killed = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = job.last_step(victim)
        until("every rank past the step it had reached",
              lambda: all(job.last_step(r) > killed_at for r in range(world) if r != victim)
              and len(incarnations(job.log(f"worker_{victim}.log"))) == 2
              and STEP_LINE.search(incarnations(job.log(f"worker_{victim}.log"))[1]), JOB_TIMEOUT, job.evidence)
        print(f"\n{why}: kill -9 -> every rank training again in {time.monotonic() - killed:.2f} s")
        assert job.finish(JOB_TIMEOUT) == 0, f"agent exit status {why}\n{job.evidence()}"
    finally:
        job.cleanup()

    after = job.procs()
    assert job.doc()["state"] == "succeeded", job.evidence()
    for r in range(world):
        p = after[f"worker_{r}"]
        if r == victim:
            assert p["restarts"] == 1 and p["exits"][0]["pid"] == pids[r] and p["exits"][0]["signal"] == "SIGKILL"
            if warm:
                assert p["last_pid"] == spare, f"worker_{r} was not relaunched from the warm spare {why}"
        else:
            assert (p["restarts"], p["last_pid"]) == (0, pids[r]), f"survivor worker_{r} restarted {why}"
        assert p["last_exit"]["code"] == 0, f"worker_{r} {why}\n{job.evidence()}"
    relaunch = re.search(rf"worker_{victim}: started pid (\d+) \(restart 1 of 3 after killed by SIGKILL(, warm spare)?",
                         job.log("agent.log"))
    assert relaunch and int(relaunch.group(1)) == after[f"worker_{victim}"]["last_pid"], job.log("agent.log")
    assert bool(relaunch.group(2)) == warm, relaunch.group(0)

    resumed = {}
    reached = {}
    for r in range(world):
        runs = incarnations(job.log(f"worker_{r}.log"))
        assert len(runs) == (2 if r == victim else 1), why
        last = runs[-1]
        if r != victim:
            assert len(CHANGED.findall(last)) == 1, f"worker_{r} {why}\n{last[-3000:]}"
            before = STEP_LINE.findall(last[:CHANGED.search(last).start()])
            reached[r] = int(before[-1][1]) if before else 0
        (m,) = [m for m in RESUMED.finditer(last)]
        resumed[r] = int(m.group(2))
        assert m.group(3).endswith("memory") and m.group(4) == "0", f"worker_{r}: {m.group(0)} {why}"
        first_after = STEP_LINE.search(last, m.end())
        assert int(first_after.group(2)) == resumed[r] + 1, why
        assert "Traceback" not in last, f"worker_{r} {why}\n{last[-3000:]}"
    assert len(set(resumed.values())) == 1, f"ranks resumed at different steps {resumed} {why}"
    step = resumed[victim]
    # Nothing recomputed: every rank goes on from the newest step a survivor had completed (not a checkpoint's).
    assert step == max(reached.values()) >= killed_at, f"resumed at {step}, survivors had reached {reached} {why}"

    state = json.loads(next((job.dir / "recovery").glob("*.json")).read_text())
    assert state["commits"] == {str(r): total for r in range(world)}, f"committed steps {why}"
    (final,) = FINAL.findall(job.log("worker_0.log"))
    assert final[1] == ref_digest, f"final parameters differ from the uninterrupted torchrun run {why}"
    assert_bitwise_equal(Path(final[0]), ref_path)


def test_sigterm_under_the_agent_saves_last_words_and_loses_no_step(tmp_path, reference) -> None:
    """recover.sh (SIGTERM to one worker) and stop.sh (SIGTERM to all, through the agent): every rank saves the
    same step first. After recover.sh the other rank keeps running and meets the replacement at that step; after
    stop.sh a new job on the same checkpoints resumes there, and the end is bitwise the uninterrupted run's."""
    world = 2
    ref_path, ref_digest = reference(world)
    rng = random.Random()
    args = ARGS + ["--step-delay", "0.05"]
    first = local_job(tmp_path / "first", world, args, warm_spare=False)
    ckpt = first.dir / "ckpt"
    try:
        first.start()
        target = rng.randint(INTERVAL + 1, 2 * INTERVAL)
        until(f"step {target}", lambda: first.last_step(1) >= target, JOB_TIMEOUT, first.evidence)
        pids = {r: first.procs()[f"worker_{r}"]["pid"] for r in range(world)}
        r = subprocess.run([str(first.dir / "recover.sh"), "worker_1"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        restarted = re.compile(r"^rank 1: stopped by SIGTERM at step (\d+), checkpoint saved$", re.M)
        last_words = int(until("worker_1's last words", lambda: restarted.search(first.log("worker_1.log")),
                               JOB_TIMEOUT, first.evidence).group(1))
        rejoined = re.compile(r"^rank 0: resumed from step (\d+) ", re.M)
        assert int(until("worker_0 to roll back", lambda: rejoined.search(first.log("worker_0.log")), JOB_TIMEOUT,
                         first.evidence).group(1)) == last_words, "the step in flight is all that may be redone"
        assert first.procs()["worker_0"]["pid"] == pids[0] and first.procs()["worker_0"]["restarts"] == 0
        until("training again", lambda: first.last_step(1) > last_words + 2, JOB_TIMEOUT, first.evidence)
        r = subprocess.run([str(first.dir / "stop.sh")], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert first.finish(30) == 3, first.evidence()  # EXIT_STOPPED: stopped by the operator
    finally:
        first.cleanup()
    stopped = re.compile(r"^rank (\d+): stopped by SIGTERM at step (\d+), checkpoint saved$", re.M)
    steps = {r: [int(m.group(2)) for m in stopped.finditer(incarnations(first.log(f"worker_{r}.log"))[-1])]
             for r in range(world)}
    assert len(steps[0]) == len(steps[1]) == 1 and steps[0] == steps[1], steps
    (saved,) = steps[0]
    assert saved > last_words
    for r in range(world):  # the host's one copy: each rank wrote its share
        assert len(list(ckpt.glob(f"host_*/step_{saved:012d}.p{r}of{world}.ckpt"))) == 1, sorted(ckpt.rglob("*"))
        assert first.procs()[f"worker_{r}"]["last_exit"]["code"] == 128 + signal.SIGTERM

    second = local_job(tmp_path / "second", world, ARGS, ckpt_dir=str(ckpt), token=first.token)  # the same job
    try:
        second.start()
        assert second.finish(JOB_TIMEOUT) == 0, second.evidence()
    finally:
        second.cleanup()
    for r in range(world):
        assert [int(m.group(2)) for m in RESUMED.finditer(second.log(f"worker_{r}.log"))] == [saved]
    (final,) = FINAL.findall(second.log("worker_0.log"))
    assert final[1] == ref_digest
    assert_bitwise_equal(Path(final[0]), ref_path)
