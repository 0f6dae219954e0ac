"""How long a local job takes to re-form after a worker is killed while the scheduler's ports are flooded with idle
connections, side by side: no flood, a flood from another address of this host than the workers' (192.0.2.2-like:
the host's own address, a different source), and a flood from the workers' own address (127.0.0.1: the same source).
Prints the seconds from the kill to the scheduler's "generation 1 formed" line, and the ratio to no flood.

    .venv/bin/python bench/flood_recovery.py [--rate 5000] [--per-port 200] [--source ADDR] [--mode partial]

--source defaults to the first non-loopback IPv4 address of this host; --mode partial holds the start of a hello
on each flood connection (the red team's round 3) instead of idle ones. Each scenario starts a fresh 2-worker job
(the sample trainer, no warm spare) and takes ~1 min on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolkit.testing.localjob import LocalJob

HERE = Path(__file__).resolve().parent
FLOOD = HERE.parent / "tests" / "scripts" / "flood.py"
WAIT = 300.0  # s for any one state of the job on a loaded machine
POLL = 0.05  # s between looks at a log (no event says a line was appended)
STEP = re.compile(r"^epoch: \d+, step: (\d+), loss is", re.M)


def until(what: str, predicate, job: LocalJob) -> float:
    deadline = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}\n{job.evidence()}")
        time.sleep(POLL)
    return time.monotonic()


def host_address() -> str:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    return next(a for a in out if "." in a and not a.startswith("127."))


def scenario(source: str | None, rate: float, per_port: int, mode: str = "idle") -> float:
    with tempfile.TemporaryDirectory(prefix="tk-flood-") as root:
        job = LocalJob(Path(root), 2, ["--epochs", "60", "--step-delay", "0.1", "--timeout", "60"], job="fl",
                       node_timeout=3, cluster_time_out=120, grace=5, warm_spare=False)
        job.start()
        flood = None
        try:
            until("both workers training", lambda: all(STEP.search(job.log(f"worker_{r}.log")) for r in (0, 1)), job)
            port = json.loads((job.dir / "host.json").read_text())["scheduler"]["port"]
            if source is not None:
                flood = subprocess.Popen([sys.executable, str(FLOOD), mode, "127.0.0.1", f"{port},{port + 1}",
                                          str(per_port), str(rate), source], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
                until("the flood filling the table", lambda: "to make room for" in job.log("scheduler.log"), job)
            os.kill(job.procs()["worker_1"]["pid"], signal.SIGKILL)
            killed = time.monotonic()
            formed = until("generation 1 formed", lambda: "generation 1 formed" in job.log("scheduler.log"), job)
            return formed - killed
        finally:
            if flood is not None:
                os.killpg(flood.pid, signal.SIGKILL)
                flood.wait(30)
            job.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=5000.0, help="new flood connections a second, at most")
    ap.add_argument("--per-port", type=int, default=200, help="idle flood connections kept open per port")
    ap.add_argument("--source", default=None, help="the other address to flood from (default: this host's)")
    ap.add_argument("--mode", choices=("idle", "partial"), default="idle",
                    help="flood connections that say nothing, or that hold the start of a hello")
    args = ap.parse_args()
    other = args.source or host_address()
    socket.inet_aton(other)
    results = {}
    for name, source in (("no flood", None), (f"flood from {other}", other), ("flood from 127.0.0.1", "127.0.0.1")):
        results[name] = scenario(source, args.rate, args.per_port, args.mode)
        print(f"{name:28s} re-formed {results[name]:7.2f} s after the kill", flush=True)
    base = results["no flood"]
    for name, seconds in results.items():
        print(f"{name:28s} {seconds / base:6.1f}x no flood")


if __name__ == "__main__":
    main()
