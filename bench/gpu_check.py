#!/usr/bin/env python3
"""Every CUDA path of toolkit that one GPU can run, checked in one go (at most about 5 minutes on an H100/H200).

Why: the CUDA and NCCL paths (the checkpoint's pinned staging, the state transfer of device tensors, the
rank-ordered reduction's hook on device buckets, the fence's abort of an NCCL communicator, a recovery with the
model on the GPU, the warm spare on a GPU host) are written on machines without a GPU. The first GPU host may have
no network and little time: this needs only the repository and its install, downloads nothing, and prints one
table (path, result, figure), also written as JSON. Not a test: tests/test_gpu_check.py runs `--dry`, the CPU twin
of every check (the same code with CPU tensors and small sizes), so that the script cannot rot.

    .venv/bin/python bench/gpu_check.py [--size-mb 2000] [--json gpu-check.json]    # on the GPU host
    .venv/bin/python bench/gpu_check.py --dry                                         # the CPU twin, anywhere

Checks (`--only` takes their names, comma-separated):
  checkpoint   a state of --size-mb on the device (MLP + AdamW) checkpointed asynchronously (pinned staging, one
               authenticated copy: toolkit.train.ckpt.manager) while training goes on; the training stall against
               torch.save of the same state; restored and compared bit for bit.
  transfer     two processes on the one device over gloo (NCCL refuses two ranks on one device): a survivor's
               device state (--size-mb) to a replacement whose optimizer never stepped (toolkit.train.transfer),
               bitwise, its speed beside a raw device-to-device copy and a raw gloo broadcast of as many bytes.
  ordered      DDP with the rank-ordered reduction's hook (toolkit.train.ddpmodel, determinism) on device tensors,
               gloo, world 2 on the one device: the parameters bitwise equal across two bucket layouts; steps/s
               beside plain DDP.
  nccl         a world-1 NCCL group through the Trainer: init, a step (with a collective), the fence's abort of the
               communicator (toolkit.train.fence), a new group and a step on it; each timed.
  recovery     the sample (examples/train.py) on the device as a local job of 2 workers over gloo (the real agent
               and scheduler: toolkit.testing.localjob), kill -9 of one at a random moment: recovered in place,
               0 steps lost, final parameters bitwise those of a run without a fault; MTTR (kill -> every rank past
               the step it had reached), and kill -> the replacement's first step, without the warm spare.
  spare        the same with the agent's warm spare, killed once it is ready: the replacement comes from the
               spare; kill -> its first step on the device beside the cold start's, and the MTTR.
Exit: 0 every check ok, 1 a check failed, 2 no CUDA here (without --dry) or bad flags.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_stall import KEY, build, stable, state_of  # noqa: E402 - the sibling bench's model and state

from toolkit.freeports import free_port  # noqa: E402
from toolkit.testing.localjob import STEP_LINE, LocalJob  # noqa: E402
from toolkit.train import determinism, transfer  # noqa: E402
from toolkit.train.ckpt.manager import CheckpointManager, Placement, host_copies  # noqa: E402
from toolkit.train.ddpmodel import ddp_arguments  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("checkpoint", "transfer", "ordered", "nccl", "recovery", "spare")
DRY_MB = 8.0  # MB of state in the CPU twin
DEPTH = 8  # hidden layers of the MLP whose parameters and AdamW moments make --size-mb
WORKER_BOUND = 600.0  # s for a check's processes (a loaded CI machine; about 10 s on the GPU host)
JOB_BOUND = 240.0  # s for one local job of the sample
SPARE_BOUND = 180.0  # s for the agent's warm spare to import torch (a heavily loaded CI machine took over 60)
POLL = 0.02  # s between looks at a log: no event tells that a line was appended
# as tests/train/test_recovery.py's: a fault noticed in seconds, a finished worker's teardown given time
JOB_OPTIONS = {"node_timeout": 3, "cluster_time_out": 120, "grace": 20}
WARM_EPOCHS = 20  # of the job with the warm spare, stopped once recovered: the spare is ready long before its end
SAMPLE_EPOCH = 23  # steps of an epoch of the sample at 2 workers (1440 digits, 32 a batch per rank)
ABORT_PROBE = 10.0  # s an all_reduce on the aborted group is given to (wrongly) complete
CUBLAS = ":4096:8"  # CUBLAS_WORKSPACE_CONFIG: cuBLAS's deterministic mode, which deterministic algorithms demand
FINAL = re.compile(r"^final parameters: \S+ sha256 ([0-9a-f]{64})$", re.M)
RESUMED = re.compile(r"^rank \d+: resumed from step (\d+) .*out of rank \d+'s (\w+).*: (\d+) step\(s\) recomputed$",
                     re.M)
START = re.compile(r"^--- toolkit agent .*: start worker_\d+ #\d+ .*---$", re.M)


@dataclass
class Row:
    """One line of the table: `status` ok, FAILED or not run; `why` says what failed or why it could not run."""

    path: str
    status: str
    result: str
    figure: str
    seconds: float = 0.0
    why: str = ""


class CheckFailed(Exception):
    """A check ran and found something wrong: the message is the table's result."""


