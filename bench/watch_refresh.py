"""What `fleet status --watch` costs on 16 namespace hosts: a job of one plain worker per host is deployed and
started, then the watch's own parts run as `fleet status --watch` runs them (one poller thread per host over kept
connections, the view rebuilt and rendered each refresh) for REFRESHES refreshes. Printed: the time one host's poll
takes (median, p95), the time to rebuild and render the view of all 16, the CPU the watching process uses per
refresh, and, for comparison, a one-shot `fleet status` (which connects afresh and starts the agent's status
command on every host). Run as root: .venv/bin/python bench/watch_refresh.py [--hosts 16] [--refreshes 30]
"""

from __future__ import annotations

import argparse
import io
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console

from toolkit.contracts import jobrecord
from toolkit.launcher.jobhosts.reach import record_ssh
from toolkit.launcher.settings import CoreFlags
from toolkit.launcher.tasks.watch import Pollers, render, watch_view
from toolkit.testing.cluster import Cluster

REPO = Path(__file__).resolve().parent.parent
FLEET = Path(sys.executable).parent / "fleet"
WORKER = REPO / "tests" / "scripts" / "tasks_worker.py"
INTERVAL = 1.0  # s: the refresh under test
COMMAND_TIMEOUT = 300.0


def fleet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(FLEET), *args], cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if r.returncode != 0:
        raise SystemExit(f"fleet {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r


def cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--refreshes", type=int, default=30)
    args = parser.parse_args()
    cluster = Cluster.up(args.hosts)
    project = Path(tempfile.mkdtemp(prefix="toolkit-bench-watch-"))
    flags = ["--job", "watchbench", "--inventory", str(cluster.inventory), "--master-port", "9700"]
    try:
        shutil.copy(WORKER, project / "train.py")
        (project / "fabric.yaml").write_text(
            f"toolkit:\n  known_hosts: {cluster.known_hosts}\n  warm_spare: false\n  grace: 3\n"
            "  script_args: '--steps 100000 --delay 0.2'\n")
        fleet("deploy", "train", *flags, cwd=project)
        record = jobrecord.load(project, "watchbench")
        one_shot = []
        for _ in range(3):
            began = time.perf_counter()
            fleet("status", *flags, cwd=project)
            one_shot.append(time.perf_counter() - began)
        polls: list[float] = []
        builds: list[float] = []
        stop = threading.Event()
        pollers = Pollers(record, record_ssh(record, CoreFlags()), INTERVAL, stop)
        console = Console(file=io.StringIO(), force_terminal=True, width=200)
        pollers.start()
        try:
            pollers.first_answers(60.0)
            time.sleep(INTERVAL)  # connections open: from here on, the steady cost
            cpu0, seen = cpu(), {}
            for _ in range(args.refreshes):
                time.sleep(INTERVAL)
                began = time.perf_counter()
                answers = pollers.answers()
                view = watch_view(record, answers, time.monotonic(), INTERVAL)
                console.print(render(record, view, INTERVAL))
                builds.append(time.perf_counter() - began)
                for name, a in answers.items():
                    if a.result is not None and a.result.ok and seen.get(name) != a.answered_at:
                        seen[name] = a.answered_at
                        polls.append(a.result.seconds)
                unreachable = [h.host for h in view.hosts if not h.reached]
                if unreachable:
                    raise SystemExit(f"hosts not answering: {unreachable}")
            per_refresh_cpu = (cpu() - cpu0) / args.refreshes
        finally:
            pollers.close()
        polls.sort()
        p95 = polls[int(0.95 * (len(polls) - 1))]
        print(f"{args.hosts} hosts, refresh every {INTERVAL:g} s, {args.refreshes} refreshes:")
        print(f"  one host's poll: median {1000 * statistics.median(polls):.1f} ms, p95 {1000 * p95:.1f} ms "
              f"({len(polls)} polls)")
        print(f"  view rebuilt and rendered: median {1000 * statistics.median(builds):.1f} ms")
        print(f"  CPU of the watching process: {1000 * per_refresh_cpu:.1f} ms per refresh "
              f"({100 * per_refresh_cpu / INTERVAL:.1f}% of one core)")
        shot = statistics.median(one_shot)
        print(f"  one-shot `fleet status` (new connections, agent status on each host): median {shot:.2f} s; "
              f"ratio to one host's poll {shot / statistics.median(polls):.0f}x")
    finally:
        subprocess.run([str(FLEET), "stop", *flags], cwd=project, capture_output=True, timeout=COMMAND_TIMEOUT)
        shutil.rmtree(project, ignore_errors=True)
        problems = cluster.down()
        if problems:
            print("cluster teardown: " + "; ".join(problems), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
