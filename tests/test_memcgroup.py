"""The memory cgroup's headroom and OOM kills (toolkit.memcgroup), what the warm spare faults in ahead from them
(toolkit.standby.prefault_size) and how the agent names an OOM kill (toolkit.agent.causes): pure over fake /proc texts
and a fake cgroup tree (v1 and v2, a container's mount root, a tighter parent), then in a real memory cgroup of this
machine with a small limit, where a process that outgrows it is killed by the kernel and named so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from toolkit import memcgroup
from toolkit.agent import causes
from toolkit.procs import ExitStatus
from toolkit.standby import MIN_PREFAULT, prefault_size

MB = 1 << 20
MOUNTINFO_V1 = ("35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                "36 31 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n")
MOUNTINFO_V2 = "30 24 0:26 /jobs /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"  # a container: root /jobs
TIMEOUT = 60.0


def tree(files: dict[str, str]):
    return files.get


def test_v1_headroom_is_the_tightest_limit_minus_usage_up_to_the_mount() -> None:
    cg = memcgroup.find("4:memory:/slurm/job_7\n1:cpu:/\n0::/\n", MOUNTINFO_V1)
    assert cg == memcgroup.MemCgroup("v1", ("/sys/fs/cgroup/memory/slurm/job_7", "/sys/fs/cgroup/memory/slurm",
                                            "/sys/fs/cgroup/memory"))
    files = {"/sys/fs/cgroup/memory/slurm/job_7/memory.limit_in_bytes": f"{9 * 1024 * MB}\n",
             "/sys/fs/cgroup/memory/slurm/job_7/memory.usage_in_bytes": f"{6660 * MB}\n",
             "/sys/fs/cgroup/memory/slurm/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
             "/sys/fs/cgroup/memory/slurm/memory.usage_in_bytes": f"{7000 * MB}\n",
             "/sys/fs/cgroup/memory/slurm/job_7/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"}
    assert cg.headroom(tree(files)) == (9 * 1024 - 6660) * MB
    assert cg.limit(tree(files)) == 9 * 1024 * MB and cg.oom_kills(tree(files)) == 5


def test_v2_in_a_container_counts_the_parent_when_it_is_tighter() -> None:
    cg = memcgroup.find("0::/jobs/a/worker\n", MOUNTINFO_V2)
    assert cg is not None and cg.dirs == ("/sys/fs/cgroup/a/worker", "/sys/fs/cgroup/a", "/sys/fs/cgroup")
    files = {"/sys/fs/cgroup/a/worker/memory.max": "max\n", "/sys/fs/cgroup/a/worker/memory.current": f"{100 * MB}",
             "/sys/fs/cgroup/a/memory.max": f"{4096 * MB}", "/sys/fs/cgroup/a/memory.current": f"{4000 * MB}",
             "/sys/fs/cgroup/a/worker/memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n"}
    assert cg.headroom(tree(files)) == 96 * MB and cg.oom_kills(tree(files)) == 1
    assert memcgroup.find("0::/\n", MOUNTINFO_V2) is None  # outside the container's root: not ours to read
    assert memcgroup.find("0::/x\n", "") is None  # no cgroup file system mounted
    unlimited = memcgroup.find("0::/jobs\n", MOUNTINFO_V2)
    assert unlimited is not None and unlimited.headroom(tree({})) is None


def test_the_spare_faults_in_at_most_half_the_cgroups_headroom_and_nothing_near_its_limit() -> None:
    """The red team's job: a 9 GiB cgroup, workers of 3 GiB (6.66 GB charged), 60 GB free on the host. Before, the
    spare faulted in 3 GB and the cgroup's OOM killer killed workers five times."""
    worker, own, available = 3072 * MB, 400 * MB, 60000 * MB
    assert prefault_size(worker, own, available) == worker - own  # no limit: as before
    headroom = 9 * 1024 * MB - 6660 * MB
    assert prefault_size(worker, own, available, headroom) == headroom // 2
    assert prefault_size(worker, own, available, 2 * MIN_PREFAULT - 1) == 0  # too little room: nothing
    assert prefault_size(worker, own, available, 0) == 0


def test_a_sigkill_while_the_cgroups_oom_kill_count_rose_is_named_an_oom_kill() -> None:
    oom = causes.oom_verdict(4, 5, "/sys/fs/cgroup/memory/slurm/job_7", 9 * 1024 * MB)
    assert oom == ("killed by the kernel's OOM killer (memory cgroup /sys/fs/cgroup/memory/slurm/job_7, "
                   "limit 9216 MB: oom_kill 4 -> 5)")
    killed = ExitStatus(None, signal.SIGKILL)
    assert causes.first_cause(killed, None, None, oom) == f"{oom} (killed by SIGKILL)"
    assert causes.first_cause(killed, None, None, causes.oom_verdict(5, 5, "x", None)) is None  # no OOM kill since
    assert causes.first_cause(killed, "RuntimeError: boom", None, oom).startswith("RuntimeError: boom")  # its own
    assert causes.first_cause(ExitStatus(None, signal.SIGTERM), None, None, oom) is None  # not the kernel's signal


@pytest.fixture
def small_cgroup():
    """A real memory cgroup of 96 MB under this process's own, or a failure saying why it cannot be made."""
    mine = memcgroup.of_process()
    if mine is None or os.geteuid() != 0:
        pytest.fail("this test needs root and a memory cgroup hierarchy (v1 or v2) mounted, as CI has")
    path = Path(mine.dirs[0]) / f"tk-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    limit = path / memcgroup.LIMIT_FILE[mine.version]
    limit.write_text(str(96 * MB))
    try:
        yield mine.version, path
    finally:
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                subprocess.run(["sleep", "0.1"], check=False)


def in_cgroup(path: Path, code: str) -> subprocess.CompletedProcess[str]:
    enter = f"import os; open({str(path / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
    return subprocess.run([sys.executable, "-c", enter + code], capture_output=True, text=True, timeout=TIMEOUT)


def test_in_a_real_cgroup_the_headroom_is_seen_and_an_oom_kill_is_named(small_cgroup) -> None:
    version, path = small_cgroup
    seen = in_cgroup(path, "from toolkit import memcgroup, standby\n"
                           "cg = memcgroup.of_process()\n"
                           "room = cg.headroom(memcgroup.read_text)\n"
                           "print(cg.dirs[0], room, standby.prefault_size(1 << 30, 0, 1 << 40, room))\n")
    assert seen.returncode == 0, seen.stderr
    where, room, size = seen.stdout.split()
    assert where == str(path) and 0 < int(room) < 96 * MB and int(size) <= int(room) // 2  # not 1 GiB
    cg = memcgroup.MemCgroup(version, (str(path),))
    before = cg.oom_kills(memcgroup.read_text)
    hog = in_cgroup(path, "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n")
    assert hog.returncode == -signal.SIGKILL, (hog.returncode, hog.stderr[-2000:])
    after = cg.oom_kills(memcgroup.read_text)
    oom = causes.oom_verdict(before, after, str(path), cg.limit(memcgroup.read_text))
    assert causes.first_cause(ExitStatus(None, signal.SIGKILL), None, None, oom) == \
        f"killed by the kernel's OOM killer (memory cgroup {path}, limit 96 MB: oom_kill {before} -> {after}) " \
        "(killed by SIGKILL)"
