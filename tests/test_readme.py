"""Every command README.md shows runs as typed, from where the README says to type it.

The commands are read from README.md's ```bash blocks (the text before a line's `  #` comment), so the test follows
the doc: a command the table below does not know, or one it knows that the README no longer shows, fails it. Each
is checked in one of these ways (COMMANDS says which):

- RUN_CLONE: typed in the toolkit clone (`. .venv/bin/activate`): it runs there and puts fleet and fab on PATH.
- RUN_LOCAL: typed in a project directory on this machine (no hosts): it runs, as typed, and succeeds.
- RUN_CLUSTER: typed in a project directory whose commands reach `node1`, `node2` (the namespace test cluster's
  hosts, named so): the user's ~/.ssh/config and known_hosts name them (HOME is a test home holding the cluster's),
  the project's fabric.yaml says which python the hosts have. `fleet run` there is also the test of `fleet run` on
  hosts: an unknown flag starts nothing, the script gets its arguments and torchrun's variables. The others run in
  `cluster_sequence`, in the states a user types them in (a running job for status, logs and restart, a stopped
  one for `train --join`, ...).
  `fleet deploy train --slurm` runs in a Slurm allocation's environment (SLURM_* variables naming node[1-2]).
- HELP: needs what the test cluster has not (a spare host node9; 20 GB free where checkpoints go): typed with
  `--help` appended, it parses every flag given and prints the task's help.
- ANSIBLE: the playbook lines, typed in the project directory after the README's `toolkit=` line (set to this
  clone: the one line a user edits), with `--syntax-check` appended (the playbooks run against the cluster in
  tests/test_playbooks.py): the playbook files are found from there.
- COVERED: scripts/demo.sh (tests/test_demo.py runs scripts/demo.py, which demo.sh runs after scripts/install.sh,
  which made this environment), scripts/test.sh (this suite) and scripts/gpu-check.sh (tests/test_gpu_check.py
  runs its --dry; its CUDA install needs a GPU host and the network): checked to be executable bash here.

The project's train.py is tests/scripts/resume_worker.py: plain Python that takes any argument (--lr 0.1 included),
and with `--hold FILE` (the cluster project's default arguments) trains until FILE is gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from toolkit.testing import waits
from toolkit.testing.cluster import Cluster, format_workload

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKER = Path(__file__).resolve().parent / "scripts" / "resume_worker.py"
COMMAND_TIMEOUT = 300.0
WAIT = 120.0  # s for a job to reach a state on the loaded machine
LEFTOVER_WAIT = 90.0

RUN_CLONE, RUN_LOCAL, RUN_CLUSTER, HELP, ANSIBLE, COVERED = "clone", "local", "cluster", "help", "ansible", "covered"
COMMANDS = {
    "scripts/demo.sh": COVERED,
    "scripts/test.sh": COVERED,
    "scripts/gpu-check.sh": COVERED,
    ". .venv/bin/activate": RUN_CLONE,
    "fleet run --nproc-per-node 2 train.py --lr 0.1": RUN_LOCAL,
    "fleet run --again train.py --lr 0.1": RUN_LOCAL,
    "fleet run --hosts=node1,node2 --nproc-per-node 4 train.py --lr 0.1": RUN_CLUSTER,
    "fleet plan --hosts=node1:4,node2:4": RUN_CLUSTER,
    "fleet deploy train --slurm": RUN_CLUSTER,
    "fleet deploy --hosts=node1:4,node2:4 --data-path /data/mnist": RUN_CLUSTER,
    "fleet check": RUN_CLUSTER,
    "fleet check --data /data/extra --min-free-gb 20": HELP,
    "fab deploy train --hosts=node1:4,node2:4": RUN_CLUSTER,
    "fleet status": RUN_CLUSTER,
    "fleet status --watch": RUN_CLUSTER,
    "fleet logs --rank 3 -f": RUN_CLUSTER,
    "fleet report": RUN_CLUSTER,
    "fleet restart --node worker_3": RUN_CLUSTER,
    "fleet restart --host node2": RUN_CLUSTER,
    "fleet replace --host node2 --with node9": HELP,
    "fleet grow --host node9": HELP,
    "fleet stop": RUN_CLUSTER,
    "fleet train --join": RUN_CLUSTER,
    "fleet train --fresh": RUN_CLUSTER,
    "fleet --help": RUN_LOCAL,
    "toolkit=~/toolkit": ANSIBLE,
    "args=(-i inventory.ini -e project=\"$PWD\" -e '{\"fleet_args\": [\"--job\", \"mnist\"]}')": ANSIBLE,
    'ansible-playbook "${args[@]}" "$toolkit/playbooks/train.yml"': ANSIBLE,
    'ansible-playbook "${args[@]}" "$toolkit/playbooks/status.yml"': ANSIBLE,
    'ansible-playbook "${args[@]}" "$toolkit/playbooks/recover.yml" -e node=worker_3': ANSIBLE,
    'ansible-playbook "${args[@]}" "$toolkit/playbooks/replace.yml" -e host=node3 -e with=node9': ANSIBLE,
    'ansible-playbook "${args[@]}" "$toolkit/playbooks/check.yml"': ANSIBLE,
    'ansible-playbook "${args[@]}" "$toolkit/playbooks/stop.yml"': ANSIBLE,
}
ALLOCATION = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)"}

pytestmark = pytest.mark.timeout(1200)


def readme_commands() -> list[str]:
    """Every command line of README.md's bash blocks, without its comment, in order."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.splitlines():
            command = re.split(r"\s{2,}#", line)[0].strip()
            if command and not command.startswith("#"):
                out.append(command)
    return out


