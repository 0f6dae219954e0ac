"""Fixtures of the fault matrix: the project deployed on the namespace cluster, and the uninterrupted baseline."""

from __future__ import annotations

import fcntl
import os
import shutil
from typing import Callable

import pytest
from fault_harness import E2E, HOSTS, LONG_ARGS, REPO, SCRIPT_ARGS, SLOTS
from fault_harness import inventory as write_inventory

from toolkit import atomicfile
from toolkit.testing import waits
from toolkit.testing.cluster import Cluster

BASELINE_WAIT = 600.0  # s for another test process to end the uninterrupted run it computes (a job and its leftovers)


@pytest.fixture(scope="session")
def e2e(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> E2E:
    hosts = cluster.names[:HOSTS]
    project = tmp_path_factory.mktemp("e2e-project")
    shutil.copy(REPO / "examples" / "train.py", project / "train.py")
    shutil.copytree(REPO / "examples" / "MNIST_Data", project / "MNIST_Data")
    inventory = project / "inventory.ini"
    inventory.write_text(write_inventory(cluster, {"workers": hosts}, SLOTS))
    (project / "fabric.yaml").write_text(
        "toolkit:\n"
        f"  inventory: {inventory}\n"
        f"  known_hosts: {cluster.known_hosts}\n"
        "  script: train.py\n"
        f"  script_args: '{SCRIPT_ARGS}'\n"
        "  node_timeout: 3\n"
        "  cluster_time_out: 90\n"
        "  grace: 5\n"
        "  max_restarts: 3\n"
    )
    return E2E(cluster, project, hosts, iter(range(21000, 22000, 2)))


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], str]) -> str:
    """`compute()` once in the whole session, across pytest-xdist's processes: the first to ask runs it under a
    lock in the session's own temporary root (the parent of each process's), the others wait for it and read its
    result. The baselines are whole training runs whose digest does not depend on the hosts: one is enough, and a
    second in the other process would only steal its CPU. Without xdist, a session fixture is once already."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    shared = tmp_path_factory.getbasetemp().parent
    done = shared / f"{name}.digest"
    with open(shared / f"{name}.lock", "a") as lock:
        def locked() -> bool:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        waits.wait_for(f"the other test process's {name}", locked, BASELINE_WAIT, poll=0.5)
        if done.exists():  # the other process computed it (one that failed left nothing: this one tries again)
            return done.read_text()
        result = compute()
        atomicfile.write(done, result)
        return result


def uninterrupted(e2e: E2E, name: str, script_args: str) -> str:
    """The final parameters' digest of job `name` run without a fault; no process of it left after."""
    job = e2e.job(name, "--script-args", script_args)
    job.start()
    digest = job.finish_ok()
    job.wait_no_leftovers()
    return digest


@pytest.fixture(scope="session")
def baseline(e2e: E2E, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final parameters' digest of an uninterrupted run with the same seed: what every fault must match."""
    # the delay is a wait, not part of the result: the baseline need not spend it
    args = SCRIPT_ARGS.replace("--step-delay 0.25", "--step-delay 0.02")
    return once_per_session(tmp_path_factory, "baseline", lambda: uninterrupted(e2e, "baseline", args))


@pytest.fixture(scope="session")
def long_baseline(e2e: E2E, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest of an uninterrupted run of LONG_ARGS on 6 ranks: what the random kills across hosts and the spares'
    takeovers must match (the spares' 2 hosts x 3 slots are 6 ranks too)."""
    return once_per_session(tmp_path_factory, "long-baseline",
                            lambda: uninterrupted(e2e, "long-baseline", f"{LONG_ARGS} --step-delay 0.02"))


@pytest.fixture(scope="session")
def ddp_e2e(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> E2E:
    """examples/ddp deployed on 3 hosts of one slot each (fabric.yaml holds only where the hosts are and their
    keys: every recovery setting is the default). Checkpoints go to a directory every host sees, as a lab's NFS
    would be: a torchrun-style script's rank 0 writes the checkpoint every rank resumes from."""
    hosts = cluster.names[:HOSTS]
    project = tmp_path_factory.mktemp("ddp-project")
    shutil.copytree(REPO / "examples" / "ddp", project, dirs_exist_ok=True)
    inventory = project / "inventory.ini"
    inventory.write_text(write_inventory(cluster, {"workers": hosts}, 1))
    (project / "fabric.yaml").write_text(
        "toolkit:\n"
        f"  inventory: {inventory}\n"
        f"  known_hosts: {cluster.known_hosts}\n"
    )
    return E2E(cluster, project, hosts, iter(range(22000, 23000, 2)))