def tail(text: str, lines: int = 3) -> str:
    """The last `lines` non-empty lines of `text` on one line (a table cell), at most 400 characters."""
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])[-400:]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (a flat uint8 view of a contiguous copy), for comparisons bit for bit, NaNs included."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    pairs = list(zip(a, b, strict=True))
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y).to(x.device))
               for x, y in pairs)


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model's state and the optimizer's tensors, in a fixed order."""
    return list(model.state_dict().values()) + [v for s in opt.state_dict()["state"].values() for v in s.values()
                                                if torch.is_tensor(v)]


def digest(tensors: Iterable[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(bits(t).cpu().numpy().tobytes())
    return h.hexdigest()


def model_of(mb: float, device: torch.device, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """checkpoint_stall's MLP + AdamW sized to about `mb` MB of parameters and moments (12 bytes a parameter), on
    `device`; (model, optimizer, width)."""
    width = max(16, int((mb * 1e6 / 12 / DEPTH) ** 0.5))
    torch.manual_seed(seed)
    model, opt = build(width, DEPTH)
    model.to(device)  # the parameters move in place: the optimizer (no state yet) keeps them
    return model, opt, width


def train_step(model: nn.Module, opt: torch.optim.Optimizer, width: int, device: torch.device,
               before_step: Callable[[], Any] = lambda: None) -> None:
    opt.zero_grad(set_to_none=True)
    x = torch.randn(8, width, device=device)
    nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.int64, device=device)).backward()
    before_step()
    opt.step()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- checkpoint (in this process)

def check_checkpoint(cfg: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    device = cfg.torch_device
    model, opt, width = model_of(cfg.size_mb, device, 0)
    for _ in range(2):
        train_step(model, opt, width, device)  # AdamW's moments exist
    sync(device)
    t0 = time.perf_counter()
    torch.save(state_of(2, model, opt), tmp / "torch.pt")
    plain = time.perf_counter() - t0
    expected = [t.clone() for t in state_tensors(model, opt)]
    manager = CheckpointManager(tmp / "ckpt", keep_max=2, placement=Placement("gpucheck"), key=KEY, async_write=True)
    try:
        t0 = time.perf_counter()
        manager.save(3, state_of(3, model, opt), stable=stable(model, opt))
        blocked = time.perf_counter() - t0
        waited: list[float] = []
        train_step(model, opt, width, device, lambda: waited.append(manager.wait_staged()))  # the loop goes on
        manager.flush()
        t0 = time.perf_counter()
        loaded = manager.load(3)
        restored = time.perf_counter() - t0
    finally:
        manager.close()
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    if not same_bits(state_tensors(model, opt), expected):
        raise CheckFailed("the restored state differs from the state saved")
    pinned = host_copies(expected[:1])[0].is_pinned() if device.type == "cuda" else None
    if pinned is False:
        raise CheckFailed("host_copies staged a device tensor in pageable memory")
    stall = blocked + waited[0]
    size = sum(t.nbytes for t in expected)
    return ("restored bitwise" + (", staged in pinned memory" if pinned else ""),
            f"{size / 1e9:.2f} GB: stall {stall * 1e3:.1f} ms vs torch.save {plain * 1e3:.0f} ms "
            f"({stall / plain:.3f}x); restore {restored:.2f} s")


# -- the processes of the multi-process checks

def init_pair(rank: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=WORKER_BOUND))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=WORKER_BOUND))


def clocked(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """(what `fn` returns, the seconds it took, the device's queued work included)."""
    sync(device)
    t0 = time.perf_counter()
    value = fn()
    sync(device)
    return value, time.perf_counter() - t0


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    return clocked(device, fn)[1]


def worker_transfer(rank: int, port: int, p: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(p["device"])
    init_pair(rank, port)
    model, opt, width = model_of(p["mb"], device, rank)  # other values on the replacement
    if rank == 0:
        train_step(model, opt, width, device)  # the survivor holds a stepped optimizer; the replacement's is new
    dist.barrier()

    def move() -> None:
        got, _ = transfer.share(state_of(1, model, opt), [0], rank=rank, world=2, device=torch.device("cpu"))
        if got is not None:
            model.load_state_dict(got["model"])
            opt.load_state_dict(got["optimizer"])

    took = timed(device, move)
    tensors = state_tensors(model, opt)
    nbytes = sum(t.nbytes for t in tensors)
    digests: list[Any] = [None, None]
    dist.all_gather_object(digests, digest(tensors))
    homes = sorted({str(t.device) for t in tensors if t.dim()})
    flat = torch.ones(nbytes, dtype=torch.uint8, device=device)
    copy = torch.empty_like(flat)
    d2d = timed(device, lambda: copy.copy_(flat))
    dist.barrier()
    raw = timed(device, lambda: dist.broadcast(flat, 0))
    dist.destroy_process_group()
    return {"bytes": nbytes, "transfer": took, "d2d": d2d, "broadcast": raw, "bitwise": digests[0] == digests[1],
            "homes": homes}


def ddp_steps(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()


def worker_ordered(rank: int, port: int, p: dict[str, Any]) -> dict[str, Any]:
    """DDP over gloo on the device: plain, then the rank-ordered hook with the Trainer's bucket layout, then with
    small buckets (another layout); each from the same initial parameters."""
    device = torch.device(p["device"])
    init_pair(rank, port)
    determinism.configure(1)
    torch.manual_seed(0)
    width = max(16, int((p["mb"] * 1e6 / 4 / DEPTH) ** 0.5))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(DEPTH)]).to(device)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank)).to(device)
    small = max(p["mb"] / DEPTH / 2, 0.01)  # MB: about two buckets per layer
    variants = {"plain": None, "ordered": {}, "ordered_small": {"bucket_cap_mb_list": [small]}}
    out: dict[str, Any] = {}
    for name, user in variants.items():
        model.load_state_dict(initial)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        kwargs = {} if user is None else ddp_arguments(user, True, "gloo")
        ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
        reducer = None
        if user is not None:
            reducer = determinism.OrderedReducer(None)
            ddp.register_comm_hook(reducer, determinism.ordered_allreduce_hook)
        ddp_steps(ddp, opt, x, 2)  # DDP rebuilds its buckets after the first
        dist.barrier()
        took = timed(device, lambda ddp=ddp, opt=opt: ddp_steps(ddp, opt, x, p["steps"]))
        out[name] = {"steps_per_s": p["steps"] / took, "digest": digest(model.state_dict().values())}
        if reducer is not None:
            reducer.close()
        ddp = None  # its reducer hooks the parameters: gone before the next wrapper
    dist.destroy_process_group()
    return out


