"""Zero lost steps, wherever the fault lands: the sample run by the real agent (scheduler, 3 or 4 workers, warm spare),
workers killed with SIGKILL at uniformly random moments of a step (forward, backward, inside the allreduce, inside
a checkpoint write, during a previous recovery), and double faults. Every run must end bitwise equal to an
uninterrupted run, with no step recomputed in any recovery where a survivor held the state (read from the
workers' logs: each recovery says where its state came from and how many steps were done again), and with one
new generation per fault, not a cascade. The sample keeps its default collective timeout (120 s): a survivor
stuck in a broken collective is freed when the new generation is announced, not by the timeout.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from functools import partial
from pathlib import Path
from typing import Callable

import pytest

from toolkit.testing import waits
from toolkit.testing.localjob import STEP_LINE, LocalJob

WORLD = 4
ARGS = ["--epochs", "8", "--ckpt-interval", "4", "--keep-max", "3"]
STEP_DELAY = "0.05"  # s per step: a step is then ~0.07 s here, so a kill lands at a random point of one
JOB_TIMEOUT = 420.0  # s for one run with its faults on a loaded 2-core machine; normally ~60 s
POLL = 0.02
FINAL = re.compile(r"^final parameters: (\S+) sha256 ([0-9a-f]{64})$", re.M)
RECOVERED = re.compile(r"^rank (\d+): resumed from step (\d+) .* out of (rank (\d+)'s (memory|checkpoint)|the initial "
                       r"state).*?(?:: (\d+) step\(s\) recomputed)?$", re.M)
FORMED = re.compile(r"generation (\d+) formed")
DEATH = re.compile(r"(worker_\d+) \(pid (\d+) on \S+\) is dead")
until = partial(waits.until, bound=JOB_TIMEOUT, poll=POLL)

pytestmark = pytest.mark.timeout(1200)


def local_job(root: Path, world: int = WORLD) -> LocalJob:
    return LocalJob(root, world, ARGS + ["--step-delay", STEP_DELAY], job="zero", node_timeout=3,
                    cluster_time_out=120, grace=5, max_restarts=30)


def steps(job: LocalJob, rank: int) -> int:
    found = STEP_LINE.findall(job.log(f"worker_{rank}.log"))
    return int(found[-1][1]) if found else 0


def training(job: LocalJob, past: dict[int, int], more: int = 2) -> bool:
    """Every rank has done `more` steps beyond `past` (so the previous recovery is over everywhere)."""
    return all(steps(job, r) >= past.get(r, 0) + more for r in range(job.workers))


def pid_of(job: LocalJob, rank: int) -> int | None:
    p = job.procs().get(f"worker_{rank}") or {}
    return p.get("pid") if p.get("state") == "running" else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], str]:
    """The final digest of an uninterrupted run per world size (computed once each)."""
    digests: dict[int, str] = {}

    def get(world: int) -> str:
        if world not in digests:
            job = local_job(tmp_path_factory.mktemp(f"reference{world}"), world)
            try:
                job.start()
                assert job.finish(JOB_TIMEOUT) == 0, job.evidence()
            finally:
                job.cleanup()
            digests[world] = FINAL.findall(job.log("worker_0.log"))[-1][1]
        return digests[world]

    return get


def check_run(job: LocalJob, reference: str, deaths_expected: int, why: str) -> list[tuple[str, ...]]:
    """The run ended well: bitwise the reference, every recovery from a survivor's memory with 0 steps
    recomputed, one generation per fault at most. Returns the recoveries (rank, step, source..., recomputed)."""
    assert job.finish(JOB_TIMEOUT) == 0, f"{why}\n{job.evidence()}"
    final = FINAL.findall(job.log("worker_0.log"))
    assert final and final[-1][1] == reference, f"final parameters differ from the uninterrupted run {why}"
    sched = job.log("scheduler.log")
    deaths = DEATH.findall(sched)
    assert len(deaths) == deaths_expected, f"{deaths} {why}"  # the faults took effect, each seen once
    generations = {int(g) for g in FORMED.findall(sched)}
    assert max(generations) <= deaths_expected, f"generations {sorted(generations)} for {deaths_expected} deaths {why}"
    recoveries = [m for r in range(job.workers) for m in RECOVERED.findall(job.log(f"worker_{r}.log"))]
    later = [m for m in recoveries if m[2] != "the initial state"]
    assert later, why
    for rank, step, source, _, kind, recomputed in later:
        assert kind == "memory" and recomputed == "0", f"rank {rank} resumed at {step} from {source}, recomputed " \
                                                       f"{recomputed} {why}\n{job.evidence()}"
    return later


@pytest.mark.parametrize("world", [4, 3])
def test_kills_at_random_moments_lose_no_step_and_change_nothing(tmp_path: Path, reference: Callable[[int], str],
                                                                 world: int) -> None:
    """10 kills per run, a run on 4 workers and one on 3 (the rank-ordered allreduce's slices differ), each kill
    at a uniformly random moment of a step, of a random rank (rank 0 included), once the previous recovery is
    over."""
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    job = local_job(tmp_path, world)
    kills = []
    try:
        job.start()
        past: dict[int, int] = {}
        for _ in range(10):
            until("every rank training", lambda past=past: training(job, past), job)
            time.sleep(rng.uniform(0.0, 0.15))  # about two steps: any moment of a step
            victim = rng.randrange(world)
            pid = pid_of(job, victim)
            assert pid is not None, job.evidence()
            os.kill(pid, signal.SIGKILL)
            kills.append((victim, steps(job, victim)))
            past = {r: steps(job, r) for r in range(world)}
        check_run(job, reference(world), len(kills), f"(seed {seed}, kills {kills})")
    finally:
        job.cleanup()


def test_double_faults_lose_no_step_and_change_nothing(tmp_path: Path, reference: Callable[[int], str]) -> None:
    """Two ranks killed at once; a survivor killed while the job recovers from a first kill; the replacement
    frozen as soon as it joined and killed while the survivors wait on it for the state transfer; the survivor
    that sends the replacement its state killed while the replacement, frozen as soon as it joined, waits on it
    (another survivor sends)."""
    rng = random.Random()
    job = local_job(tmp_path)
    deaths = 0
    try:
        job.start()
        until("every rank training", lambda: training(job, {}, 4), job)

        a, b = rng.sample(range(WORLD), 2)  # two at once
        for victim in (a, b):
            os.kill(pid_of(job, victim), signal.SIGKILL)
        deaths += 2
        past = {r: steps(job, r) for r in range(WORLD)}
        until("every rank training again", lambda: training(job, past), job)

        first, second = rng.sample(range(WORLD), 2)  # a second fault during the recovery from the first
        pid = pid_of(job, first)
        os.kill(pid, signal.SIGKILL)
        until("the first death seen", lambda: f"(pid {pid} on" in job.log("scheduler.log"), job)
        os.kill(pid_of(job, second), signal.SIGKILL)  # while the survivors leave their group and gather again
        deaths += 2
        past = {r: steps(job, r) for r in range(WORLD)}
        until("every rank training again", lambda: training(job, past), job)

        victim = rng.randrange(WORLD)  # the replacement killed in the middle of taking the state
        old = pid_of(job, victim)
        os.kill(old, signal.SIGKILL)
        log = f"worker_{victim}.log"
        before = job.log(log).count("process group of")
        replacement = until("the replacement to join its group",
                            lambda: job.log(log).count("process group of") > before and pid_of(job, victim), job)
        os.kill(replacement, signal.SIGSTOP)  # it joined: the survivors now wait on it for the state transfer
        time.sleep(0.5)
        os.kill(replacement, signal.SIGKILL)
        deaths += 2
        past = {r: steps(job, r) for r in range(WORLD)}
        until("every rank training again", lambda: training(job, past), job)

        taker = rng.randrange(WORLD)  # the sender killed while the replacement takes the state from it
        sender = min(r for r in range(WORLD) if r != taker)  # the lowest survivor sends to a single replacement
        os.kill(pid_of(job, taker), signal.SIGKILL)
        log = f"worker_{taker}.log"
        before = job.log(log).count("process group of")
        replacement = until("the replacement to join its group",
                            lambda: job.log(log).count("process group of") > before and pid_of(job, taker), job)
        os.kill(replacement, signal.SIGSTOP)  # it joined and waits for its state: frozen there
        spid = pid_of(job, sender)
        os.kill(spid, signal.SIGKILL)
        until("the sender's death seen", lambda: f"(pid {spid} on" in job.log("scheduler.log"), job)
        os.kill(replacement, signal.SIGCONT)  # its transfer has failed; it joins the next group
        deaths += 2
        why = f"(double faults: {a}+{b}, {first} then {second}, {victim}, sender {sender} of {taker})"
        check_run(job, reference(WORLD), deaths, why)
        last = job.log(log).split("--- toolkit agent")[-1]
        assert last.count("process group of") >= 2, f"the replacement never lost its first group {why}"
        taken = RECOVERED.findall(last)
        assert taken and taken[-1][3] not in ("", str(sender)), f"{taken} {why}"
    finally:
        job.cleanup()
