"""How the launch cost grows with the number of hosts: time from `fleet train` to every process of the job
running (each host's agent.json lists every process as running with a pid) and to every worker's first step
(reported to its agent), for 1, 4 and 16 namespace hosts, one worker per host. The goal is that 16 hosts cost
about what 4 do (parallel fan-out, every agent starts its processes itself), so the ratios 16/4 and 4/1 are
printed; they should stay near 1.

All the hosts share this machine's two cores, and a launch starts a few Python interpreters on every host (the
agent, its starter, the workers), so the CPU cost grows with the host count here as it would not on real
machines: the "baseline" column is a fan-out that starts one Python importing toolkit.agent on every host; its
ratios show how much of the launch ratios is this shared CPU rather than the launcher.

The times include starting `fleet` itself (Python, Fabric, rich: ~1 s here). The worker is
tests/scripts/tasks_worker.py (plain Python: it waits until the scheduler listens, then steps), so "first step"
also contains the scheduler's start (it imports torch). The job is deployed before the clock starts and stopped
after; nothing of it is left.
Run as root: .venv/bin/python bench/launch.py [--repeat N] [--hosts 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from toolkit.launcher.inventory import load_ansible_inventory
from toolkit.launcher.remote import SshSettings, Target, check_all, run_on_all
from toolkit.testing.cluster import Cluster

REPO = Path(__file__).resolve().parent.parent

FLEET = Path(sys.executable).parent / "fleet"
WORKER = REPO / "tests" / "scripts" / "tasks_worker.py"
POLL = 0.02  # s between looks at the hosts' agent.json files (the hosts share this filesystem)
BOUND = 120.0  # s: a launch that takes longer is reported as failed
COMMAND_TIMEOUT = 300.0


def fleet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(FLEET), *args], cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if r.returncode != 0:
        raise SystemExit(f"fleet {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r


def states(job_dirs: list[Path]) -> tuple[bool, bool]:
    """(every process running with a pid, every worker has reported a step)."""
    running = stepped = True
    for d in job_dirs:
        try:
            doc = json.loads((d / "state" / "agent.json").read_text())
        except (OSError, ValueError):
            return False, False
        for p in doc.get("processes", []):
            running = running and p.get("state") == "running" and bool(p.get("pid"))
            if p.get("role") == "MS_WORKER":
                stepped = stepped and p.get("step") is not None
    return running, stepped


def one_launch(cluster: Cluster, n: int, project: Path, port: int) -> tuple[float, float, float]:
    """(train returned, all running, all stepped), seconds from starting `fleet train`."""
    job = f"b{uuid.uuid4().hex[:8]}"
    inventory = project / f"inventory-{n}.ini"
    flags = ["--job", job, "--inventory", str(inventory), "--master-port", str(port)]
    fleet("deploy", *flags, cwd=project)
    job_dirs = [h.workdir / job for h in cluster.hosts[:n]]
    start = time.perf_counter()
    train = subprocess.Popen([str(FLEET), "train", *flags], cwd=project, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    returned = running = stepped = None
    try:
        while stepped is None:
            now = time.perf_counter() - start
            if now > BOUND:
                raise SystemExit(f"{n} hosts: not every process running within {BOUND:.0f} s")
            if returned is None and train.poll() is not None:
                if train.returncode != 0:
                    raise SystemExit(f"fleet train failed: {train.stderr.read()}")  # type: ignore[union-attr]
                returned = now
            is_running, has_stepped = states(job_dirs)
            if running is None and is_running:
                running = now
            if running is not None and has_stepped:
                stepped = now
            time.sleep(POLL)
        train.wait(timeout=COMMAND_TIMEOUT)
        returned = returned if returned is not None else time.perf_counter() - start
    finally:
        fleet("stop", *flags, cwd=project)
    left = {h.name: cluster.workload_pids(h.name) for h in cluster.hosts[:n]}
    if any(_live(pids) for pids in left.values()):
        raise SystemExit(f"processes left after stop: {left}")
    return returned, running, stepped  # type: ignore[return-value]


def baseline(cluster: Cluster, n: int) -> float:
    """A fan-out that starts one Python importing toolkit.agent on each of n hosts: what shared CPU alone costs."""
    targets = [Target.of(h) for h in load_ansible_inventory(cluster.inventory).hosts[:n]]
    settings = SshSettings(known_hosts=str(cluster.known_hosts))
    start = time.perf_counter()
    check_all(run_on_all(targets, lambda h: h.run([cluster.python, "-c", "import toolkit.agent"], check=True),
                         settings))
    return time.perf_counter() - start


def _live(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(pid)
        except OSError:
            pass
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hosts", default="1,4,16")
    args = parser.parse_args()
    sizes = [int(n) for n in args.hosts.split(",")]

    cluster = Cluster.up(max(sizes))
    project = Path(tempfile.mkdtemp(prefix="toolkit-bench-launch-"))
    try:
        shutil.copy(WORKER, project / "train.py")
        (project / "fabric.yaml").write_text(
            f"toolkit:\n  known_hosts: {cluster.known_hosts}\n  warm_spare: false\n  grace: 3\n"
            "  script_args: '--steps 100000 --delay 0.2'\n")
        lines = cluster.inventory.read_text().splitlines()
        for n in sizes:
            keep = {f"node{i}" for i in range(1, n + 1)}
            (project / f"inventory-{n}.ini").write_text(
                "\n".join(line for line in lines if line.split(" ", 1)[0] not in
                          {h.name for h in cluster.hosts} - keep) + "\n")
        port = 9500
        rows = {}
        for n in sizes:
            runs = []
            for _ in range(args.repeat):
                launch = one_launch(cluster, n, project, port)
                runs.append((*launch, baseline(cluster, n)))
                port += 2
            rows[n] = tuple(statistics.median(r[i] for r in runs) for i in range(4))
            print(f"{n:>3} hosts: train returns {rows[n][0]:.2f} s, all running {rows[n][1]:.2f} s, "
                  f"first step everywhere {rows[n][2]:.2f} s, baseline {rows[n][3]:.2f} s (median of {args.repeat})",
                  flush=True)
        print()
        print(f"{'hosts':>5} {'train returns':>14} {'all running':>12} {'first step':>11} {'baseline':>9}")
        for n, (ret, run, step, base) in rows.items():
            print(f"{n:>5} {ret:>13.2f}s {run:>11.2f}s {step:>10.2f}s {base:>8.2f}s")
        for a, b in ((16, 4), (4, 1)):
            if a in rows and b in rows:
                r = [rows[a][i] / rows[b][i] for i in range(4)]
                print(f"ratio {a}/{b}: train returns {r[0]:.2f}, all running {r[1]:.2f}, first step {r[2]:.2f}, "
                      f"baseline {r[3]:.2f}")
    finally:
        shutil.rmtree(project, ignore_errors=True)
        problems = cluster.down()
        if problems:
            print("cluster teardown: " + "; ".join(problems), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
