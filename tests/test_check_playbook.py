"""playbooks/check.yml on the namespace cluster: the facts phase of `fleet check` for those who stay in Ansible,
with the same probe and decisions: it passes on a deployed job, and names the host whose project copy differs.
The job's inventory holds a spare (`[spares]`), which both the playbook and `fleet check` must take as it is: a host
running nothing yet, with its standby env files (issue 26: both refused every spare)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from test_playbooks import HOSTS, PLAYBOOK_TIMEOUT, PLAYBOOKS, ansible_env
from test_tasks import BIN, LONG, WORKER, fleet, ok

from toolkit.freeports import free_port_pair
from toolkit.testing.cluster import Cluster

pytestmark = pytest.mark.timeout(600)


def test_check_playbook_and_fleet_check_pass_with_a_spare_then_name_the_host_whose_copy_differs(
        cluster: Cluster, tmp_path: Path) -> None:
    hosts = cluster.names[:HOSTS]
    spare = hosts[-1]
    lines = cluster.inventory.read_text().splitlines()
    entry = next(line for line in lines if line.split(" ", 1)[0] == spare)
    kept = [line for line in lines if line.split(" ", 1)[0] not in cluster.names[HOSTS - 1:]]
    at = kept.index("[all:vars]")
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("\n".join(kept[:at] + ["[spares]", entry, ""] + kept[at:]) + "\n")
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(WORKER, project / "train.py")
    (project / "fabric.yaml").write_text(f"toolkit:\n  warm_spare: false\n  known_hosts: {cluster.known_hosts}\n")
    job = f"k{uuid.uuid4().hex[:8]}"
    args = ["--job", job, "--master-port", str(free_port_pair()), "--script-args", LONG]
    ok(fleet("deploy", "--inventory", str(inventory), *args, cwd=project))
    env = ansible_env(cluster, tmp_path, Path(tempfile.mkdtemp(prefix="pb", dir="/tmp")))

    def check() -> subprocess.CompletedProcess[str]:
        extra = json.dumps({"project": str(project), "fleet": str(BIN / "fleet"), "fleet_args": args})
        return subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), str(PLAYBOOKS / "check.yml"),
                               "-e", extra], cwd=project, env=env, capture_output=True, text=True,
                              timeout=PLAYBOOK_TIMEOUT)

    record = json.loads((project / ".toolkit" / "jobs" / f"{job}.json").read_text())
    assert {h["name"]: h["spare"] for h in record["hosts"]} == {**dict.fromkeys(hosts[:-1], False), spare: True}
    assert (cluster.host(spare).workdir / job / "env" / "worker_0.env").exists()  # standby files only
    assert not (cluster.host(spare).workdir / job / "env" / "sched.env").exists()
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"all {HOSTS} host(s) agree" in r.stdout
    r = fleet("check", "--job", job, cwd=project)  # facts and the health test, the spare in the ring
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert f"check: all {HOSTS} host(s) of job {job} agree" in r.stderr
    row = next(line for line in r.stdout.splitlines() if f" {spare} " in line)
    assert re.search(r"\d+\.\d+ s", row) and row.rstrip(" │|").endswith("ok"), row  # its matmul ran; no problem

    edited = hosts[1]
    copy = cluster.host(edited).workdir / job / "project" / "train.py"
    copy.write_text(copy.read_text() + "# edited on the host\n")
    r = check()
    assert r.returncode != 0
    lines = [line for line in r.stdout.splitlines() if ": project: " in line]
    assert lines and all(f"{edited}: project: its copy differs from the project here" in line for line in lines), \
        r.stdout
    assert not any(f"{h}: " in r.stdout for h in hosts if h != edited)