def worker_nccl(rank: int, port: int, p: dict[str, Any]) -> dict[str, Any]:
    """World 1 under torchrun's variables (the mode whose fence records an NCCL group): the Trainer's init, a step
    whose loss is all-reduced (NCCL makes its communicator at the first collective), the fence's abort, the group
    left and a new one built (what Runtime.reform does between generations), a new Trainer resuming from the
    step's checkpoint, and its step on the new group."""
    import toolkit.train

    times: dict[str, float] = {}
    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 64), torch.zeros(8, dtype=torch.int64))
    steps: list[int] = []

    def one_step(rt: Any) -> Any:
        trainer = toolkit.train.Trainer(rt, model, opt, torch.utils.data.DataLoader(data, batch_size=4),
                                        ckpt_dir=Path(p["dir"]), ckpt_every=1, async_ckpt=False)
        for x, y in trainer.batches(1):
            with trainer.step() as step:
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(trainer.model(x.to(rt.device)), y.to(rt.device))
                loss.backward()
                opt.step()
                dist.all_reduce(loss.detach())
            steps.append(step)
            break
        return trainer

    t0 = time.perf_counter()
    rt = toolkit.train.init(backend=p["backend"])
    model.to(rt.device)
    times["init"] = time.perf_counter() - t0
    if p["device"] == "cuda" and rt.device.type != "cuda":
        raise CheckFailed(f"the runtime's device is {rt.device}, not the GPU")
    trainer, times["step"] = clocked(rt.device, lambda: one_step(rt))
    t0 = time.perf_counter()
    rt.fence.abandon(rt.generation)
    times["abort"] = time.perf_counter() - t0
    tripped = rt.fence.tripped
    after = collective_after_abort(rt.device) if p["device"] == "cuda" else "not tried (gloo: no communicator)"
    t0 = time.perf_counter()
    trainer.close()  # leaves the aborted group (Runtime.close: the fence disarmed, the group destroyed)
    rt = toolkit.train.init(backend=p["backend"])
    times["reform"] = time.perf_counter() - t0
    trainer, times["step_after"] = clocked(rt.device, lambda: one_step(rt))
    trainer.finish()
    return {"times": times, "tripped": tripped, "steps": steps, "backend": rt.backend, "after_abort": after}


