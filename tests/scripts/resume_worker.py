"""A plain script that keeps its checkpoint where users' scripts often do, in its working directory (the project):
each rank writes `checkpoints/last-<r>.pt` at every step, and `my_ckpt/rank_<r>/step_<n>.ckpt` (as a ported script
given its own `Trainer(ckpt_dir="my_ckpt")` would); at start it resumes from `checkpoints/last-<r>.pt` when it is
there. No torch (the tests start several jobs on two shared cores): the "checkpoint" is a JSON line.

Prints `resumed from checkpoints/last-<r>.pt at step N` or `starting at step 0`, then `step S` lines, then `done`.
Also prints `contract {json}`: its arguments and the environment variables of the launch contract it sees. With
`--hold FILE` it trains on (beyond --steps) while FILE exists in its working directory: a job that runs until the
test lets it end. With `--in-ckpt-dir` both checkpoints go under $CKPT_DIR instead, as a well-behaved script does.

usage: resume_worker.py [--steps N] [--delay S] [--hold FILE] [--in-ckpt-dir] [ANY OTHER ARGUMENTS...]
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

SCHEDULER_WAIT = 60.0  # s at most before training without the scheduler
PROBE_INTERVAL = 0.1  # s between connection attempts
CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MS_SCHED_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")


def main(argv: list[str]) -> int:
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 3
    delay = float(argv[argv.index("--delay") + 1]) if "--delay" in argv else 0.05
    hold = Path(argv[argv.index("--hold") + 1]) if "--hold" in argv else None
    rank = int(os.environ.get("RANK", "0"))
    print("contract " + json.dumps({"argv": argv, "env": {k: os.environ.get(k) for k in CONTRACT}}), flush=True)
    wait_for_scheduler()
    root = Path(os.environ["CKPT_DIR"]) if "--in-ckpt-dir" in argv else Path()
    last = root / f"checkpoints/last-{rank}.pt"
    start = json.loads(last.read_text())["step"] if last.exists() else 0
    print(f"resumed from {last} at step {start}" if start else "starting at step 0", flush=True)
    agent = os.environ.get("TOOLKIT_AGENT_SOCKET")
    progress = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    node = os.environ.get("MS_NODE_ID", f"worker_{rank}")
    step = start
    while step < steps or (hold is not None and hold.exists()):
        step += 1
        if agent:  # the step for fleet status, as toolkit.train reports it
            try:
                progress.sendto(json.dumps({"node_id": node, "step": step, "epoch": 0}).encode(), agent)
            except OSError:
                pass  # the agent may be restarting; progress is advisory
        if step <= steps:  # (held on, it writes no more of these: a held job may run for minutes)
            mine = root / f"my_ckpt/rank_{rank}/step_{step:04d}.ckpt"
            mine.parent.mkdir(parents=True, exist_ok=True)
            mine.write_text(json.dumps({"step": step}))
        last.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{last}.tmp").write_text(json.dumps({"step": step}))
        os.replace(f"{last}.tmp", last)
        print(f"step {step}", flush=True)
        time.sleep(delay)
    print("done", flush=True)
    return 0


def wait_for_scheduler(bound: float = SCHEDULER_WAIT) -> None:
    """A plain worker never registers, so only its agent's exit report tells the scheduler it finished; a job
    shorter than the scheduler's start must not end before the scheduler can hear that."""
    address = (os.environ.get("MS_SCHED_HOST", ""), int(os.environ.get("MS_SCHED_PORT", "0")))
    if not address[0]:
        return
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            socket.create_connection(address, timeout=1).close()
            return
        except OSError:
            time.sleep(PROBE_INTERVAL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
