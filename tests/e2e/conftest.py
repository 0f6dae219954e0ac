"""Fixtures of the fault matrix: the project deployed on the namespace cluster, and the uninterrupted baseline."""

from __future__ import annotations

import shutil

import pytest
from fault_harness import E2E, HOSTS, LONG_ARGS, REPO, SCRIPT_ARGS, SLOTS

from toolkit.testing.cluster import Cluster


@pytest.fixture(scope="session")
def e2e(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> E2E:
    hosts = cluster.names[:HOSTS]
    project = tmp_path_factory.mktemp("e2e-project")
    shutil.copy(REPO / "examples" / "train.py", project / "train.py")
    shutil.copytree(REPO / "examples" / "MNIST_Data", project / "MNIST_Data")
    inventory = project / "inventory.ini"
    inventory.write_text(_inventory(cluster, hosts))
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


def _inventory(cluster: Cluster, hosts: list[str]) -> str:
    lines = ["[workers]"]
    for name in hosts:
        h = cluster.host(name)
        lines.append(f"{name} ansible_host={h.address} ansible_user=root ansible_ssh_private_key_file={cluster.key} "
                     f"slots={SLOTS} workdir={h.workdir} python={cluster.python}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def baseline(e2e: E2E) -> str:
    """The final parameters' digest of an uninterrupted run with the same seed: what every fault must match."""
    job = e2e.job("baseline", "--script-args", SCRIPT_ARGS.replace("--step-delay 0.25", "--step-delay 0.02"))
    job.start()  # the delay is a wait, not part of the result: the baseline need not spend it
    digest = job.finish_ok()
    job.wait_no_leftovers()
    return digest


@pytest.fixture(scope="session")
def long_baseline(e2e: E2E) -> str:
    """The digest of an uninterrupted run of LONG_ARGS on 6 ranks: what the random kills across hosts and the spares'
    takeovers must match (the spares' 2 hosts x 3 slots are 6 ranks too)."""
    job = e2e.job("long-baseline", "--script-args", f"{LONG_ARGS} --step-delay 0.02")
    job.start()
    digest = job.finish_ok()
    job.wait_no_leftovers()
    return digest


@pytest.fixture(scope="session")
def ddp_e2e(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> E2E:
    """examples/ddp deployed on 3 hosts of one slot each (fabric.yaml holds only where the hosts are and their
    keys: every recovery setting is the default). Checkpoints go to a directory every host sees, as a lab's NFS
    would be: a torchrun-style script's rank 0 writes the checkpoint every rank resumes from."""
    hosts = cluster.names[:HOSTS]
    project = tmp_path_factory.mktemp("ddp-project")
    shutil.copytree(REPO / "examples" / "ddp", project, dirs_exist_ok=True)
    inventory = project / "inventory.ini"
    inventory.write_text(_inventory(cluster, hosts).replace(f"slots={SLOTS}", "slots=1"))
    (project / "fabric.yaml").write_text(
        "toolkit:\n"
        f"  inventory: {inventory}\n"
        f"  known_hosts: {cluster.known_hosts}\n"
    )
    return E2E(cluster, project, hosts, iter(range(22000, 23000, 2)))
