"""Checkpoints on real files: one copy per host split between its ranks, authentication, atomic commit under a real
SIGKILL, verification and fallback, keep_max, a really full disk and a read-only mount, the asynchronous writer and
its staging, and the restart agreement in real gloo groups of simulated hosts."""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.contracts import ckptkey
from toolkit.train.ckpt import manager as checkpoint
from toolkit.train.ckpt import partfile
from toolkit.train.ckpt import parts as ckptparts
from toolkit.train.ckpt.manager import CheckpointManager, Choice, Placement, choose
from toolkit.train.ckpt.partfile import PartName
from toolkit.train.faults import BadPart, CheckpointError, CorruptCheckpoint

HERE = Path(__file__).resolve().parent
PROC_TIMEOUT = 60
KEY = b"agreement test key, 32 bytes!!!!"  # the agreement worker's (tests/train/agree_worker.py)


def manager(root: Path, host: str = "a", local_rank: int = 0, local_world: int = 1, **kw) -> CheckpointManager:
    return CheckpointManager(root, kw.pop("keep_max", 2), placement=Placement(host, local_rank, local_world),
                             key=kw.pop("key", KEY), **kw)


def state_of(step: int, n: int = 1000) -> dict:
    return {"step": step, "w": torch.full((n,), float(step)), "opt": {"m": [torch.arange(3.0) * step]}}


def assert_state(state: dict, step: int, n: int = 1000) -> None:
    assert state["step"] == step
    assert torch.equal(state["w"], torch.full((n,), float(step)))
    assert torch.equal(state["opt"]["m"][0], torch.arange(3.0) * step)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_file())


# --- format, authentication, verification ------------------------------------------------------------------------


@pytest.mark.parametrize("async_write", [False, True])
def test_round_trip_keeps_every_tensor_and_value(tmp_path, async_write):
    with manager(tmp_path, async_write=async_write) as m:
        m.save(7, state_of(7))
        m.flush()
        assert_state(m.load(7), 7)
        assert m.scan().intact == (7,)
    assert files(tmp_path / "host_a") == ["step_000000000007.p0of1.ckpt"]
    assert oct((tmp_path / "host_a" / "step_000000000007.p0of1.ckpt").stat().st_mode & 0o777) == "0o600"


