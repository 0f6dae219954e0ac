#!/usr/bin/env python3
"""What logical ranks cost (issue 42's targets), side by side; prints medians and ratios. Not a test.

    .venv/bin/python bench/logical_ranks.py [--parts steady,degraded,memory] [--rounds 3] [--baseline-src DIR]

- steady: one logical rank per process (L = N, nothing lost) against main's code path: the same Trainer script, N=2
  processes under torchrun's environment, once with this checkout's toolkit and once with the baseline's (default:
  `git archive main` of this repository, extracted to a temporary directory), in alternating rounds. Target: steps/s
  >= 0.97x.
- degraded: N=4 processes serving L=6 logical ranks (`--logical-ranks 6`) against 6 processes, through the real
  agent and scheduler (toolkit.testing.localjob). Target: >= 0.9 x (4/6) of the 6 processes' steps/s. On a machine
  with fewer cores than processes both share the same cores: the ratio says what the logical layer costs, not
  what losing hosts costs. (Its steps per CPU-second are rank 0's, which serves 2 of the 6: not comparable.)
- memory: one process serving k = 1, 2, 3 logical ranks of a model of --mb MB of parameters (SGD, no optimizer
  state), its peak RSS after a step; the bytes each extra logical rank adds, over the parameters' bytes, and that
  figure for 600 MB of training state (AdamW: parameters, two moments: 200 MB of gradients).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from toolkit.freeports import free_port
from toolkit.testing.localjob import LocalJob, clean_env
from toolkit.train.determinism import GLOO_BUCKET_MB

ROOT = Path(__file__).resolve().parent.parent
PROC_TIMEOUT = 1800.0

TRAIN = textwrap.dedent(r'''
    """A Trainer loop timed after its warm-up: rank 0 writes {"steps_per_s": ..., "steps_per_cpu_s": ...} to OUT
    (steps per second of wall time, and per second of this process's CPU time: the machine's load from others moves
    the first far more than the second)."""
    import json, os, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    import toolkit.train

    *numbers, out = sys.argv[1:7]
    steps, warm, width, layers, batch = (int(a) for a in numbers)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rt = toolkit.train.init()
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(4096, width), torch.randn(4096, width))
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True, seed=0))
    trainer = toolkit.train.Trainer(rt, model, optimizer, loader, ckpt_every=10**6, verify_every=0,
                                    ckpt_dir=os.environ.get("CKPT_DIR", "ckpt"))
    per_epoch = trainer.position.per_epoch
    epochs = -(-(warm + steps) // per_epoch)
    began = None
    for x, y in trainer.batches(epochs):
        with trainer.step() as step:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(trainer.model(x), y).backward()
            optimizer.step()
        if trainer.step_count == warm and began is None:
            began, cpu = time.perf_counter(), time.process_time()
        if trainer.step_count == warm + steps:
            break
    rate, cpu_rate = steps / (time.perf_counter() - began), steps / (time.process_time() - cpu)
    trainer.finish()
    if rt.rank == 0:
        with open(out, "w") as f:
            json.dump({"steps_per_s": rate, "steps_per_cpu_s": cpu_rate}, f)
''')

MEMORY = textwrap.dedent(r'''
    import json, sys
    import torch
    from torch import nn
    from toolkit.train.logicalgrad import LogicalGrad

    k, mb = int(sys.argv[1]), float(sys.argv[2])
    torch.set_num_threads(1)
    width = 1024
    layers = max(1, round(mb * 2**20 / 4 / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(8, width)
    logical = LogicalGrad(model, None, 0, k, [tuple(range(k))], "gloo") if k > 1 else None
    for lane in range(k):
        if logical is not None:
            logical.begin(lane)
        model(x).sum().backward()
        if logical is not None and lane < k - 1:
            logical.keep(lane)
    if logical is not None:
        logical.reduce()
    opt.step()
    hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak": hwm, "param_bytes": nbytes}))
''')


def run(argv: list[str], env: dict[str, str], timeout: float = PROC_TIMEOUT) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:3]} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def steady_round(src: Path, work: Path, args: argparse.Namespace) -> dict[str, float]:
    """Steps/s of N=2 processes in torchrun's environment, with the toolkit found at `src`."""
    script = work / "train_timed.py"
    script.write_text(TRAIN)
    out = work / f"out-{src.name}.json"
    port = free_port()
    env = {**clean_env(), "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1",
           "CKPT_DIR": tempfile.mkdtemp(prefix="ckpt-", dir=work),  # fresh: no run resumes another's checkpoint
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script), str(args.steps), "3", str(args.width), str(args.layers),
                               str(args.batch), str(out)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    texts = [p.communicate(timeout=PROC_TIMEOUT)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, texts, strict=True)):
        if p.returncode != 0:
            raise SystemExit(f"steady-state rank {r} exited {p.returncode}:\n{text[-3000:]}")
    return json.loads(out.read_text())


