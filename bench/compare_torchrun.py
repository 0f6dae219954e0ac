#!/usr/bin/env python3
"""The sample (examples/train.py, 2 workers, gloo) under torchrun and under toolkit, side by side, in one run.

Why: the claims that matter to a user are relative ones: a fault costs less than under torchrun, the launcher
costs nothing while training, and a job starts no slower. Not a test: it prints medians and ratios (toolkit /
torchrun); docs/benchmarks.md has the results and how to read them.

    .venv/bin/python bench/compare_torchrun.py [--repeats 5] [--steady-epochs 120] [--json OUT]

torchrun: `torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
--log-dir D --redirects 3 train.py ...` (a fresh port per run). toolkit: the local job that `fleet deploy train`
runs on this machine: toolkit.launcher.plan.make_plan(local_inventory(2), ...) + toolkit.launcher.render, then `python
-m toolkit.agent run --job-dir D` (scheduler, 2 workers, warm spare; default restart policy and timeouts).

Metrics (every rank's step lines are followed in its log file; a line's time is when the follower saw it, at most
POLL late, the same for both launchers):
  launch    command start -> the first step line of every rank (fault runs, before the fault)
  recovery  `kill -9` of rank 1 -> every rank has printed, in the new timeline (after its post-kill "resumed
            from step" line), a step past the newest step any rank had printed in the old one
  lost      steps recomputed: that newest old step minus the step the ranks resumed from
  steady    steps/s of rank 0 over the second half of a fault-free run with --step-delay 0 (the first half holds
            the start-up: imports, and under toolkit the warm spare's own import of torch)
Faulted runs use --step-delay 0.05 and kill rank 1 at the first step >= 12 with step % 10 == 5 (half-way between
two checkpoints), under toolkit once the warm spare is ready (as it is in a job that has been running a while).
Every run must end with exit code 0; the final parameters' digests of all faulted runs are compared (they must
all be equal: a fault changes nothing in the result). Runs alternate launchers so that load from others on the
machine hits both alike. Every wait is bounded; a kill not recovered from (the launcher gave up, or no recovery
within RECOVERY_BOUND) is counted and left out of the medians, and the run's process group is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from toolkit.freeports import free_port_pair
from toolkit.testing.localjob import EXAMPLES, LocalJob, clean_env

ROOT = Path(__file__).resolve().parent.parent

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WORLD = 2
VICTIM = 1
INTERVAL = 10
FAULT_ARGS = ["--epochs", "8", "--ckpt-interval", str(INTERVAL), "--step-delay", "0.05", "--timeout", "60"]
POLL = 0.01  # s between looks at the logs (no event says a line was appended); the resolution of every figure
RUN_BOUND = 300.0  # s for one whole run
RECOVERY_BOUND = 90.0  # s for a recovery before it counts as hung
SPARE_BOUND = 60.0  # s for the agent's warm spare to be ready
STEP = re.compile(r"^epoch:? \d+,? step:? (\d+),? loss")  # the sample's line, and examples/ddp's
RESUMED = re.compile(r"^rank \d+: (?:resumed from step (\d+)|starting fresh)")
FINAL = re.compile(r"^final parameters: \S+ sha256 ([0-9a-f]{64})$")


def base_env() -> dict[str, str]:
    return {**clean_env(), "OMP_NUM_THREADS": "1"}


@dataclass
class Event:
    t: float
    kind: str  # step, resumed, final
    value: Any


@dataclass
class Follower:
    """Follows the step, resume and final lines of every rank's log files in a thread. `files()` lists the
    (rank, path) pairs to follow; new files (a restarted torchrun attempt) are picked up as they appear."""

    files: Callable[[], list[tuple[int, Path]]]
    events: dict[int, list[Event]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)
    _offsets: dict[Path, int] = field(default_factory=dict)
    _partial: dict[Path, bytes] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(5)
            self._scan()

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            self._scan()

    def _scan(self) -> None:
        now = time.monotonic()
        for rank, path in self.files():
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            data = self._partial.pop(path, b"") + data
            *lines, rest = data.split(b"\n")
            if rest:
                self._partial[path] = rest
            found = []
            for raw in lines:
                line = raw.decode(errors="replace")
                if m := STEP.match(line):
                    found.append(Event(now, "step", int(m.group(1))))
                elif m := RESUMED.match(line):
                    found.append(Event(now, "resumed", int(m.group(1) or 0)))
                elif m := FINAL.match(line):
                    found.append(Event(now, "final", m.group(1)))
            if found:
                with self.cond:
                    self.events.setdefault(rank, []).extend(found)
                    self.cond.notify_all()

    def wait(self, what: str, predicate: Callable[[dict[int, list[Event]]], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate(self.events)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {what} within {timeout:g} s")
                self.cond.wait(left)

    def last_step(self, rank: int) -> int:
        with self.cond:
            return max((e.value for e in self.events.get(rank, []) if e.kind == "step"), default=0)


def first_steps(events: dict[int, list[Event]], world: int = WORLD) -> float | None:
    if sorted(events) != list(range(world)):
        return None
    firsts = [next((e.t for e in events[r] if e.kind == "step"), None) for r in range(world)]
    return None if None in firsts else max(firsts)


def recovered_after(run: Run, killed: float) -> Callable[[dict[int, list[Event]]], Any]:
    """A predicate for Follower.wait: (seconds from `killed` until every rank printed, in its new timeline, a step
    past the newest step any rank had printed in the old one; that newest step; the step resumed from), or a
    string if the launcher gave up, or None while recovering."""
    def recovered(events: dict[int, list[Event]]) -> tuple[float, int, int] | str | None:
        if run.proc.poll() is not None:
            return f"exited {run.proc.returncode} without recovering"
        parts = {r: split_at_kill(events.get(r, []), killed) for r in range(run.world)}
        if not all(new for _, new in parts.values()):
            return None
        reached = max((e.value for old, _ in parts.values() for e in old if e.kind == "step"), default=0)
        past = [next((e.t for e in new if e.kind == "step" and e.value > reached), None)
                for _, new in parts.values()]
        if None in past:
            return None
        return max(past) - killed, reached, parts[0][1][0].value

    return recovered


def split_at_kill(events: list[Event], killed: float) -> tuple[list[Event], list[Event]]:
    """A rank's events before its first resume after the kill (old timeline) and from it on (new timeline)."""
    for i, e in enumerate(events):
        if e.kind == "resumed" and e.t >= killed:
            return events[:i], events[i:]
    return events, []


