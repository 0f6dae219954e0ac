"""Session-wide fixtures. The namespace test cluster is built once per session (it takes well under a second)
and torn down after, even when tests fail; sub-directories keep their own fixtures in their own conftest.py."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from cluster import Cluster

HOSTS = int(os.environ.get("TOOLKIT_TEST_HOSTS", "4"))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """N network-namespace hosts with sshd (TOOLKIT_TEST_HOSTS, default 4). Tests that break a host use the
    cluster's context managers (partitioned, crashed, host_key_changed) so the next test finds it whole."""
    built = Cluster.up(HOSTS)
    try:
        yield built
    finally:
        problems = built.down()
        if problems:
            pytest.fail("test cluster teardown: " + "; ".join(problems))