def collective_after_abort(device: torch.device) -> str:
    """What an all_reduce on the aborted NCCL group does: it must fail (or never complete), not succeed."""
    try:
        work = dist.all_reduce(torch.ones(1, device=device), async_op=True)
        deadline = time.monotonic() + ABORT_PROBE
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(POLL)
        if not work.is_completed():
            return f"still pending after {ABORT_PROBE:g} s"
        work.wait()
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - the failure is the point
        return f"failed: {tail(str(e), 1)[:120]}"
    return "completed"


WORKERS = {"transfer": worker_transfer, "ordered": worker_ordered, "nccl": worker_nccl}


def run_workers(kind: str, world: int, params: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    """`world` processes running WORKERS[kind] (this file with --worker); each one's JSON result."""
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--port", str(port), "--params",
            json.dumps(params)]
    procs = [subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r)}, cwd=ROOT, start_new_session=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=WORKER_BOUND))
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"its processes did not end within {WORKER_BOUND:g} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            raise CheckFailed(f"rank {r} exited with {p.returncode}: {tail(err)}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def worker_env(cfg: argparse.Namespace) -> dict[str, str]:
    """The environment of every process started here: no job's variables, one thread, cuBLAS deterministic."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "TOOLKIT_", "TORCHELASTIC_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CKPT_DIR")}
    return {**keep, "OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": CUBLAS}


def check_transfer(cfg: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    r = run_workers("transfer", 2, {"device": cfg.device, "mb": cfg.size_mb}, worker_env(cfg))[1]
    if not r["bitwise"]:
        raise CheckFailed("the replacement's state differs from the survivor's")
    if r["homes"] != [str(cfg.torch_device)]:
        raise CheckFailed(f"the replacement's state lives on {r['homes']}, not on {cfg.torch_device}")
    gb = r["bytes"] / 1e9
    return (f"bitwise, in the replacement's {cfg.device} memory",
            f"{gb:.2f} GB in {r['transfer']:.2f} s ({gb / r['transfer']:.2f} GB/s); raw device copy "
            f"{gb / r['d2d']:.1f} GB/s, raw gloo broadcast {gb / r['broadcast']:.2f} GB/s")


def check_ordered(cfg: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    outs = run_workers("ordered", 2, {"device": cfg.device, "mb": cfg.size_mb / 4, "steps": cfg.steps},
                       worker_env(cfg))
    r = outs[0]
    if r["ordered"]["digest"] != r["ordered_small"]["digest"]:
        raise CheckFailed("the parameters differ between two bucket layouts")
    if any(o["ordered"]["digest"] != r["ordered"]["digest"] for o in outs):
        raise CheckFailed("the ranks' parameters differ")
    ratio = r["ordered"]["steps_per_s"] / r["plain"]["steps_per_s"]
    return ("bitwise across two bucket layouts, ranks equal",
            f"{r['ordered']['steps_per_s']:.1f} steps/s vs plain DDP {r['plain']['steps_per_s']:.1f} ({ratio:.2f}x)")


def check_nccl(cfg: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    env = {**worker_env(cfg), "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    (r,) = run_workers("nccl", 1, {"device": cfg.device, "backend": backend, "dir": str(tmp)}, env)
    if r["backend"] != backend or not r["tripped"] or r["steps"] != [1, 2] or r["after_abort"] == "completed":
        raise CheckFailed(f"backend {r['backend']}, fence tripped {r['tripped']}, steps {r['steps']}, a collective "
                          f"after the abort {r['after_abort']} (expected {backend}, True, [1, 2], not completed)")
    t = r["times"]
    return (f"{backend}: init, step, abort (a collective after it: {r['after_abort']}), new group, step 2 resumed",
            f"init {t['init']:.2f} s, step {t['step']:.2f} s, abort {t['abort'] * 1e3:.1f} ms, re-form "
            f"{t['reform']:.2f} s, step {t['step_after']:.2f} s")


# -- the sample as a local job (the real agent, scheduler, warm spare and workers)

def sample_args(cfg: argparse.Namespace, epochs: int, delay: float) -> list[str]:
    return ["--device", cfg.device, "--backend", "gloo", "--epochs", str(epochs), "--ckpt-interval", "4",
            "--timeout", "30", "--step-delay", str(delay)]


def wait_for(what: str, predicate: Callable[[], Any], bound: float, job: LocalJob) -> Any:
    deadline = time.monotonic() + bound
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise CheckFailed(f"no {what} within {bound:g} s: {tail(job.evidence())}")
        time.sleep(POLL)
    return value


def final_digest(job: LocalJob) -> str | None:
    found = FINAL.findall(job.log("worker_0.log"))
    return found[-1] if found else None


def reference_digest(cfg: argparse.Namespace, tmp: Path) -> str:
    """The final parameters' digest of the sample run without a fault (computed once)."""

    def run() -> str:
        job = LocalJob(tmp / "ref", 2, sample_args(cfg, cfg.epochs, 0.0), job="ref", warm_spare=False, **JOB_OPTIONS)
        try:
            job.start(worker_env(cfg))
            code = job.finish(JOB_BOUND)
        finally:
            job.cleanup()
        found = final_digest(job)
        if code != 0 or found is None:
            raise CheckFailed(f"the run without a fault ended with {code}: {tail(job.evidence())}")
        return found

    return once(cfg, "reference", run)