@cache
def one_part() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            partfile.write_part(fd, PartName(3, 0, 1), state_of(3, n=50), KEY)
        finally:
            os.close(fd)
        return (Path(d) / PartName(3, 0, 1).name).read_bytes()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_truncation_or_flipped_byte_is_caught(data):
    blob, name = one_part(), PartName(3, 0, 1)
    cut = data.draw(st.integers(0, len(blob) - 1), label="truncate at")
    with pytest.raises(BadPart):
        partfile.verify(memoryview(blob[:cut]), name, KEY)
    pos = data.draw(st.integers(0, len(blob) - 1), label="flip at")
    flipped = bytearray(blob)
    flipped[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with pytest.raises(BadPart):
        partfile.verify(memoryview(bytes(flipped)), name, KEY)
    assert partfile.verify(memoryview(blob), name, KEY) is not None


def test_a_restore_reads_the_file_into_the_tensors_without_a_copy_of_it_in_memory(tmp_path):
    """A restore holds the state once: the file is authenticated through one small buffer and loaded from the open
    file into the tensors' storage; no buffer the size of the file (read whole, then copied into a BytesIO, it
    took 3x the state). Python's own allocations (tracemalloc) are where such a copy would be."""
    import tracemalloc
    n = 4_000_000  # 16 MB of float32
    with manager(tmp_path) as m:
        m.save(1, state_of(1, n=n))
    tracemalloc.start()
    try:
        state = m.load(1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_state(state, 1, n=n)
    assert peak < n * 4 / 4, f"{peak} bytes allocated while loading a {n * 4}-byte state"


def test_a_file_of_another_key_or_renamed_does_not_verify():
    blob = memoryview(one_part())
    with pytest.raises(BadPart, match="fails authentication"):
        partfile.verify(blob, PartName(3, 0, 1), b"another key of thirty-two bytes!")
    with pytest.raises(BadPart, match="holds step 3 part 0 of 1, not what its name says"):
        partfile.verify(blob, PartName(4, 0, 1), KEY)


def test_a_refused_file_never_overwrites_one_refused_before(tmp_path):
    """Two files refused under the same name (a damaged copy, then another one a later run finds): refused/ keeps
    both, byte for byte: refused files are moved aside, never deleted."""
    with manager(tmp_path) as m:
        m.save(1, state_of(1))
        m.save(2, state_of(2))
    planted = []
    for attempt in range(3):
        fd = os.open(m.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            partfile.write_part(fd, PartName(9, 0, 1), state_of(attempt), b"another key of thirty-two bytes!")
        finally:
            os.close(fd)
        planted.append((m.directory / PartName(9, 0, 1).name).read_bytes())
        assert m.agree() == Choice(2, 0)
    refused = m.directory / "refused"
    name = PartName(9, 0, 1).name
    assert sorted(p.name for p in refused.iterdir()) == [name, f"{name}.1", f"{name}.2"]
    assert [(refused / n).read_bytes() for n in (name, f"{name}.1", f"{name}.2")] == planted


def snapshot_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_job_given_the_same_directory_is_refused_in_one_line_and_touches_nothing(tmp_path):
    """Two jobs (two keys) sharing a checkpoint root: the second is refused when its manager is made, naming the
    directory and what to do; the first's files stay as they were (nothing moved to refused/, nothing pruned), and
    the first goes on from them."""
    with manager(tmp_path) as first:
        for step in (1, 2, 3):
            first.save(step, state_of(step))
    before = snapshot_files(tmp_path)
    assert (tmp_path / "key-id").read_text().strip() == ckptkey.key_id(KEY)
    for host in ("a", "b"):  # its own host's directory or the first's: the root is refused either way
        with pytest.raises(CheckpointError) as e:
            manager(tmp_path, host=host, key=b"the other job's key, 32 bytes!!!")
        msg = one_line(e)
        assert f"checkpoint directory {tmp_path} holds another job's checkpoints" in msg, msg
        assert "nothing in it was used or changed" in msg and "CKPT_DIR" in msg and "--ckpt-dir" in msg, msg
    assert snapshot_files(tmp_path) == before and not (tmp_path / "host_b").exists()
    with manager(tmp_path) as again:
        assert again.load_latest()[0] == 3


def test_pruning_deletes_only_what_authenticates_and_refuses_the_rest(tmp_path, caplog):
    """A complete copy of an old step that is not this key's (planted, or another job's from before key-ids) is
    never deleted by pruning: it is moved aside; an authentic old copy this process did not write is checked, then
    deleted."""
    with manager(tmp_path) as m:
        m.save(1, state_of(1))  # authentic, written by an earlier incarnation
    fd = os.open(m.directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        partfile.write_part(fd, PartName(0, 0, 1), state_of(0), b"another key of thirty-two bytes!")
    finally:
        os.close(fd)
    foreign = (m.directory / PartName(0, 0, 1).name).read_bytes()
    with caplog.at_level(logging.WARNING, logger="toolkit.train.ckpt.manager"), manager(tmp_path) as m:
        m.save(2, state_of(2))
        m.save(3, state_of(3))  # keep 2: steps 0 and 1 go
    assert m.steps_on_disk() == [2, 3]
    assert (m.directory / "refused" / PartName(0, 0, 1).name).read_bytes() == foreign
    said = [r.getMessage() for r in caplog.records if PartName(0, 0, 1).name in r.getMessage()]
    assert len(said) == 1 and "fails authentication" in said[0] and "not pruned" in said[0], said


def test_the_job_key_comes_from_the_token_and_is_not_the_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("ab" * 32 + "\n")
    key = ckptkey.default_key({"TOOLKIT_TOKEN_FILE": str(token)})
    assert key == ckptkey.job_key("ab" * 32) and len(key) == 32 and key != ("ab" * 32).encode()[:32]
    assert ckptkey.job_key("cd" * 32) != key


def test_this_users_key_is_made_once_and_must_stay_private(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    key = ckptkey.user_key(env)
    path = tmp_path / "config" / "toolkit" / "checkpoint.key"
    assert ckptkey.user_key(env) == key and len(key) == 32
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    path.chmod(0o644)
    with pytest.raises(ckptkey.KeyFileError, match=f"{path} is not a private file of yours.*remove it"):
        ckptkey.user_key(env)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ckptkey.KeyFileError, match="cannot be read"):
        ckptkey.user_key(env)


# --- one copy per host, split between its ranks --------------------------------------------------------------------


def varied_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    base = torch.randn(40, 30, generator=g)
    return {
        "step": step,
        "model": collections.OrderedDict(w=torch.randn(300, 200, generator=g), b=torch.randn(200, generator=g),
                                         half=torch.randn(64, generator=g).half(), t=base.t(), row=base[3]),
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(500, generator=g)}},
                      "param_groups": [{"lr": 0.01, "params": [0, 1]}]},
        "extra": {"sched": {"last_epoch": step, "names": ("a", None, 2.5)}, "flags": torch.tensor([True, False])},
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes()
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("local_world", [1, 2, 3])
def test_a_hosts_ranks_write_one_copy_between_them_and_any_process_reads_it(tmp_path, local_world):
    state = varied_state(5)
    ranks = [manager(tmp_path, "node1", r, local_world) for r in range(local_world)]
    for m in ranks:
        m.save(5, state)
    host = tmp_path / "host_node1"
    assert files(host) == [f"step_000000000005.p{r}of{local_world}.ckpt" for r in range(local_world)]
    tensor_bytes = sum(t.nbytes for t in ckptparts.split(state, 1).tensors)
    written = sum((host / f).stat().st_size for f in files(host))
    assert tensor_bytes < written < tensor_bytes + local_world * 20_000, "the host writes the state once"
    biggest = max(t.nbytes for t in ckptparts.split(state, 1).tensors)
    sizes = [(host / f).stat().st_size for f in files(host)]
    assert max(sizes) - min(sizes) <= biggest + 20_000, f"the ranks share the writing: {sizes}"
    for m in ranks:
        assert_same(m.load(5), state)
        m.close()
    with manager(tmp_path, "node1", 0, 1) as alone:  # another layout reads the copy too
        assert_same(alone.load(5), state)


def test_a_copy_missing_a_part_is_not_complete_and_the_previous_is_used(tmp_path):
    ranks = [manager(tmp_path, "a", r, 2, keep_max=3) for r in range(2)]
    for step in (1, 2):
        for m in ranks:
            m.save(step, state_of(step))
    ranks[1].path_for(2).unlink()
    assert ranks[0].steps_on_disk() == [1]
    found = ranks[0].load_latest()
    assert found is not None and found[0] == 1
    assert_state(found[1], 1)


def test_parts_that_do_not_fit_together_are_corrupt():
    cut = ckptparts.split(varied_state(1), 2)
    other = ckptparts.split(state_of(1), 2)
    with pytest.raises(ValueError, match="disagree on the number of tensors"):
        ckptparts.merge([cut.payload(0), other.payload(1)])
    with pytest.raises(ValueError, match="in no part"):
        ckptparts.merge([cut.payload(0)])
    with pytest.raises(ValueError, match="in two parts"):
        ckptparts.merge([cut.payload(0), cut.payload(0), cut.payload(1)])
    assert_same(ckptparts.merge([cut.payload(1), cut.payload(0)]), varied_state(1))


# --- atomic commit: a real crash between write and rename -------------------------------------------------------

CRASH_BEFORE_RENAME = textwrap.dedent("""
    import os, signal, sys, torch
    from toolkit.train.ckpt.manager import CheckpointManager, Placement
    m = CheckpointManager(sys.argv[1], keep_max=2, placement=Placement("a"), key=b"k" * 32,
                          async_write=sys.argv[2] == "async")
    os.rename = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)   # die after write+fsync, before rename
    m.save(2, {"step": 2, "w": torch.full((1000,), 2.0), "opt": {"m": [torch.arange(3.0) * 2]}})
    m.flush()
    print("survived", flush=True)
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_between_write_and_rename_leaves_the_old_checkpoint_valid(tmp_path, mode):
    with manager(tmp_path, key=b"k" * 32) as m:
        m.save(1, state_of(1))
    proc = subprocess.run([sys.executable, "-c", CRASH_BEFORE_RENAME, str(tmp_path), mode],
                          capture_output=True, text=True, timeout=PROC_TIMEOUT)
    assert proc.returncode == -9, proc.stderr
    host = tmp_path / "host_a"
    leftovers = [p.name for p in host.iterdir() if p.name.startswith(checkpoint.TMP_PREFIX)]
    assert len(leftovers) == 1, "the crash should have left the fully written temp file behind"
    with manager(tmp_path, key=b"k" * 32) as m:
        assert m.steps_on_disk() == [1]
        found = m.load_latest()
        assert found is not None and found[0] == 1
        assert_state(found[1], 1)
    assert not [p for p in host.iterdir() if p.name.startswith(checkpoint.TMP_PREFIX)], "stale temp kept"


# --- fallback -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_newest_is_reported_and_the_previous_one_used(tmp_path, damage, caplog):
    with manager(tmp_path, keep_max=3) as m:
        for step in (10, 20, 30):
            m.save(step, state_of(step))
    newest = m.path_for(30)
    blob = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        newest.write_bytes(blob[:-100] + bytes([blob[-100] ^ 0x40]) + blob[-99:])
    else:
        newest.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="toolkit.train.ckpt.manager"):
        with manager(tmp_path, keep_max=3) as m:
            found = m.load_latest()
            scan = m.scan()
            with pytest.raises(CorruptCheckpoint, match=f"^{newest}: "):
                m.load(30)
    assert found is not None and found[0] == 20
    assert_state(found[1], 20)
    assert scan.intact == (10, 20) and [d.path for d in scan.damaged] == [newest]
    assert str(newest) in caplog.text
    assert ("truncated" if damage != "flip" else "fails authentication") in scan.damaged[0].reason


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    with manager(tmp_path / "new") as m:
        assert m.load_latest() is None
        assert m.agree() is None


# --- keep_max ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_write", [False, True])
@pytest.mark.parametrize("keep_max", [2, 3, 5])
def test_keep_max_newest_are_kept(tmp_path, keep_max, async_write):
    with manager(tmp_path, keep_max=keep_max, async_write=async_write) as m:
        for step in range(1, 9):
            m.save(step, state_of(step, n=10))
            m.flush()
            assert len(m.steps_on_disk()) <= keep_max
    assert m.steps_on_disk() == list(range(9 - keep_max, 9))
    assert all(m.verify(s) is None for s in m.steps_on_disk())


def test_keep_counts_only_complete_copies(tmp_path):
    ranks = [manager(tmp_path, "a", r, 2) for r in range(2)]
    for step in (1, 2):
        for m in ranks:
            m.save(step, state_of(step, n=10))
    ranks[0].save(3, state_of(3, n=10))  # rank 1 has not written its part of 3 yet: 1 and 2 stay
    assert ranks[0].steps_on_disk() == [1, 2]
    ranks[1].save(3, state_of(3, n=10))  # 3 is complete: rank 1 prunes its share of 1 (each rank prunes its own)
    assert ranks[0].steps_on_disk() == [2, 3] and files(ranks[0].directory) == [
        "step_000000000001.p0of2.ckpt", *(f"step_00000000000{s}.p{r}of2.ckpt" for s in (2, 3) for r in range(2))]
    for m in ranks:  # rank 0 prunes its share of 1 before it writes 4; rank 1 its share of 2 once 4 is complete
        m.save(4, state_of(4, n=10))
    assert files(ranks[0].directory) == [
        "step_000000000002.p0of2.ckpt", *(f"step_00000000000{s}.p{r}of2.ckpt" for s in (3, 4) for r in range(2))]


def test_keep_max_below_two_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="keep_max must be >= 2.*nothing to fall back to"):
        manager(tmp_path, keep_max=1)


# --- full disk, read-only disk ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_write", [False, True])
def test_a_full_disk_skips_the_checkpoint_says_so_once_and_the_next_one_is_tried_again(tiny_tmpfs, async_write,
                                                                                       caplog):
    """A full disk costs the checkpoints that do not fit, never the job: no error reaches the training loop (it used
    to exit at every save, and in-place recovery spent the restart budget on it), the older copy stays, one line
    says so (not one per interval), nothing is committed for the skipped steps, and once there is room the next
    checkpoint is written and that is said too."""
    d = tiny_tmpfs / "ckpt"
    commits = []
    m = manager(d, async_write=async_write, on_commit=commits.append)
    m.save(1, state_of(1, n=1000))  # ~5 KB
    m.flush()
    before = m.path_for(1).read_bytes()
    with caplog.at_level(logging.WARNING, logger="toolkit.train.ckpt.manager"):
        for step in (2, 3):
            m.save(step, state_of(step, n=200_000))  # ~800 KB on a 256 KiB disk
            m.flush()
        skipped = [r.getMessage() for r in caplog.records]
        assert len(skipped) == 1, skipped
        msg = skipped[0]
        assert str(d) in msg and "no space left on device" in msg and "CKPT_DIR" in msg and "step 2 skipped" in msg
        assert "training goes on" in msg and "tries again" in msg and m.skipped == 2
        assert m.path_for(1).read_bytes() == before
        assert m.steps_on_disk() == [1] and m.verify(1) is None and commits == [1]
        assert not [p for p in m.directory.iterdir() if p.name.startswith(checkpoint.TMP_PREFIX)], "temp left"
        caplog.clear()
        m.save(4, state_of(4, n=1000))  # the disk has room again for a small one
        m.close()
    assert m.steps_on_disk() == [1, 4] and commits == [1, 4] and m.skipped == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint of step 4 written in {m.directory}: checkpoints are saved again (2 skipped for lack of space)"]


def test_read_only_directory_is_one_clear_error_and_nothing_changes(tiny_tmpfs):
    d = tiny_tmpfs / "ckpt"
    with manager(d) as m:
        m.save(1, state_of(1))
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True, timeout=30)
    with pytest.raises(CheckpointError) as e:
        m.save(2, state_of(2))
    assert "read-only file system" in str(e.value) and str(d) in str(e.value)
    with pytest.raises(CheckpointError, match="read-only file system.*CKPT_DIR"):
        manager(d)
    assert m.steps_on_disk() == [1] and m.verify(1) is None


# --- asynchronous writer -------------------------------------------------------------------------------------------


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return model, opt


def test_async_snapshot_is_a_copy_not_an_alias(tmp_path):
    model, opt = trained()
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    with manager(tmp_path, async_write=True) as m:
        m.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        with torch.no_grad():  # the training loop goes on at once and changes the live tensors in place
            for p in model.parameters():
                p.add_(1000.0)
        opt.state[model[0].weight]["momentum_buffer"].mul_(-1)
        m.flush()
        loaded = m.load(1)
    for k, v in expect.items():
        assert torch.equal(loaded["model"][k], v)
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum_buffer"], momentum)


def test_stable_tensors_are_staged_by_the_writer_before_the_optimizer_changes_them(tmp_path):
    """Parameters and optimizer state (stable) are copied by the writer; once wait_staged() returns (the Trainer
    calls it before the optimizer step) they may change. Buffers (BatchNorm's running stats change in forward) are
    copied by save() itself."""
    model, opt = trained()
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    stable = [p for p in model.parameters()] + [s["momentum_buffer"] for s in opt.state.values()]
    with manager(tmp_path, async_write=True) as m:
        m.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict()},
               stable=frozenset(t.untyped_storage().data_ptr() for t in stable))
        model.train()
        model(torch.randn(8, 64) * 50)  # forward: the running stats change now, before the stage may be done
        m.wait_staged()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()  # after wait_staged: parameters and momentum change
        m.flush()
        loaded = m.load(1)
    assert not torch.equal(model[1].running_mean, expect["1.running_mean"]), "the fault was not injected"
    for k, v in expect.items():
        assert torch.equal(loaded["model"][k], v), k
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum_buffer"], momentum)


def test_snapshot_clones_every_tensor():
    live = {"a": torch.ones(3), "b": [torch.zeros(2), (torch.ones(1), 5)], "c": "x"}
    snap = checkpoint.snapshot(live)
    assert snap["b"][1][1] == 5 and snap["c"] == "x"
    for x, y in [(live["a"], snap["a"]), (live["b"][0], snap["b"][0]), (live["b"][1][0], snap["b"][1][0])]:
        assert torch.equal(x, y) and x.data_ptr() != y.data_ptr()


def test_what_a_safe_load_refuses_is_found_with_its_path():
    sched = torch.optim.lr_scheduler.StepLR(trained()[1], 3)
    assert checkpoint.first_unloadable({"model": trained()[0].state_dict(), "s": sched.state_dict()}) is None
    assert checkpoint.first_unloadable({"extra": {"s": {"a": [1, np.float64(2.0)]}}}) == (
        ("extra", "s", "a", 1), "numpy.float64")
    assert checkpoint.first_unloadable({"o": collections.OrderedDict(x=np.int32(1))})[1] == "numpy.int32"


# --- the restart agreement ------------------------------------------------------------------------------------------


def row(host: int, local: int, world: int, *steps: int) -> list[int]:
    return [host, local, world, *steps, *[-1] * (3 - len(steps))]


def test_choose_takes_the_newest_copy_complete_on_some_host():
    a0, a1, b0, b1 = row(7, 0, 2, 30, 20), row(7, 1, 2, 20), row(9, 0, 2, 30, 20), row(9, 1, 2, 30, 20)
    assert choose([a0, a1, b0, b1]) == Choice(30, 2)  # host 7's 30 lacks rank 1's part: host 9's, read by rank 2
    assert choose([a0, a1]) == Choice(20, 0)
    assert choose([row(7, 0, 1, 10, 20), row(9, 0, 1)]) == Choice(20, 0)  # a host with nothing takes another's
    assert choose([row(7, 0, 1), row(9, 0, 1)]) is None
    assert choose([row(9, 0, 1, 5), row(7, 0, 1, 5)]) == Choice(5, 0)  # a tie: the lowest rank reads


@pytest.mark.parametrize("rows", [
    [row(7, 0, 1), row(7, 0, 1)],  # two ranks both local rank 0 of one host
    [row(7, 0, 2), row(7, 1, 3)],  # disagree on the host's size
    [row(7, 0, 2)],  # local rank 1 of the host is missing
])
def test_choose_refuses_a_layout_that_does_not_number_a_hosts_ranks(rows):
    with pytest.raises(CheckpointError, match="LOCAL_RANK and LOCAL_WORLD_SIZE must number a host's ranks"):
        choose(rows)


def run_group(root: Path, layout: list[tuple[str, int, int]], port: int) -> list[dict]:
    world = len(layout)
    procs = [subprocess.Popen([sys.executable, str(HERE / "agree_worker.py"), str(r), str(world), str(port),
                               str(root), *map(str, layout[r])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for r in range(world)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=PROC_TIMEOUT)
            assert p.returncode == 0, err
            results.append({**json.loads(out.strip().splitlines()[-1]), "log": err})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


def write_copies(root: Path, host: str, parts: int, steps: list[int], only_part: int | None = None) -> list[Path]:
    paths = []
    for r in range(parts):
        if only_part is not None and r != only_part:
            continue
        with manager(root, host, r, parts, keep_max=5) as m:
            for s in steps:
                m.save(s, state_of(s, n=10))
            paths.append(m.directory)
    return paths


def test_every_rank_takes_the_newest_copy_any_host_has_and_nothing_usable_is_deleted(tmp_path, new_port):
    """Two hosts of two ranks. Host a's newest copy (30) has a damaged part, host b's is whole and b also holds an
    unfinished 40 (only part 0: it died mid-checkpoint). Everyone resumes from 30, read by rank 2 (b's lowest);
    the damaged part is moved aside and named by the rank whose share it is; b's part of 40 is removed; every
    other file stays."""
    write_copies(tmp_path, "a", 2, [10, 20, 30])
    write_copies(tmp_path, "b", 2, [10, 20, 30])
    write_copies(tmp_path, "b", 2, [40], only_part=0)
    damaged = tmp_path / "host_a" / "step_000000000030.p1of2.ckpt"
    blob = bytearray(damaged.read_bytes())
    blob[-5] ^= 0x01
    damaged.write_bytes(bytes(blob))
    results = run_group(tmp_path, [("a", 0, 2), ("a", 1, 2), ("b", 0, 2), ("b", 1, 2)], new_port())
    assert [(r["step"], r["source"]) for r in results] == [(30, 2)] * 4
    assert [r["loaded"] for r in results] == [None, None, 30, None]
    assert results[1]["refused"] == [damaged.name] and str(damaged) in results[1]["log"]
    assert "fails authentication" in results[1]["log"]
    assert files(tmp_path / "host_a") == [f"step_0000000000{s}.p{r}of2.ckpt" for s in (10, 20) for r in (0, 1)] + [
        "step_000000000030.p0of2.ckpt"]
    assert files(tmp_path / "host_b") == [f"step_0000000000{s}.p{r}of2.ckpt" for s in (10, 20, 30) for r in (0, 1)]
    assert "step_000000000040.p0of2.ckpt" in results[2]["log"] and "removed" in results[2]["log"]


def test_a_rank_whose_host_has_no_copy_resumes_from_another_hosts_and_none_is_deleted(tmp_path, new_port):
    """Issue 25's finding: rank 0 held steps 10 and 20, rank 1 none, and resume() deleted both. Now rank 1 (its
    own host, empty) takes 20 from rank 0's host, and rank 0's files stay."""
    write_copies(tmp_path, "a", 1, [10, 20])
    results = run_group(tmp_path, [("a", 0, 1), ("b", 0, 1)], new_port())
    assert [(r["step"], r["source"], r["loaded"]) for r in results] == [(20, 0, 20), (20, 0, None)]
    assert results[0]["left"] == ["step_000000000010.p0of1.ckpt", "step_000000000020.p0of1.ckpt"]
    assert results[1]["left"] == []


def test_ranks_that_claim_the_same_share_of_a_host_are_told_so(tmp_path, new_port):
    results = run_group(tmp_path, [("a", 0, 1), ("a", 0, 1)], new_port())
    for r in results:
        assert r["step"] is None and "ranks [0, 1] share a host" in r["error"], r


def test_host_copies_are_equal_independent_and_keep_dtype_and_layout() -> None:
    """What the checkpoint stages: copies equal to the originals bit for bit, in their dtype and strides, that a
    change to an original after the call does not reach (the training loop goes on once staging returns). Here the
    CPU branch; the CUDA one (pinned host memory, one synchronise per device) was not run: no GPU."""
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    tensors = [base, base.t(), torch.tensor([1, 2, 3], dtype=torch.int8), torch.ones(3, dtype=torch.bfloat16)]
    copies = checkpoint.host_copies(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert c.device.type == "cpu" and c.dtype == t.dtype and c.stride() == t.stride() and torch.equal(c, t)
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    base.add_(1)
    assert copies[0][0, 0].item() == 0.0 and copies[1][0, 0].item() == 0.0  # the originals moved on, not the copies
    assert checkpoint.host_copies([]) == []
