"""A trivial training script for the task tests: N steps with a small sleep, printing msrun's line
(`epoch: 0, step: S, loss is L`) and reporting each step to the host agent, so status shows steps and logs show
lines.

By default it is plain Python and sends the agent the same progress datagram toolkit.train sends (cheap: the
tests start many jobs on two shared cores). With --runtime it joins through toolkit.train.init() (imports torch;
the scheduler forms the job) and ends with rt.done().

usage: tasks_worker.py [--steps N] [--delay S] [--runtime] [--fail-rank R [--fail-step S] [--fail-code C]]
                       [--until FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

SCHEDULER_WAIT = 60.0  # s at most before training without the scheduler
PROBE_INTERVAL = 0.1  # s between connection attempts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--delay", type=float, default=0.1)
    ap.add_argument("--runtime", action="store_true", help="join through toolkit.train.init()")
    ap.add_argument("--fail-rank", type=int, default=None, help="this rank fails (exits --fail-code)")
    ap.add_argument("--fail-step", type=int, default=0, help="... before this step (0: before training)")
    ap.add_argument("--fail-code", type=int, default=3)
    ap.add_argument("--until", default=None, help="finish (exit 0) at the first step after this file exists")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    node = os.environ.get("MS_NODE_ID", f"worker_{rank}")
    if not args.runtime:
        wait_for_scheduler()
    if rank == args.fail_rank and args.fail_step <= 0:
        return fail(node, args.fail_code)
    rt = None
    if args.runtime:
        from toolkit import train

        rt = train.init()
    progress = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent = os.environ.get("TOOLKIT_AGENT_SOCKET")
    for step in range(1, args.steps + 1):
        if rank == args.fail_rank and step == args.fail_step:
            return fail(node, args.fail_code)
        if args.until and os.path.exists(args.until):
            break
        loss = 2.0 / (step + rank + 1)
        print(f"epoch: 0, step: {step}, loss is {loss:.3f}", flush=True)
        if rt is not None:
            rt.report(step, 0)
        elif agent:
            try:
                progress.sendto(json.dumps({"node_id": node, "step": step, "epoch": 0}).encode(), agent)
            except OSError:
                pass  # the agent may be restarting; progress is advisory
        time.sleep(args.delay)
    if rt is not None:
        rt.done()
    print(f"{node}: done after {args.steps} steps", flush=True)
    return 0


def fail(node: str, code: int) -> int:
    print(f"{node}: failing on purpose with exit code {code}", flush=True)
    return code


def wait_for_scheduler(bound: float = SCHEDULER_WAIT) -> None:
    """A plain worker never registers, so only its agent's exit report tells the scheduler it finished; a job
    shorter than the scheduler's start (it imports torch) must not end before the scheduler can hear that."""
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
    sys.exit(main())
