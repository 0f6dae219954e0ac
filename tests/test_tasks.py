"""The Fabric tasks end to end, as a user runs them: `fleet` (and `fab` with the repo's fabfile.py) as real
subprocesses in a project directory, against the namespace cluster's real sshd hosts (and against this machine
with no hosts). The worker is tests/scripts/tasks_worker.py: msrun-style step lines, progress to the agent.

Every test that starts a job checks, on every host, through the hosts' network namespaces (never by name), that
no process of the job is left when it is over.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from toolkit.freeports import free_port_pair
from toolkit.launcher.remote import LocalHost
from toolkit.procs import proc_info
from toolkit.testing import waits
from toolkit.testing.cluster import Cluster, ProcessInfo, describe, format_workload

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKER = Path(__file__).resolve().parent / "scripts" / "tasks_worker.py"
WAIT = 60.0  # s: bound of every wait on the job to reach a state
LEFTOVER_WAIT = 90.0  # s for every process of a stopped job to be gone, on a busy machine
POLL = 0.3  # s between looks while waiting
COMMAND_TIMEOUT = 120.0
LONG = "--steps 100000 --delay 0.2"  # a job that runs until it is stopped

pytestmark = pytest.mark.timeout(300)


# --- helpers -----------------------------------------------------------------------------------------------------


def fleet(*args: str, cwd: Path, tool: str = "fleet") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / tool), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT)


def ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "Traceback" not in r.stderr
    return r


def wait_for(what: str, condition: Callable[[], Any], bound: float = WAIT,
             evidence: Callable[[], str] | None = None) -> Any:
    return waits.wait_for(what, condition, bound, poll=POLL, evidence=evidence)


def status(project: Path, job: str, *core: str) -> dict[str, Any]:
    return json.loads(ok(fleet(*core, "status", "--job", job, "--json", cwd=project)).stdout)


def all_running(project: Path, job: str = "", min_step: int = 1, job_flag: bool = True) -> dict[str, Any] | None:
    doc = status(project, job) if job_flag else status_here(project)
    procs = doc["processes"]
    running = all(p["state"] == "running" and p["pid"] for p in procs)
    stepping = all(p["step"] is not None and p["step"] >= min_step for p in procs if p["role"] == "worker")
    return doc if running and stepping else None


def live(pids: list[int]) -> set[int]:
    """Those still running (a zombie awaiting this machine's slow reaper has exited)."""
    return {pid for pid in pids if (info := describe(pid)) is not None and info.live}


def assert_nothing_left(cluster: Cluster, ignore: frozenset[int] = frozenset()) -> None:
    """No process of the job on any host (found through the hosts' network namespaces, sshd's own excluded, and
    `ignore`: what the test itself started there); bounded generously, since a loaded machine takes its time to
    tear processes down."""
    def left() -> dict[str, list[ProcessInfo]]:
        found = {n: [i for i in infos if i.pid not in ignore] for n, infos in cluster.workload().items()}
        return {n: infos for n, infos in found.items() if infos}

    wait_for("no process of the job left on any host", lambda: not left(), bound=LEFTOVER_WAIT,
             evidence=lambda: "still running:\n" + format_workload(left()))


@pytest.fixture
def project(tmp_path: Path, cluster: Cluster) -> Path:
    """A user's project: the training script and a fabric.yaml whose toolkit section names the cluster."""
    d = tmp_path / "proj"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    (d / "fabric.yaml").write_text(
        "toolkit:\n"
        f"  inventory: {cluster.inventory}\n"
        f"  known_hosts: {cluster.known_hosts}\n"
        "  warm_spare: false\n"
        "  grace: 3\n"
    )
    return d


@pytest.fixture
def job(tmp_path: Path) -> Iterator[str]:
    """A fresh job name. Whatever the test did, nothing of that job runs after it: a job it deployed (from any
    project under tmp_path) is stopped, so one failed test does not leave processes that fail the next ones'
    leftover checks."""
    name = f"t{uuid.uuid4().hex[:8]}"
    yield name
    for record in tmp_path.rglob(f"{name}.json"):
        if record.parent.name == "jobs" and record.parent.parent.name == ".toolkit":
            fleet("stop", "--job", name, cwd=record.parents[2])


@pytest.fixture(scope="session")
def ports() -> Iterator[int]:
    return iter(range(9300, 9900, 2))


@pytest.fixture
def port(ports: Iterator[int]) -> str:
    return str(next(ports))


# --- the whole flow ----------------------------------------------------------------------------------------------


def test_deploy_train_status_logs_restart_stop(cluster: Cluster, project: Path, job: str, port: str) -> None:
    flags = ["--job", job, "--master-port", port, "--script-args", LONG]
    r = ok(fleet("deploy", *flags, cwd=project))
    assert f"deployed job {job} to {len(cluster.hosts)} host(s)" in r.stderr
    job_dirs = {h.name: h.workdir / job for h in cluster.hosts}
    for d in job_dirs.values():
        assert (d / "project" / "train.py").read_bytes() == WORKER.read_bytes()
        assert (d / "launch.sh").is_file() and (d / "recover.sh").is_file() and (d / "stop.sh").is_file()
        assert oct((d / "token").stat().st_mode & 0o777) == "0o600"
    assert not (job_dirs["node1"] / "project" / ".toolkit").exists()  # the local job record stays local

    def snapshot() -> dict[Path, tuple[int, float]]:
        return {p: (p.stat().st_ino, p.stat().st_mtime) for d in job_dirs.values() for p in d.rglob("*")
                if p.is_file() and "state" not in p.parts and "logs" not in p.parts}

    before = snapshot()
    r = ok(fleet("deploy", *flags, cwd=project))  # nothing changed: nothing is sent
    assert f"deployed job {job} to {len(cluster.hosts)} host(s): 0 file(s) sent (0 B)" in r.stderr
    assert snapshot() == before  # no file rewritten (every write is a rename: a new inode)

    r = ok(fleet("train", "--job", job, cwd=project))
    assert f"job {job} started on {len(cluster.hosts)} host(s)" in r.stderr
    doc = wait_for("every process running and stepping", lambda: all_running(project, job, min_step=2))
    # the SSH sessions that started them are closed; the processes run on, each on its own host
    assert [p["node_id"] for p in doc["processes"]] == ["sched"] + [f"worker_{i}" for i in range(4)]
    assert {p["host"] for p in doc["processes"]} == set(cluster.names)
    for p in doc["processes"]:
        assert p["pid"] in cluster.workload_pids(p["host"])
        assert p["log_age"] is not None and p["log_age"] < 30

    table = ok(fleet("status", "--job", job, cwd=project)).stdout
    for word in ("host", "node id", "rank", "pid", "state", "restarts", "step", "steps/s", "loss", "heartbeat",
                 "log age", "note", "worker_3"):
        assert word in table

    lines = ok(fleet("logs", "--job", job, "--rank", "1", "-n", "3", cwd=project)).stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("node2:worker:1 | epoch: 0, step: ") for line in lines)
    lines = ok(fleet("logs", "--job", job, "--host", "node1", "-n", "2", cwd=project)).stdout.splitlines()
    assert {line.split(" | ")[0] for line in lines} == {"node1:sched:-", "node1:worker:0"}
    assert "scheduler" not in ok(fleet("logs", "--job", job, "--node", "worker_3", cwd=project)).stdout

    # -f streams from every host at once until Ctrl-C, then leaves no tail behind on any host
    before_follow = {n: live(cluster.workload_pids(n)) for n in cluster.names}
    follower = subprocess.Popen([str(BIN / "fleet"), "logs", "--job", job, "-f", "-n", "0"], cwd=project,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    deadline = time.monotonic() + WAIT
    while len(seen) < 4 and time.monotonic() < deadline:
        line = follower.stdout.readline()  # type: ignore[union-attr]
        if "| epoch: 0, step:" in line:
            seen.add(line.split(" | ")[0])
    assert seen == {"node1:worker:0", "node2:worker:1", "node3:worker:2", "node4:worker:3"}
    follower.send_signal(signal.SIGINT)
    out, err = follower.communicate(timeout=30)
    assert follower.returncode == 0 and "Traceback" not in err, err
    wait_for("the remote tails to be gone",
             lambda: all(live(cluster.workload_pids(n)) <= before_follow[n] for n in cluster.names), bound=15)

    # restart one process by hand, with fleet and with the rendered recover.sh on its host
    old = {p["node_id"]: p["pid"] for p in doc["processes"]}
    ok(fleet("restart", "--job", job, "--node", "worker_2", cwd=project))
    doc = wait_for("worker_2 restarted", lambda: next(
        (d for d in [status(project, job)] if _proc(d, "worker_2")["restarts"] == 1
         and _proc(d, "worker_2")["state"] == "running"), None))
    assert _proc(doc, "worker_2")["pid"] != old["worker_2"]
    assert _proc(doc, "worker_1")["pid"] == old["worker_1"]  # nobody else was touched
    recover = job_dirs["node3"] / "recover.sh"
    by_hand = subprocess.run(["ssh", "-F", str(cluster.ssh_config), "node3", str(recover), "worker_2"],
                             capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert by_hand.returncode == 0, by_hand.stderr
    wait_for("worker_2 restarted by recover.sh", lambda: _proc(status(project, job), "worker_2")["restarts"] == 2)

    # an agent that dies shows as gone, with its processes; restart --host brings it back
    agent = next(h for h in status(project, job)["hosts"] if h["host"] == "node4")["agent_pid"]
    os.kill(agent, signal.SIGKILL)
    r = wait_for("node4's agent gone", lambda: (lambda r: r if "gone" in r.stdout else None)(
        ok(fleet("status", "--job", job, cwd=project))))
    assert "node4: the agent is gone" in r.stderr
    gone = status(project, job)
    assert _proc(gone, "worker_3")["state"] == "gone" and _proc(gone, "worker_3")["pid"] is None
    ok(fleet("restart", "--job", job, "--host", "node4", cwd=project))
    wait_for("node4 running again", lambda: _proc(status(project, job), "worker_3")["state"] == "running")

    # train again is harmless (every agent already runs), and --join-timeout bounds the wait, not the job
    r = fleet("train", "--job", job, "--join", "--join-timeout", "1", cwd=project)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"({len(cluster.hosts)} already running)" in r.stderr
    assert f"error: job {job} still runs after --join-timeout 1 s; it keeps running" in r.stderr
    assert all(p["state"] == "running" for p in status(project, job)["processes"])

    r = ok(fleet("stop", "--job", job, cwd=project))
    assert "no process of the job is left" in r.stderr
    assert_nothing_left(cluster)
    assert {p["state"] for p in status(project, job)["processes"]} <= {"stopped", "succeeded"}


def _proc(doc: dict[str, Any], node_id: str) -> dict[str, Any]:
    return next(p for p in doc["processes"] if p["node_id"] == node_id)


# --- all or nothing ----------------------------------------------------------------------------------------------


def test_unreachable_host_starts_nothing_anywhere(cluster: Cluster, project: Path, job: str, port: str) -> None:
    victim = cluster.hosts[-1]
    ok(fleet("deploy", "--job", job, "--master-port", port, "--script-args", LONG, cwd=project))
    with cluster.partitioned(victim.name):
        # the start's own all or nothing (`fleet check` is tested in test_check.py)
        r = fleet("--connect-timeout", "2", "train", "--no-check", "--job", job, cwd=project)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        first = r.stderr.splitlines()[0]
        assert first.startswith(f"error: 1 of {len(cluster.hosts)} hosts failed; root cause: {victim.name}: "
                                "unreachable")
        assert victim.address in first
        assert "stopped the job again on node1, node2, node3: no process of it is left there" in r.stderr
        assert_nothing_left(cluster)

        r = fleet("--connect-timeout", "2", "status", "--job", job, cwd=project)  # the others still answer
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert f"{victim.name}: unreachable" in r.stderr
        assert all(name in r.stdout for name in cluster.names) and "unreachable" in r.stdout

        r = fleet("--connect-timeout", "2", "deploy", "--job", job, cwd=project)
        assert r.returncode == 2 and f"root cause: {victim.name}: unreachable" in r.stderr
    assert_nothing_left(cluster)


def test_changed_host_key_starts_nothing_anywhere(cluster: Cluster, project: Path, job: str, port: str) -> None:
    victim = cluster.hosts[2]
    ok(fleet("deploy", "--job", job, "--master-port", port, "--script-args", LONG, cwd=project))
    with cluster.host_key_changed(victim.name):
        r = fleet("train", "--no-check", "--job", job, cwd=project)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert f"root cause: {victim.name}: host key for {victim.address} has CHANGED" in r.stderr.splitlines()[0]
        assert_nothing_left(cluster)
    assert_nothing_left(cluster)


def test_busy_scheduler_port_starts_nothing_anywhere(cluster: Cluster, project: Path, job: str, port: str) -> None:
    sched = cluster.hosts[0]
    ok(fleet("deploy", "--job", job, "--master-port", port, "--script-args", LONG, cwd=project))
    squatter = subprocess.Popen(cluster.netns_argv(sched.name, [
        # SO_REUSEADDR as any server sets it: the port may still hold TIME_WAIT connections of an earlier pre-flight
        # check's pair stores (they use the ports after a job's pair), which would fail a plain bind.
        sys.executable, "-c", "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
        "socket.SO_REUSEADDR, 1); s.bind(('', int(sys.argv[1]))); s.listen(); print('up', flush=True); "
        "sys.stdin.read()", port]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline() == "up\n"  # type: ignore[union-attr]
        r = fleet("train", "--no-check", "--job", job, cwd=project)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert (f"root cause: {sched.name}: port {port} is already in use; stop what listens there or choose "
                "another --master-port") in r.stderr.splitlines()[0]
        assert_nothing_left(cluster, ignore=frozenset({squatter.pid}))
    finally:
        squatter.kill()
        squatter.wait(timeout=10)
    assert_nothing_left(cluster)


@pytest.mark.parametrize("change,message", [
    ("python=/nonexistent/python3", "node2: python /nonexistent/python3 not found"),
    ("python=/usr/bin/python3", "node2: /usr/bin/python3 cannot import toolkit"),
    ("workdir=/proc/no/such/dir", "node2: cannot create the workdir /proc/no/such/dir"),
    ("ansible_ssh_private_key_file={wrong}", "node2: authentication failed for user root"),
])
def test_a_bad_host_fails_deploy_with_one_line_naming_it(
        cluster: Cluster, project: Path, job: str, tmp_path: Path, change: str, message: str) -> None:
    wrong = tmp_path / "id_wrong"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True, timeout=30)
    key, value = change.format(wrong=wrong).split("=", 1)
    lines = []
    for line in cluster.inventory.read_text().splitlines():
        if line.startswith("node2 "):
            line = " ".join(w if not w.startswith(key + "=") else f"{key}={value}" for w in line.split())
        lines.append(line)
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("\n".join(lines) + "\n")
    r = fleet("deploy", "train", "--job", job, "--inventory", str(inventory), cwd=project)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[0].startswith(f"error: 1 of {len(cluster.hosts)} hosts failed; root cause: {message}")
    assert not (cluster.hosts[0].workdir / job).exists()  # nothing deployed, so nothing could start
    assert_nothing_left(cluster)


def test_unknown_host_keys_are_refused_unless_accepted(cluster: Cluster, project: Path, job: str,
                                                       tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("")
    r = fleet("deploy", "--job", job, "--known-hosts", str(known), cwd=project)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for h in cluster.hosts:  # each host's refusal, said once (the root cause's on the first line)
        assert r.stderr.count(f"{h.name}: host key unknown: {h.address} is not in {known}") == 1, r.stderr
    assert "--accept-new-host-keys" in r.stderr and known.read_text() == ""
    ok(fleet("deploy", "--job", job, "--known-hosts", str(known), "--accept-new-host-keys", cwd=project))
    assert sorted(known.read_text().splitlines()) == sorted(f"{h.address} {h.public_key()}" for h in cluster.hosts)


# --- join --------------------------------------------------------------------------------------------------------


def test_join_waits_for_success(cluster: Cluster, project: Path, job: str, port: str) -> None:
    r = ok(fleet("deploy", "train", "--join", "--job", job, "--master-port", port, "--worker-num", "2",
                 "--script-args", "--steps 4 --delay 0.1", cwd=project))
    assert f"job {job} succeeded: every worker exited 0" in r.stderr
    assert "node2:worker:1 succeeded" in r.stdout
    assert_nothing_left(cluster)
    assert "done after 4 steps" in ok(fleet("logs", "--job", job, "--rank", "1", cwd=project)).stdout


def test_join_reports_a_failed_worker_and_leaves_nothing(cluster: Cluster, project: Path, job: str, port: str) -> None:
    r = fleet("deploy", "train", "--join", "--job", job, "--master-port", port, "--worker-num", "2",
              "--max-restarts", "1",
              "--script-args", "--steps 100000 --delay 0.2 --fail-rank 1 --fail-step 10 --fail-code 3",
              cwd=project)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"error: job {job} failed after" in r.stderr
    assert "worker_1 on node2 (rank 1, pid " in r.stderr and "exit code 3 after 1 restart(s)" in r.stderr
    assert "node2:worker:1 | worker_1: failing on purpose with exit code 3" in r.stderr
    assert "node2:worker:1 failed" in r.stdout
    assert_nothing_left(cluster)


# --- fab, as typed -----------------------------------------------------------------------------------------------


def test_fab_deploy_train_with_hosts_as_typed(cluster: Cluster, tmp_path: Path, job: str, port: str) -> None:
    d = tmp_path / "fabproj"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    shutil.copy(REPO / "fabfile.py", d / "fabfile.py")
    hosts = ",".join(h.address for h in cluster.hosts[:2])  # ssh_config gives user, key and timeouts
    try:
        r = ok(fleet("deploy", "train", f"--hosts={hosts}", "--ssh-config", str(cluster.ssh_config),
                     "--known-hosts", str(cluster.known_hosts), "--python", cluster.python, "--job", job,
                     "--master-port", port, "--no-warm-spare", "--join", "--script-args", "--steps 3 --delay 0.1",
                     cwd=d, tool="fab"))
        assert f"job {job} succeeded" in r.stderr
        for h in cluster.hosts[:2]:  # the default workdir, under each host's own home
            assert (h.home / "toolkit-jobs" / job / "logs" / "scheduler.log").exists() == (h is cluster.hosts[0])
        assert_nothing_left(cluster)
    finally:  # the homes are shared by the whole session: leave them as they were
        for h in cluster.hosts[:2]:
            shutil.rmtree(h.home / "toolkit-jobs", ignore_errors=True)


# --- local mode --------------------------------------------------------------------------------------------------


def test_local_mode_without_ssh(tmp_path: Path, job: str) -> None:
    d = tmp_path / "local"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    (d / "fabric.yaml").write_text(f"toolkit:\n  workdir: {tmp_path / 'work'}\n  warm_spare: false\n  grace: 3\n")
    flags = ["--job", job, "--worker-num", "2", "--master-port", str(free_port_pair())]
    ok(fleet("deploy", "train", *flags, "--script-args", LONG, cwd=d))
    doc = wait_for("local processes running", lambda: all_running(d, job))
    assert {p["host"] for p in doc["processes"]} == {"localhost"}
    pids = [p["pid"] for p in doc["processes"]] + [h["agent_pid"] for h in doc["hosts"]]
    assert live(pids) == set(pids)
    for p in doc["processes"]:  # runs in place, in the project directory
        assert os.readlink(f"/proc/{p['pid']}/cwd") == str(d)
    lines = ok(fleet("logs", "--job", job, "--rank", "1", "-n", "1", cwd=d)).stdout
    assert lines.startswith("localhost:worker:1 | epoch: 0, step: ")
    follower = subprocess.Popen([str(BIN / "fleet"), "logs", "--job", job, "-f", "--node", "worker_0"], cwd=d,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert follower.stdout.readline().startswith("localhost:worker:0 | ")  # type: ignore[union-attr]
    tails = _children(follower.pid)  # the tail it runs (in a session of its own)
    assert tails
    follower.send_signal(signal.SIGINT)
    _, err = follower.communicate(timeout=30)
    assert follower.returncode == 0 and "Traceback" not in err, err
    wait_for("the local tail to be gone", lambda: not live(tails), bound=15)
    ok(fleet("stop", "--job", job, cwd=d))
    assert live(pids) == set()

    ok(fleet("train", "--join", "--job", job + "j", "--worker-num", "2", "--master-port", str(free_port_pair()),
             "--script-args", "--steps 3 --delay 0.1", cwd=d))  # never deployed: train deploys first
    assert (tmp_path / "work" / (job + "j") / "state" / "agent.json").is_file()


def test_a_finished_job_is_not_started_again_by_accident(tmp_path: Path, job: str) -> None:
    d = tmp_path / "again"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    work = tmp_path / "work"
    flags = ["--job", job, "--worker-num", "2", "--master-port", str(free_port_pair()), "--workdir", str(work),
             "--no-warm-spare", "--script-args", "--steps 3 --delay 0.1"]
    ok(fleet("deploy", "train", "--join", *flags, cwd=d))
    r = fleet("train", "--join", *flags, cwd=d)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"error: job {job} already finished at step 3" in r.stderr
    assert "'fleet train --fresh'" in r.stderr and "'fleet train --again'" in r.stderr
    assert {p["state"] for p in status(d, job)["processes"]} == {"succeeded"}  # nothing was started

    r = ok(fleet("train", "--join", "--again", *flags, cwd=d))
    assert f"job {job} succeeded" in r.stderr
    # each start begins new logs: `fleet logs` shows the --again run's alone, the first run's is kept by number
    assert ok(fleet("logs", "--job", job, "--rank", "0", "-n", "100", cwd=d)).stdout.count("step: 3,") == 1
    assert "step: 3," in (work / job / "logs" / "runs" / "1" / "worker_0.log").read_text()

    r = fleet("train", "--fresh", "--again", *flags, cwd=d)
    assert r.returncode == 2 and "--fresh and --again both given" in r.stderr
    (work / job / "ckpt" / "rank_0").mkdir(parents=True)  # what a script that checkpoints would have left
    (work / job / "ckpt" / "rank_0" / "step_3").write_text("state")
    r = ok(fleet("train", "--join", "--fresh", *flags, cwd=d))
    assert f"job {job} succeeded" in r.stderr
    moved = sorted(p.name for p in (work / job).iterdir() if ".previous-" in p.name)
    assert len(moved) == 2 and moved[0].startswith("ckpt.previous-") and moved[1].startswith("recovery.previous-")
    stamp = moved[0].split(".previous-")[1]
    assert moved[1] == f"recovery.previous-{stamp}"
    assert (work / job / moved[0] / "rank_0" / "step_3").read_text() == "state"  # moved aside, not deleted
    assert (work / job / "state" / f"agent.previous-{stamp}.json").is_file()

    # A deploy elsewhere that fails half-way: status shows where the job now lives, not the finished run
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / job).mkdir(parents=True)
    (elsewhere / job / "env").write_text("in the way")  # the job's layout cannot be made
    moved_flags = [str(elsewhere) if f == str(work) else f for f in flags]
    r = fleet("deploy", *moved_flags, cwd=d)
    assert r.returncode == 2 and str(elsewhere / job / "env") in r.stderr, r.stderr  # failed where it was meant to
    assert {p["state"] for p in status(d, job)["processes"]} == {"not started"}
    (elsewhere / job / "env").unlink()
    r = ok(fleet("train", "--join", *moved_flags, cwd=d))  # the incomplete deploy is done again first
    assert f"deployed job {job}" in r.stderr and f"job {job} succeeded" in r.stderr


def test_a_second_project_of_the_same_name_never_takes_over_a_running_job(tmp_path: Path) -> None:
    """Two checkouts named `mnist` (the same default job name, the same workdir): the second one's deploy, its train
    on a stale record and its stop all refuse with one line naming the directory and the first project; the first
    job keeps its token, keeps running and succeeds."""
    a, b = tmp_path / "a" / "mnist", tmp_path / "b" / "mnist"
    for d in (a, b):
        d.mkdir(parents=True)
        shutil.copy(WORKER, d / "train.py")
    work, done = tmp_path / "work", tmp_path / "a-may-finish"
    flags = ["--workdir", str(work), "--worker-num", "1", "--master-port", str(free_port_pair()), "--no-warm-spare",
             "--grace", "3"]
    ok(fleet("deploy", *flags, cwd=b))  # B deployed first; then its job directory was removed (its record stays)
    shutil.rmtree(work / "mnist")
    runner = subprocess.Popen([str(BIN / "fleet"), "deploy", "train", "--join", *flags, "--script-args",
                               f"--steps 100000 --delay 0.2 --until {done}"], cwd=a, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = wait_for("A's job running", lambda: (a / ".toolkit" / "jobs" / "mnist.json").is_file()
                         and all_running(a, "mnist"))
        token = (work / "mnist" / "token").read_bytes()
        said = {  # B's record says deployed: each command of B reaches A's job directory, and leaves it alone
            ("train", *flags): f"{work / 'mnist'} holds another project's job of this name (running): nothing was "
                               "started",
            ("stop",): f"{work / 'mnist'} holds another project's job mnist (project {a} on ",
            ("restart", "--node", "worker_0"): f"{work / 'mnist'} holds another project's job mnist: nothing was "
                                               "restarted",
            ("deploy", "train", "--join", *flags): f"{work / 'mnist'} holds another project's job mnist (project {a} "
                                                   "on ",
        }
        for args, line in said.items():
            r = fleet(*args, cwd=b)
            assert line in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
            assert r.returncode == (0 if args == ("stop",) else 2), (args, r.returncode, r.stderr)
        r = subprocess.run([str(work / "mnist" / "launch.sh"), "--job-id", "0" * 32], capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT)  # launch.sh itself: "already running" only for this job
        assert r.returncode == 4 and "holds another project's job mnist" in r.stderr, r.stderr
        assert (work / "mnist" / "token").read_bytes() == token
        step = next(p["step"] for p in first["processes"] if p["role"] == "worker")
        again = wait_for("A's job still running, further on", lambda: all_running(a, "mnist", min_step=step + 1))
        assert [p["pid"] for p in again["processes"]] == [p["pid"] for p in first["processes"]]  # never restarted
        done.touch()
        out, _ = runner.communicate(timeout=COMMAND_TIMEOUT)
        assert runner.returncode == 0 and "job mnist succeeded" in out, out
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
        fleet("stop", cwd=a)


def test_status_says_when_a_rank_keeps_failing_at_the_same_step(tmp_path: Path, job: str) -> None:
    """--restart-refill reaches the agent through host.json; a rank that fails at the same step every time uses up
    its budget and `status` says where and how it keeps failing."""
    d = tmp_path / "proj"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    work = tmp_path / "work"
    flags = ["--job", job, "--workdir", str(work), "--worker-num", "1", "--master-port", str(free_port_pair()),
             "--no-warm-spare", "--max-restarts", "1", "--restart-refill", "progress"]
    r = fleet("deploy", "train", "--join", *flags, "--script-args", "--steps 20 --delay 0.05 --fail-rank 0 "
              "--fail-step 4", cwd=d)
    assert r.returncode != 0 and "worker_0" in r.stderr, r.stderr
    spec = json.loads((work / job / "host.json").read_text())
    assert spec["restart_refill"] == "progress" and spec["max_restarts"] == 1
    out = fleet("status", "--job", job, cwd=d)
    assert ("localhost:worker:0 (worker_0): failed 2 times in a row at step 3, each time with exit code 3: it does "
            "not get past it") in out.stderr, out.stderr
    r = fleet("deploy", *flags[:-1], "soon", cwd=d)
    assert r.returncode == 2 and "--restart-refill 'soon': give 'progress'" in r.stderr, r.stderr


def test_logs_show_control_characters_instead_of_obeying_them(tmp_path: Path, job: str) -> None:
    """A log line with a terminal escape, a carriage return and a bidirectional override (what a forged "job
    finished" line used): `fleet logs` prints them as escapes, on the process's own prefixed line."""
    d = tmp_path / "proj"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    work = tmp_path / "work"
    ok(fleet("deploy", "--job", job, "--workdir", str(work), "--worker-num", "1", cwd=d))
    forged = f"\x1b[2J\x1b[Hjob done\rjob {job} succeeded\u202e\tend"
    (work / job / "logs" / "worker_0.log").write_text(f"step 1\n{forged}\n")
    out = ok(fleet("logs", "--job", job, "--rank", "0", cwd=d)).stdout
    assert out == ("localhost:worker:0 | step 1\n"
                   f"localhost:worker:0 | \\x1b[2J\\x1b[Hjob done\\rjob {job} succeeded\\u202e\tend\n"), out


def test_tasks_read_every_flag_from_the_job_record(tmp_path: Path, job: str) -> None:
    """Deployed from a parent directory with non-default --project, --script, --worker-num and --workdir: every
    later task typed there (or in the project) needs no flag, and a flag that contradicts the record is refused."""
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    shutil.copy(WORKER, project / "src" / "run.py")
    work = tmp_path / "elsewhere"
    ok(fleet("deploy", "train", "--project", "proj", "--script", "src/run.py", "--worker-num", "3", "--workdir",
             str(work), "--job", job, "--master-port", str(free_port_pair()), "--no-warm-spare", "--grace", "3",
             "--script-args", LONG, cwd=tmp_path))
    doc = wait_for("three workers stepping", lambda: all_running(tmp_path, job_flag=False))
    assert sorted(p["node_id"] for p in doc["processes"]) == ["sched", "worker_0", "worker_1", "worker_2"]
    assert ok(fleet("status", cwd=project)).stdout.count("running") == 4  # from the project too
    lines = ok(fleet("logs", "--rank", "2", "-n", "1", cwd=tmp_path)).stdout
    assert lines.startswith("localhost:worker:2 | epoch: 0, step: ")
    r = fleet("status", "--worker-num", "2", "--script", "src/run.py", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"error: --worker-num 2, but job {job} was deployed with 3: run 'fleet deploy'" in r.stderr
    r = fleet("status", "--metrics-address", "9464", cwd=tmp_path)  # the scheduler's endpoint is set at deploy
    assert r.returncode == 2 and f"--metrics-address '9464', but job {job} was deployed without it" in r.stderr
    r = fleet("stop", "--workdir", str(tmp_path / "other"), cwd=tmp_path)
    assert r.returncode == 2 and "--workdir" in r.stderr and str(work) in r.stderr
    assert all(p["state"] == "running" for p in status_here(tmp_path)["processes"])  # nothing was stopped
    r = ok(fleet("stop", cwd=tmp_path))
    assert "no process of the job is left" in r.stderr
    assert {p["state"] for p in status_here(tmp_path)["processes"]} <= {"stopped", "succeeded"}


def status_here(cwd: Path) -> dict[str, Any]:
    return json.loads(ok(fleet("status", "--json", cwd=cwd)).stdout)


def _children(pid: int) -> list[int]:
    infos = (proc_info(int(name)) for name in os.listdir("/proc") if name.isdigit())
    return [info.pid for info in infos if info is not None and info.ppid == pid]


# --- pieces ------------------------------------------------------------------------------------------------------


def test_tail_output_is_split_by_file_and_keeps_blank_lines() -> None:
    from toolkit.launcher.jobhosts.scripts import TailParser

    got: list[tuple[str, str]] = []
    parse = TailParser({"/a.log": "h:worker:0", "/b.log": "h:worker:1"},
                       lambda p, lines: got.extend((p, line) for line in lines))
    output = ["==> /a.log <==", "one", "", "two", "", "==> /b.log <==", "three", "", "==> /a.log <==", "four"]
    for cut in (1, 2, 4, len(output)):  # whatever batches the stream's reads make
        got.clear()
        for at in range(0, len(output), cut):
            parse(output[at:at + cut])
        assert got == [("h:worker:0", "one"), ("h:worker:0", ""), ("h:worker:0", "two"), ("h:worker:1", "three"),
                       ("h:worker:0", "four")], cut


def test_deploy_refuses_a_job_directory_others_could_change_and_keeps_its_own_private(tmp_path: Path,
                                                                                    job: str) -> None:
    d = tmp_path / "proj"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    (d / "link-out").symlink_to(Path.home() / ".bashrc")  # a link out of the project: never followed
    (d / "link-in").symlink_to(d / "train.py")
    work = tmp_path / "shared"
    flags = ["--job", job, "--workdir", str(work), "--worker-num", "1", "--master-port", str(free_port_pair())]
    (work / job).mkdir(parents=True)
    os.chown(work / job, 12345, 12345)  # another local user made the job directory first
    r = fleet("deploy", *flags, cwd=d)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{work / job} belongs to uid 12345, not to you (uid 0): another user made it" in r.stderr
    assert not (work / job / "launch.sh").exists()
    os.chown(work / job, 0, 0)
    os.chmod(work, 0o777)  # noqa: S103 - the fault: a workdir every local user may write
    r = fleet("deploy", *flags, cwd=d)
    assert r.returncode == 2 and f"{work} is writable by other users (mode 777)" in r.stderr, r.stderr
    os.chmod(work, 0o755)  # noqa: S103 - the usual mode of a workdir
    (work / job).rename(work / "elsewhere")
    (work / job).symlink_to(work / "elsewhere")  # a job directory that is a link: whoever owns it decides
    r = fleet("deploy", *flags, cwd=d)
    assert r.returncode == 2 and f"{work / job} is a symbolic link (to {work / 'elsewhere'})" in r.stderr, r.stderr
    assert "mode" not in r.stderr
    (work / job).unlink()
    (work / "elsewhere").rename(work / job)
    r = ok(fleet("deploy", *flags, cwd=d))
    for sub in ("", "env", "logs", "state", "recovery", "ckpt"):
        assert (work / job / sub).stat().st_mode & 0o777 == 0o700, sub
    assert (work / job / "token").stat().st_mode & 0o777 == 0o600

    ckpt = Path(tempfile.mkdtemp(prefix="tk-ckpt-", dir="/tmp"))  # --ckpt-dir where every local user may write
    try:
        ckpt.chmod(0o777)
        r = fleet("deploy", *flags, "--ckpt-dir", str(ckpt), cwd=d)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and f"checkpoint directory {ckpt / job}: {ckpt} above it is writable by other " \
            "users (mode 777, no sticky bit)" in lines[-1], r.stderr
        assert "--ckpt-dir" in lines[-1] and "Traceback" not in r.stderr, r.stderr
        ckpt.chmod(0o700)
        ok(fleet("deploy", *flags, "--ckpt-dir", str(ckpt / "mnist"), cwd=d))
        assert (ckpt / "mnist" / job).stat().st_mode & 0o777 == 0o700  # the job's own subdirectory
    finally:
        shutil.rmtree(ckpt)

    copy = tmp_path / "copy"  # what deploy does to a remote host's project copy, with this machine as the host
    stats = LocalHost().sync_dir(d, str(copy), delete=True)
    assert stats.outside == ("link-out",) and (copy / "link-in").read_bytes() == WORKER.read_bytes()
    assert not (copy / "link-out").exists()


def test_join_wakes_when_a_local_agent_exits_and_on_ctrl_c() -> None:
    """--join's wait between polls ends when the job's agent on this machine exits (its pidfd) or on Ctrl-C, not
    at the end of the interval: with an interval of 10 minutes, only the event can end these waits in time."""
    import threading

    from toolkit.launcher.jobhosts.follow import _sleep
    from toolkit.launcher.jobhosts.output import interrupt_sets

    agent = subprocess.Popen(["sleep", "600"])
    threading.Timer(0.5, agent.kill).start()
    interrupted = threading.Event()
    with interrupt_sets(interrupted):
        assert _sleep(interrupted, 600, [agent.pid]) is False  # woken by the exit, not interrupted
        agent.wait(10)
        other = subprocess.Popen(["sleep", "600"])
        try:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            assert _sleep(interrupted, 600, [other.pid]) is True  # Ctrl-C while waiting
        finally:
            other.kill()
            other.wait(10)