def degraded_round(workers: int, logical: int, work: Path, args: argparse.Namespace) -> dict[str, float]:
    """Steps/s of `workers` processes serving `logical` logical ranks, through the real agent and scheduler."""
    project = work / "project"
    project.mkdir(exist_ok=True)
    (project / "train_timed.py").write_text(TRAIN)
    out = work / f"out-{workers}-{logical}.json"
    root = Path(tempfile.mkdtemp(prefix="lr-", dir="/tmp"))
    job = LocalJob(root, workers, [str(args.steps), "3", str(args.width), str(args.layers), str(args.batch), str(out)],
                   job="lrb", project=project, script="train_timed.py", warm_spare=False, cluster_time_out=300,
                   logical_ranks=logical)
    try:
        job.start()
        code = job.finish(PROC_TIMEOUT)
        if code != 0:
            raise SystemExit(f"the {workers}-worker job failed ({code}):\n{job.evidence()}")
    finally:
        job.cleanup()
    return json.loads(out.read_text())


def report(what: str, pairs: list[tuple[dict[str, float], dict[str, float]]], target: float) -> None:
    """One line per measure: the medians (the second of each pair over the first), the median of the rounds' own
    ratios (each round ran its two side by side, so a round's load cancels out), every round's ratio."""
    for key, unit in (("steps_per_s", "steps/s"), ("steps_per_cpu_s", "steps per CPU-s")):
        a, b = statistics.median(p[1][key] for p in pairs), statistics.median(p[0][key] for p in pairs)
        ratios = [p[1][key] / p[0][key] for p in pairs]
        print(f"{what}: {a:.2f} vs {b:.2f} {unit}, median of the rounds' ratios {statistics.median(ratios):.3f}x "
              f"(target >= {target:.3f}x; rounds {', '.join(f'{r:.3f}' for r in ratios)})")


def baseline(src: str | None, work: Path) -> Path:
    if src:
        return Path(src).resolve()
    dest = work / "main"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "main"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="steady,degraded,memory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="timed steps per run (after 3 warm-up steps)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--mb", type=float, default=100.0, help="MB of parameters for the memory part")
    p.add_argument("--baseline-src", default=None, help="a source tree of toolkit to compare with [main's]")
    args = p.parse_args()
    parts = args.parts.split(",")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; medians of {args.rounds} rounds; model "
          f"{args.layers} x Linear({args.width}, {args.width}), batch {args.batch} per logical rank")
    with tempfile.TemporaryDirectory(prefix="lrbench-") as tmp:
        work = Path(tmp)
        if "steady" in parts:
            base = baseline(args.baseline_src, work)
            pairs = [(steady_round(base, work, args), steady_round(ROOT, work, args)) for _ in range(args.rounds)]
            report("steady, L = N = 2: this checkout vs main's code path", pairs, 0.97)
        if "degraded" in parts:
            pairs = [(degraded_round(6, 6, work, args), degraded_round(4, 6, work, args)) for _ in range(args.rounds)]
            report("degraded: 4 processes serving 6 logical ranks vs 6 processes", pairs, 0.9 * 4 / 6)
        if "memory" in parts:
            peaks = {}
            for k in (1, 2, 3):
                res = json.loads(run([sys.executable, "-c", MEMORY, str(k), str(args.mb)],
                                     {**clean_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}))
                peaks[k] = res["peak"]
                nbytes = res["param_bytes"]
            per = (peaks[3] - peaks[2]) / nbytes  # the second extra logical rank: its gradient copy alone
            scratch = (peaks[2] - peaks[1]) / nbytes - per  # the first also brings the exchange's scratch
            print(f"memory, {nbytes / 1e6:.0f} MB of parameters: peak RSS "
                  f"{', '.join(f'{v / 1e6:.0f} MB' for v in peaks.values())} serving 1, 2, 3 logical ranks: each "
                  f"extra logical rank adds {per:.2f}x the parameters' bytes (target: at most one gradient copy, "
                  f"1x), and serving more than one adds the exchange's scratch once ({scratch * nbytes / 1e6:.0f} MB,"
                  f" at most two buckets of {GLOO_BUCKET_MB} MB); at 600 MB of state (AdamW: parameters and two "
                  f"moments, 200 MB of gradients): {per * 200:.0f} MB per extra logical rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
