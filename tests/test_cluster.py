"""The namespace test cluster itself: what every other multi-host test relies on. Checked with the OpenSSH
client and toolkit's own inventory parser, so a mistake in the generated files shows here first."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.launcher.inventory import load_ansible_inventory
from toolkit.testing import waits
from toolkit.testing.cluster import REGISTRY, Cluster, describe, exited

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
WAIT = 30.0  # s for processes started over ssh to show up: generous, CI's machine is shared


def ssh(cluster: Cluster, name: str, command: str) -> subprocess.CompletedProcess[str]:
    """The real OpenSSH client with the generated ssh_config (StrictHostKeyChecking yes, the cluster's
    known_hosts): a wrong key or config fails here."""
    return subprocess.run(["ssh", "-F", str(cluster.ssh_config), name, command], capture_output=True, text=True,
                          timeout=30)


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_each_host_has_its_own_name_address_home_and_workdir(cluster: Cluster) -> None:
    for h in cluster.hosts:
        out = ssh(cluster, h.name, 'hostname; ip -4 -o addr show eth0; echo "$HOME"; ls -A "$HOME"; pwd')
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == h.name
        assert f"inet {h.address}/" in lines[1]
        assert lines[2] == "/root" and ".bashrc" not in lines[3:-1]  # the machine's ~/.bashrc is hidden
        assert h.workdir.is_dir()
    assert len({h.workdir for h in cluster.hosts}) == len(cluster.hosts)


def test_hosts_reach_each_other_but_nothing_else(cluster: Cluster) -> None:
    a, b = cluster.hosts[0], cluster.hosts[1]
    probe = ("import socket, sys\n"
             "s = socket.create_connection((sys.argv[1], 22), timeout=5); print(s.recv(7).decode())")
    out = ssh(cluster, a.name, f"{cluster.python} -c '{probe}' {b.address}")
    assert out.stdout.strip() == "SSH-2.0", out.stderr
    route = ssh(cluster, a.name, "ip -4 route")
    assert "default" not in route.stdout  # a private bridge: no way out


def test_generated_inventory_is_what_the_launcher_reads(cluster: Cluster) -> None:
    inventory = load_ansible_inventory(cluster.inventory)
    assert [h.name for h in inventory.hosts] == cluster.names
    for parsed, h in zip(inventory.hosts, cluster.hosts, strict=True):
        assert (parsed.address, parsed.port, parsed.user, parsed.key_file) == (h.address, 22, "root", str(cluster.key))
        assert (parsed.slots, parsed.workdir, parsed.python) == (1, str(h.workdir), cluster.python)
    out = ssh(cluster, cluster.hosts[-1].name, f"{cluster.python} -c 'import toolkit; print(\"ok\")'")
    assert out.stdout.strip() == "ok", out.stderr  # the inventory's python works on the hosts


def test_openssh_refuses_a_host_whose_key_is_not_the_recorded_one(cluster: Cluster) -> None:
    victim = cluster.hosts[-1]
    with cluster.host_key_changed(victim.name):
        out = ssh(cluster, victim.name, "true")
        assert out.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in out.stderr
    assert ssh(cluster, victim.name, "true").returncode == 0


def test_crashing_a_host_kills_everything_in_it_even_detached_processes(cluster: Cluster) -> None:
    victim = cluster.hosts[-1]
    out = ssh(cluster, victim.name, "setsid sh -c 'sleep 300 & sleep 301' >/dev/null 2>&1 </dev/null & echo $!")
    assert out.returncode == 0, out.stderr
    session = int(out.stdout)  # setsid's sh: the leader of the detached group (hosts share the PID space)
    try:
        waits.wait_for("both detached sleeps to start",
                       lambda: _commands(cluster.workload_pids(victim.name)) >= {"sleep 300", "sleep 301"}, WAIT,
                       evidence=lambda: str(_commands(cluster.workload_pids(victim.name))))
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # the cluster is shared: leave nothing for the next test
            os.killpg(session, signal.SIGKILL)
        raise
    with cluster.crashed(victim.name) as h:
        assert cluster.netns_pids(h.name) == []
        assert ssh(cluster, h.name, "true").returncode == 255
    assert cluster.workload_pids(victim.name) == []
    assert ssh(cluster, victim.name, "hostname").stdout.strip() == victim.name  # booted again


def test_two_clusters_coexist_and_down_removes_only_its_own(cluster: Cluster) -> None:
    other = Cluster.up(2)
    try:
        assert other.state.bridge != cluster.state.bridge
        assert {h.address for h in other.hosts}.isdisjoint(h.address for h in cluster.hosts)
        assert ssh(other, "node1", "hostname").stdout.strip() == "node1"
        sshd = [other.sshd_pid(n) for n in other.names]
    finally:
        assert other.down() == []
    assert not {h.netns for h in other.hosts} & netns_names()
    assert not Path(f"/sys/class/net/{other.state.bridge}").exists()
    assert all(exited(pid) for pid in sshd if pid)
    assert not Path(other.state.dir).exists() and not (REGISTRY / f"{other.state.id}.json").exists()
    assert other.down() == []  # twice is harmless
    assert ssh(cluster, cluster.hosts[0].name, "hostname").stdout.strip() == cluster.hosts[0].name


def test_a_cluster_whose_builder_died_is_removed_from_its_recorded_state(tmp_path: Path) -> None:
    directory = tmp_path / "orphan"
    build = ("import os, sys; from toolkit.testing.cluster import Cluster; "
             "c = Cluster.up(2, dir=sys.argv[1]); print(c.state.id, flush=True); os._exit(0)")  # no teardown
    out = subprocess.run([sys.executable, "-c", build, str(directory)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cid = out.stdout.strip()
    orphan = Cluster.load(directory)
    assert (cid, str(directory), True) in Cluster.recorded()  # its owner is gone: stale
    assert {h.netns for h in orphan.hosts} <= netns_names()
    down = subprocess.run([sys.executable, str(REPO / "scripts" / "cluster.py"), "down", "--dir", str(directory)],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert not {h.netns for h in orphan.hosts} & netns_names()
    assert not any(r[0] == cid for r in Cluster.recorded())


def _commands(pids: list[int]) -> set[str]:
    """The command lines of those of `pids` still running (one may exit while it is read: it is left out)."""
    return {info.command for info in map(describe, pids) if info is not None and info.live}


def test_up_refuses_bad_sizes() -> None:
    from toolkit.testing.cluster import ClusterSetupError

    with pytest.raises(ClusterSetupError, match="1 to 250 hosts"):
        Cluster.up(0)
    with pytest.raises(ClusterSetupError, match="1 to 250 hosts"):
        Cluster.up(251)
