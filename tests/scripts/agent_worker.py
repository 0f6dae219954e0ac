"""A stand-in training process for the agent tests: real process, real signals, no torch unless asked.

It tells the test that it started (a datagram on --events, with its pid, rank and environment), then does what
the flags say: block until signalled, exit with a code, print lines for a log tail, trap SIGTERM to write "last
words", leave a grandchild in its group, report progress to the agent.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

BLOCK_LIMIT = 120.0  # a blocked worker that nobody kills exits on its own, so a broken test cannot hang forever

ENV_KEYS = ("RANK", "LOCAL_RANK", "MS_NODE_ID", "MS_ROLE", "TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE",
            "TOOLKIT_AGENT_SOCKET", "EXTRA", "OMP_NUM_THREADS", "GLOO_ENABLE_STORE_V2_API",
            "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", "TORCHELASTIC_ERROR_FILE", "THP_MEM_ALLOC_ENABLE")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", required=True)
    ap.add_argument("--block", action="store_true", help="wait until signalled")
    ap.add_argument("--block-until-restart", type=int, default=None,
                    help="block while TORCHELASTIC_RESTART_COUNT is below this, then exit 0")
    ap.add_argument("--exit", type=int, default=0)
    ap.add_argument("--exit-until-restart", type=int, default=None,
                    help="exit with --exit while TORCHELASTIC_RESTART_COUNT is below this, then exit 0")
    ap.add_argument("--print-lines", type=int, default=0)
    ap.add_argument("--on-term", default=None, help="on SIGTERM append a line to this file and exit 0")
    ap.add_argument("--term-stays", action="store_true", help="with --on-term: note SIGTERM but keep running")
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--grandchild", action="store_true")
    ap.add_argument("--progress", type=int, default=0)
    ap.add_argument("--progress-on-usr1", action="store_true", help="report step 1 to the agent on SIGUSR1")
    ap.add_argument("--error", default=None, help="write this message to TORCHELASTIC_ERROR_FILE (as @record does)")
    ap.add_argument("--linger", type=float, default=0.0, help="seconds to wait before exiting")
    args = ap.parse_args()

    warm = "torch._dynamo" in sys.modules  # true only when a warm spare ran us
    if args.on_term:
        def on_term(signum, frame):
            with open(args.on_term, "a") as f:
                f.write(f"TERM {os.getpid()} {os.environ.get('MS_NODE_ID')} {time.time()}\n")
            if not args.term_stays:
                sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.progress_on_usr1:  # before the test hears that it started, so a SIGUSR1 never meets the default action
        signal.signal(signal.SIGUSR1, lambda *_: send(os.environ.get("TOOLKIT_AGENT_SOCKET"),
                                                      {"node_id": os.environ.get("MS_NODE_ID"), "step": 1}))

    grandchild = None
    if args.grandchild:
        grandchild = subprocess.Popen(["sleep", "300"]).pid

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    event = {
        "event": "started", "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
        "time": time.time(), "warm": warm, "cwd": os.getcwd(), "argv": sys.argv,
        "env": {k: os.environ.get(k) for k in ENV_KEYS}, "affinity": sorted(os.sched_getaffinity(0)),
        "policies": sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}),
        "grandchild": grandchild, "restart": restart,
    }
    send(args.events, event)

    for i in range(args.print_lines):
        print(f"{os.environ.get('MS_NODE_ID')} line {i}", flush=True)
    agent_sock = os.environ.get("TOOLKIT_AGENT_SOCKET")
    for step in range(1, args.progress + 1):
        send(agent_sock, {"node_id": os.environ.get("MS_NODE_ID"), "step": step, "epoch": 0})

    if args.error is not None:
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": args.error, "extraInfo": {"py_callstack": "...", "timestamp": "0"}}}, f)
    blocked = args.block or (args.block_until_restart is not None and restart < args.block_until_restart)
    if blocked:
        select.select([], [], [], BLOCK_LIMIT)
        return 4
    time.sleep(args.linger)
    code = args.exit
    if args.exit_until_restart is not None and restart >= args.exit_until_restart:
        code = 0
    print(f"exiting with {code}", file=sys.stderr, flush=True)
    return code


def send(path: str | None, obj: dict) -> None:
    if not path:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(json.dumps(obj).encode(), path)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
