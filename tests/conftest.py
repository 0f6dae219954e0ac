"""Session-wide fixtures. The namespace test cluster is built once per session (it takes well under a second)
and torn down after, even when tests fail; sub-directories keep their own fixtures in their own conftest.py."""

from __future__ import annotations

import os
import signal
from typing import Any, Iterator

import pytest

from toolkit.testing.cluster import Cluster

HOSTS = int(os.environ.get("TOOLKIT_TEST_HOSTS", "4"))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """N network-namespace hosts with sshd (TOOLKIT_TEST_HOSTS, default 4). Tests that break a host use the
    cluster's context managers (partitioned, crashed, host_key_changed) so the next test finds it whole.
    Clusters left by killed earlier runs are removed first; a SIGTERM (a CI timeout) still tears this one down."""
    Cluster.remove_stale()
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    built = Cluster.up(HOSTS)
    try:
        yield built
    finally:
        problems = built.down()
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
        if problems:
            pytest.fail("test cluster teardown: " + "; ".join(problems))
