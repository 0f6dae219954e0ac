"""Session-wide fixtures. The namespace test cluster is built once per session (it takes well under a second)
and torn down after, even when tests fail; sub-directories keep their own fixtures in their own conftest.py.

The suite runs in parallel processes (pytest-xdist, `scripts/test.sh`): most of its time is spent waiting on
timeouts and start-ups, not computing. Each process builds its own cluster; a file's tests stay in one process
so that its module fixtures (a running job, a cluster's baseline) are built once."""

from __future__ import annotations

import os
import signal
from typing import Any, Iterator

import pytest

from toolkit.testing.cluster import Cluster

HOSTS = int(os.environ.get("TOOLKIT_TEST_HOSTS", "4"))
# Files that share a session fixture costlier than a file's own (the e2e baselines: a whole training run each)
# run in the same process; every other file is a group of its own.
SHARED_GROUPS = {
    "tests/e2e/test_faults.py": "e2e-baselines",
    "tests/e2e/test_spares.py": "e2e-baselines",
    "tests/e2e/test_zero_loss_on_hosts.py": "e2e-baselines",
    "tests/e2e/test_elastic_on_hosts.py": "e2e-baselines",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put each test in its xdist group (its file's, or the shared one above); `--dist loadgroup` keeps a group in
    one process. Runs before xdist reads the marks; without xdist the marks do nothing."""
    for item in items:
        path = item.path.relative_to(config.rootpath).as_posix()
        item.add_marker(pytest.mark.xdist_group(SHARED_GROUPS.get(path, path)))


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
