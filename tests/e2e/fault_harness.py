"""The fault matrix's harness: the sample trainer deployed with `fleet deploy train --join` on namespace hosts, as
a user runs it, with faults injected from outside while it trains.

Polling reads the hosts' state/agent.json straight from their workdirs (the hosts share this filesystem): cheap
enough to look often on a 2-core machine, where a `fleet status` per look would steal the trainer's CPU. What the
user would check (status, logs, stop) goes through `fleet`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from toolkit.testing import waits
from toolkit.testing.cluster import Cluster, ProcessInfo, format_workload

REPO = Path(__file__).resolve().parents[2]
FLEET = str(Path(sys.executable).parent / "fleet")
HOSTS, SLOTS = 3, 2
POLL = 0.2  # s between looks at agent.json while waiting for a training state
FINAL = re.compile(r"final parameters: (\S+) sha256 ([0-9a-f]{64})")
# Small and quick, but long enough to hit mid-training: 1440 samples / 6 ranks / 16 = 15 steps per epoch. The sample's
# default collective timeout (120 s): survivors abandon a broken collective when the new generation is announced.
SCRIPT_ARGS = "--epochs 2 --batch-size 16 --ckpt-interval 4 --keep-max 3 --step-delay 0.25"
# The longer runs (random kills, spares): 120 steps. The final parameters depend on the world size (6) and these
# arguments, not on the hosts the ranks run on nor on --step-delay (a wait), so one uninterrupted run is the
# reference for all of them (conftest.long_baseline).
LONG_ARGS = "--epochs 8 --batch-size 16 --ckpt-interval 4 --keep-max 3"
JOB_TIMEOUT = 240.0  # s for one job from deploy to its end, faults and recoveries included
LEFTOVER_WAIT = 90.0  # s for every process of an ended job (or a killed agent's) to be gone, on a busy machine


DEAD_LINE = re.compile(r"^.* (worker_\d+) \(pid \d+ on \S+\) is dead: ([^;]+);", re.M)
GENERATION_LINE = re.compile(r"generation (\d+) (?:formed:|begins)")


def inventory(cluster: Cluster, groups: dict[str, list[str]], slots: int) -> str:
    """An inventory.ini of the cluster's hosts, a section a group ("workers", "spares"), `slots` workers a host."""
    lines = []
    for group, names in groups.items():
        lines.append(f"[{group}]")
        for name in names:
            h = cluster.host(name)
            lines.append(f"{name} ansible_host={h.address} ansible_user=root "
                         f"ansible_ssh_private_key_file={cluster.key} slots={slots} workdir={h.workdir} "
                         f"python={cluster.python}")
    return "\n".join(lines) + "\n"


@dataclass
class E2E:
    cluster: Cluster
    project: Path
    hosts: list[str]
    ports: Iterator[int]

    def job(self, name: str, *flags: str) -> "Job":
        return Job(self, name, next(self.ports), flags)