class User:
    """A shell as the README's reader has it: the clone's environment activated, a home whose ssh config and
    known_hosts name the test cluster's hosts node1..node4."""

    def __init__(self, cluster: Cluster, home: Path) -> None:
        (home / ".ssh").mkdir(parents=True)
        shutil.copy(cluster.ssh_config, home / ".ssh" / "config")
        shutil.copy(cluster.known_hosts, home / ".ssh" / "known_hosts")
        self.env = {**os.environ, "HOME": str(home)}
        for name in [n for n in self.env if n.startswith("SLURM_")]:
            del self.env[name]

    def script(self, command: str, cwd: Path) -> str:
        """What the reader types: activate in the clone, go to `cwd`, type `command`."""
        return f"cd {shlex.quote(str(REPO))} && . .venv/bin/activate && cd {shlex.quote(str(cwd))} && {command}"

    def run(self, command: str, cwd: Path, env: dict[str, str] | None = None,
            expect: int = 0) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["bash", "-c", self.script(command, cwd)], env={**self.env, **(env or {})},
                           capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        assert r.returncode == expect and "Traceback" not in r.stderr, (
            f"README: {command!r} in {cwd}: exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        return r

    def interrupted(self, command: str, cwd: Path, first: str, expect: int) -> str:
        """Run `command` on a terminal (a pty: what `--watch` draws on) until its output shows `first`, then Ctrl-C
        it, as the reader ends a follow; bounded by COMMAND_TIMEOUT."""
        main, terminal = pty.openpty()
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # 50 rows, 200 columns
        # a terminal as a reader's: its kind and size, also where programs look first (rich takes TERM=dumb, which a
        # CI runner may set, for 80 columns, and COLUMNS/LINES before the terminal's own size)
        env = {**self.env, "TERM": "xterm-256color", "COLUMNS": "200", "LINES": "50"}
        proc = subprocess.Popen(["bash", "-c", self.script(f"exec {command}", cwd)], env=env, stdin=terminal,
                                stdout=terminal, stderr=subprocess.PIPE, text=True, start_new_session=True)
        os.close(terminal)
        seen = b""
        deadline = time.monotonic() + COMMAND_TIMEOUT
        try:
            while first.encode() not in seen and time.monotonic() < deadline:
                if select.select([main], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    try:
                        seen += os.read(main, 65536)
                    except OSError:  # the command ended: its terminal is gone
                        break
            os.killpg(proc.pid, signal.SIGINT)
            while select.select([main], [], [], max(0.0, deadline - time.monotonic()))[0]:
                try:  # drain the terminal until the command ends: a full pty would block its last writes
                    if not os.read(main, 65536):
                        break
                except OSError:
                    break
            _, err = proc.communicate(timeout=COMMAND_TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            os.close(main)
        text = seen.decode(errors="replace")
        assert first in text and proc.returncode == expect and "Traceback" not in err, (
            f"README: {command!r}: exit {proc.returncode}\nterminal:\n{text}\nstderr:\n{err}")
        return text


def project(path: Path, cluster: Cluster | None = None, port: int = 0) -> Path:
    path.mkdir(parents=True)
    shutil.copy(WORKER, path / "train.py")
    if cluster is not None:
        shutil.copy(REPO / "fabfile.py", path / "fabfile.py")
        (path / "fabric.yaml").write_text(
            "toolkit:\n"
            f"  python: {cluster.python}\n"
            f"  master_port: {port}\n"
            "  warm_spare: false\n"
            "  grace: 3\n"
            "  script_args: --hold hold --delay 0.2 --in-ckpt-dir\n"
        )
        (path / "hold").write_text("the job trains until this file is gone\n")
    return path


def status(user: User, cwd: Path) -> dict[str, Any]:
    r = subprocess.run([str(BIN / "fleet"), "status", "--json"], cwd=cwd, env=user.env, capture_output=True,
                       text=True, timeout=COMMAND_TIMEOUT)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def workers(user: User, cwd: Path, state: str) -> bool:
    procs = [p for p in status(user, cwd).get("processes", []) if p["role"] == "worker"]
    return len(procs) == 8 and all(p["state"] == state and (state != "running" or p.get("step")) for p in procs)


def test_the_readme_commands_run_as_typed(cluster: Cluster, tmp_path: Path) -> None:
    shown = readme_commands()
    assert sorted(set(shown)) == sorted(COMMANDS), (
        f"README commands this test does not know: {sorted(set(shown) - set(COMMANDS))}; known but no longer in the "
        f"README: {sorted(set(COMMANDS) - set(shown))}")
    user = User(cluster, tmp_path / "home")
    hosts = cluster.hosts[:2]
    assert [h.name for h in hosts] == ["node1", "node2"]
    jobs = []
    try:
        for command in (c for c in shown if COMMANDS[c] == COVERED):
            script = REPO / command
            assert os.access(script, os.X_OK), script
            subprocess.run(["bash", "-n", str(script)], check=True)
        activated = user.run("command -v fleet fab", REPO).stdout.split()  # after `. .venv/bin/activate`
        assert activated == [str(REPO / ".venv" / "bin" / "fleet"), str(REPO / ".venv" / "bin" / "fab")]

        here = project(tmp_path / "here")
        assert "Usage: fleet TASK" in user.run("fleet --help", here).stdout
        user.run("fleet run --nproc-per-node 2 train.py --lr 0.1", here)
        assert "step 3" in user.run("fleet logs --rank 1 -n 20", here).stdout
        again = user.run("fleet run --again train.py --lr 0.1", here)  # the recorded job: its 2 workers again
        assert "job here succeeded" in again.stderr and "[rank1]: " in again.stdout, again

        for command in (c for c in shown if COMMANDS[c] == HELP):
            task = command.split()[1]
            assert user.run(command + " --help", here).stdout.startswith(f"Usage: fleet {task} ")

        ran = project(tmp_path / f"r{uuid.uuid4().hex[:6]}", cluster, port=9960)
        jobs.append(ran)
        fleet_run_on_the_cluster(user, ran, hosts)

        job = project(tmp_path / f"c{uuid.uuid4().hex[:6]}", cluster, port=9970)
        jobs.append(job)
        cluster_sequence(user, job, hosts)
        ansible(user, job, cluster, [c for c in shown if COMMANDS[c] == ANSIBLE])
    finally:
        for d in jobs:
            subprocess.run([str(BIN / "fleet"), "stop"], cwd=d, env=user.env, capture_output=True,
                           timeout=COMMAND_TIMEOUT)
        for h in hosts:  # the homes are shared by the whole session: leave them as they were
            shutil.rmtree(h.home / "toolkit-jobs", ignore_errors=True)
    waits.wait_for("no process of the jobs left on the hosts", lambda: not cluster.workload(["node1", "node2"]),
                   LEFTOVER_WAIT, evidence=lambda: format_workload(cluster.workload(["node1", "node2"])))


def fleet_run_on_the_cluster(user: User, ran: Path, hosts: list[Any]) -> None:
    """`fleet run` as torchrun is typed, on two hosts: an unknown flag starts nothing; then the script's arguments
    reach it word for word and it sees torchrun's (and msrun's) variables."""
    r = user.run("fleet run --hosts=node1,node2 --nproc-per-node 4 --dry-run train.py --lr 0.1", ran, expect=2)
    assert "error: run: unknown flag --dry-run" in r.stderr
    assert not any((h.home / "toolkit-jobs" / ran.name).exists() for h in hosts)  # nothing deployed, nothing run
    r = user.run("fleet run --hosts=node1,node2 --nproc-per-node 4 train.py --lr 0.1", ran)
    assert f"job {ran.name} succeeded: every worker exited 0" in r.stderr
    for rank, host in ((3, "node1"), (4, "node2")):
        log = user.run(f"fleet logs --rank {rank} -n 200", ran).stdout.replace(f"{host}:worker:{rank} | ", "")
        seen = json.loads(next(line for line in log.splitlines() if line.startswith("contract "))[len("contract "):])
        assert seen["argv"] == ["--lr", "0.1"]
        assert seen["env"] == {
            "RANK": str(rank), "WORLD_SIZE": "8", "LOCAL_RANK": str(rank % 4), "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": str(rank // 4), "GROUP_WORLD_SIZE": "2", "ROLE_NAME": "default", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "8", "MASTER_ADDR": "node1", "MASTER_PORT": "9961", "MS_SCHED_PORT": "9960",
            "TORCHELASTIC_RUN_ID": ran.name, "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def cluster_sequence(user: User, job: Path, hosts: list[Any]) -> None:
    """The RUN_CLUSTER commands, each once as typed, in the states a user types them in."""
    def wait(what: str, state: str) -> None:
        waits.wait_for(what, lambda: workers(user, job, state), WAIT, evidence=lambda: json.dumps(status(user, job)))

    assert "worker_7" in user.run("fleet plan --hosts=node1:4,node2:4", job).stdout
    user.run("fleet deploy --hosts=node1:4,node2:4 --data-path /data/mnist", job)
    user.run("fleet check", job)
    r = user.run("fleet deploy train --slurm", job, env=ALLOCATION)
    assert "Slurm job 7" in r.stderr and f"job {job.name} started on 2 host(s)" in r.stderr
    wait("8 workers stepping", "running")
    assert user.run("fleet status", job).stdout.count("running") == 9  # the scheduler and 8 workers
    assert "worker_7" in user.interrupted("fleet status --watch", job, "worker_7", expect=130)
    assert "node1:worker:3 | " in user.interrupted("fleet logs --rank 3 -f", job, "node1:worker:3 | ", expect=0)
    user.run("fleet restart --node worker_3", job)
    user.run("fleet restart --host node2", job)
    wait("8 workers stepping after the restarts", "running")
    assert "no process of the job is left" in user.run("fleet stop", job).stderr
    assert f"job {job.name} started on 2 host(s)" in user.run("fab deploy train --hosts=node1:4,node2:4", job).stderr
    wait("8 workers stepping again", "running")

    user.run("fleet stop", job)  # (again, for `train --join` below: it starts a stopped job)
    (job / "hold").unlink()
    for h in hosts:
        (h.home / "toolkit-jobs" / job.name / "project" / "hold").unlink()
    r = user.run("fleet train --join", job)
    assert f"job {job.name} succeeded" in r.stderr
    log = user.run("fleet logs --rank 0 -n 1000", job).stdout
    assert "/checkpoints/last-0.pt at step " in log  # resumed from the script's own checkpoint (in $CKPT_DIR)
    r = user.run("fleet train --fresh", job)
    assert "moved " in r.stderr and "/ckpt.previous-" in r.stderr
    wait("the fresh run to succeed", "succeeded")
    log = user.run("fleet logs --rank 0 -n 1000", job).stdout
    assert log.rsplit("starting at step 0", 1)[-1].count("resumed from") == 0  # the fresh run began at 0
    user.run("fleet report", job)  # last: its PNG lands in the project, which the next train's check would see
    assert (job / f"{job.name}-report.png").is_file()


def ansible(user: User, job: Path, cluster: Cluster, lines: list[str]) -> None:
    """The Ansible block typed in the project directory, the `toolkit=` line naming this clone, each playbook
    line with --syntax-check: every playbook is found and parses with the arguments given."""
    shutil.copy(cluster.inventory, job / "inventory.ini")
    typed = [f"toolkit={shlex.quote(str(REPO))}" if line.startswith("toolkit=") else
             line + " --syntax-check" if line.startswith("ansible-playbook") else line for line in lines]
    env = {"ANSIBLE_CONFIG": str(job / "no-ansible.cfg"), "ANSIBLE_HOME": str(job / ".ansible"),
           "ANSIBLE_LOCAL_TEMP": str(job / ".ansible" / "tmp"), "ANSIBLE_NOCOLOR": "1"}
    r = user.run(" && ".join(typed), job, env=env)
    assert r.stdout.count("playbook: ") == sum(line.startswith("ansible-playbook") for line in lines), r.stdout
