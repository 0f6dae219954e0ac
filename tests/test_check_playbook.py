"""playbooks/check.yml on the namespace cluster: the facts phase of `fleet check` for those who stay in Ansible,
with the same probe and decisions: it passes on a deployed job, and names the host whose project copy differs."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from test_playbooks import HOSTS, PLAYBOOK_TIMEOUT, PLAYBOOKS, ansible_env
from test_tasks import BIN, LONG, WORKER, fleet, ok

from toolkit.testing.cluster import Cluster
from toolkit.testing.ports import free_port_pair

pytestmark = pytest.mark.timeout(600)


def test_check_playbook_passes_then_names_the_host_whose_copy_differs(cluster: Cluster, tmp_path: Path) -> None:
    hosts = cluster.names[:HOSTS]
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("".join(line + "\n" for line in cluster.inventory.read_text().splitlines()
                                 if line.split(" ", 1)[0] not in cluster.names[HOSTS:]))
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

    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"all {HOSTS} host(s) agree" in r.stdout

    edited = hosts[1]
    copy = cluster.host(edited).workdir / job / "project" / "train.py"
    copy.write_text(copy.read_text() + "# edited on the host\n")
    r = check()
    assert r.returncode != 0
    lines = [line for line in r.stdout.splitlines() if ": project: " in line]
    assert lines and all(f"{edited}: project: its copy differs from the project here" in line for line in lines), \
        r.stdout
    assert not any(f"{h}: " in r.stdout for h in hosts if h != edited)
