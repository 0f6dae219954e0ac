#!/usr/bin/env python3
"""Recovery at a size users train: a 670 MB transformer (bench/transformer.py: model + AdamW state) on 3 workers,
kill -9 of a random rank at a random moment, under toolkit (in place) and torchrun (restart of the world from the
newest checkpoint), side by side in one run.

Why: in-place recovery must stay ahead of a restart when the state is large, not only for a model of a few MB: the
survivors keep their state, the replacement takes it over the link, nothing is recomputed. Not a test: it prints
MTTR percentiles, lost steps and whether every run ended bitwise equal to an uninterrupted one.

    .venv/bin/python bench/recovery_at_size.py [--runs 3] [--kills-per-run 4] [--epochs 2] [--batch-size 2]
                                               [--seq 32]

Each run: the script under one launcher, --kills-per-run kills, each of a uniformly random rank at a uniformly
random moment of about two steps, the first once the first checkpoint is written (step --ckpt-every), each once
every rank trained 2 steps past the previous recovery (under toolkit, also once the warm spare is ready); then the
run goes to its end. MTTR and lost work are defined as in
bench/compare_torchrun.py (kill -> every rank past the newest step any rank had printed; steps done again), so the
MTTR includes at least one step; "resumed" is kill -> every rank has printed its `resumed from step` line (the
recovery without that step). A reference run without faults (toolkit) gives the digest every run must end with.
Runs alternate launchers.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_torchrun import (  # noqa: E402 - the sibling bench's launchers and log follower
    RUN_BOUND,
    Run,
    ToolkitRun,
    TorchrunRun,
    first_steps,
    percentile,
    recovered_after,
)

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "transformer.py"
WORLD = 3
RECOMPUTED = re.compile(r"^rank \d+: resumed from step \d+ .*: (\d+) step\(s\) recomputed$", re.M)
STATE = re.compile(r"^state: (\d+) bytes of model \+ optimizer, peak RSS (\d+) MB$", re.M)
LONG_RUN = 3 * RUN_BOUND  # s for a whole run at this size on a loaded machine
RECOVERY_BOUND = 900.0  # s: a restart of the world that redoes its steps since a checkpoint, on a loaded machine


def launcher(cls: type[Run]) -> type[Run]:
    return type(f"{cls.__name__}_transformer", (cls,), {"script": SCRIPT, "world": WORLD, "max_restarts": 100,
                                                        "options": {"max_restarts": 100}})


def run_with_kills(run: Run, kills: int, rng: random.Random, step_time: float, first: int = 0) -> dict[str, Any]:
    """The run with `kills` random-moment kills (the first once every rank is past step `first`: a checkpoint
    exists), then to its end: one row per kill, the exit code, the digest."""
    f = run.follower
    run.start()
    rows: list[dict[str, Any]] = []
    try:
        f.wait("first step of every rank", lambda ev: first_steps(ev, run.world), LONG_RUN)
        f.wait(f"every rank past step {first}", lambda _: all(f.last_step(r) > first for r in range(run.world)),
               LONG_RUN)
        for _ in range(kills):
            run.ready_to_kill()
            base = {r: f.last_step(r) for r in range(run.world)}
            f.wait("every rank training",
                   lambda _, base=base: all(f.last_step(r) >= base[r] + 2 for r in range(run.world)), LONG_RUN)
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
                return {"kills": rows, "failed": outcome}
            mttr, reached, resumed = outcome
            with f.cond:
                back = [next((e.t for e in f.events.get(r, []) if e.kind == "resumed" and e.t >= killed), None)
                        for r in range(run.world)]
            rows.append({"victim": victim, "recovery": mttr, "lost": reached - resumed,
                         "resumed": max(back) - killed if None not in back else None})
        code = run.wait_exit(LONG_RUN)
        f.stop()
        digest = next((e.value for e in f.events.get(0, []) if e.kind == "final"), None)
        return {"kills": rows, "exit": code, "digest": digest}
    finally:
        f.stop()
        run.kill_all()


def logs_of(run: Run) -> str:
    return "\n".join(p.read_text(errors="replace") for _, p in run.log_files() if p.exists())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="faulted runs per launcher")
    ap.add_argument("--kills-per-run", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2, help="of 40 steps each on 3 workers at --batch-size 2")
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step (the state's size does "
                    "not depend on it; the step's time does)")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--seed", type=int, default=None, help="the victims' and moments' seed")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (logs) for inspection")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    script_args = ["--epochs", str(args.epochs), "--ckpt-every", str(args.ckpt_every), "--batch-size",
                   str(args.batch_size), "--seq", str(args.seq)]
    base = Path(tempfile.mkdtemp(prefix="size-", dir="/tmp"))  # short: unix socket paths are limited
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f}; runs in {base}", flush=True)
    try:
        ref = launcher(ToolkitRun)(base / "reference", script_args)
        (base / "reference").mkdir()
        began = time.monotonic()
        out = run_with_kills(ref, 0, rng, 0.0)
        steps = [e for e in ref.follower.events.get(0, []) if e.kind == "step"]
        step_time = (steps[-1].t - steps[len(steps) // 2].t) / max(1, len(steps) - 1 - len(steps) // 2)
        sizes = STATE.findall(logs_of(ref))
        reference = out.get("digest")
        print(f"reference: exit {out.get('exit')}, {len(steps)} steps in {time.monotonic() - began:.0f} s, "
              f"{step_time:.2f} s per step; state {int(sizes[0][0]) / 1e6:.0f} MB per rank, peak RSS "
              f"{max(int(s[1]) for s in sizes)} MB; digest {reference}", flush=True)
        if out.get("exit") != 0 or reference is None:
            print("the reference run failed")
            return 1
        results: dict[str, list[dict[str, Any]]] = {"toolkit": [], "torchrun": []}
        recomputed: list[int] = []
        for i in range(args.runs):
            order = (ToolkitRun, TorchrunRun) if i % 2 == 0 else (TorchrunRun, ToolkitRun)
            for cls in order:
                root = base / f"{cls.name}-{i}"
                root.mkdir()
                run = launcher(cls)(root, script_args)
                row = run_with_kills(run, args.kills_per_run, rng, step_time, first=args.ckpt_every)
                if cls is ToolkitRun:
                    recomputed += [int(n) for n in RECOMPUTED.findall(logs_of(run))]
                results[cls.name].append(row)
                print(f"run {i} {cls.name:8} MTTR {[round(k['recovery'], 2) for k in row['kills']]} lost "
                      f"{[k['lost'] for k in row['kills']]} exit {row.get('exit')} "
                      f"{'bitwise equal' if row.get('digest') == reference else 'DIFFERENT: ' + str(row.get('digest'))}"
                      + (f"; {row['failed']}" if row.get("failed") else ""), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\n{WORLD} workers, {int(sizes[0][0]) / 1e6:.0f} MB of model + optimizer state per rank, kills at random "
          "moments")
    print(f"{'launcher':<10}{'kills':>6}{'p50':>9}{'p95':>9}{'max':>9}{'resumed p50/max':>17}{'lost mean':>11}"
          f"{'lost max':>10}{'bitwise runs':>14}")
    p50 = {}
    for name, rows in results.items():
        kills = [k for r in rows for k in r["kills"]]
        times = [k["recovery"] for k in kills]
        same = sum(1 for r in rows if r.get("digest") == reference and r.get("exit") == 0)
        if not times:
            print(f"{name:<10}{0:>6}")
            continue
        p50[name] = percentile(times, 0.5)
        back = [k["resumed"] for k in kills if k["resumed"] is not None]
        shown = f"{percentile(back, 0.5):.2f}s/{max(back):.2f}s" if back else "-"
        print(f"{name:<10}{len(kills):>6}{p50[name]:>8.2f}s{percentile(times, 0.95):>8.2f}s{max(times):>8.2f}s"
              f"{shown:>17}{statistics.mean(k['lost'] for k in kills):>11.1f}{max(k['lost'] for k in kills):>10}"
              f"{same:>9} of {len(rows)}")
    if len(p50) == 2:
        print(f"MTTR p50 toolkit / torchrun: {p50['toolkit'] / p50['torchrun']:.2f} (target <= 0.3); steps "
              f"recomputed in toolkit's recoveries (from its logs): {sorted(set(recomputed))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