class Run:
    """One launch of the sample; subclasses know how to start it, where its logs are and which pid is a rank."""

    name = ""

    def __init__(self, root: Path, args: list[str]) -> None:
        self.root, self.args = root, args
        self.proc: subprocess.Popen | None = None
        self.follower = Follower(self.log_files)

    def log_files(self) -> list[tuple[int, Path]]:
        raise NotImplementedError

    def pid_of(self, rank: int) -> int:
        raise NotImplementedError

    def ready_to_kill(self) -> None:
        """Block until the launcher is in its steady state for a fault (toolkit: the warm spare is ready)."""

    def start(self) -> float:
        raise NotImplementedError

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill_all(self) -> None:
        """Bounded teardown of what we started: SIGTERM our launcher's process group, then SIGKILL it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class TorchrunRun(Run):
    name = "torchrun"
    script = EXAMPLES / "train.py"
    world = WORLD
    max_restarts = 3

    def start(self) -> float:
        t0 = time.monotonic()
        argv = [TORCHRUN, "--nproc-per-node", str(self.world), "--max-restarts", str(self.max_restarts),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port_pair()}", "--log-dir",
                str(self.root / "logs"), "--redirects", "3", str(self.script), *self.args]
        with open(self.root / "torchrun.out", "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=self.root, env={**base_env(), "CKPT_DIR": str(self.root / "ckpt")},
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        self.follower.start()
        return t0

    def log_files(self) -> list[tuple[int, Path]]:
        found = sorted(self.root.glob("logs/*/attempt_*/*/stdout.log"), key=lambda p: p.parent.parent.name)
        return [(int(p.parent.name), p) for p in found]

    def pid_of(self, rank: int) -> int:
        """The worker of `rank` among our torchrun's children (its environment names the rank)."""
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return int(pid)
        raise RuntimeError(f"no worker of rank {rank} among torchrun's children {children}")


