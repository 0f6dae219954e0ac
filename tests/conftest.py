"""Session-wide fixtures. The namespace test cluster is built once per session (it takes well under a second)
and torn down after, even when tests fail; sub-directories keep their own fixtures in their own conftest.py.

The suite runs in parallel processes (pytest-xdist, `scripts/test.sh`): most of its time is spent waiting on
timeouts and start-ups, not computing. Each process builds its own cluster; a file's tests stay in one process
so that its module fixtures (a running job, a cluster's baseline) are built once; the longest files go first."""

from __future__ import annotations

import os
import signal
from typing import Any, Iterator

import pytest

from toolkit.testing.cluster import Cluster

HOSTS = int(os.environ.get("TOOLKIT_TEST_HOSTS", "4"))
# The order in which the processes take the files (scripts/test.sh turns off xdist's own, by number of tests, which
# left the files of one or two long tests to the end): the longest first, the many short unit tests last, where they
# fill the gaps; a long file taken last leaves one process working alone while the other has nothing left. Measured
# alone on this 2-core machine at load 12-23 (s): test_playbooks 254, test_readme 192, each e2e file 190-250,
# test_check 102, the train files with jobs 50-260, test_agent 76, test_demo 61, test_another_user 52.
HEAVY_FIRST = ("tests/test_playbooks.py", "tests/test_readme.py", "tests/e2e/", "tests/test_check.py", "tests/train/",
               "tests/test_agent.py", "tests/test_demo.py", "tests/test_another_user.py")


def _weight(path: str) -> int:
    return next((i for i, prefix in enumerate(HEAVY_FIRST) if path.startswith(prefix)), len(HEAVY_FIRST))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put each test in its file's xdist group (`--dist loadgroup` keeps a group in one process, so that its module
    fixtures are built once; the e2e baselines, shared by several files, are run once a session across processes by
    tests/e2e/conftest.py), and the files in HEAVY_FIRST's order. Runs before xdist reads the marks; without xdist
    the marks do nothing."""
    paths = {item: item.path.relative_to(config.rootpath).as_posix() for item in items}
    items.sort(key=lambda item: _weight(paths[item]))  # stable: each file's tests stay in their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(paths[item]))


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
