"""Spare hosts (issue 17, part 2), as a user runs them: the sample deployed with `fleet deploy train --join` on two
worker hosts of three workers each, with the other two hosts of the cluster as the inventory's [spares].

One job carries both flows: a worker host crashes for good mid-run (every process killed, its cable pulled), a spare
takes its ranks by itself and the job goes on; the crashed host, healed and its agent started again, is refused by the
scheduler; then the operator hands the spare's ranks to the other spare with `fleet replace --host X --with Y`. The job
finishes with the final parameters of an uninterrupted run of the same job, on the second spare, and `fleet status`
and the job record say so.
"""

from __future__ import annotations

import json
import shutil

import pytest
from fault_harness import E2E, LONG_ARGS, REPO, Job, inventory

from toolkit.testing.cluster import Cluster

SLOTS = 3
KILL_AT = 6  # every worker past this step (a checkpoint every 4) when the host crashes
# 1440 samples / 6 ranks / 16 = 15 steps per epoch, 120 in all: long enough for a takeover, a refused host and a
# replacement by hand before the end, on a busy 2-core machine (each takeover waits for the spare's cold start).
SCRIPT_ARGS = f"{LONG_ARGS} --step-delay 0.4"
LAST_STEP = 8 * 15
HOST_TIMEOUT = 4  # s: a host whose agent is gone this long, its workers dead, is lost


@pytest.fixture(scope="module")
def spares_e2e(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> E2E:
    hosts = cluster.names[:4]
    if len(hosts) < 4:
        pytest.fail("the spares test needs 4 cluster hosts (TOOLKIT_TEST_HOSTS >= 4)")
    project = tmp_path_factory.mktemp("spares-project")
    shutil.copy(REPO / "examples" / "train.py", project / "train.py")
    shutil.copytree(REPO / "examples" / "MNIST_Data", project / "MNIST_Data")
    (project / "inventory.ini").write_text(inventory(cluster, {"workers": hosts[:2], "spares": hosts[2:]}, SLOTS))
    (project / "fabric.yaml").write_text(
        "toolkit:\n"
        f"  inventory: {project / 'inventory.ini'}\n"
        f"  known_hosts: {cluster.known_hosts}\n"
        "  script: train.py\n"
        f"  script_args: '{SCRIPT_ARGS}'\n"
        "  node_timeout: 3\n"
        f"  host_timeout: {HOST_TIMEOUT}\n"
        "  cluster_time_out: 120\n"
        "  grace: 5\n"
    )
    return E2E(cluster, project, hosts, iter(range(23000, 24000, 2)))


def holders(job: Job, host: str) -> dict[str, dict]:
    """The workers `host`'s agent runs now (state running), by node id."""
    return {p["node_id"]: p for p in job.agent(host).get("processes") or []
            if p["node_id"] != "sched" and p.get("state") == "running" and p.get("pid")}


def test_a_spare_takes_over_a_lost_host_and_another_by_hand(spares_e2e: E2E, long_baseline: str) -> None:
    a, b = spares_e2e.hosts[:2]
    spares = spares_e2e.hosts[2:]
    cluster = spares_e2e.cluster
    baseline = long_baseline  # an uninterrupted run of the same arguments on 6 ranks (tests/e2e/conftest.py)

    job = spares_e2e.job("spares")
    job.start(check=True)  # the pre-flight check passes with spares in the inventory (issue 26)
    job.wait_step(KILL_AT)
    lost = {n for n, p in job.processes().items() if p["host"] == b and n != "sched"}
    assert lost == {"worker_3", "worker_4", "worker_5"}
    for spare in spares:  # deployed, its agent up, running nothing
        assert job.agent(spare).get("spare") and not holders(job, spare)

    # b crashes for good: its cable pulled and every process on it killed
    cluster.link_down(b)
    killed = cluster.kill_host(b)
    assert killed and not cluster.workload([b])
    c = job.wait_for(f"a spare holding {b}'s ranks", lambda: next(
        (s for s in spares if set(holders(job, s)) == lost), None), timeout=180)  # the first free one
    d = next(s for s in spares if s != c)
    job.wait_for(f"{c} training", lambda: all((p.get("step") or 0) > KILL_AT for p in holders(job, c).values()))
    sched_log = job.log("sched")
    assert f"host {b} replaced by spare {c}" in sched_log, sched_log[-3000:]
    took = job.agent(c)["took_over"]
    assert [(t["host"], sorted(t["node_ids"])) for t in took] == [(b, sorted(lost))]

    # status shows the new layout and writes it into the job record (b is still down: not an error)
    status = json.loads(job.fleet("status", "--json").stdout)
    assert {p["node_id"]: p["host"] for p in status["processes"] if p["node_id"] in lost} == dict.fromkeys(lost, c)
    assert status["replaced"] == {b: c}
    record = json.loads((spares_e2e.project / ".toolkit" / "jobs" / "spares.json").read_text())
    assert {p["node_id"]: p["host"] for p in record["processes"] if p["node_id"] in lost} == dict.fromkeys(lost, c)

    # b comes back and its agent is started again (as a boot script or an operator would): the scheduler refuses it
    cluster.start_sshd(b)
    cluster.link_up(b)
    job.fleet("restart", "--host", b)
    job.wait_for(f"the scheduler refusing {b}'s agent", lambda: f"refused the agent of {b}" in job.log("sched"),
                 timeout=60)
    job.wait_for(f"{b}'s agent stopped by the scheduler", lambda: job.agent(b).get("state") == "failed", timeout=60)
    agent_log = (job.job_dir(b) / "logs" / "agent.log").read_text()
    assert f"the scheduler stopped the job: host {b} was replaced by {c}" in agent_log, agent_log[-2000:]
    job.wait_no_leftovers([b])  # none of its processes runs on, none writes into the job

    # by hand: the other spare takes c's ranks while the job runs
    steps = [p.get("step") or 0 for p in holders(job, c).values()]
    assert max(steps) < LAST_STEP - 10, f"the job is nearly done (step {max(steps)}): too late for a replacement"
    refused = job.fleet("replace", "--host", a, check=False)  # the scheduler's host: one line saying why not
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: the scheduler refused: host {a} runs the scheduler: it cannot be replaced while the job runs"]
    out = job.fleet("replace", "--host", c, "--with", d)
    assert f"{c} replaced by {d}" in out.stdout + out.stderr
    job.wait_for(f"{d} holding the ranks, training", lambda: set(holders(job, d)) == lost and all(
        (p.get("step") or 0) > max(steps) for p in holders(job, d).values()), timeout=180)

    assert job.finish_ok() == baseline  # the same final parameters as the uninterrupted run
    assert f"step: {LAST_STEP}," in (job.job_dir(d) / "logs" / "worker_3.log").read_text()  # d trained to the end
    status = json.loads(job.fleet("status", "--json").stdout)
    assert {p["node_id"]: p["host"] for p in status["processes"] if p["node_id"] in lost} == dict.fromkeys(lost, d)
    assert {h["host"]: h["agent"] for h in status["hosts"]} == {a: "succeeded", d: "succeeded"}
    assert status["replaced"] == {b: c, c: d}
    record = json.loads((spares_e2e.project / ".toolkit" / "jobs" / "spares.json").read_text())
    assert {h["name"]: h["replaced_by"] for h in record["hosts"]} == {a: None, b: c, c: d, d: None}
    job.wait_no_leftovers()
