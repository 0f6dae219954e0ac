#!/usr/bin/env python3
"""What streaming the ranks' output costs the training: `fleet run` with a rank that prints fast, its output shown
(read by a fast reader, or by a terminal that stalls) next to `fleet run --quiet` (nothing streamed).

Why: `fleet run` shows every rank's output as it prints (`[rank1]: ...`). A rank writes to its log file, never to
fleet, so however fast it prints and however slow the terminal, its training must not slow down: fleet follows the
files (tail -F) and holds at most STREAM_BUFFER_LINES unwritten lines, dropping (and counting) the rest. Not a
test: it prints numbers.

    .venv/bin/python bench/stream_cost.py [--repeats 3] [--steps 300] [--lines-per-step 200]

Each run is a local job of 2 workers of the same script: every step spins a fixed amount of CPU work (about 5 ms);
rank 1 also prints --lines-per-step lines of 100 bytes a step (about 4 MB/s at 200 lines: a fast printer). Each
rank writes its steps/s over the whole run to a file. Modes, interleaved, --repeats times each:
  quiet     `fleet run --quiet`: nothing streamed (the reference)
  streamed  `fleet run`: every line shown, read at once by this script (to /dev/null)
  stalled   `fleet run`: shown to a pipe nobody reads until the job ended (a paused terminal: lines dropped)
Printed: each mode's median steps/s of rank 0 (silent) and rank 1 (the printer) and their ratio to `quiet`.
`--path-cost`: instead, the CPU fleet's own Python spends on a line (tail's output split, parsed, cleaned, queued and
written by the bounded Printer `run` uses, to /dev/null; a step's lines a read), and what that is at the printer's
line rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLEET = str(Path(sys.executable).parent / "fleet")
JOB_BOUND = 600.0  # s for one job, start to end, on a loaded machine
WORKER = r'''
import json, os, sys, time
steps, lines = int(sys.argv[1]), int(sys.argv[2])
rank = int(os.environ["RANK"])
line = "x" * 99
def work():
    end = time.thread_time() + 0.005
    n = 0
    while time.thread_time() < end:
        n += 1
    return n
begun = time.monotonic()
for step in range(steps):
    work()
    if rank == 1:
        for i in range(lines):
            print(line, flush=False)
        sys.stdout.flush()
rate = steps / (time.monotonic() - begun)
with open(f"rate-{rank}.json", "w") as f:
    json.dump({"rate": rate}, f)
'''


def one_run(project: Path, work: Path, mode: str, steps: int, lines: int) -> tuple[float, float]:
    """(rank 0's, rank 1's steps/s) of one `fleet run` in `mode`."""
    for r in (0, 1):
        (project / f"rate-{r}.json").unlink(missing_ok=True)
    again = ["--again"] if (work / "bench").exists() else []  # the job finished last time: once more
    argv = [FLEET, "run", "--nproc-per-node", "2", "--workdir", str(work), "--no-warm-spare", "--no-check",
            *(["--quiet"] if mode == "quiet" else []), *again, "--job", "bench", "worker.py", str(steps), str(lines)]
    if mode == "stalled":
        proc = subprocess.Popen(argv, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + JOB_BOUND
        while not all((project / f"rate-{r}.json").exists() for r in (0, 1)):  # nobody reads its output meanwhile
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the {mode} run did not produce its rates (exit {proc.poll()})")
            time.sleep(0.2)
        proc.communicate(timeout=JOB_BOUND)
    else:
        proc = subprocess.run(argv, cwd=project, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=JOB_BOUND)
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} run exited {proc.returncode}")
    return tuple(json.loads((project / f"rate-{r}.json").read_text())["rate"] for r in (0, 1))  # type: ignore


def path_cost(lines: int, lines_per_step: int) -> None:
    """--path-cost: CPU time a line through the stream's LineSplitter, TailParser and the bounded Printer, in this
    process, fed one step's output (--lines-per-step lines) a read."""
    from toolkit.launcher.jobhosts.scripts import TailParser
    from toolkit.launcher.jobhosts.streams import STREAM_BUFFER_LINES, Printer
    from toolkit.launcher.remote.host import LineSplitter

    stdout = sys.stdout
    chunk = ("x" * 99 + "\n").encode() * lines_per_step
    with open(os.devnull, "w") as sink:
        sys.stdout = sink
        try:
            printer = Printer(": ", bound=STREAM_BUFFER_LINES)
            printer.start()
            split = LineSplitter(TailParser({"/job/logs/worker_1.log": "[rank1]"}, printer.lines))
            began = time.process_time()
            for _ in range(lines // lines_per_step):
                split.feed(chunk)
            printer.close()
            cpu = time.process_time() - began
        finally:
            sys.stdout = stdout
    per_line = cpu / lines
    shares = ", ".join(f"{rate} steps/s {100 * per_line * lines_per_step * rate:.1f}%" for rate in (50, 100, 200))
    print(f"{1e6 * per_line:.2f} us of CPU a line ({lines} lines, {sum(printer.dropped.values())} dropped); at "
          f"{lines_per_step} lines a step, of a core: {shares}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lines-per-step", type=int, default=200)
    ap.add_argument("--path-cost", action="store_true", help="instead: fleet's own CPU a streamed line")
    args = ap.parse_args()
    if args.path_cost:
        path_cost(200_000, args.lines_per_step)
        return
    root = Path(tempfile.mkdtemp(prefix="stream-cost-"))
    try:
        project, work = root / "proj", root / "w"
        project.mkdir()
        (project / "worker.py").write_text(WORKER)
        modes = ("quiet", "streamed", "stalled")
        rates: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for i in range(args.repeats):
            for mode in modes:
                rates[mode].append(one_run(project, work, mode, args.steps, args.lines_per_step))
                print(f"run {i + 1} {mode}: rank 0 {rates[mode][-1][0]:.1f} steps/s, rank 1 {rates[mode][-1][1]:.1f}",
                      flush=True)
        ref = [statistics.median(r[k] for r in rates["quiet"]) for k in (0, 1)]
        print(f"\n{args.lines_per_step} lines of 100 B a step from rank 1, {args.steps} steps, {os.cpu_count()} CPUs")
        print(f"{'mode':<10} {'rank 0 steps/s':>15} {'ratio':>6} {'rank 1 steps/s':>15} {'ratio':>6}")
        for mode in modes:
            med = [statistics.median(r[k] for r in rates[mode]) for k in (0, 1)]
            print(f"{mode:<10} {med[0]:>15.1f} {med[0] / ref[0]:>6.3f} {med[1]:>15.1f} {med[1] / ref[1]:>6.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
