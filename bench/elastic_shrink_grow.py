#!/usr/bin/env python3
"""Shrink and grow on the namespace cluster (issue 42): 3 hosts x 2 workers of examples/train.py, no spare,
`--min-workers 4`. One host crashes for good (cable pulled, every process killed); then it is healed and its agent
started again (`fleet restart --host`). Printed side by side:

- crash -> training again at 4 workers, against --host-timeout (the wait before a host counts as lost: the rest is
  the shrink's own cost: the re-formation, nothing recomputed);
- the agent reconnecting -> training again at 6 workers (the grow: its workers start, register, the survivors
  re-form at their next step boundary and the newcomers take the state from a peer);
- steps/s of each world size (the ledger's world_periods), and 4 workers' against 4/6 of 6 workers'.

Not a test: it prints numbers. Needs root (the namespace cluster).

    .venv/bin/python bench/elastic_shrink_grow.py [--host-timeout 4] [--step-delay 0.3]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from toolkit.testing.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent
FLEET = str(Path(sys.executable).parent / "fleet")
TIMEOUT = 300.0  # s for any one wait
POLL = 0.1  # s between looks at the hosts' agent.json
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+) sched \w+ (.*)$", re.M)


def wait(what: str, predicate: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL)
    sys.exit(f"timed out waiting for {what}")


def sched_at(log: str, pattern: str, after: float = 0.0) -> float | None:
    """The wall time of the scheduler's first log line after `after` that contains `pattern`."""
    for stamp, text in STAMP.findall(log):
        at = datetime.fromisoformat(stamp).timestamp()
        if at > after and pattern in text:
            return at
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-timeout", type=float, default=4.0)
    parser.add_argument("--step-delay", type=float, default=0.3)
    a = parser.parse_args()
    cluster = Cluster.up(3)
    tmp = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    try:
        project = tmp / "proj"
        project.mkdir()
        shutil.copy(ROOT / "examples" / "train.py", project / "train.py")
        shutil.copytree(ROOT / "examples" / "MNIST_Data", project / "MNIST_Data")
        lines = ["[workers]"] + [
            f"{h.name} ansible_host={h.address} ansible_user=root ansible_ssh_private_key_file={cluster.key} slots=2 "
            f"workdir={h.workdir} python={cluster.python}" for h in cluster.hosts]
        (project / "inventory.ini").write_text("\n".join(lines) + "\n")
        (project / "fabric.yaml").write_text(
            f"toolkit:\n  inventory: {project / 'inventory.ini'}\n  known_hosts: {cluster.known_hosts}\n"
            f"  node_timeout: 3\n  host_timeout: {a.host_timeout}\n  min_workers: 4\n  cluster_time_out: 120\n")
        args = f"--epochs 12 --batch-size 16 --ckpt-interval 4 --keep-max 3 --step-delay {a.step_delay}"
        flags = ["--job", "bench", "--no-check", "--quiet", "--script-args", args]
        runner = subprocess.Popen([FLEET, "deploy", "train", "--join", *flags], cwd=project,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        hosts = [h.name for h in cluster.hosts]

        def steps(host: str) -> list[int]:
            try:
                doc = json.loads((cluster.host(host).workdir / "bench" / "state" / "agent.json").read_text())
            except (OSError, ValueError):
                return []
            return [p.get("step") or 0 for p in doc.get("processes") or []
                    if p["node_id"] != "sched" and p.get("state") == "running"]

        def log() -> str:
            return (cluster.host(hosts[0]).workdir / "bench" / "logs" / "scheduler.log").read_text()

        wait("every worker past step 8", lambda: all(len(steps(h)) == 2 and min(steps(h)) >= 8 for h in hosts))
        lost = hosts[2]
        survivors = hosts[:2]
        with cluster.partitioned(lost), cluster.crashed(lost):
            crashed = time.time()
            at = max(s for h in survivors for s in steps(h))
            wait("the survivors training again", lambda: min(s for h in survivors for s in steps(h)) > at)
            shrunk = time.time() - crashed
            formed4 = sched_at(log(), "formed: 4 workers", crashed)
            time.sleep(8 * a.step_delay + 2)  # a few steps at 4 workers
        subprocess.run([FLEET, "restart", "--host", lost, "--job", "bench"], cwd=project, check=True,
                       capture_output=True, timeout=TIMEOUT)
        back = wait("the agent reconnecting", lambda: sched_at(log(), f"agent of {lost} connected", crashed))
        now = max(s for h in survivors for s in steps(h))
        wait("6 workers training", lambda: len(steps(lost)) == 2 and min(s for h in hosts for s in steps(h)) > now)
        grown = time.time() - back
        registered = sched_at(log(), f"back on {lost}", crashed)  # its workers registered: the grow began
        out, err = runner.communicate(timeout=TIMEOUT * 2)
        if runner.returncode != 0:
            sys.exit(f"the job failed:\n{out}\n{err}")
        ledger = json.loads((cluster.host(hosts[0]).workdir / "bench" / "recovery" / "ledger.json").read_text())
        periods = ledger["world_periods"]
        print(f"3 hosts x 2 workers, --min-workers 4, --host-timeout {a.host_timeout:g} s, {a.step_delay} s steps")
        print(f"crash -> training again at 4 workers: {shrunk:6.2f} s  (host-timeout {a.host_timeout:g} s + "
              f"{shrunk - a.host_timeout:.2f} s; formed {formed4 - crashed if formed4 else float('nan'):.2f} s "
              "after the crash)")
        print(f"agent back -> training at 6 workers:  {grown:6.2f} s  (of which its workers' start, to their "
              f"registration: {registered - back if registered else float('nan'):.2f} s; the grow itself, from "
              f"their registration: {grown - (registered - back) if registered else float('nan'):.2f} s)")
        for p in periods:
            print(f"  {p['workers']} workers: {p['steps_per_s']} steps/s over {p['until'] - p['from']:.1f} s")
        six = [p["steps_per_s"] for p in periods if p["workers"] == 6 and p["steps_per_s"]]
        four = [p["steps_per_s"] for p in periods if p["workers"] == 4 and p["steps_per_s"]]
        if six and four:
            print(f"4 workers / 6 workers steps/s: {four[0] / six[0]:.2f} (4/6 = 0.67; --step-delay dominates a "
                  "step here, so a degraded job keeps the pace until compute does)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        cluster.down()


if __name__ == "__main__":
    main()
