"""Fixtures for the training package's tests: a tiny real tmpfs (for a real ENOSPC) and free TCP ports."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from toolkit.freeports import free_port


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a disk that really fills up. Needs root, which the test machines and CI have."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.fail("the ENOSPC tests mount a tmpfs and must run as root (scripts/test.sh as root, like CI)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


@pytest.fixture(scope="session")
def new_port():
    """Call it for each round: a restarted group must not meet the dead incarnation's store keys."""
    return free_port
