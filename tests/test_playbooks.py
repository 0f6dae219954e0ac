"""The Ansible playbooks (playbooks/*.yml) end to end, as a user runs them: ansible-playbook against the namespace
cluster's real sshd hosts, host keys checked against the cluster's known_hosts. The job is the task tests' worker
(tests/scripts/tasks_worker.py); what the playbooks render must be what `fleet plan --render` renders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_tasks import BIN, COMMAND_TIMEOUT, LONG, REPO, WORKER, assert_nothing_left, fleet, ok, wait_for

from toolkit.testing.cluster import Cluster
from toolkit.testing.ports import free_port_pair

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
             args: list[str]) -> subprocess.CompletedProcess[str]:
    extra_vars = json.dumps({"project": str(project), "fleet": str(BIN / "fleet"), "fleet_args": args})
    r = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), str(PLAYBOOKS / name),
                        "-e", extra_vars, *extra], cwd=project, env=env, capture_output=True, text=True,
                       timeout=PLAYBOOK_TIMEOUT)
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


def test_deploy_train_recover_stop(cluster: Cluster, tmp_path: Path) -> None:
    hosts = cluster.names[:HOSTS]
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("".join(line + "\n" for line in cluster.inventory.read_text().splitlines()
                                 if line.split(" ", 1)[0] not in cluster.names[HOSTS:]))
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(WORKER, project / "train.py")
    (project / "fabric.yaml").write_text("toolkit:\n  warm_spare: false\n  grace: 3\n")
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

        playbook("stop.yml", **run)
        assert_nothing_left(cluster)
        assert {p["state"] for d in job_dirs.values() for p in (agent_doc(d) or {"processes": []})["processes"]} \
            <= {"stopped", "succeeded"}
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
