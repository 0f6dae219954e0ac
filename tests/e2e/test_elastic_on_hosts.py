"""Elastic shrink and grow (issue 42, items 2-4), as a user runs them: the sample on 3 hosts x 2 workers with no
spare and `--min-workers 4`. A worker host crashes for good mid-run (every process killed, its cable pulled): after
--host-timeout the 4 survivors re-form in place in a smaller generation and train on; `fleet status` says the job is
degraded. The host is healed and its agent started again (`fleet restart --host`): its workers join at a step
boundary, taking the state from a peer, and the job is back at 6 workers and finishes. The scheduler's log is the
record of each generation's world size. One job holds the whole flow, with a worker killed -9 at a random moment
of the shrink and another at a random moment of the grow: each kill is recovered like any fault.

The final parameters are bitwise those of an uninterrupted 6-worker run: while degraded, the 4 survivors serve all
6 logical ranks (toolkit.train's logical-rank layer), and nothing is recomputed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time

from fault_harness import E2E, LONG_ARGS, Job

KILL_AT = 6
HOST_TIMEOUT = 4  # s: a host whose agent is gone this long, its workers dead, is lost
FORMED = re.compile(r"generation (\d+) formed: (\d+) workers")


def worlds(job: Job) -> list[tuple[int, int]]:
    """(generation, workers) of every generation the scheduler formed, in order."""
    return [(int(g), int(n)) for g, n in FORMED.findall(job.log("sched"))]


def steps_on(job: Job, host: str) -> list[int]:
    return [p.get("step") or 0 for n, p in job.processes().items()
            if p["host"] == host and n != "sched" and p.get("state") == "running"]


def kill_one(job: Job, hosts: list[str], rng: random.Random) -> str:
    """SIGKILL a random running worker on `hosts`; returns its node id."""
    running = {n: p for n, p in job.processes().items()
               if p["host"] in hosts and n != "sched" and p.get("state") == "running" and p.get("pid")}
    victim = rng.choice(sorted(running))
    os.kill(running[victim]["pid"], signal.SIGKILL)
    return victim


def test_a_lost_host_shrinks_the_job_in_place_and_its_return_grows_it_back_through_kills_at_random_moments(
        e2e: E2E, long_baseline: str) -> None:
    """The whole flow in one job: c crashes, a survivor is killed -9 at a random moment of the shrink (between the
    crash and a while after the smaller generation formed), `fleet status` says the job is degraded, c's agent is
    started again and a worker is killed at a random moment of the grow (from the restart until a while after the
    job is back at 6). Each kill is recovered like any fault; the job finishes with the uninterrupted run's final
    parameters and nothing is recomputed. (A worker restarted while the job is shrunk builds its sampler for the
    smaller world; once grown back it must still draw its logical rank's batches.)"""
    a, b, c = e2e.hosts[:3]
    cluster, rng = e2e.cluster, random.Random()
    job = e2e.job("elastic", "--min-workers", "4", "--host-timeout", str(HOST_TIMEOUT),
                  "--script-args", f"{LONG_ARGS} --step-delay 0.3")
    job.start()
    job.wait_step(KILL_AT)
    lost = sorted(n for n, p in job.processes().items() if p["host"] == c and n != "sched")
    assert lost == ["worker_4", "worker_5"]

    # c crashes for good (cable pulled, every process killed); the block's end heals it (sshd up, link up)
    with cluster.partitioned(c), cluster.crashed(c) as crashed:
        assert not cluster.workload([crashed.name])
        time.sleep(rng.uniform(0.0, HOST_TIMEOUT + 2.0))  # the kill's random moment: before, at or after the shrink
        victim = kill_one(job, [a, b], rng)
        job.wait_for("the scheduler shrinking the job", lambda: "shrinking to 4 of 6 workers" in job.log("sched"),
                     timeout=180)
        job.wait_for("a generation of 4 workers formed after the kill", lambda: any(
            n == 4 for _, n in worlds(job)) and job.processes()[victim].get("state") == "running", timeout=180)
        at = max(min(steps_on(job, a) + steps_on(job, b)), KILL_AT)
        job.wait_for("the 4 training on", lambda: len(steps_on(job, a) + steps_on(job, b)) == 4
                     and min(steps_on(job, a) + steps_on(job, b)) > at + 2, timeout=180)
        status = job.fleet("status", check=False)  # c is down: status says so (exit 2), and what the job does
        said = status.stderr  # the lines under the table
        assert "degraded: 4 of 6 workers, serving 6 logical ranks" in said, f"killed {victim}\n{status.stdout}{said}"
        assert "logical ranks: worker_0 0,4; worker_1 1,5; worker_2 2; worker_3 3" in said, f"killed {victim}\n{said}"
        shrunk = json.loads(job.fleet("status", "--json", check=False).stdout)
        assert shrunk["elastic"]["workers"] == 4 and shrunk["elastic"]["logical_world"] == 6

    # its agent started again, as an operator would
    job.fleet("restart", "--host", c)
    time.sleep(rng.uniform(0.0, 4.0))  # the kill's random moment: while c's agent and workers start, register, or
    second = kill_one(job, [a, b, c], rng)  # the group re-forms
    job.wait_for("the job growing back", lambda: f"worker_4, worker_5 back on {c}" in job.log("sched"), timeout=180)
    job.wait_for(f"{c}'s workers training again", lambda: len(steps_on(job, c)) == 2 and min(steps_on(job, c)) > at,
                 timeout=240)
    code, output = job.join()
    assert code == 0, f"killed {victim}, then {second}: fleet train --join exited {code}:\n{output}\n{job.evidence()}"
    recomputed = re.findall(r"; (\d+) step\(s\) recomputed", job.log("sched"))
    assert recomputed and set(recomputed) == {"0"}, recomputed  # every recovery went on from a survivor's memory
    # the same final parameters as an uninterrupted 6-worker run: the 4 served all 6 logical ranks meanwhile
    assert job.digest() == long_baseline, f"killed {victim}, then {second}: other final parameters"
    sizes = [n for _, n in worlds(job)]
    assert sizes[0] == 6 and 4 in sizes and sizes[-1] == 6, worlds(job)  # 6, then 4 (shrunk), then 6 (grown)
    assert sizes.index(4) < len(sizes) - 1
    grown = (job.job_dir(c) / "logs" / "worker_4.log").read_text()
    assert "from rank" in grown or "memory" in grown, grown[-2000:]  # its state came from a peer
    job.wait_no_leftovers()


PLAIN_STEP = re.compile(r"^epoch (\d+) step (\d+) loss", re.M)


def test_a_plain_torchrun_script_under_nnodes_min_max_restarts_at_the_smaller_world(ddp_e2e: E2E, tmp_path) -> None:
    """examples/ddp/plain.py (unmodified) on 3 hosts of one worker, `--nnodes 2:3`: a host crashes for good, the
    others are restarted at a world of 2 from the script's own checkpoint (its DistributedSampler then cuts an
    epoch in 32 steps of 2048 / 2 / 32, not 22: only a world of 2 reaches step 23 in epoch 0), then the host comes
    back and the job grows back to 3 and finishes."""
    ckpt = tmp_path / "shared-ckpt"
    job = ddp_e2e.job("plain-elastic", "--script", "plain.py", "--ckpt-dir", str(ckpt), "--nnodes", "2:3",
                      "--host-timeout", str(HOST_TIMEOUT), "--script-args", "--epochs 8 --step-delay 0.1")

    def step(node: str) -> int:
        found = PLAIN_STEP.findall(job.log(node))
        return int(found[-1][1]) if found else 0

    job.start()
    job.wait_for("every rank past its first checkpoint", lambda: all(step(f"worker_{r}") > 11 for r in range(3)))
    c = job.host_of("worker_2")
    assert c != job.host_of("sched")
    with ddp_e2e.cluster.partitioned(c), ddp_e2e.cluster.crashed(c):  # healed at the block's end
        job.wait_for("a generation of 2 workers formed", lambda: any(n == 2 for _, n in worlds(job)), timeout=120)
        job.wait_for("the 2 restarted at a world of 2 (an epoch of 32 steps)", lambda: all(
            re.search(r"^epoch 0 step (2[3-9]|3[0-2]) loss", job.log(f"worker_{r}"), re.M) for r in (0, 1)),
            timeout=180)
        assert all("resumed from step" in job.log(f"worker_{r}") for r in (0, 1))  # from the script's own checkpoint
    job.fleet("restart", "--host", c)
    job.wait_for("the job growing back to 3", lambda: worlds(job)[-1][1] == 3 and f"worker_2 back on {c}"
                 in job.log("sched"), timeout=180)
    code, output = job.join()
    assert code == 0, f"{output}\n{job.evidence()}"
    sizes = [n for _, n in worlds(job)]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, worlds(job)
    assert "final checkpoint" in job.log("worker_0")
    job.wait_no_leftovers()


def test_fleet_grow_gives_a_degraded_job_a_new_host(e2e: E2E, long_baseline: str) -> None:
    """`fleet grow --host D` (issue 42 item 3): the same job, degraded to 4 workers by c's crash, is given the
    cluster's 4th host, which the operator keeps at hand in the inventory outside [workers] and [spares]. It is
    refused while the job is not degraded and for a host the job has or cannot reach; then D is deployed, checked
    and started, takes c's two slots (c stays down for good) and the state from a peer, and the job finishes at 6
    workers with the uninterrupted run's final parameters, nothing recomputed."""
    a, b, c = e2e.hosts[:3]
    d = e2e.cluster.names[3]
    cluster = e2e.cluster
    inventory = e2e.project / "inventory.ini"
    kept = inventory.read_text()
    h = cluster.host(d)
    inventory.write_text(kept + f"[at_hand]\n{d} ansible_host={h.address} ansible_user=root "
                         f"ansible_ssh_private_key_file={cluster.key} workdir={h.workdir} python={cluster.python}\n")
    try:
        job = e2e.job("elastic-grow", "--min-workers", "4", "--host-timeout", str(HOST_TIMEOUT),
                      "--script-args", f"{LONG_ARGS} --step-delay 0.3")
        job.start()
        job.wait_step(KILL_AT)
        whole = job.fleet("grow", "--host", d, check=False)
        assert whole.returncode == 2 and "is not degraded" in whole.stderr, whole.stderr
        assert "nothing to grow into" in whole.stderr and "Traceback" not in whole.stderr
        assert not (job.job_dir(d) / "launch.sh").exists()  # refused before anything was deployed
        known = job.fleet("grow", "--host", b, check=False)
        assert known.returncode == 2 and f"{b} is already a host of job elastic-grow" in known.stderr, known.stderr

        with cluster.partitioned(c), cluster.crashed(c):  # c stays down until the job's end
            job.wait_for("a generation of 4 workers formed", lambda: any(n == 4 for _, n in worlds(job)),
                         timeout=120)
            job.wait_for("the scheduler's live document saying so", lambda: (json.loads(job.fleet(
                "status", "--json", check=False).stdout).get("elastic") or {}).get("workers") == 4, timeout=120)
            gone = job.fleet("grow", "--host", "nosuch-host.invalid", check=False)
            assert gone.returncode != 0 and "nosuch-host.invalid" in gone.stderr, gone.stderr
            assert "Traceback" not in gone.stderr
            job.fleet("grow", "--host", d, timeout=240)
            job.wait_for(f"{d} taking {c}'s slots", lambda: f"host {c} replaced by spare {d}" in job.log("sched"),
                         timeout=120)

            def on_d() -> list[int]:
                return [p.get("step") or 0 for p in job.agent(d).get("processes") or []
                        if p.get("state") == "running"]
            at = max(min(steps_on(job, a) + steps_on(job, b)), KILL_AT)
            job.wait_for(f"{d}'s workers training", lambda: len(on_d()) == 2 and min(on_d()) > at, timeout=180)
            assert job.finish_ok() == long_baseline
        sizes = [n for _, n in worlds(job)]
        assert sizes[0] == 6 and 4 in sizes and sizes[-1] == 6, worlds(job)  # 6, shrunk to 4, grown with d to 6
        recomputed = re.findall(r"; (\d+) step\(s\) recomputed", job.log("sched"))
        assert recomputed and set(recomputed) == {"0"}, recomputed
        grown = (job.job_dir(d) / "logs" / "worker_4.log").read_text()
        assert "from rank" in grown or "memory" in grown, grown[-2000:]  # its state came from a peer
        job.wait_no_leftovers()
        job.wait_no_leftovers([d])
    finally:
        inventory.write_text(kept)
