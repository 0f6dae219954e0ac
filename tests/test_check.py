"""`fleet check` (and `train`'s check first) on the namespace cluster, as a user runs it, against one deployed job
shared by the tests. Each fault is made for real on one host and undone after: another torch behind the host's
interpreter path (a second venv whose own `torch` shadows the real one), an edited project copy, different data,
a process holding the scheduler's port, a slow link (a token-bucket rate limit on both ends of the host's cable).
The job's interpreter is /root/tkpy/bin/python on every host: each host's private home has its own `tkpy` link to
a venv, so one host can be given another environment behind the same path, as happens on a real rack."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from test_tasks import LONG, WORKER, assert_nothing_left, fleet, ok

from toolkit.testing.cluster import Cluster

PORT = 9950  # the job's scheduler port (the health test's pair stores use the ports after PORT + 1)
VENV = Path(sys.prefix)  # the venv the cluster's hosts run (its python is the one the tests run with)
# Tests of facts, not of speed: a loaded machine can make a healthy link's all-reduce several times the median
NO_SLOWNESS = ("--slow-factor", "1000")
RATE = "1mbit"  # the slow host's link: its all-reduces take ~0.03 s each instead of ~1 ms

pytestmark = pytest.mark.timeout(600)


class Job:
    """The shared deployed job: its project, name, and the lines `fleet check` prints per problem."""

    def __init__(self, cluster: Cluster, project: Path, name: str) -> None:
        self.cluster, self.project, self.name = cluster, project, name

    def check(self, *args: str, task: str = "check") -> subprocess.CompletedProcess[str]:
        r = fleet(task, "--job", self.name, *args, cwd=self.project)
        assert "Traceback" not in r.stderr, r.stderr
        return r

    @staticmethod
    def problems(r: subprocess.CompletedProcess[str]) -> list[str]:
        """The problem lines (`host: check: what; fix`) under the error's first line."""
        lines = r.stderr.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("error: check found"))
        return [line for line in lines[start + 1:] if re.match(r"^\S+: \w+: ", line)]

    def link_python(self, host: str, venv: Path) -> None:
        link = self.cluster.host(host).home / "tkpy"
        link.unlink(missing_ok=True)
        link.symlink_to(venv)


