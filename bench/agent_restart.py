#!/usr/bin/env python3
"""How fast a dead worker is replaced: toolkit's agent (cold spawn, and with the warm spare) next to torchrun.

Why: on this machine ~94% of torchrun's recovery is rebuilding Python processes (interpreter, `import torch`,
DDP's lazy torch._dynamo import); the agent's part (noticing the death, starting the replacement) should cost
milliseconds, and the warm spare should remove the import cost. Not a test: it prints numbers.

    .venv/bin/python bench/agent_restart.py [--kills 10] [--modes cold,warm,torchrun,early]

Each mode runs 2 workers of a small script that reports (a datagram) when its first line runs and when it has
imported torch, torch.distributed, torch.nn.parallel and torch._dynamo (what a DDP job needs before its first
step), then blocks. The bench `kill -9`s rank 0 N times and reports medians of:
  detect    kill -> the agent has seen the exit (agent.log timestamp; includes the kernel tearing the process down)
  agent     detect -> spawn: the agent's own part
  spawn     kill -> the agent has started the replacement (agent.log timestamp: detection + fork/exec or handoff)
  first     kill -> the replacement's first line runs
  imported  kill -> the replacement has torch and DDP's imports done (ready to rebuild its process group)
Between kills it waits until the replacement has run `healthy_reset` seconds (so every kill meets the
immediate first restart, as a single fault in production does) and, in warm mode, until a new spare is ready.
torchrun restarts every worker (restart the world) and has no agent.log: only first/imported are shown for it.
`early` (warm spare on): every kill lands while the spare still imports torch (a fault seconds after a start or a
takeover): the replacement starts cold beside the held spare, and must cost what `cold` costs, not more;
`spare_cpu` is the CPU time the importing spare took from the kill until the replacement's imports were done (what
it took from them; held meanwhile, about 0). On a shared machine the time figures move with the others' load far
more than with the spare; `spare_cpu` does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolkit.freeports import free_port
from toolkit.testing.events import Events

ROOT = Path(__file__).resolve().parent.parent
HEALTHY_RESET = 1.0  # s: a replacement that ran this long restarts its budget (the policy's first restart is 0 s)
WAIT = 120.0  # s: bound of every wait for an event
POLL = 0.05  # s between looks at agent.json while waiting for a spare to be ready (no event says when)

WORKER = r'''
import json, os, select, socket, sys, time
def send(obj):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps(obj).encode(), sys.argv[1])
rank = os.environ.get("RANK")
send({"event": "first", "t": time.time(), "pid": os.getpid(), "rank": rank})
import torch, torch.distributed, torch.nn.parallel, torch._dynamo
send({"event": "imported", "t": time.time(), "pid": os.getpid(), "rank": rank})
agent = os.environ.get("TOOLKIT_AGENT_SOCKET")
if agent:  # progress tells the agent the job is running: it may build its spare now
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(json.dumps({"node_id": os.environ["MS_NODE_ID"], "step": 1}).encode(), agent)
        except OSError:
            pass
select.select([], [], [], 600)
'''


def wait_event(events: Events, event: str, rank: str, after: float = 0.0) -> dict:
    """The first datagram `event` of `rank` sent after `after` (the two ranks' events interleave)."""
    return events.match(lambda ev: ev["event"] == event and ev["rank"] == rank and ev["t"] > after, WAIT)


def make_job(root: Path, events: Events, warm: bool) -> Path:
    job = root / ("warm" if warm else "cold")
    (job / "env").mkdir(parents=True)
    (job / "project").mkdir()
    (job / "project" / "worker.py").write_text(WORKER)
    (job / "token").write_text("bench\n")
    processes = []
    for rank in range(2):
        node = f"worker_{rank}"
        env = {"MS_NODE_ID": node, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "OMP_NUM_THREADS": "1", "TOOLKIT_AGENT_SOCKET": str(job / "state" / "progress.sock")}
        (job / "env" / f"{node}.env").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        processes.append({"node_id": node, "role": "MS_WORKER", "rank": rank, "local_rank": rank,
                          "argv": [sys.executable, "worker.py", events.path], "cwd": "project",
                          "env_file": f"env/{node}.env", "log_file": f"logs/{node}.log"})
    port = free_port()  # a port nobody serves: no scheduler, the agent works on without it
    spec = {"version": 1, "job": "bench", "host": "local", "scheduler": {"host": "127.0.0.1", "port": port},
            "token_file": "token", "max_restarts": 1000, "backoff_base": 1.0, "backoff_max": 30.0,
            "healthy_reset": HEALTHY_RESET, "grace": 2.0, "bind_core": False, "warm_spare": warm,
            "processes": processes}
    (job / "host.json").write_text(json.dumps(spec))
    return job


def log_time(job: Path, needle: str) -> float:
    """When the agent logged a line holding `needle` (ms resolution, UTC)."""
    for line in reversed((job / "logs" / "agent.log").read_text().splitlines()):
        if needle in line:
            stamp = line.split()[0]
            whole = time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")
            return time.mktime(whole) - time.timezone + int(stamp[20:23]) / 1000
    raise RuntimeError(f"no {needle!r} in agent.log")


def wait_spare(job: Path, ready: bool = True) -> dict:
    """agent.json's warm spare once it is ready (or, with `ready` False, once one exists that is still importing)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            spare = json.loads((job / "state" / "agent.json").read_text())["warm_spare"]
            if spare["ready"] if ready else (spare["pid"] and not spare["ready"]):
                return spare
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(POLL)
    raise RuntimeError("the warm spare never became " + ("ready" if ready else "one that imports"))


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) the process has used so far, None if it is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_agent(root: Path, kills: int, warm: bool, early: bool = False) -> dict[str, list[float]]:
    """`early`: each measured kill lands while the warm spare still imports (after an unmeasured kill that used the
    ready one, so that a new one starts): the replacement starts cold beside it."""
    events = Events(root / f"ev-{'warm' if warm else 'cold'}.sock")
    job = make_job(root, events, warm)
    agent = subprocess.Popen([sys.executable, "-m", "toolkit.agent", "--job-dir", str(job)], cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, list[float]] = {"detect": [], "agent": [], "spawn": [], "first": [], "imported": []}
    try:
        pid = wait_event(events, "imported", "0")["pid"]
        wait_event(events, "imported", "1")
        for _ in range(kills):
            if warm:
                wait_spare(job)
            spare = None
            if early:
                t0 = time.time()
                os.kill(pid, signal.SIGKILL)
                pid = wait_event(events, "first", "0", t0)["pid"]
                spare = wait_spare(job, ready=False)["pid"]
            spare_cpu = cpu_seconds(spare)
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            first = wait_event(events, "first", "0", t0)
            imported = wait_event(events, "imported", "0", t0)
            if spare_cpu is not None and cpu_seconds(spare) is not None:
                out.setdefault("spare_cpu", []).append(cpu_seconds(spare) - spare_cpu)
            out["detect"].append(log_time(job, f"pid {pid} killed by SIGKILL") - t0)
            pid = first["pid"]
            out["spawn"].append(log_time(job, f"started pid {pid} ") - t0)
            out["agent"].append(out["spawn"][-1] - out["detect"][-1])
            out["first"].append(first["t"] - t0)
            out["imported"].append(imported["t"] - t0)
            time.sleep(HEALTHY_RESET + 0.2)  # let the replacement count as healthy (see the docstring)
    except BaseException:
        for log in sorted((job / "logs").glob("*.log")):
            print(f"--- {log}:\n" + "\n".join(log.read_text().splitlines()[-15:]), file=sys.stderr)
        raise
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(WAIT)
        events.sock.close()
    return out


def run_torchrun(root: Path, kills: int) -> dict[str, list[float]]:
    events = Events(root / "ev-torchrun.sock")
    script = root / "torchrun_worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "--max-restarts", str(kills + 1), str(script), events.path]
    run = subprocess.Popen(cmd, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    out: dict[str, list[float]] = {"first": [], "imported": []}
    try:
        pid = wait_event(events, "imported", "0")["pid"]
        wait_event(events, "imported", "1")
        for _ in range(kills):
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            first = wait_event(events, "first", "0", t0)
            imported = wait_event(events, "imported", "0", t0)
            wait_event(events, "imported", "1", t0)  # restart the world: rank 1 was restarted too
            pid = first["pid"]
            out["first"].append(first["t"] - t0)
            out["imported"].append(imported["t"] - t0)
            time.sleep(0.2)
    finally:
        os.killpg(run.pid, signal.SIGTERM)  # torchrun's own session: its workers are in it
        try:
            run.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(WAIT)
        events.sock.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--modes", default="cold,warm,torchrun")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        for mode in args.modes.split(","):
            root = Path(tmp) / mode
            root.mkdir()
            print(f"{mode}: {args.kills} kills ...", file=sys.stderr, flush=True)
            results[mode] = run_torchrun(root, args.kills) if mode == "torchrun" else \
                run_agent(root, args.kills, warm=mode in ("warm", "early"), early=mode == "early")
    print(f"kill -9 of rank 0 -> replacement, median of {args.kills} (min-max), seconds")
    keys = ("detect", "agent", "spawn", "first", "imported", "spare_cpu")
    print(f"{'mode':10}" + "".join(f"{k:>22}" for k in keys))
    for mode, res in results.items():
        cells = []
        for key in keys:
            v = res.get(key)
            cells.append(f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" if v else "-")
        print(f"{mode:10}" + "".join(f"{c:>22}" for c in cells))
    if "early" in results and "cold" in results:
        ratio = statistics.median(results["early"]["imported"]) / statistics.median(results["cold"]["imported"])
        print(f"early / cold (imports done): {ratio:.2f}x")
    if "torchrun" in results:
        base = statistics.median(results["torchrun"]["imported"])
        for mode in ("cold", "warm"):
            if mode in results:
                ratio = statistics.median(results[mode]["imported"]) / base
                print(f"{mode} / torchrun (imports done): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
