#!/usr/bin/env python3
"""How long `fleet run` (deploy, train, --join) takes to return once the job has ended, on this machine.

Why: --join used to return 4-7 s after the last worker said it was done: the workers' interpreters spent seconds
in their last garbage collections over torch's objects, and --join noticed the agent's end only at its next
2-second poll. Not a test: it prints the figures; docs/benchmarks.md does not quote them.

    .venv/bin/python bench/join_latency.py [--repeats 5]

Each run trains the sample (examples/train.py, 2 workers, one epoch) with `fleet run`. Figures per run, from the
scheduler's log (when every worker had said done), the agent's log (each worker's exit, the agent's own) and the
moment the command returned: worker exits (the slowest worker's exit after done), agent (its exit after that),
join (the command's return after the agent's exit), total (done to return).
"""

from __future__ import annotations

import argparse
import datetime
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolkit.freeports import free_port_pair
from toolkit.testing.localjob import EXAMPLES

FLEET = str(Path(sys.executable).parent / "fleet")
STAMP = r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z?"


def at(pattern: str, text: str) -> float:
    """The time (epoch seconds) of the last line matching `pattern` (its timestamp is the line's first word)."""
    found = re.findall(STAMP + r"\S* .*" + pattern, text)
    if not found:
        raise SystemExit(f"join_latency: no line matching {pattern!r}")
    return datetime.datetime.fromisoformat(found[-1]).replace(tzinfo=datetime.timezone.utc).timestamp()


def one(work: Path, project: Path, n: int) -> dict[str, float]:
    job = f"lat{n}"
    done = subprocess.run([FLEET, "run", "--nproc-per-node", "2", "--workdir", str(work), "--job", job,
                           "--master-port", str(free_port_pair()), "train.py", "--epochs", "1", "--log-every", "100"],
                          cwd=project, capture_output=True, text=True, timeout=900)
    returned = time.time()
    if done.returncode != 0:
        raise SystemExit(f"join_latency: fleet run exited {done.returncode}:\n{done.stderr[-2000:]}")
    logs = work / job / "logs"
    sched, agent = (logs / "scheduler.log").read_text(), (logs / "agent.log").read_text()
    finished = at("workers finished", sched)
    exits = max(at(f"worker_{r}: pid \\d+ exited", agent) for r in range(2))
    agent_end = at("agent exits", agent)
    return {"worker exits": exits - finished, "agent": agent_end - exits, "join": returned - agent_end,
            "total": returned - finished}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="join-latency-"))
    project = work / "project"  # a copy of the sample's directory: the job records go there
    project.mkdir()
    shutil.copy(EXAMPLES / "train.py", project)
    shutil.copytree(EXAMPLES / "MNIST_Data", project / "MNIST_Data")
    try:
        runs = [one(work, project, n) for n in range(args.repeats)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"fleet run of the sample, {args.repeats} run(s); seconds after every worker said done (median, max):")
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"  {key:<14} {statistics.median(values):6.2f} {max(values):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