def killed_run(cfg: argparse.Namespace, tmp: Path, warm: bool) -> dict[str, Any]:
    """The sample with one worker killed (-9) at a random moment after the first checkpoint, recovered in place with
    0 steps lost. Without the warm spare the job runs to its end and must end bitwise as the run without a fault.
    With it the job is long (the spare must be ready before the training ends, on a loaded machine too), the kill
    comes once the spare is ready, and the job is stopped once every rank is past the step the victim had reached."""
    rng = random.Random(cfg.seed + warm)
    victim = rng.randrange(2)
    epochs = WARM_EPOCHS if warm else cfg.epochs
    total = epochs * SAMPLE_EPOCH
    job = LocalJob(tmp / ("warm" if warm else "cold"), 2, sample_args(cfg, epochs, cfg.step_delay),
                   job="warm" if warm else "cold", warm_spare=warm, **JOB_OPTIONS)
    try:
        job.start(worker_env(cfg))
        spare = wait_for("warm spare ready", lambda: (job.doc().get("warm_spare") or {}).get("ready")
                         and job.doc()["warm_spare"]["pid"], SPARE_BOUND, job) if warm else None
        target = max(job.last_step(victim), 4) + rng.randint(1, 3) if warm else rng.randint(5, total - 10)
        if target > total - 3:
            raise CheckFailed(f"the training was at step {target} of {total} when the warm spare was ready")
        wait_for(f"step {target} of worker_{victim}", lambda: job.last_step(victim) >= target, JOB_BOUND, job)
        time.sleep(rng.uniform(0.0, cfg.step_delay))  # a random moment of the step
        os.kill(job.procs()[f"worker_{victim}"]["pid"], signal.SIGKILL)
        killed, reached = time.monotonic(), job.last_step(victim)

        def replacement() -> str:
            parts = START.split(job.log(f"worker_{victim}.log"))
            return parts[2] if len(parts) > 2 else ""

        wait_for("first step of the replacement", lambda: STEP_LINE.search(replacement()), JOB_BOUND, job)
        first = time.monotonic() - killed
        wait_for("every rank past the step reached", lambda: all(job.last_step(r) > reached for r in range(2)),
                 JOB_BOUND, job)
        mttr = time.monotonic() - killed
        code = None if warm else job.finish(JOB_BOUND)
    finally:
        job.cleanup()
    procs = job.procs()
    resumed = [m for r in range(2) for m in RESUMED.findall(job.log(f"worker_{r}.log"))]
    problems = [what for what, bad in (
        ("the survivor was restarted", procs[f"worker_{1 - victim}"]["restarts"] != 0),
        (f"worker_{victim} restarted {procs[f'worker_{victim}']['restarts']} times",
         procs[f"worker_{victim}"]["restarts"] != 1),
        ("the replacement did not come from the warm spare", warm and procs[f"worker_{victim}"]["last_pid"] != spare),
        (f"resumed {resumed} (expected each rank once, from memory, 0 steps recomputed)",
         len(resumed) != 2 or any(src != "memory" or lost != "0" for _, src, lost in resumed)),
        (f"the agent ended the job with {code}", not warm and code != 0),
        ("the final parameters differ from the run without a fault",
         not warm and final_digest(job) != reference_digest(cfg, tmp))) if bad]
    if problems:
        raise CheckFailed("; ".join(problems))
    return {"first_step": first, "mttr": mttr, "step": reached, "victim": victim}


