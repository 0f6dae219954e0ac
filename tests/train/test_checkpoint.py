"""Checkpoints on real files: atomic commit under a real SIGKILL, verification and fallback, keep_max, a really
full disk and a read-only mount, the asynchronous writer, and the rollback agreement in real gloo groups."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.train import checkpoint
from toolkit.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpoint,
    agree_on_step,
    newest_common_step,
)

HERE = Path(__file__).resolve().parent
PROC_TIMEOUT = 60


def state_of(step: int, n: int = 1000) -> dict:
    return {"step": step, "w": torch.full((n,), float(step)), "opt": {"m": [torch.arange(3.0) * step]}}


def assert_state(state: dict, step: int, n: int = 1000) -> None:
    assert state["step"] == step
    assert torch.equal(state["w"], torch.full((n,), float(step)))
    assert torch.equal(state["opt"]["m"][0], torch.arange(3.0) * step)


# --- format and verification ----------------------------------------------------------------------------------


@pytest.mark.parametrize("async_write", [False, True])
def test_round_trip_keeps_every_tensor_and_value(tmp_path, async_write):
    with CheckpointManager(tmp_path / "rank_0", keep_max=2, async_write=async_write) as m:
        m.save(7, state_of(7))
        m.flush()
        assert_state(m.load(7), 7)
        assert m.scan().intact == (7,)
    assert (tmp_path / "rank_0" / "step_000000000007.ckpt").is_file()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_truncation_or_flipped_byte_is_caught(data):
    blob = checkpoint.encode(3, state_of(3, n=50))
    cut = data.draw(st.integers(0, len(blob) - 1), label="truncate at")
    assert checkpoint.verify_bytes(blob[:cut], 3) is not None
    pos = data.draw(st.integers(0, len(blob) - 1), label="flip at")
    bit = data.draw(st.integers(0, 7), label="bit")
    flipped = bytearray(blob)
    flipped[pos] ^= 1 << bit
    assert checkpoint.verify_bytes(bytes(flipped), 3) is not None
    assert checkpoint.verify_bytes(blob, 3) is None


def test_a_file_renamed_to_another_step_does_not_verify(tmp_path):
    with CheckpointManager(tmp_path, keep_max=3) as m:
        m.save(1, state_of(1))
        os.replace(m.path_for(1), m.path_for(2))
        with pytest.raises(CorruptCheckpoint, match="holds step 1, not the step 2"):
            m.load(2)


# --- atomic commit: a real crash between write and rename -------------------------------------------------------

CRASH_BEFORE_RENAME = textwrap.dedent("""
    import os, signal, sys, torch
    from toolkit.train.checkpoint import CheckpointManager
    m = CheckpointManager(sys.argv[1], keep_max=2, async_write=sys.argv[2] == "async")
    os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)   # die after write+fsync, before rename
    m.save(2, {"step": 2, "w": torch.full((1000,), 2.0), "opt": {"m": [torch.arange(3.0) * 2]}})
    m.flush()
    print("survived", flush=True)
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_between_write_and_rename_leaves_the_old_checkpoint_valid(tmp_path, mode):
    with CheckpointManager(tmp_path, keep_max=2) as m:
        m.save(1, state_of(1))
    proc = subprocess.run([sys.executable, "-c", CRASH_BEFORE_RENAME, str(tmp_path), mode],
                          capture_output=True, text=True, timeout=PROC_TIMEOUT)
    assert proc.returncode == -9, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(checkpoint.TMP_PREFIX)]
    assert len(leftovers) == 1, "the crash should have left the fully written temp file behind"
    with CheckpointManager(tmp_path, keep_max=2) as m:
        assert m.steps_on_disk() == [1]
        found = m.load_latest()
        assert found is not None and found[0] == 1
        assert_state(found[1], 1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(checkpoint.TMP_PREFIX)], "stale temp kept"


# --- fallback -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_newest_is_reported_and_the_previous_one_used(tmp_path, damage, caplog):
    with CheckpointManager(tmp_path, keep_max=3) as m:
        for step in (10, 20, 30):
            m.save(step, state_of(step))
    newest = tmp_path / "step_000000000030.ckpt"
    blob = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        newest.write_bytes(blob[:-100] + bytes([blob[-100] ^ 0x40]) + blob[-99:])
    else:
        newest.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="toolkit.train.checkpoint"):
        m = CheckpointManager(tmp_path, keep_max=3)
        found = m.load_latest()
        scan = m.scan()
    assert found is not None and found[0] == 20
    assert_state(found[1], 20)
    assert scan.intact == (10, 20) and [d.path for d in scan.damaged] == [newest]
    assert str(newest) in caplog.text
    assert ("truncated" if damage != "flip" else "sha256") in scan.damaged[0].reason


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    with CheckpointManager(tmp_path / "new", keep_max=2) as m:
        assert m.load_latest() is None
        found = checkpoint.resume(m)
    assert found.step is None and found.state is None


def test_resume_discards_checkpoints_newer_than_the_agreed_step(tmp_path):
    with CheckpointManager(tmp_path, keep_max=5) as m:
        for s in (1, 2, 3):
            m.save(s, state_of(s))
        assert m.discard_after(2) == [3]
        assert m.steps_on_disk() == [1, 2]
        assert m.discard_after(None) == [1, 2]
        assert m.steps_on_disk() == []


# --- keep_max ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_write", [False, True])
@pytest.mark.parametrize("keep_max", [2, 3, 5])
def test_keep_max_newest_are_kept(tmp_path, keep_max, async_write):
    with CheckpointManager(tmp_path, keep_max=keep_max, async_write=async_write) as m:
        for step in range(1, 9):
            m.save(step, state_of(step, n=10))
            m.flush()
            assert len(m.steps_on_disk()) <= keep_max
    assert m.steps_on_disk() == list(range(9 - keep_max, 9))
    assert all(m.verify(s) is None for s in m.steps_on_disk())