class ToolkitRun(Run):
    name = "toolkit"
    script = EXAMPLES / "train.py"
    world = WORLD
    options: dict[str, Any] = {}

    def start(self) -> float:
        t0 = time.monotonic()
        # fleet's defaults, as `fleet deploy` plans (the script in its project directory)
        self.job = LocalJob(self.root, self.world, self.args, job="cmp", project=self.script.parent,
                            script=self.script.name, **self.options)
        self.proc = self.job.start(base_env())
        self.follower.start()
        return t0

    def log_files(self) -> list[tuple[int, Path]]:
        return [(r, self.job.dir / "logs" / f"worker_{r}.log") for r in range(self.world)]

    def pid_of(self, rank: int) -> int:
        return self.job.procs()[f"worker_{rank}"]["pid"]

    def ready_to_kill(self) -> None:
        deadline = time.monotonic() + SPARE_BOUND
        while not (self.job.doc().get("warm_spare") or {}).get("ready"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the warm spare was not ready within {SPARE_BOUND:g} s")
            time.sleep(POLL)

    def kill_all(self) -> None:
        self.job.cleanup()


def fault_run(run: Run) -> dict[str, Any]:
    f = run.follower
    t0 = run.start()
    try:
        launch = f.wait("first step of every rank", first_steps, RUN_BOUND) - t0
        run.ready_to_kill()
        now = f.last_step(VICTIM)
        kill_at = next(s for s in range(max(now + 2, 12), 10**6) if s % INTERVAL == INTERVAL // 2)
        f.wait(f"rank {VICTIM} at step {kill_at}", lambda _: f.last_step(VICTIM) >= kill_at, RUN_BOUND)
        pid = run.pid_of(VICTIM)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            outcome = f.wait("recovery", recovered_after(run, killed), RECOVERY_BOUND)
        except TimeoutError:
            outcome = f"no recovery within {RECOVERY_BOUND:g} s"
        if isinstance(outcome, str):
            return {"launch": launch, "failed": outcome, "kill_at": kill_at}
        mttr, reached, resumed = outcome
        code = run.wait_exit(RUN_BOUND)
        f.stop()
        digest = next((e.value for e in f.events.get(0, []) if e.kind == "final"), None)
        return {"launch": launch, "recovery": mttr, "lost": reached - resumed, "exit": code, "digest": digest,
                "kill_at": kill_at, "reached": reached, "resumed": resumed}
    finally:
        f.stop()
        run.kill_all()


def random_kills_run(run: Run, kills: int, rng: random.Random, step_time: float) -> list[dict[str, Any]]:
    """`kills` kills in one run, each of a random rank at a uniformly random moment of about two steps, once every
    rank has trained two steps past the previous recovery (and, under toolkit, the warm spare is ready: a job
    that has been running a while). One row per kill: recovery, lost, or why it failed."""
    f = run.follower
    run.start()
    rows: list[dict[str, Any]] = []
    try:
        f.wait("first step of every rank", lambda ev: first_steps(ev, run.world), RUN_BOUND)
        for _ in range(kills):
            run.ready_to_kill()
            base = {r: f.last_step(r) for r in range(run.world)}
            f.wait("every rank training",
                   lambda _, base=base: all(f.last_step(r) >= base[r] + 2 for r in range(run.world)), RUN_BOUND)
            time.sleep(rng.uniform(0.0, 2 * step_time))
            victim = rng.randrange(run.world)
            pid = run.pid_of(victim)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            try:
                outcome = f.wait("recovery", recovered_after(run, killed), RECOVERY_BOUND)
            except TimeoutError:
                outcome = f"no recovery within {RECOVERY_BOUND:g} s"
            if isinstance(outcome, str):
                rows.append({"victim": victim, "failed": outcome})
                break
            mttr, reached, resumed = outcome
            rows.append({"victim": victim, "recovery": mttr, "lost": reached - resumed, "reached": reached})
        return rows
    finally:
        f.stop()
        run.kill_all()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def random_kills(args: argparse.Namespace, base: Path) -> int:
    """Random-moment kills: the sample on 3 workers under both launchers, and examples/ddp's plain script (as it is)
    under both and its port under toolkit."""
    rng = random.Random(args.seed)
    step_time = 0.07  # s per step with --step-delay 0.05 on 3 workers here
    long_run = ["--epochs", "400", "--ckpt-interval", str(INTERVAL), "--step-delay", "0.05"]
    plain = ["--epochs", "400", "--ckpt-every", str(INTERVAL), "--step-delay", "0.05", "--workers", "0"]
    ddp = EXAMPLES / "ddp"
    cases = [
        ("sample", "toolkit", _launcher(ToolkitRun, EXAMPLES / "train.py", 3), long_run),
        ("sample", "torchrun", _launcher(TorchrunRun, EXAMPLES / "train.py", 3), long_run),
        ("plain script", "toolkit", _launcher(ToolkitRun, ddp / "plain.py", 3), plain),
        ("plain script", "torchrun", _launcher(TorchrunRun, ddp / "plain.py", 3), plain),
        ("ported script", "toolkit", _launcher(ToolkitRun, ddp / "ported.py", 3), plain),
    ]
    if args.only:
        wanted = {tuple(w.strip().split("/")) for w in args.only.split(",")}
        unknown = wanted - {(c, n) for c, n, _, _ in cases}
        if unknown:
            raise SystemExit(f"--only: no case {sorted('/'.join(u) for u in unknown)}; the cases are "
                             f"{', '.join(c + '/' + n for c, n, _, _ in cases)}")
        cases = [case for case in cases if case[:2] in wanted]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {(c, n): [] for c, n, _, _ in cases}
    per_run = args.kills_per_run
    i = 0
    while any(len(v) < args.random_kills for v in rows.values()):
        for case, name, cls, run_args in cases:
            if len(rows[(case, name)]) >= args.random_kills:
                continue
            root = base / f"{name}-{case.replace(' ', '-')}-{i}"
            root.mkdir()
            got = random_kills_run(cls(root, run_args), min(per_run, args.random_kills - len(rows[(case, name)])),
                                   rng, step_time)
            rows[(case, name)] += got
            ok = [r for r in got if "recovery" in r]
            print(f"{case:14} {name:8} run {i}: {len(ok)} kill(s) recovered, MTTR "
                  f"{[round(r['recovery'], 2) for r in ok]}, lost {[r['lost'] for r in ok]}"
                  + (f"; {got[-1]['failed']}" if got and "failed" in got[-1] else ""), flush=True)
        i += 1
    print("\nrandom-moment kills, 3 workers: MTTR over the kills recovered from, lost steps")
    print(f"{'script':<16}{'launcher':<10}{'kills':>6}{'p50':>9}{'p95':>9}{'max':>9}{'lost p50':>10}{'lost max':>10}"
          f"{'failed':>8}")
    for (case, name), got in rows.items():
        ok = [r for r in got if "recovery" in r]
        times = [r["recovery"] for r in ok]
        lost = [r["lost"] for r in ok]
        if not times:
            print(f"{case:<16}{name:<10}{len(got):>6}{'-':>9}{'-':>9}{'-':>9}{'-':>10}{'-':>10}{len(got):>8}")
            continue
        print(f"{case:<16}{name:<10}{len(got):>6}{percentile(times, 0.5):>8.2f}s{percentile(times, 0.95):>8.2f}s"
              f"{max(times):>8.2f}s{percentile(lost, 0.5):>10.0f}{max(lost):>10}{len(got) - len(ok):>8}")
    if args.json:
        args.json.write_text(json.dumps({f"{c}/{n}": v for (c, n), v in rows.items()}, indent=1))
    return 0


def _launcher(cls: type[Run], script: Path, world: int) -> type[Run]:
    """A Run class for `script` on `world` workers (torchrun may restart as often as it is killed here)."""
    return type(f"{cls.__name__}_{script.stem}", (cls,), {"script": script, "world": world, "max_restarts": 100,
                                                          "options": {"max_restarts": 100}})


def steady_run(run: Run) -> dict[str, Any]:
    f = run.follower
    run.start()
    try:
        code = run.wait_exit(RUN_BOUND)
        f.stop()
        steps = [e for e in f.events.get(0, []) if e.kind == "step"]
        half = steps[len(steps) // 2:]
        rate = (len(half) - 1) / (half[-1].t - half[0].t)
        digest = next((e.value for e in f.events.get(0, []) if e.kind == "final"), None)
        return {"steady": rate, "exit": code, "digest": digest, "steps": len(steps)}
    finally:
        f.stop()
        run.kill_all()


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steady-epochs", type=int, default=120, help="epochs of the fault-free run (23 steps each)")
    ap.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (logs) for inspection")
    ap.add_argument("--random-kills", type=int, default=0, metavar="N",
                    help="instead: N kills at random moments per script and launcher (3 workers)")
    ap.add_argument("--kills-per-run", type=int, default=10, help="with --random-kills: kills in one run")
    ap.add_argument("--seed", type=int, default=None, help="with --random-kills: the victims' and moments' seed")
    ap.add_argument("--only", default="", help="with --random-kills: only these SCRIPT/LAUNCHER cases, comma-separated "
                    "(e.g. 'sample/toolkit,ported script/toolkit')")
    args = ap.parse_args()
    if args.random_kills:
        base = Path(tempfile.mkdtemp(prefix="cmp-", dir="/tmp"))
        try:
            return random_kills(args, base)
        finally:
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
    steady_args = ["--epochs", str(args.steady_epochs), "--ckpt-interval", str(INTERVAL), "--step-delay", "0",
                   "--timeout", "60"]
    base = Path(tempfile.mkdtemp(prefix="cmp-", dir="/tmp"))  # short: unix socket paths are limited to 107 bytes
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; runs in {base}",
          flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        n: {"fault": [], "steady": []} for n in ("toolkit", "torchrun")}
    try:
        for i in range(args.repeats):
            for kind, fn, run_args in (("fault", fault_run, FAULT_ARGS), ("steady", steady_run, steady_args)):
                for cls in ((ToolkitRun, TorchrunRun) if i % 2 == 0 else (TorchrunRun, ToolkitRun)):
                    root = base / f"{cls.name}-{kind}-{i}"
                    root.mkdir()
                    row = fn(cls(root, run_args))
                    results[cls.name][kind].append(row)
                    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "digest"}
                    print(f"{i + 1}/{args.repeats} {cls.name:8} {kind:6} {shown}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

    print(f"\nmedians over {args.repeats} runs each (2 workers, gloo, CPU)")
    print(f"{'metric':<28}{'toolkit':>16}{'torchrun':>16}{'ratio':>10}{'target':>12}")
    for label, kind, key, unit, target in (
            ("launch to first step", "fault", "launch", "s", "<= 1.0"),
            ("recovery (MTTR)", "fault", "recovery", "s", "<= 0.5"),
            ("lost work", "fault", "lost", "steps", ""),
            ("steady state", "steady", "steady", "steps/s", ">= 0.98")):
        a, b = median(results["toolkit"][kind], key), median(results["torchrun"][kind], key)
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        fa = f"{a:.2f} {unit}" if a is not None else "-"
        fb = f"{b:.2f} {unit}" if b is not None else "-"
        print(f"{label:<28}{fa:>16}{fb:>16}{ratio:>10}{target:>12}")
    failed = {n: sum(1 for r in results[n]["fault"] if r.get("failed")) for n in results}
    bad = {n: sum(1 for k in ("fault", "steady") for r in results[n][k] if not r.get("failed") and r.get("exit") != 0)
           for n in results}
    fault_digests = {r.get("digest") for n in results for r in results[n]["fault"] if not r.get("failed")}
    steady_digests = {r.get("digest") for n in results for r in results[n]["steady"]}
    print(f"kills not recovered from: toolkit {failed['toolkit']}, torchrun {failed['torchrun']}; "
          f"other runs not exiting 0: toolkit {bad['toolkit']}, torchrun {bad['torchrun']}")
    print(f"final parameters: faulted runs {len(fault_digests)} distinct digest(s) {sorted(map(str, fault_digests))}; "
          f"fault-free runs {len(steady_digests)} distinct digest(s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if len(fault_digests) == 1 and None not in fault_digests and not any(bad.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
