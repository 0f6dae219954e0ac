from __future__ import annotations

import subprocess
import sys

from toolkit.netif import interface_toward
from toolkit.testing.cluster import Cluster


def test_loopback_and_unresolvable() -> None:
    assert interface_toward("127.0.0.1", 9) == "lo"
    assert interface_toward("no-such-host.invalid", 9) is None


def test_a_namespace_host_reaches_its_peers_through_eth0(cluster: Cluster) -> None:
    """The case gloo gets wrong: the hostname (node1) resolves to nothing on the host, so gloo would bind to
    127.0.0.1; the route toward the scheduler's host names the interface the peers can reach."""
    a, b = cluster.names[:2]
    code = f"from toolkit.netif import interface_toward as f; print(f({cluster.host(b).address!r}, 8118))"
    done = subprocess.run(cluster.netns_argv(a, [sys.executable, "-c", code]), capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "eth0"), done.stderr