def test_keep_max_below_two_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="keep_max must be >= 2.*nothing to fall back to"):
        CheckpointManager(tmp_path, keep_max=1)


# --- full disk, read-only disk ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_write", [False, True])
def test_disk_full_is_one_clear_error_and_the_previous_checkpoint_stays(tiny_tmpfs, async_write):
    d = tiny_tmpfs / "rank_0"
    m = CheckpointManager(d, keep_max=2, async_write=async_write)
    m.save(1, state_of(1, n=1000))  # ~5 KB
    m.flush()
    before = m.path_for(1).read_bytes()
    with pytest.raises(CheckpointError) as e:
        m.save(2, state_of(2, n=200_000))  # ~800 KB on a 256 KiB disk
        m.flush()
    msg = str(e.value)
    assert "\n" not in msg
    assert str(d) in msg and "no space left on device" in msg and "CKPT_DIR" in msg and "untouched" in msg
    assert m.path_for(1).read_bytes() == before
    assert m.steps_on_disk() == [1] and m.verify(1) is None
    assert not [p for p in d.iterdir() if p.name.startswith(checkpoint.TMP_PREFIX)], "temp file left on full disk"
    m.save(3, state_of(3, n=1000))  # the disk has room again for a small one: the manager goes on
    m.close()
    assert m.steps_on_disk() == [1, 3]


def test_read_only_directory_is_one_clear_error_and_nothing_changes(tiny_tmpfs):
    d = tiny_tmpfs / "rank_0"
    with CheckpointManager(d, keep_max=2) as m:
        m.save(1, state_of(1))
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True, timeout=30)
    with pytest.raises(CheckpointError) as e:
        m.save(2, state_of(2))
    assert "read-only file system" in str(e.value) and str(d) in str(e.value)
    with pytest.raises(CheckpointError, match="read-only file system.*CKPT_DIR"):
        CheckpointManager(d, keep_max=2)
    assert m.steps_on_disk() == [1] and m.verify(1) is None


# --- asynchronous writer -------------------------------------------------------------------------------------------


def test_async_snapshot_is_a_copy_not_an_alias(tmp_path):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    with CheckpointManager(tmp_path, keep_max=2, async_write=True) as m:
        m.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        with torch.no_grad():  # the training loop goes on at once and changes the live tensors in place
            for p in model.parameters():
                p.add_(1000.0)
        opt.state[model.weight]["momentum_buffer"].mul_(-1)
        m.flush()
        loaded = m.load(1)
    for k, v in expect.items():
        assert torch.equal(loaded["model"][k], v)
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum_buffer"], momentum)


def test_snapshot_clones_every_tensor():
    live = {"a": torch.ones(3), "b": [torch.zeros(2), (torch.ones(1), 5)], "c": "x"}
    snap = checkpoint.snapshot(live)
    assert snap["b"][1][1] == 5 and snap["c"] == "x"
    for x, y in [(live["a"], snap["a"]), (live["b"][0], snap["b"][0]), (live["b"][1][0], snap["b"][1][0])]:
        assert torch.equal(x, y) and x.data_ptr() != y.data_ptr()


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    torch.rand(5), random.random(), np.random.rand(2)
    saved = checkpoint.capture_rng_state()
    expect = (torch.rand(4), random.random(), np.random.rand(3))
    with CheckpointManager(tmp_path, keep_max=2) as m:
        m.save(1, {"rng": saved})
        restored = m.load(1)["rng"]
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    checkpoint.restore_rng_state(restored)
    got = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(got[0], expect[0]) and got[1] == expect[1] and np.array_equal(got[2], expect[2])


# --- rollback agreement ---------------------------------------------------------------------------------------------


def test_newest_common_step():
    assert newest_common_step([[10, 20, 30], [10, 20], [20, 30]]) == 20
    assert newest_common_step([[10, 20], []]) is None
    assert newest_common_step([]) is None
    assert newest_common_step([[5, 7]]) == 7
    assert agree_on_step([3, 1]) == 3  # no process group: this process alone


def run_group(root: Path, world: int, port: int) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, str(HERE / "agree_worker.py"), str(r), str(world), str(port),
                               str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=PROC_TIMEOUT)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


def make_ranks(root: Path, steps_per_rank: list[list[int]]) -> None:
    for r, steps in enumerate(steps_per_rank):
        with CheckpointManager(root / f"rank_{r}", keep_max=5) as m:
            for s in steps:
                m.save(s, state_of(s, n=10))


def test_three_ranks_agree_on_the_newest_step_all_have_intact(tmp_path, new_port):
    make_ranks(tmp_path, [[10, 20, 30], [10, 20, 30], [10, 20]])
    newest = tmp_path / "rank_1" / "step_000000000030.ckpt"
    newest.write_bytes(newest.read_bytes()[:-7])  # rank 1 has 30 but truncated; rank 2 never wrote it
    results = run_group(tmp_path, 3, new_port())
    assert [r["step"] for r in results] == [20, 20, 20]
    assert [r["loaded"] for r in results] == [20, 20, 20]
    assert results[1]["damaged"] == ["step_000000000030.ckpt"]
    assert results[0]["discarded"] == [30] and results[2]["discarded"] == []
    assert [r["left"] for r in results] == [[10, 20]] * 3


def test_a_rank_with_no_checkpoint_makes_everyone_start_fresh(tmp_path, new_port):
    make_ranks(tmp_path, [[5, 10], []])
    results = run_group(tmp_path, 2, new_port())
    assert [r["step"] for r in results] == [None, None]
    assert [r["left"] for r in results] == [[], []], "files of the abandoned timeline must go"
