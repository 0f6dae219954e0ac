"""Elastic shrink and grow (issue 42, items 2-4), as a user runs them: the sample on 3 hosts x 2 workers with no
spare and `--min-workers 4`. A worker host crashes for good mid-run (every process killed, its cable pulled): after
--host-timeout the 4 survivors re-form in place in a smaller generation and train on; `fleet status` says the job is
degraded. The host is healed and its agent started again (`fleet restart --host`): its workers join at a step
boundary, taking the state from a peer, and the job is back at 6 workers and finishes. The scheduler's log is the
record of each generation's world size.

(The final parameters equal an uninterrupted run's only with the logical-rank layer on the training side, which
serves the lost workers' logical ranks: that assertion comes with it; until then the sample's survivors train their
own shards while degraded.)
"""

from __future__ import annotations

import json
import re

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


def test_a_lost_host_shrinks_the_job_in_place_and_its_return_grows_it_back(e2e: E2E) -> None:
    a, b, c = e2e.hosts[:3]
    cluster = e2e.cluster
    job = e2e.job("elastic", "--min-workers", "4", "--host-timeout", str(HOST_TIMEOUT),
                  "--script-args", f"{LONG_ARGS} --step-delay 0.3")
    job.start()
    job.wait_step(KILL_AT)
    lost = sorted(n for n, p in job.processes().items() if p["host"] == c and n != "sched")
    assert lost == ["worker_4", "worker_5"]

    cluster.link_down(c)  # c crashes for good: cable pulled, every process killed
    killed = cluster.kill_host(c)
    assert killed and not cluster.workload([c])
    job.wait_for("the scheduler shrinking the job", lambda: "shrinking to 4 of 6 workers" in job.log("sched"),
                 timeout=120)
    job.wait_for("a generation of 4 workers formed", lambda: any(n == 4 for _, n in worlds(job)), timeout=120)
    at = max(min(steps_on(job, a) + steps_on(job, b)), KILL_AT)
    job.wait_for("the 4 survivors training on", lambda: min(steps_on(job, a) + steps_on(job, b)) > at + 2,
                 timeout=120)
    status = job.fleet("status", check=False)  # c is down: status says so (exit 2), and what the job does
    assert "degraded: 4 of 6 workers, serving 6 logical ranks" in status.stdout, status.stdout + status.stderr
    assert "logical ranks: worker_0 0,4; worker_1 1,5; worker_2 2; worker_3 3" in status.stdout, status.stdout
    shrunk = json.loads(job.fleet("status", "--json", check=False).stdout)
    assert shrunk["elastic"]["workers"] == 4 and shrunk["elastic"]["logical_world"] == 6

    cluster.start_sshd(c)  # healed; its agent started again as an operator would
    cluster.link_up(c)
    job.fleet("restart", "--host", c)
    job.wait_for("the job growing back", lambda: f"worker_4, worker_5 back on {c}" in job.log("sched"), timeout=120)
    job.wait_for(f"{c}'s workers training again", lambda: len(steps_on(job, c)) == 2 and min(steps_on(job, c)) > at,
                 timeout=180)
    code, output = job.join()
    assert code == 0, f"fleet train --join exited {code}:\n{output}\n{job.evidence()}"
    sizes = [n for _, n in worlds(job)]
    assert sizes[0] == 6 and 4 in sizes and sizes[-1] == 6, worlds(job)  # 6, then 4 (shrunk), then 6 (grown)
    assert sizes.index(4) < len(sizes) - 1
    grown = (job.job_dir(c) / "logs" / "worker_4.log").read_text()
    assert "from rank" in grown or "memory" in grown, grown[-2000:]  # its state came from a peer
    job.wait_no_leftovers()