@dataclass
class Job:
    e2e: E2E
    name: str
    port: int
    flags: tuple[str, ...]
    runner: subprocess.Popen[str] | None = None
    output: str | None = None  # what `fleet ... --join` printed, once it ended

    # -- the user's commands

    def args(self) -> list[str]:
        return ["--job", self.name, "--master-port", str(self.port), *self.flags]

    def fleet(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([FLEET, *args, *self.args()], cwd=self.e2e.project, capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"fleet {' '.join(args)} exited {r.returncode}:\n{r.stderr}\n{self.evidence()}")
        return r

    def start(self, *tasks: str, check: bool = False) -> None:
        """`fleet deploy train --join` in the background: it returns when the job ends. Without `check`, with
        --no-check: the pre-flight check has its own tests (tests/test_check.py); before every job of the fault
        matrix it would add ~10 s of torch imports on each host of this 2-core machine. A job whose layout the check
        sees differently (spares) starts with it, as a user's would."""
        self.output = None
        unchecked = [] if check else ["--no-check"]
        # --quiet: the ranks' output is not streamed here (tests/e2e/test_run_terminal_on_hosts.py streams it): its
        # followers run on the hosts for as long as --join waits, and the matrix checks hosts for leftovers mid-run
        self.runner = subprocess.Popen([FLEET, *(tasks or ("deploy", "train")), "--join", "--quiet", *unchecked,
                                        *self.args()],
                                       cwd=self.e2e.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, start_new_session=True)

    def join(self, timeout: float = JOB_TIMEOUT) -> tuple[int, str]:
        assert self.runner is not None
        if self.output is not None:
            return self.runner.returncode, self.output
        try:
            out, err = self.runner.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.runner.pid, signal.SIGKILL)
            out, err = self.runner.communicate()
            self.output = out + err
            raise AssertionError(f"the job did not end within {timeout} s\n{err}\n{self.evidence()}") from None
        self.output = out + err
        return self.runner.returncode, self.output

    def finish_ok(self) -> str:
        """Join, expect success, and return the digest of the final parameters."""
        code, output = self.join()
        assert code == 0, f"fleet train --join exited {code}:\n{output}\n{self.evidence()}"
        return self.digest()

    def digest(self) -> str:
        log = self.log("worker_0")
        found = FINAL.findall(log)
        assert found, f"no final parameters in worker_0.log:\n{log[-2000:]}"
        return found[-1][1]

    # -- looking at the hosts

    def job_dir(self, host: str) -> Path:
        return self.e2e.cluster.host(host).workdir / self.name

    def agent(self, host: str) -> dict[str, Any]:
        try:
            return json.loads((self.job_dir(host) / "state" / "agent.json").read_text())
        except (OSError, ValueError):
            return {}

    def processes(self) -> dict[str, dict[str, Any]]:
        out = {}
        for host in self.e2e.hosts:
            for p in self.agent(host).get("processes") or []:
                out[p["node_id"]] = {**p, "host": host}
        return out

    def host_of(self, node_id: str) -> str:
        return self.processes()[node_id]["host"]

    def log(self, node_id: str) -> str:
        name = "scheduler.log" if node_id == "sched" else f"{node_id}.log"
        for host in self.e2e.hosts:
            path = self.job_dir(host) / "logs" / name
            if path.exists():
                return path.read_text(errors="replace")
        return ""

    # -- what the scheduler decided (its log is the record of its decisions)

    def declared_dead(self) -> dict[str, list[str]]:
        """Node id -> the reasons the scheduler gave, each time it declared that node's incarnation dead."""
        out: dict[str, list[str]] = {}
        for node, reason in DEAD_LINE.findall(self.log("sched")):
            out.setdefault(node, []).append(reason)
        return out

    def generation(self) -> int:
        """The newest generation the scheduler began (a death begins one) or formed; 0 before the first."""
        return max((int(g) for g in GENERATION_LINE.findall(self.log("sched"))), default=0)

    def workers_on(self, host: str) -> dict[str, int]:
        """Node id -> pid of the workers the agent of `host` runs now."""
        return {n: p["pid"] for n, p in self.processes().items() if p["host"] == host and n != "sched"}

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 120.0,
                 while_running: bool = True, evidence: Callable[[], str] | None = None) -> Any:
        """Poll `predicate` until it is true (its value is returned) or `timeout` passes. With `while_running`,
        the job ending first is a failure too (the condition can no longer come about); the assertion carries the
        runner's output, the hosts' logs and `evidence()`."""
        def ended() -> str | None:
            if while_running and self.runner is not None and self.output is None and self.runner.poll() is not None:
                return f"the job ended:\n{self.join()[1]}"
            return None

        def more() -> str:
            return (f"{evidence()}\n" if evidence else "") + self.evidence()

        return waits.wait_for(what, predicate, timeout, poll=POLL, evidence=more, ended=ended)

    def wait_step(self, step: int, timeout: float = 120.0) -> dict[str, dict[str, Any]]:
        """Until every worker reported at least `step` (and is running)."""

        def reached() -> dict[str, dict[str, Any]] | None:
            procs = {k: v for k, v in self.processes().items() if k != "sched"}
            if len(procs) == HOSTS * SLOTS and all(
                (p.get("step") or 0) >= step and p.get("state") == "running" for p in procs.values()
            ):
                return procs
            return None

        return self.wait_for(f"every worker past step {step}", reached, timeout)

    def leftovers(self, hosts: list[str] | None = None) -> dict[str, list[ProcessInfo]]:
        """Processes still running in each host's namespace (sshd's own excluded): after a job, none may remain."""
        return self.e2e.cluster.workload(hosts if hosts is not None else self.e2e.hosts)

    def wait_no_leftovers(self, hosts: list[str] | None = None, timeout: float = LEFTOVER_WAIT) -> None:
        """Every process of the job gone from `hosts` (all by default), bounded generously for a busy machine;
        on timeout the assertion lists each process left with its parent, command line and age."""
        self.wait_for("no process of the job left on " + (", ".join(hosts) if hosts else "any host"),
                      lambda: not self.leftovers(hosts), timeout, while_running=False,
                      evidence=lambda: "still running:\n" + format_workload(self.leftovers(hosts)))

    def evidence(self) -> str:
        lines = []
        for host in self.e2e.hosts:
            doc = self.agent(host)
            lines.append(f"--- {host} agent: {doc.get('state')} {doc.get('reason') or ''}")
            logs = self.job_dir(host) / "logs"
            for path in sorted(logs.glob("*.log")) if logs.exists() else []:
                tail = path.read_text(errors="replace").splitlines()[-12:]
                lines.append(f"--- {host}:{path.name}\n" + "\n".join(tail))
        return "\n".join(lines)
