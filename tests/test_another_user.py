"""Another local user against a running job (uid 65534 through setpriv; the job runs as root): a local training job
run by the real agent, attacked on the ports anyone on the host can reach.

- A worker's gloo port: every connection to it costs the worker a descriptor for good (gloo's doing, and gloo
  aborts at the limit). The agent raised its workers' limit to the hard one and names the worker whose open files
  climb.
- The scheduler's two ports, flooded from the workers' own address with partial hellos that never authenticate (the
  red team's round 3), far beyond one source's rate, while a worker is killed: the survivors and the replacement
  reconnect (a new store connection each, a registration) through the flood, their hellos read at accept, and the
  job recovers in place; nobody else is declared dead. Before, 64 idle connections from one address locked the
  job's own workers out.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from toolkit.testing import waits
from toolkit.testing.localjob import LocalJob
from toolkit.testing.stranger import AS_STRANGER, readable_copies, stranger_python

FLOOD_SCRIPT = Path(__file__).resolve().parent / "scripts" / "flood.py"  # copied where the stranger can read it
WAIT = 120.0  # s for each state of the job on a loaded 2-core machine
POLL = 0.2  # s between looks at a log or agent.json: no event tells that a line was appended
LOW_LIMIT = 1024  # the agent's soft open-file limit when started (raised to the hard limit for the workers)
CHURN = 600  # connections opened and closed to the worker's gloo port
FLOOD = 200  # partial hellos kept open to each of the scheduler's ports (its table holds 256, 128 per address)
FLOOD_RATE = 2000  # new flood connections a second, at most (one source may open 64 a second within its rate)
RESUMED = re.compile(r"^rank 1: resumed from step (\d+) .*rank 0's memory", re.M)
EVICTIONS = re.compile(r"^(\S+) sched WARNING \d+ more like this in the last .* to make room for", re.M)
STEP = re.compile(r"^epoch: \d+, step: (\d+), loss is", re.M)
until = partial(waits.until, bound=WAIT, poll=POLL)

pytestmark = pytest.mark.timeout(600)


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """The TCP addresses process `pid` listens on (its own sockets in /proc/<pid>/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        words = line.split()
        if words[3] == "0A" and words[9] in inodes:  # LISTEN, one of its own
            addr, port = words[1].split(":")
            out.append((socket.inet_ntoa(bytes.fromhex(addr)[::-1]), int(port, 16)))
    return out


def soft_limit(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines() if "open files" in line)
    return int(line.split()[3])


@pytest.fixture(scope="module")
def stranger_flood() -> Any:
    """argv prefix that runs flood.py as uid 65534: an interpreter and a copy that user can reach, wherever the
    clone is (a 0700 home, say)."""
    with readable_copies([FLOOD_SCRIPT]) as copies:
        yield [*AS_STRANGER, stranger_python(), str(copies["flood.py"])]


def test_another_user_can_neither_lock_workers_out_nor_quietly_exhaust_a_workers_files(
        tmp_path: Path, stranger_flood: list[str]) -> None:
    job = LocalJob(tmp_path, 2, ["--epochs", "60", "--step-delay", "0.1", "--timeout", "30"], job="nb",
                   node_timeout=3, cluster_time_out=60, grace=5, warm_spare=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard > LOW_LIMIT, f"the hard open-file limit here ({hard}) leaves nothing to raise"
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_LIMIT, hard))
    try:
        job.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    sched_port = json.loads((job.dir / "host.json").read_text())["scheduler"]["port"]
    flood = None
    try:
        # 1. gloo's port: the worker may hold many more descriptors than the agent was started with, and when a
        #    stranger makes them climb, the agent says which worker and why.
        baseline = until("worker_0's open files counted once it joined its group",
                         lambda: (job.procs().get("worker_0", {}).get("open_files") or {}).get("low"), job)
        pid0 = job.procs()["worker_0"]["pid"]
        assert soft_limit(pid0) == hard  # raised from LOW_LIMIT
        gloo = listening_ports(pid0)
        assert gloo and all(addr == "127.0.0.1" for addr, _ in gloo), gloo  # loopback: the interface toward the
        # scheduler (GLOO_SOCKET_IFNAME), not every interface
        churn = subprocess.run([*stranger_flood, "churn", "127.0.0.1", ",".join(str(p) for _, p in gloo),
                                str(CHURN)], capture_output=True, text=True, timeout=WAIT, cwd="/")
        assert churn.returncode == 0, churn.stderr
        warned = re.compile(rf"worker_0: pid {pid0} holds (\d+) open files, up from {baseline} once it had joined "
                            r"its group \(limit \d+\): connections that never close, e.g. to its gloo port")
        m = until("the agent to name worker_0's climbing open files", lambda: warned.search(job.log("agent.log")),
                  job)
        assert int(m.group(1)) >= baseline + CHURN
        assert job.procs()["worker_0"]["open_files"]["climbing"] is True

        # 2. the scheduler's ports, flooded while a worker dies: the job recovers in place through the flood.
        flood = subprocess.Popen([*stranger_flood, "partial", "127.0.0.1", f"{sched_port},{sched_port + 1}", str(FLOOD),
                                  str(FLOOD_RATE)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True, cwd="/")
        assert flood.stdout is not None
        until(f"the flood's first {2 * FLOOD} connections open",
              lambda: flood.stdout.readline().strip() == f"opened {2 * FLOOD}", job)  # a line a second
        until("the scheduler's table of connections waiting to authenticate full",
              lambda: "to make room for" in job.log("scheduler.log"), job)
        victim = job.procs()["worker_1"]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed_at = max(int(s) for s in STEP.findall(job.log("worker_1.log")))
        resumed = until("worker_1 relaunched and back in the group from rank 0's memory",
                        lambda: RESUMED.search(job.log("worker_1.log")), job)
        until("both ranks training past the step of the kill",
              lambda: all(max(map(int, STEP.findall(job.log(f"worker_{r}.log")[-5000:])), default=0) > killed_at + 2
                          for r in (0, 1)), job)
        assert int(resumed.group(1)) >= killed_at
        assert job.procs()["worker_1"]["restarts"] == 1 and job.procs()["worker_0"]["restarts"] == 0
        sched_log = job.log("scheduler.log")
        formed = re.search(r"^(\S+) sched INFO generation 1 formed", sched_log, re.M)
        assert formed, sched_log[-3000:]
        # the flood went on through the recovery: evictions are summed up once per LOG_EVERY (10 s), so a summary
        # stamped after the new generation formed shows the table was still being flooded then
        until("a summary of evictions stamped after generation 1 formed",
              lambda: any(stamp > formed.group(1) for stamp in EVICTIONS.findall(job.log("scheduler.log"))),
              job)
        assert "refused" not in sched_log
        dead = re.findall(r"^\S+ sched WARNING (\S+) \(pid \d+ on .*\) is dead: ", job.log("scheduler.log"), re.M)
        assert dead == ["worker_1"], dead  # the one killed, and no false death through the flood
        assert "is lost" not in job.log("scheduler.log")  # nor the host's agent, whose link reconnects through it
    finally:
        if flood is not None:
            os.killpg(flood.pid, signal.SIGKILL)
            flood.wait(30)
        job.cleanup()
