"""Sharded state (FSDP2 over gloo on CPU, world 4 on two simulated hosts of two ranks): its checkpoints
(toolkit.train.ckpt.shards) and its redundancy in memory (toolkit.train.shardmirror), with real processes.

- A whole-job kill -9 at a random moment, then a restart from the per-host shards: the run goes on from the newest
  checkpoint every rank holds and ends bitwise equal to an uninterrupted run.
- A restart at another world size is refused in one line, on every rank, touching nothing.
- The shard mirror: a rank's shard wiped after a random step (a replacement's state) is taken back from the copy
  another host's rank keeps; every rank goes back to the copy's step and redoes the steps since (at most K), and
  the run ends bitwise equal to the uninterrupted one.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from toolkit.freeports import free_port
from toolkit.testing.localjob import clean_env
from toolkit.train.ckpt.manager import Placement
from toolkit.train.ckpt.shards import Manifest, ShardCheckpoints, ShardName, decide
from toolkit.train.faults import CheckpointError
from toolkit.train.shardmirror import ShardMirror, choose_every, holder_of, kept_by, ring_problem, rollback_step

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "fsdp_shard_worker.py"
RUN_TIMEOUT = 240.0  # s for one run of 4 ranks on a loaded 2-core machine; normally ~10 s
POLL = 0.05  # s between looks at the checkpoint directory: no event tells that a file was renamed in
STEPS = 24

pytestmark = pytest.mark.timeout(900)


def start(tmp: Path, name: str, *args: str, world: int = 4, per_host: int = 2) -> list[subprocess.Popen[str]]:
    out = tmp / name
    out.mkdir(exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**clean_env(), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_host),
               "LOCAL_WORLD_SIZE": str(per_host), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TOOLKIT_HOST": f"host{rank // per_host}", "XDG_CONFIG_HOME": str(tmp / "config"),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "--out", str(out), "--steps", str(STEPS), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen[str]], code: int = 0) -> list[str]:
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=RUN_TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == code, f"rank {rank} exited {p.returncode}:\n{text[-3000:]}"
    return outputs


def finals(tmp: Path, name: str, world: int = 4) -> list[list[torch.Tensor]]:
    return [torch.load(tmp / name / f"final_{r}.pt", weights_only=True) for r in range(world)]


def assert_bitwise(want: list[list[torch.Tensor]], got: list[list[torch.Tensor]], why: str) -> None:
    for rank, (a, b) in enumerate(zip(want, got, strict=True)):
        assert len(a) == len(b), f"rank {rank}: {why}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x.detach().numpy().tobytes() == y.detach().numpy().tobytes(), f"rank {rank} tensor {i} differs {why}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[list[torch.Tensor]]:
    """The uninterrupted run, shared by the tests."""
    tmp = tmp_path_factory.mktemp("ref")
    finish(start(tmp, "whole"))
    return finals(tmp, "whole")


def newest_complete(root: Path, world: int = 4) -> int:
    found: dict[int, int] = {}
    for f in root.glob("host_*/step_*.ckpt"):
        name = ShardName.parse(f.name)
        if name is not None and name.parts == world:
            found[name.step] = found.get(name.step, 0) + 1
    return max((s for s, n in found.items() if n == world), default=0)


def test_a_whole_job_killed_at_a_random_moment_restarts_from_its_shards_bitwise(
        tmp_path: Path, reference: list[list[torch.Tensor]]) -> None:
    ckpt = tmp_path / "ckpt"
    flags = ("--ckpt-dir", str(ckpt), "--ckpt-every", "4", "--stall", "0.1")
    procs = start(tmp_path, "cut", *flags)
    target = random.Random().choice([4, 8, 12])
    deadline = time.monotonic() + RUN_TIMEOUT
    while newest_complete(ckpt) < target:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint came"
        time.sleep(POLL)
    time.sleep(random.Random().uniform(0, 0.5))  # anywhere in the steps after it, a write in flight or not
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
    finish(procs, -signal.SIGKILL)
    saved = newest_complete(ckpt)
    assert target <= saved < STEPS, "the kill took effect before the end"
    assert sorted(d.name for d in ckpt.iterdir() if d.is_dir()) == ["host_host0", "host_host1"]
    outputs = finish(start(tmp_path, "cut", *flags))
    for rank, text in enumerate(outputs):
        assert f"resumed from step {saved}\n" in text, f"rank {rank}:\n{text[-2000:]}"
        assert f"done step {STEPS}" in text
    assert_bitwise(reference, finals(tmp_path, "cut"), f"(killed after step {saved}'s checkpoint)")

    # the same directory at another world size: one line, on every rank, and nothing touched
    before = {p.name for p in ckpt.rglob("*")}
    outputs = finish(start(tmp_path, "two", "--ckpt-dir", str(ckpt), world=2, per_host=1), code=3)
    for text in outputs:
        lines = [line for line in text.splitlines() if line.startswith("refused:")]
        assert len(lines) == 1, text[-2000:]
        assert re.search(rf"holds the sharded checkpoint of step {STEPS} of a world of 4; this run is a world of 2 "
                         r"on a \(2,\) mesh: .* restart with 4 workers", lines[0]), lines[0]
    assert all(p.name in before for p in ckpt.rglob("*")), "the refusal changed the directory"


def test_the_restart_decision() -> None:
    layout = Manifest(4, (2, 2))
    assert decide([[0, -1, 8, 4, -1]] * 4, layout, "d") == 8
    assert decide([[0, -1, 8, 4], [0, -1, 4, -1], [0, -1, 8, 4], [0, -1, 8, 4]], layout, "d") == 4
    assert decide([[0, -1, -1]] * 4, layout, "d") is None
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] hold none"):
        decide([[0, -1, 8], [0, -1, -1], [0, -1, 8], [0, -1, 8]], layout, "d")
    with pytest.raises(CheckpointError, match="of a world of 8; this run is a world of 4 on a \\(2, 2\\) mesh"):
        decide([[0, -1, 4], [8, 12, 4], [0, -1, 4], [0, -1, 4]], layout, "d")


def test_a_shard_of_another_mesh_shape_is_refused_at_the_load(tmp_path: Path) -> None:
    key = b"k" * 32
    flat = ShardCheckpoints(tmp_path, 0, Manifest(4, (4,)), key=key, async_write=False, placement=Placement("a"))
    flat.save(3, {"w": torch.ones(2)})
    hsdp = ShardCheckpoints(tmp_path, 0, Manifest(4, (2, 2)), key=key, async_write=False, placement=flat.placement)
    assert hsdp.agree() == 3
    with pytest.raises(CheckpointError, match=r"sharded on a world of 4 on a \(4,\) mesh, this run is a world of 4 "
                                              r"on a \(2, 2\) mesh"):
        hsdp.load(3)
    assert flat.load(3)["w"].tolist() == [1.0, 1.0]


def test_a_lost_shard_comes_back_from_another_hosts_copy_bitwise(
        tmp_path: Path, reference: list[list[torch.Tensor]]) -> None:
    rng = random.Random()
    every, victim = 4, rng.randrange(4)
    lose_at = rng.randint(every + 1, STEPS - 2)
    outputs = finish(start(tmp_path, "mirror", "--mirror", str(every), "--lose", str(victim), "--lose-at",
                           str(lose_at)))
    why = f"(rank {victim} lost after step {lose_at}, refresh every {every})"
    for text in outputs:
        found = re.findall(r"^rolled back to step (\d+), (\d+) step\(s\) redone$", text, re.M)
        assert len(found) == 1, text[-2000:]
        back, redone = map(int, found[0])
        assert back == lose_at - lose_at % every and redone <= every, why
    assert_bitwise(reference, finals(tmp_path, "mirror"), why)


# --- in one process: the files, the ring, the interval ------------------------------------------------------------


def test_a_damaged_shard_is_refused_and_the_restart_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    ckpt = ShardCheckpoints(tmp_path, 0, Manifest(1, (1,)), key=b"k" * 32, placement=Placement("a"))
    for step in (4, 8):
        ckpt.save(step, {"w": torch.full((64,), float(step)), "step": step})
    ckpt.close()
    newest = tmp_path / "host_a" / ShardName(8, 0, 1).name
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0x10
    newest.write_bytes(bytes(data))
    again = ShardCheckpoints(tmp_path, 0, Manifest(1, (1,)), key=b"k" * 32, placement=Placement("a"))
    assert again.agree() == 4
    assert again.load(4)["w"][0].item() == 4.0
    assert (tmp_path / "host_a" / "refused" / newest.name).exists() and not newest.exists()


def test_a_full_disk_skips_the_sharded_checkpoint_and_training_goes_on(tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "ckpt"
    ckpt = ShardCheckpoints(root, 0, Manifest(1, (1,)), key=b"k" * 32, placement=Placement("a"))
    ckpt.save(1, {"w": torch.zeros(1 << 17)})  # 512 KB into 256 KB
    ckpt.flush()  # no error: skipped
    assert ckpt.skipped == 1 and not list((root / "host_a").glob("*step_*"))
    ckpt.save(2, {"w": torch.zeros(16)})
    ckpt.close()
    assert ckpt.skipped == 0 and ckpt.agree() == 2


def test_the_ring_keeps_each_copy_on_another_host_and_knows_when_it_cannot() -> None:
    for world, per_host in ((4, 2), (8, 2), (16, 8), (6, 3)):
        for r in range(world):
            assert holder_of(r, world, per_host) // per_host != r // per_host
            assert kept_by(holder_of(r, world, per_host), world, per_host) == r
    assert "one host" in ring_problem(4, 4)
    held = [[4, 8], [8], [4, 8], [4, 8]]
    assert rollback_step(held, [1], 4, 2) == 8  # the lost rank's own list does not count
    assert rollback_step([[4], [4, 8], [4, 8], [4, 8]], [2], 4, 2) == 4  # the newest every survivor holds
    assert rollback_step(held, [0, 2], 4, 2) is None  # 0 keeps 2's copy and 2 keeps 0's: both gone
    assert rollback_step(held, [0, 1], 4, 2) == 8  # a whole host lost: its copies are on the other one
    assert choose_every(0.05, 0.1) == 17 and choose_every(0.001, 1.0) == 1
    short = ShardMirror(0, 4, 2, 100 << 20, available=500 << 20)
    assert not short.enabled and not short.due(10)
    assert short.why_not == ("the copies need 0.84 GB of host memory (4 x 104.9 MB for each of 2 ranks), 0.52 GB "
                             "is available")
