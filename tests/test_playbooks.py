"""The Ansible playbooks (playbooks/*.yml) end to end, as a user runs them: ansible-playbook against the namespace
cluster's real sshd hosts, host keys checked against the cluster's known_hosts. The job is the task tests' worker
(tests/scripts/tasks_worker.py); what the playbooks render must be what `fleet plan --render` renders, and the job
record they write the one `fleet deploy` writes: a job the playbooks started is followed, restarted, stopped and
started again with `fleet`, and status.yml shows the table of `fleet status`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_tasks import (
    BIN,
    COMMAND_TIMEOUT,
    LONG,
    REPO,
    WAIT,
    WORKER,
    all_running,
    assert_nothing_left,
    fleet,
    ok,
    status_here,
    wait_for,
)

from toolkit.freeports import free_port_pair
from toolkit.testing.cluster import Cluster

PLAYBOOKS = REPO / "playbooks"
HOSTS = 3
PLAYBOOK_TIMEOUT = 300.0  # s for one ansible-playbook run on two shared cores

pytestmark = pytest.mark.timeout(900)


def ansible_env(cluster: Cluster, tmp: Path, control: Path) -> dict[str, str]:
    """No user or machine Ansible config; host keys checked strictly against the cluster's known_hosts; one SSH
    connection per host, shared by the tasks (its socket in `control`, a short path)."""
    (tmp / "ansible-home").mkdir()
    return {
        "PATH": f"{BIN}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "ANSIBLE_CONFIG": str(tmp / "no-ansible.cfg"),
        "ANSIBLE_HOME": str(tmp / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-home" / "tmp"),
        "ANSIBLE_REMOTE_TMP": str(tmp / "ansible-remote"),
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_SSH_ARGS": f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile={cluster.known_hosts} -o BatchMode=yes"
                            f" -o ControlMaster=auto -o ControlPersist=60s -o ControlPath={control}/%C",
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
    }


def playbook(name: str, *extra: str, inventory: Path, project: Path, env: dict[str, str],
             args: list[str], expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    extra_vars = json.dumps({"project": str(project), "fleet": str(BIN / "fleet"), "fleet_args": args})
    r = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), str(PLAYBOOKS / name),
                        "-e", extra_vars, *extra], cwd=project, env=env, capture_output=True, text=True,
                       timeout=PLAYBOOK_TIMEOUT)
    if expect_ok:
        assert r.returncode == 0, f"{name}: exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def agent_doc(job_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((job_dir / "state" / "agent.json").read_text())
    except (OSError, ValueError):
        return None  # not written yet (every write is a rename, so never half)


def running(job_dir: Path) -> dict[str, dict[str, Any]] | None:
    """The host's processes by node id, if the agent shows every one of them running."""
    doc = agent_doc(job_dir)
    if not doc or not doc["processes"]:
        return None
    procs = {p["node_id"]: p for p in doc["processes"]}
    return procs if all(p["state"] == "running" and p["pid"] for p in procs.values()) else None


def table_rows(ansible_output: str) -> list[list[str]]:
    """The body rows of the rich table that status.yml's debug task prints (one JSON string per line: the cells
    between the table's light vertical bars)."""
    return [[cell.strip() for cell in line.split("\u2502")[1:-1]] for line in ansible_output.splitlines()
            if "\u2502" in line]


def rows_of(doc: dict[str, Any]) -> list[list[str]]:
    """`fleet status --json`'s processes as the table shows them: host, node id, rank, pid, state, restarts."""
    def cell(v: Any) -> str:
        return "-" if v is None else str(v)

    return [[p["host"], p["node_id"], cell(p["rank"]), cell(p["pid"]), p["state"], str(p["restarts"])]
            for p in doc["processes"]]


