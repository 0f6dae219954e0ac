"""Zero lost steps across hosts: the sample on 3 namespace hosts x 2 workers, 10 workers killed with SIGKILL at
uniformly random moments of a step, each of a random rank (rank 0 included), each once the previous recovery is
over. The run ends bitwise equal to an uninterrupted one, every recovery took the state from a survivor's memory
with no step recomputed, and each fault moved the job by one generation at most."""

from __future__ import annotations

import os
import random
import re
import signal
import time

from fault_harness import E2E, HOSTS, LONG_ARGS, SLOTS, Job

ARGS = f"{LONG_ARGS} --step-delay 0.08"
KILLS = 10
STEP = re.compile(r"^epoch: (\d+), step: (\d+), loss is", re.M)
RECOVERED = re.compile(r"^rank (\d+): resumed from step (\d+) .* out of rank \d+'s (memory|checkpoint).*?"
                       r"(?:: (\d+) step\(s\) recomputed)?$", re.M)
WORLD = HOSTS * SLOTS


def steps(job: Job, rank: int) -> int:
    found = STEP.findall(job.log(f"worker_{rank}"))
    return int(found[-1][1]) if found else 0


def test_kills_at_random_moments_across_hosts_lose_no_step(e2e: E2E, long_baseline: str) -> None:
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    job = e2e.job("zero-kills", "--script-args", ARGS, "--max-restarts", "20")
    job.start()
    past = {r: 0 for r in range(WORLD)}
    kills = []
    for _ in range(KILLS):
        job.wait_for("every rank training", lambda past=past: all(steps(job, r) >= past[r] + 2 for r in range(WORLD)))
        time.sleep(rng.uniform(0.0, 0.25))  # about two steps: any moment of a step
        victim = rng.randrange(WORLD)
        pid = job.processes()[f"worker_{victim}"]["pid"]
        os.kill(pid, signal.SIGKILL)
        kills.append((victim, steps(job, victim)))
        past = {r: steps(job, r) for r in range(WORLD)}
    why = f"(seed {seed}, kills {kills})"
    assert job.finish_ok() == long_baseline, f"final parameters differ from the uninterrupted run {why}"
    sched = job.log("sched")
    assert len(re.findall(r"worker_\d+ \(pid \d+ on \S+\) is dead", sched)) == KILLS, why
    assert max(int(g) for g in re.findall(r"generation (\d+) formed", sched)) <= KILLS, why
    recoveries = [m for r in range(WORLD) for m in RECOVERED.findall(job.log(f"worker_{r}"))]
    assert len(recoveries) >= KILLS, why
    assert all(kind == "memory" and recomputed == "0" for _, _, kind, recomputed in recoveries), (recoveries, why)
    job.wait_no_leftovers()