@pytest.fixture(scope="module")
def job(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    tmp = tmp_path_factory.mktemp("check")
    project = tmp / "proj"
    project.mkdir()
    shutil.copy(WORKER, project / "train.py")
    inventory = tmp / "inventory.ini"
    inventory.write_text(cluster.inventory.read_text().replace(f"python={cluster.python}",
                                                               "python=/root/tkpy/bin/python"))
    (project / "fabric.yaml").write_text(
        "toolkit:\n"
        f"  inventory: {inventory}\n"
        f"  known_hosts: {cluster.known_hosts}\n"
        "  warm_spare: false\n"
        "  grace: 3\n"
    )
    made = Job(cluster, project, f"c{uuid.uuid4().hex[:8]}")
    for h in cluster.hosts:
        made.link_python(h.name, VENV)
        data = h.home / "data"
        shutil.rmtree(data, ignore_errors=True)
        (data / "shards").mkdir(parents=True)
        for i in range(3):
            (data / "shards" / f"{i}.bin").write_bytes(bytes([i]) * 4096)
    ok(fleet("deploy", "--job", made.name, "--master-port", str(PORT), "--data-path", "/root/data",
             "--script-args", LONG, cwd=project))
    yield made
    fleet("stop", "--job", made.name, cwd=project)
    for h in cluster.hosts:
        (h.home / "tkpy").unlink(missing_ok=True)
        shutil.rmtree(h.home / "data", ignore_errors=True)


def test_a_uniform_cluster_passes_and_a_second_check_reads_no_data_again(job: Job) -> None:
    r = ok(job.check())
    assert f"check: all {len(job.cluster.hosts)} host(s) of job {job.name} agree" in r.stderr
    for name in job.cluster.names:  # one row per host, nothing wrong with any
        row = next(line for line in r.stdout.splitlines() if f" {name} " in line)
        assert "2.13.0" in row and row.rstrip(" │|").endswith("ok"), row
    again = ok(job.check())
    assert "data: 0 file(s) hashed" in again.stderr  # every host's manifest came from its cache


def test_each_bad_host_is_named_with_one_line(job: Job, tmp_path: Path) -> None:
    cluster = job.cluster
    sched, other_torch, edited, other_data = cluster.names[:4]
    # a second venv on one host: its own torch (another version) shadows the real one, the rest is shared
    venv2 = tmp_path / "venv2"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv2)],
                   check=True, timeout=120)
    (site2,) = venv2.glob("lib/python*/site-packages")
    (site1,) = VENV.glob("lib/python*/site-packages")
    (site2 / "torch").mkdir()
    (site2 / "torch" / "__init__.py").write_text('__version__ = "2.0.0"\n')
    (site2 / "torch-2.0.0.dist-info").mkdir()
    (site2 / "torch-2.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.0.0\n")
    (site2 / "zz_shared.pth").write_text(f"import site; site.addsitedir({str(site1)!r})\n")
    job.link_python(other_torch, venv2)
    copy = cluster.host(edited).workdir / job.name / "project" / "train.py"
    copy.write_text(copy.read_text() + "# edited on the host\n")
    shard = cluster.host(other_data).home / "data" / "shards" / "1.bin"
    shard.write_bytes(b"\xff" * 4096)
    squatter = subprocess.Popen(cluster.netns_argv(sched, [
        sys.executable, "-c", "import socket, sys; s = socket.socket(); s.bind(('', int(sys.argv[1]))); s.listen();"
        " print('up', flush=True); sys.stdin.read()", str(PORT + 1)]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert squatter.stdout.readline() == "up\n"  # type: ignore[union-attr]
        r = job.check(*NO_SLOWNESS)
        assert r.returncode == 2
        problems = job.problems(r)
        assert f"error: check found {len(problems)} problem(s):\n" in r.stderr
        by_host = {name: [p for p in problems if p.startswith(f"{name}: ")] for name in cluster.names[:4]}
        assert all(len(lines) == 1 for lines in by_host.values()), problems
        assert by_host[sched][0] == (f"{sched}: port: port {PORT + 1} is taken by pid {squatter.pid} "
                                     f"({sys.executable} -c import socket, sys; s = socket.socket(); "
                                     "s.bind(('', int(sys.argv[1]))); s.listen(); print('up', flush=True); "
                                     f"sys.stdin.read() {PORT + 1}); stop what listens there, or deploy with another "
                                     "--master-port")
        assert by_host[other_torch][0].startswith(f"{other_torch}: torch: torch 2.0.0, but 2.13.0")
        assert by_host[edited][0].startswith(f"{edited}: project: its copy differs from the project here")
        assert "fleet deploy" in by_host[edited][0]
        assert by_host[other_data][0].startswith(f"{other_data}: data: /root/data differs from")
        assert len(problems) == 4, problems
        row = next(line for line in r.stdout.splitlines() if f" {other_torch} " in line)
        assert "2.0.0" in row and "skipped" in row  # no health test with another torch
    finally:
        squatter.kill()
        squatter.wait(timeout=10)
        job.link_python(other_torch, VENV)
        shard.write_bytes(bytes([1]) * 4096)
        ok(fleet("deploy", "--job", job.name, cwd=job.project))  # puts the project copy right again
    ok(job.check(*NO_SLOWNESS))


def test_a_host_whose_key_changed_is_named_and_the_others_are_still_checked(job: Job) -> None:
    victim = job.cluster.names[3]
    with job.cluster.host_key_changed(victim):
        r = job.check(*NO_SLOWNESS)
    assert r.returncode == 2
    (line,) = job.problems(r)
    assert line.startswith(f"{victim}: ssh: host key for ") and "CHANGED" in line, line
    row = next(line for line in r.stdout.splitlines() if f" {job.cluster.names[0]} " in line)
    assert re.search(r"node\d+ [\d.]+ s", row), row  # the others' health test ran: their all-reduces were timed


@pytest.fixture
def slow_link(job: Job) -> Iterator[str]:
    """The third host's link made slow: a token bucket of RATE on both ends of its cable (the bridge's end and the
    host's eth0), removed after. (netem is not in this machine's kernel; tbf is.)"""
    name = job.cluster.names[2]
    h = job.cluster.host(name)
    ends = [["tc", "qdisc", "{}", "dev", h.veth, "root"], job.cluster.netns_argv(name, ["tc", "qdisc", "{}", "dev",
                                                                                        "eth0", "root"])]
    shaping = ["tbf", "rate", RATE, "burst", "8kb", "latency", "1s"]
    for argv in ends:
        subprocess.run([a.format("add") for a in argv] + shaping, check=True, timeout=30)
    try:
        shown = subprocess.run(["tc", "qdisc", "show", "dev", h.veth], capture_output=True, text=True, timeout=30)
        assert "tbf" in shown.stdout and "rate 1Mbit" in shown.stdout, shown.stdout  # the shaping is in force
        yield name
    finally:
        for argv in ends:
            subprocess.run([a.format("del") for a in argv], check=True, timeout=30)


def test_a_slow_host_is_named_with_how_much_slower_it_is(job: Job, slow_link: str) -> None:
    r = job.check()
    assert r.returncode == 2, r.stdout + r.stderr
    problems = job.problems(r)
    assert [p.split(":")[0] for p in problems] == [slow_link], r.stdout + r.stderr
    (line,) = problems
    assert line.startswith(f"{slow_link}: health: "), line
    m = re.search(r"all-reduce with (\S+) and (\S+) ([\d.]+)x the median", line)
    assert m and {m.group(1), m.group(2)} == {job.cluster.names[1], job.cluster.names[3]}, line
    assert float(m.group(3)) >= 3.0, line


def test_train_checks_first_and_refuses_a_bad_cluster_unless_told_not_to(job: Job) -> None:
    cluster = job.cluster
    edited = cluster.names[1]
    copy = cluster.host(edited).workdir / job.name / "project" / "train.py"
    original = copy.read_text()
    copy.write_text(original + "# edited on the host\n")
    try:
        r = job.check(task="train")
        assert r.returncode == 2
        assert [p.split(":")[0] for p in job.problems(r)] == [edited]
        assert "nothing was started; fix these (or pass --no-check to start anyway)" in r.stderr
        assert not cluster.workload()  # no agent, no process of the job anywhere
        r = ok(job.check("--no-check", task="train"))
        assert f"job {job.name} started on {len(cluster.hosts)} host(s)" in r.stderr
        assert "checked" not in r.stderr
    finally:
        copy.write_text(original)
        ok(fleet("stop", "--job", job.name, cwd=job.project))
    assert_nothing_left(cluster)
    assert os.path.exists(copy)