def test_deploy_train_recover_stop(cluster: Cluster, tmp_path: Path) -> None:
    hosts = cluster.names[:HOSTS]
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("".join(line + "\n" for line in cluster.inventory.read_text().splitlines()
                                 if line.split(" ", 1)[0] not in cluster.names[HOSTS:]))
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(WORKER, project / "train.py")
    # known_hosts for fleet's own commands (status, logs, stop, train) on the job the playbooks started
    (project / "fabric.yaml").write_text(f"toolkit:\n  known_hosts: {cluster.known_hosts}\n  warm_spare: false\n"
                                         "  grace: 3\n")
    job = f"p{uuid.uuid4().hex[:8]}"
    args = ["--job", job, "--master-port", str(free_port_pair()), "--script-args", LONG]
    control = Path(tempfile.mkdtemp(prefix="pb", dir="/tmp"))
    env = ansible_env(cluster, tmp_path, control)
    job_dirs = {n: cluster.host(n).workdir / job for n in hosts}
    run = {"inventory": inventory, "project": project, "env": env, "args": args}
    try:
        # a file or directory removed from the project is removed from the hosts at the next deploy
        (project / "gone.py").write_text("x = 1\n")
        (project / "pkg").mkdir()
        (project / "pkg" / "gone.py").write_text("y = 2\n")
        playbook("deploy.yml", **run)
        for d in job_dirs.values():
            assert (d / "project" / "pkg" / "gone.py").read_text() == "y = 2\n"
            (d / "project" / "__pycache__").mkdir()
            (d / "project" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"cache")
        (project / "gone.py").unlink()
        shutil.rmtree(project / "pkg")

        playbook("train.yml", **run)  # imports deploy.yml, as a user would run it
        for d in job_dirs.values():
            assert sorted(p.name for p in (d / "project").iterdir()) == ["__pycache__", "fabric.yaml", "train.py"]
        started = {n: wait_for(f"every process on {n} running", lambda d=d: running(d)) for n, d in job_dirs.items()}
        assert sorted(node for procs in started.values() for node in procs) == \
            ["sched"] + [f"worker_{i}" for i in range(HOSTS)]
        for n, procs in started.items():
            assert {p["pid"] for p in procs.values()} <= set(cluster.workload_pids(n))

        # the files on the hosts are those fleet renders, and the job token is in none of them
        rendered = tmp_path / "rendered"
        ok(fleet("plan", "--inventory", str(inventory), "--render", str(rendered), *args, cwd=project))
        local_token = project / ".toolkit" / "jobs" / f"{job}.token"  # where fleet keeps it too
        token = local_token.read_text().strip()
        assert len(token) == 64 and oct(local_token.stat().st_mode & 0o777) == "0o600"
        for n, d in job_dirs.items():
            assert (d / "token").read_text() == token + "\n" and oct((d / "token").stat().st_mode & 0o777) == "0o600"
            assert (d / "project" / "train.py").read_bytes() == WORKER.read_bytes()
            assert not (d / "project" / ".toolkit").exists()
            names = sorted(str(p.relative_to(rendered / n)) for p in (rendered / n).rglob("*")
                           if p.is_file() and p.name != "token")
            assert "launch.sh" in names and "recover.sh" in names and any(x.startswith("env/") for x in names)
            for name in names:
                there = (d / name).read_text()
                assert there == (rendered / n / name).read_text(), f"{n}: {name} differs from fleet's"
                assert (d / name).stat().st_mode & 0o777 == (rendered / n / name).stat().st_mode & 0o777, name
                assert token not in there

        # recover.yml restarts the one process named, and nothing else
        victim_host = next(n for n, procs in started.items() if "worker_1" in procs)
        old = started[victim_host]["worker_1"]
        playbook("recover.yml", "-e", "node=worker_1", **run)

        def restarted() -> dict[str, Any] | None:
            procs = running(job_dirs[victim_host])
            p = procs and procs["worker_1"]
            return p if p and p["pid"] != old["pid"] and p["restarts"] > old["restarts"] else None

        new = wait_for("worker_1 restarted by recover.yml", restarted)
        assert new["pid"] in cluster.workload_pids(victim_host)
        for n, procs in started.items():
            now = running(job_dirs[n])
            assert now is not None
            assert {k: p["pid"] for k, p in now.items() if k != "worker_1"} == \
                {k: p["pid"] for k, p in procs.items() if k != "worker_1"}

        # the playbooks wrote fleet's job record: fleet finds the job with no flag (the project's only job) and
        # shows it where the plan put it, with the pids the hosts' agents report
        planned = json.loads(ok(fleet("plan", "--json", "--inventory", str(inventory), *args, cwd=project)).stdout)
        doc = wait_for("fleet status: every process running and stepping",
                       lambda: all_running(project, min_step=2, job_flag=False))
        assert [(p["host"], p["node_id"], p["rank"]) for p in doc["processes"]] == \
            [(p["host"], p["node_id"], p["rank"]) for p in planned["processes"]]
        agents = {node: p["pid"] for d in job_dirs.values() for node, p in (running(d) or {}).items()}
        assert {p["node_id"]: p["pid"] for p in doc["processes"]} == agents

        # status.yml shows the same table, row for row
        shown = table_rows(playbook("status.yml", **run).stdout)
        assert [row[:6] for row in shown] == rows_of(status_here(project))

        # replace.yml is fleet replace, answered by the scheduler: its own host is refused with fleet's one line
        # (a spare's takeover itself: tests/e2e/test_spares.py); without a host the play says what to give
        sched_host = next(p["host"] for p in planned["processes"] if p["node_id"] == "sched")
        r = playbook("replace.yml", "-e", f"host={sched_host}", expect_ok=False, **run)
        assert r.returncode != 0 and f"host {sched_host} runs the scheduler: it cannot be replaced" in r.stdout, \
            r.stdout + r.stderr
        r = playbook("replace.yml", expect_ok=False, **run)
        assert r.returncode != 0 and "-e host=HOST_TO_REPLACE" in r.stdout, r.stdout + r.stderr

        # fleet logs -f follows every worker the playbooks started
        follower = subprocess.Popen([str(BIN / "fleet"), "logs", "-f", "-n", "0"], cwd=project,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            seen: set[str] = set()
            deadline = time.monotonic() + WAIT
            while len(seen) < HOSTS and time.monotonic() < deadline:
                line = follower.stdout.readline()  # type: ignore[union-attr]
                if "| epoch: 0, step:" in line:
                    seen.add(line.split(" | ")[0])
            assert seen == {f"{p['host']}:worker:{p['rank']}" for p in planned["processes"] if p["rank"] is not None}
        finally:
            follower.send_signal(signal.SIGINT)
            _, err = follower.communicate(timeout=COMMAND_TIMEOUT)
        assert follower.returncode == 0 and "Traceback" not in err, err

        # fleet restart restarts one process, and nothing else
        before = {p["node_id"]: p["pid"] for p in status_here(project)["processes"]}
        ok(fleet("restart", "--node", "worker_2", cwd=project))

        def restarted_by_fleet() -> dict[str, int] | None:
            doc = all_running(project, job_flag=False)
            pids = doc and {p["node_id"]: p["pid"] for p in doc["processes"]}
            return pids if pids and pids["worker_2"] != before["worker_2"] else None

        now = wait_for("worker_2 restarted by fleet", restarted_by_fleet)
        assert {k: v for k, v in now.items() if k != "worker_2"} == {k: v for k, v in before.items() if k != "worker_2"}

        # fleet stop ends it everywhere; fleet train starts it again from the record (no deploy)
        r = ok(fleet("stop", cwd=project))
        assert "no process of the job is left" in r.stderr
        assert_nothing_left(cluster)
        r = ok(fleet("train", cwd=project))
        assert f"job {job} started on {HOSTS} host(s)" in r.stderr and "deployed" not in r.stderr
        doc = wait_for("every process running again", lambda: all_running(project, min_step=2, job_flag=False))
        assert not {p["pid"] for p in doc["processes"]} & set(now.values())
        for p in doc["processes"]:
            assert p["pid"] in cluster.workload_pids(p["host"])

        playbook("stop.yml", **run)
        assert_nothing_left(cluster)
        assert {p["state"] for d in job_dirs.values() for p in (agent_doc(d) or {"processes": []})["processes"]} \
            <= {"stopped", "succeeded"}

        # the record the playbooks wrote is the one fleet deploy writes for the same inputs
        written = json.loads((project / ".toolkit" / "jobs" / f"{job}.json").read_text())
        assert written["deployed"] is True
        ok(fleet("deploy", "--inventory", str(inventory), *args, cwd=project))
        assert json.loads((project / ".toolkit" / "jobs" / f"{job}.json").read_text()) == written
        assert local_token.read_text().strip() == token
    finally:
        for n, d in job_dirs.items():  # whatever happened, leave the session's cluster with nothing running
            if (d / "stop.sh").exists():
                subprocess.run(["ssh", "-F", str(cluster.ssh_config), n, str(d / "stop.sh")], capture_output=True,
                               timeout=COMMAND_TIMEOUT)
        for n in hosts:  # the shared connections end with the test
            subprocess.run(["ssh", "-F", str(cluster.ssh_config), "-o", f"ControlPath={control}/%C", "-O", "exit",
                            cluster.host(n).address], capture_output=True, timeout=COMMAND_TIMEOUT)
        shutil.rmtree(control, ignore_errors=True)
        assert_nothing_left(cluster)


def test_record_refuses_a_relative_workdir(tmp_path: Path) -> None:
    """`fleet record` reaches no host, so it cannot resolve a relative workdir there: one line naming the host,
    and nothing written."""
    (tmp_path / "train.py").write_text("")
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("[workers]\nn1 ansible_host=10.0.0.1 workdir=/srv/jobs\n"
                         "n2 ansible_host=10.0.0.2 workdir=jobs\n")
    r = fleet("record", "--inventory", str(inventory), "--job", "j", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == ["error: host n2: job directory jobs/j is relative; give the hosts an absolute "
                                     "workdir (workdir=/path in the inventory, or --workdir /path)"]
    assert not (tmp_path / ".toolkit").exists()


def test_incomplete_deploy_starts_nothing(cluster: Cluster, tmp_path: Path) -> None:
    """A host the playbooks cannot reach: train.yml names it, starts nothing, and the job record stays marked
    incomplete (as after a failed `fleet deploy`, so that `fleet train` deploys again)."""
    real = cluster.hosts[0]
    line = next(x for x in cluster.inventory.read_text().splitlines() if x.startswith(f"{real.name} "))
    inventory = tmp_path / "inventory.ini"
    # the same host under another name, on a port where no sshd listens: refused at once
    ghost = re.sub(r"ansible_port=\d+", "ansible_port=1", line.replace(f"{real.name} ", "ghost ", 1))
    inventory.write_text(f"[workers]\n{line}\n{ghost}\n")
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(WORKER, project / "train.py")
    job = f"p{uuid.uuid4().hex[:8]}"
    extra_vars = json.dumps({"project": str(project), "fleet": str(BIN / "fleet"),
                             "fleet_args": ["--job", job, "--master-port", str(free_port_pair())]})
    control = Path(tempfile.mkdtemp(prefix="pb", dir="/tmp"))
    try:
        r = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), str(PLAYBOOKS / "train.yml"),
                            "-e", extra_vars], cwd=project, env=ansible_env(cluster, tmp_path, control),
                           capture_output=True, text=True, timeout=PLAYBOOK_TIMEOUT)
        assert r.returncode != 0
        assert "the deploy did not complete on ghost: the job record stays marked incomplete" in r.stdout, r.stdout
        assert "PLAY [Start every host's agent]" not in r.stdout
        record = json.loads((project / ".toolkit" / "jobs" / f"{job}.json").read_text())
        assert record["deployed"] is False and [h["name"] for h in record["hosts"]] == [real.name, "ghost"]
        assert (real.workdir / job / "host.json").is_file()  # the reachable host was deployed
        assert not (real.workdir / job / "state" / "agent.json").exists()  # and nothing was started there
    finally:
        subprocess.run(["ssh", "-F", str(cluster.ssh_config), "-o", f"ControlPath={control}/%C", "-O", "exit",
                        real.address], capture_output=True, timeout=COMMAND_TIMEOUT)
        shutil.rmtree(control, ignore_errors=True)
    assert_nothing_left(cluster)
