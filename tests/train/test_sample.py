"""The sample, run as real processes: alone, and as gloo groups of 2 and 3 workers in a torchrun-style
environment that the test sets up itself (rank 0 serves the store, a fresh port per round).

The headline: a worker killed with SIGKILL at a random step, the group restarted from the newest common
checkpoint, ends with parameters bitwise equal to an uninterrupted run with the same seed.
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "train.py"
STEP_LINE = re.compile(r"^epoch: (\d+), step: (\d+), loss is (\d+\.\d+)$")
RESUMED = re.compile(r"^rank (\d+): resumed from step (\d+) ")
FINAL = re.compile(r"^final parameters: (\S+) sha256 ([0-9a-f]{64})$")
STOPPED = re.compile(r"^rank (\d+): stopped by SIGTERM at step (\d+), checkpoint saved$")
INTERVAL = 4
ARGS = ["--epochs", "2", "--ckpt-interval", str(INTERVAL), "--keep-max", "2", "--timeout", "30"]
ROUND_TIMEOUT = 240.0  # a whole round of 2-3 workers on a loaded 2-core machine; normally ~10 s
EXIT_TIMEOUT = 60.0
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "DATA_PATH", "CKPT_DIR", "TOOLKIT_HOST")
HOST_DIR = f"host_{socket.gethostname()}"  # where this machine's copy goes (one host: every rank's share)


def steps_total(world: int, batch: int = 32, epochs: int = 2, dataset: int = 1440) -> int:
    per_rank = -(-dataset // world)
    return epochs * -(-per_rank // batch)


class Worker:
    """One sample process; its stdout lines arrive on a queue so that waits are bounded event waits."""

    def __init__(self, rank: int, world: int, port: int, ckpt: Path, args: list[str], log_dir: Path,
                 host: tuple[str, int, int] | None = None) -> None:
        """`host`: (name, local rank, ranks there) of a simulated host, whose copy is kept in `ckpt`; else every
        rank on this machine's."""
        env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
        env.update(CKPT_DIR=str(ckpt), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if world > 1:
            name, local, there = host or ("", rank, world)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(there), **({"TOOLKIT_HOST": name} if name else {}))
        self.rank = rank
        self.stderr_path = log_dir / f"rank{rank}-{port}.err"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(SAMPLE), *args], env=env, stdout=subprocess.PIPE,
                                         stderr=err, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for_step(self, step: int, timeout: float) -> int:
        """Block until the worker prints a step >= ``step``; the step it printed."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"rank {self.rank} did not reach step {step} in {timeout} s")
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"rank {self.rank} exited before step {step}: {self.stderr()}")
            m = STEP_LINE.match(line)
            if m and int(m.group(2)) >= step:
                return int(m.group(2))

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"rank {self.rank} still running after {timeout} s: {self.stderr()}") from None
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-3000:]

    def matches(self, pattern: re.Pattern) -> list[re.Match]:
        return [m for m in map(pattern.match, self.lines) if m]


def start_group(world: int, port: int, ckpt: Path, args: list[str], log_dir: Path) -> list[Worker]:
    return [Worker(r, world, port, ckpt, args, log_dir) for r in range(world)]


def stop_all(workers: list[Worker]) -> None:
    for w in workers:
        w.kill()


def finish_ok(workers: list[Worker]) -> None:
    try:
        for w in workers:
            code = w.wait(ROUND_TIMEOUT)
            assert code == 0, f"rank {w.rank} exited {code}: {w.stderr()}"
    finally:
        stop_all(workers)


def final_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_bitwise_equal(a: Path, b: Path) -> None:
    pa, pb = final_params(a), final_params(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape
        assert pa[k].numpy().tobytes() == pb[k].numpy().tobytes(), f"{k} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, new_port):
    """Final parameters of one uninterrupted run per world size (computed once, used by several tests)."""
    runs: dict[int, tuple[Path, str]] = {}

    def get(world: int) -> tuple[Path, str]:
        if world not in runs:
            d = tmp_path_factory.mktemp(f"reference{world}")
            workers = start_group(world, new_port(), d / "ckpt", ARGS, d)
            finish_ok(workers)
            (m,) = workers[0].matches(FINAL)
            runs[world] = (Path(m.group(1)), m.group(2))
            assert len(workers[0].matches(STEP_LINE)) == steps_total(world)
        return runs[world]

    return get


# --- alone ----------------------------------------------------------------------------------------------------


def test_runs_alone_and_a_second_run_resumes_the_finished_job(tmp_path):
    args = ["--epochs", "1", "--ckpt-interval", "10"]
    w = Worker(0, 1, 0, tmp_path / "ckpt", args, tmp_path)
    assert w.wait(ROUND_TIMEOUT) == 0, w.stderr()
    steps = w.matches(STEP_LINE)
    assert [int(m.group(2)) for m in steps] == list(range(1, 46))  # 1440 / 32 = 45 steps, world size 1
    assert {m.group(1) for m in steps} == {"0"}
    assert float(steps[-1].group(3)) < float(steps[0].group(3)), "the loss should go down on real digits"
    (final,) = w.matches(FINAL)
    assert Path(final.group(1)) == tmp_path / "ckpt" / "final.pt"
    assert sorted(p.name for p in (tmp_path / "ckpt" / HOST_DIR).iterdir()) == [
        "step_000000000030.p0of1.ckpt", "step_000000000040.p0of1.ckpt", "step_000000000045.p0of1.ckpt"]

    again = Worker(0, 1, 0, tmp_path / "ckpt", args, tmp_path)
    assert again.wait(ROUND_TIMEOUT) == 0, again.stderr()
    assert again.matches(RESUMED)[0].group(2) == "45"
    assert not again.matches(STEP_LINE)
    assert again.matches(FINAL)[0].group(2) == final.group(2)


def test_a_full_disk_costs_the_checkpoints_not_the_run(tiny_tmpfs, tmp_path):
    """CKPT_DIR on a disk too small for one checkpoint (a 256 KiB tmpfs, a checkpoint is ~0.3 MB): the run trains
    to its end, says once that checkpoints are skipped, and writes its final parameters (~0.2 MB fit)."""
    w = Worker(0, 1, 0, tiny_tmpfs / "ckpt", ["--epochs", "1", "--ckpt-interval", "10"], tmp_path)
    assert w.wait(ROUND_TIMEOUT) == 0, w.stderr()
    assert [int(m.group(2)) for m in w.matches(STEP_LINE)] == list(range(1, 46))
    skipped = [line for line in w.stderr().splitlines() if "skipped" in line]
    assert len(skipped) == 1 and "no space left on device" in skipped[0] and "training goes on" in skipped[0], \
        w.stderr()
    assert not list((tiny_tmpfs / "ckpt" / HOST_DIR).glob("*.ckpt")), "the disk was meant to be too small"
    assert w.matches(FINAL)


def test_a_missing_dataset_is_one_line_and_exit_2(tmp_path):
    env_path = tmp_path / "nowhere"
    proc = subprocess.run([sys.executable, str(SAMPLE)], capture_output=True, text=True, timeout=EXIT_TIMEOUT,
                          env={**{k: v for k, v in os.environ.items() if k not in DIST_VARS},
                               "DATA_PATH": str(env_path), "CKPT_DIR": str(tmp_path / "ckpt")})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(env_path) in lines[0] and "DATA_PATH" in lines[0], proc.stderr


# --- the headline ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_kill9_at_a_random_step_then_restart_is_bitwise_equal_to_an_uninterrupted_run(
        tmp_path, world, reference, new_port):
    ref_path, ref_digest = reference(world)
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    total = steps_total(world)
    target = rng.randint(2 * INTERVAL + 1, total - 4)
    victim = rng.randrange(world)
    why = f"(seed {seed}: world {world}, kill rank {victim} at step >= {target} of {total})"

    ckpt = tmp_path / "ckpt"
    workers = start_group(world, new_port(), ckpt, ARGS + ["--step-delay", "0.05"], tmp_path)
    try:
        workers[victim].wait_for_step(target, ROUND_TIMEOUT)
        time.sleep(rng.uniform(0, 0.05))  # anywhere inside the step: compute, checkpoint write, or idle
        workers[victim].proc.send_signal(signal.SIGKILL)
        assert workers[victim].wait(EXIT_TIMEOUT) == -signal.SIGKILL, why
        for w in workers:
            if w.rank != victim:
                assert w.wait(EXIT_TIMEOUT) == 1, f"survivor rank {w.rank} {why}: {w.stderr()}"
                assert "collective failed, a peer is gone" in w.stderr(), why
    finally:
        stop_all(workers)
    killed_at = max(int(m.group(2)) for m in workers[victim].matches(STEP_LINE))

    again = start_group(world, new_port(), ckpt, ARGS, tmp_path)
    finish_ok(again)
    resumed = {int(w.matches(RESUMED)[0].group(2)) for w in again}
    assert len(resumed) == 1, f"ranks resumed from different steps {resumed} {why}"
    (step,) = resumed
    assert INTERVAL <= step <= killed_at and step % INTERVAL == 0, why
    first_step = min(int(m.group(2)) for m in again[0].matches(STEP_LINE))
    assert first_step == step + 1, why

    (final,) = again[0].matches(FINAL)
    assert final.group(2) == ref_digest, f"final parameters differ from the uninterrupted run {why}"
    assert_bitwise_equal(Path(final.group(1)), ref_path)


def test_sigterm_saves_the_same_last_step_on_every_rank_and_resumes_bitwise(tmp_path, reference, new_port):
    world = 2
    ref_path, ref_digest = reference(world)
    rng = random.Random()
    target = rng.randint(INTERVAL + 1, steps_total(world) - 4)
    ckpt = tmp_path / "ckpt"
    workers = start_group(world, new_port(), ckpt, ARGS + ["--step-delay", "0.05"], tmp_path)
    try:
        workers[1].wait_for_step(target, ROUND_TIMEOUT)
        workers[1].proc.send_signal(signal.SIGTERM)  # one rank only: the others must stop with it
        for w in workers:
            assert w.wait(EXIT_TIMEOUT) == 0, w.stderr()
    finally:
        stop_all(workers)
    stops = {int(w.matches(STOPPED)[0].group(2)) for w in workers}
    assert len(stops) == 1, f"ranks stopped at different steps: {stops}"
    (last,) = stops
    for r in range(world):  # one copy on this host, each rank wrote its share
        assert (ckpt / HOST_DIR / f"step_{last:012d}.p{r}of{world}.ckpt").is_file()

    again = start_group(world, new_port(), ckpt, ARGS, tmp_path)
    finish_ok(again)
    assert {int(w.matches(RESUMED)[0].group(2)) for w in again} == {last}
    (final,) = again[0].matches(FINAL)
    assert final.group(2) == ref_digest
    assert_bitwise_equal(Path(final.group(1)), ref_path)


def test_a_whole_job_restart_resumes_every_rank_from_another_hosts_copy_bitwise(tmp_path, reference, new_port):
    """Four ranks on three simulated hosts (a: ranks 0 and 1, b: rank 2, c: rank 3), each host with its own
    checkpoint directory, as on machines with local disks. Stopped by SIGTERM (every rank saves the same step),
    then host a's copy of that step is damaged (one of its two parts) and host b's is gone: every rank on a and b
    resumes from host c's copy, and the run ends bitwise equal to an uninterrupted one."""
    world = 4
    ref_path, ref_digest = reference(world)
    layout = [("a", 0, 2), ("a", 1, 2), ("b", 0, 1), ("c", 0, 1)]
    dirs = {name: tmp_path / f"disk-{name}" for name in "abc"}

    def group(args: list[str]) -> list[Worker]:
        port = new_port()
        return [Worker(r, world, port, dirs[h[0]], args, tmp_path, host=h) for r, h in enumerate(layout)]

    workers = group(ARGS + ["--step-delay", "0.05"])
    try:
        workers[0].wait_for_step(random.randint(INTERVAL + 1, steps_total(world) - 4), ROUND_TIMEOUT)
        workers[0].proc.send_signal(signal.SIGTERM)
        for w in workers:
            assert w.wait(EXIT_TIMEOUT) == 0, w.stderr()
    finally:
        stop_all(workers)
    (last,) = {int(w.matches(STOPPED)[0].group(2)) for w in workers}
    a_part = dirs["a"] / "host_a" / f"step_{last:012d}.p1of2.ckpt"
    blob = bytearray(a_part.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    a_part.write_bytes(bytes(blob))
    b_copy = dirs["b"] / "host_b" / f"step_{last:012d}.p0of1.ckpt"
    b_copy.unlink()
    assert (dirs["c"] / "host_c" / f"step_{last:012d}.p0of1.ckpt").is_file()

    again = group(ARGS)
    finish_ok(again)
    for w in again:
        (line,) = [x for x in w.lines if RESUMED.match(x)]
        assert f"resumed from step {last} " in line and "out of rank 3's checkpoint" in line, line
    assert a_part.name in again[1].stderr() and "fails authentication" in again[1].stderr()
    (final,) = again[0].matches(FINAL)
    assert final.group(2) == ref_digest
    assert_bitwise_equal(Path(final.group(1)), ref_path)