def once(cfg: argparse.Namespace, key: str, fn: Callable[[], Any]) -> Any:
    """fn()'s result, or the CheckFailed it raised, computed once for the checks that share it."""
    if key not in cfg.cache:
        try:
            cfg.cache[key] = fn()
        except CheckFailed as e:
            cfg.cache[key] = e
    if isinstance(cfg.cache[key], CheckFailed):
        raise cfg.cache[key]
    return cfg.cache[key]


def check_recovery(cfg: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    r = once(cfg, "cold", lambda: killed_run(cfg, tmp, warm=False))
    return ("recovered in place, 0 steps lost, bitwise",
            f"MTTR {r['mttr']:.2f} s, a cold start (worker_{r['victim']} killed at step {r['step']})")


def check_spare(cfg: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    warm = killed_run(cfg, tmp, warm=True)
    cold = once(cfg, "cold", lambda: killed_run(cfg, tmp, warm=False))
    return (f"kill -9 -> the replacement's first step; recovered in place, MTTR {warm['mttr']:.2f} s",
            f"{warm['first_step']:.2f} s with the warm spare, {cold['first_step']:.2f} s without "
            f"({warm['first_step'] / cold['first_step']:.2f}x)")


CHECK_FUNCTIONS: dict[str, Callable[[argparse.Namespace, Path], tuple[str, str]]] = {
    "checkpoint": check_checkpoint, "transfer": check_transfer, "ordered": check_ordered, "nccl": check_nccl,
    "recovery": check_recovery, "spare": check_spare}


def cannot_run(name: str, cfg: argparse.Namespace) -> str | None:
    """Why check `name` cannot run here, or None."""
    if name == "nccl" and cfg.device == "cuda" and not dist.is_nccl_available():
        return "this torch was built without NCCL"
    return None


def run_check(name: str, cfg: argparse.Namespace, tmp: Path) -> Row:
    why = cannot_run(name, cfg)
    if why is not None:
        return Row(name, "not run", "-", "-", why=why)
    t0 = time.monotonic()
    try:
        result, figure = CHECK_FUNCTIONS[name](cfg, tmp)
    except CheckFailed as e:
        return Row(name, "FAILED", str(e), "-", time.monotonic() - t0, why=str(e))
    except Exception as e:  # noqa: BLE001 - a check's own error is its result; the others still run
        first = (str(e).strip().splitlines() or [""])[0]
        return Row(name, "FAILED", f"{type(e).__name__}: {first}", "-", time.monotonic() - t0, why=first)
    return Row(name, "ok", result, figure, time.monotonic() - t0)


def show(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("path", "status", "result", "figure", "s"):
        table.add_column(column, justify="right" if column == "s" else "left")
    for r in rows:
        style = {"ok": "green", "FAILED": "bold red"}.get(r.status, "yellow")
        table.add_row(r.path, f"[{style}]{r.status}[/]", r.result if r.status != "not run" else r.why, r.figure,
                      f"{r.seconds:.1f}")
    Console(width=200).print(table)


def environment(cfg: argparse.Namespace) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if cfg.device == "cuda" else None
    return {"device": cfg.device, "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cfg.device == "cuda" else None,
            "cpus": os.cpu_count(), "size_mb": cfg.size_mb, "dry": cfg.dry}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help=f"the CPU twin: --device cpu, {DRY_MB:g} MB, short jobs")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda (cpu with --dry)")
    ap.add_argument("--size-mb", type=float, default=None, help="MB of state in checkpoint and transfer (default "
                    f"2000; {DRY_MB:g} with --dry)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps of each DDP variant (default 10; 3 dry)")
    ap.add_argument("--epochs", type=int, default=None,
                    help=f"of the sample in the local jobs, {SAMPLE_EPOCH} steps each (default 3; 2 with --dry)")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"checks to run, of {','.join(CHECKS)}")
    ap.add_argument("--json", type=Path, default=Path("gpu-check.json"), help="where the table goes as JSON")
    ap.add_argument("--seed", type=int, default=None, help="the victim's and the kill's moment's seed")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    cfg = ap.parse_args(argv)
    cfg.device = cfg.device or ("cpu" if cfg.dry else "cuda")
    cfg.size_mb = cfg.size_mb or (DRY_MB if cfg.dry else 2000.0)
    cfg.steps = cfg.steps or (3 if cfg.dry else 10)
    cfg.epochs = cfg.epochs or (2 if cfg.dry else 3)
    cfg.step_delay = 0.1 if cfg.device == "cpu" else 0.05  # s a step sleeps in the killed runs: a moment to hit
    cfg.seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(2**32)
    cfg.only = [c.strip() for c in cfg.only.split(",") if c.strip()]
    unknown = [c for c in cfg.only if c not in CHECKS]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: no such check; the checks are {','.join(CHECKS)}")
    if cfg.size_mb <= 0 or cfg.steps < 1 or cfg.epochs < 2:
        ap.error("--size-mb must be > 0, --steps >= 1 and --epochs >= 2")
    cfg.torch_device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    cfg.cache = {}
    return cfg


def main(argv: list[str]) -> int:
    cfg = parse(argv)
    if cfg.worker:
        print(json.dumps(WORKERS[cfg.worker](cfg.rank, cfg.port, json.loads(cfg.params))), flush=True)
        return 0
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False): "
              "run it on the GPU host, or `--dry` for the CPU twin", file=sys.stderr)
        return 2
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuck-", dir="/tmp") as tmp:  # short: job dirs hold Unix sockets
        rows = [run_check(name, cfg, Path(tmp)) for name in cfg.only]
    env = environment(cfg)
    total = time.monotonic() - began
    show(rows, f"toolkit GPU check: {env['gpu'] or 'CPU twin (--dry)'}, torch {env['torch']}, {total:.0f} s, "
               f"seed {cfg.seed}")
    doc = {**env, "seconds": total, "seed": cfg.seed, "checks": [asdict(r) for r in rows]}
    cfg.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"written: {cfg.json}")
    return 0 if all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
