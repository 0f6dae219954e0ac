"""The sharded resumable sampler and the IDX reader, on the committed digits and on damaged copies of them."""

from __future__ import annotations

import gzip
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.train.data import (
    IDX_IMAGES_MAGIC,
    IDX_LABELS_MAGIC,
    DataError,
    SamplerStateError,
    ShardedSampler,
    load_mnist,
    read_idx,
)

REPO = Path(__file__).resolve().parents[2]
MNIST = REPO / "examples" / "MNIST_Data"

sizes = st.integers(min_value=1, max_value=300)
worlds = st.integers(min_value=1, max_value=9)
seeds = st.integers(min_value=0, max_value=2**31)
epochs = st.integers(min_value=0, max_value=5)


def shards(n: int, world: int, seed: int, epoch: int, drop: bool) -> list[list[int]]:
    out = []
    for r in range(world):
        s = ShardedSampler(n, world, r, seed=seed, drop_remainder=drop)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


# --- sampler: sharding ------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(n=sizes, world=worlds, seed=seeds, epoch=epochs)
def test_padded_shards_are_equal_complete_and_disjoint_but_for_the_padding(n, world, seed, epoch):
    parts = shards(n, world, seed, epoch, drop=False)
    lengths = {len(p) for p in parts}
    assert lengths == {-(-n // world)}, "every rank must run the same number of steps"
    seen = Counter(i for p in parts for i in p)
    assert set(seen) == set(range(n)), "padding mode must hand out every sample"
    extra = sum(seen.values()) - n
    assert extra == -(-n // world) * world - n
    assert extra < world or n < world
    if n >= world:
        assert all(c <= 2 for c in seen.values())


@settings(max_examples=200, deadline=None)
@given(n=sizes, world=worlds, seed=seeds, epoch=epochs)
def test_dropped_shards_are_equal_and_disjoint(n, world, seed, epoch):
    if n < world:
        with pytest.raises(ValueError, match="drop_remainder"):
            ShardedSampler(n, world, 0, drop_remainder=True)
        return
    parts = shards(n, world, seed, epoch, drop=True)
    assert {len(p) for p in parts} == {n // world}
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == (n // world) * world
    assert n - len(flat) < world


def test_order_depends_on_seed_and_epoch_and_is_the_same_on_every_instance():
    a = ShardedSampler(500, 2, 1, seed=7)
    b = ShardedSampler(500, 2, 1, seed=7)
    assert list(a) == list(b)
    e0 = a.shard_indices(0)
    assert e0 != a.shard_indices(1)
    assert e0 != ShardedSampler(500, 2, 1, seed=8).shard_indices(0)
    # (seed, epoch) are hashed, not added: seed 7 epoch 1 is not seed 8 epoch 0
    assert a.shard_indices(1) != ShardedSampler(500, 2, 1, seed=8).shard_indices(0)
    plain = ShardedSampler(10, 3, 2, shuffle=False)
    assert list(plain) == [2, 5, 8, 1]  # dataset order, round robin, padded from the start


# --- sampler: resume ---------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(n=sizes, world=worlds, seed=seeds, epoch=epochs, data=st.data())
def test_resume_at_any_position_continues_with_the_same_samples(n, world, seed, epoch, data):
    rank = data.draw(st.integers(0, world - 1), label="rank")
    drop = data.draw(st.booleans(), label="drop") and n >= world
    reference = ShardedSampler(n, world, rank, seed=seed, drop_remainder=drop)
    reference.set_epoch(epoch)
    whole = list(reference)
    stop = data.draw(st.integers(0, len(whole)), label="stop")

    first = ShardedSampler(n, world, rank, seed=seed, drop_remainder=drop)
    first.set_epoch(epoch)
    it = iter(first)
    head = [next(it) for _ in range(stop)]
    saved = first.state_dict()

    resumed = ShardedSampler(n, world, rank, seed=seed, drop_remainder=drop)
    resumed.load_state_dict(saved)
    resumed.set_epoch(epoch)  # what a training loop does on entering the epoch: must not rewind
    assert head + list(resumed) == whole
    resumed.set_epoch(epoch + 1)
    nxt = ShardedSampler(n, world, rank, seed=seed, drop_remainder=drop)
    nxt.set_epoch(epoch + 1)
    assert list(resumed) == list(nxt)


@settings(max_examples=200, deadline=None)
@given(n=sizes, world=worlds, batch=st.integers(1, 40), data=st.data())
def test_resume_by_batches_yields_the_remaining_batches(n, world, batch, data):
    ref = ShardedSampler(n, world, 0, seed=3)
    batches = list(ref.iter_batches(batch))
    assert len(batches) == ref.batches_per_epoch(batch)
    k = data.draw(st.integers(0, len(batches)), label="steps done")
    s = ShardedSampler(n, world, 0, seed=3)
    gen = s.iter_batches(batch)
    for _ in range(k):
        next(gen)
    state = s.state_dict()  # at the step boundary after k steps
    t = ShardedSampler(n, world, 0, seed=3)
    t.load_state_dict(state)
    assert list(t.iter_batches(batch)) == batches[k:]


def test_drop_last_leaves_the_short_batch_out():
    s = ShardedSampler(10, 1, 0, shuffle=False)
    assert list(s.iter_batches(4, drop_last=True)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert s.batches_per_epoch(4, drop_last=True) == 2


def test_state_from_another_sharding_is_refused_with_the_fix():
    s = ShardedSampler(100, 2, 0, seed=1)
    with pytest.raises(SamplerStateError, match="num_shards=3 but this run has num_shards=2.*same world size"):
        s.load_state_dict(ShardedSampler(100, 3, 0, seed=1).state_dict())
    with pytest.raises(SamplerStateError, match="seed"):
        s.load_state_dict(ShardedSampler(100, 2, 0, seed=2).state_dict())
    bad = ShardedSampler(100, 2, 0, seed=1).state_dict() | {"position": 51}
    with pytest.raises(SamplerStateError, match="outside 0..50"):
        s.load_state_dict(bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dataset_size": 0}, "dataset_size"),
        ({"dataset_size": 5, "num_shards": 0}, "num_shards"),
        ({"dataset_size": 5, "num_shards": 2, "shard_id": 2}, "shard_id must be in 0..1"),
    ],
)
def test_bad_arguments_say_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedSampler(**kwargs)


# --- IDX reader ----------------------------------------------------------------------------------------------


def test_committed_digits_load_in_the_mindspore_layout():
    train = load_mnist(MNIST, "train")
    test = load_mnist(MNIST, "test")
    assert train.images.shape == (1440, 8, 8) and train.labels.shape == (1440,)
    assert test.images.shape == (357, 8, 8)
    assert train.images_file.name == "train-images-idx3-ubyte"
    assert test.labels_file.name == "t10k-labels-idx1-ubyte"
    assert set(np.unique(train.labels)) == set(range(10))
    assert train.images.max() == 255 and train.images.min() == 0


def write_idx(path: Path, magic: int, dims: tuple[int, ...], payload: bytes) -> None:
    path.write_bytes(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims) + payload)


@pytest.fixture
def split_dir(tmp_path: Path) -> Path:
    d = tmp_path / "MNIST_Data" / "train"
    d.mkdir(parents=True)
    write_idx(d / "train-images-idx3-ubyte", IDX_IMAGES_MAGIC, (3, 2, 2), bytes(range(12)))
    write_idx(d / "train-labels-idx1-ubyte", IDX_LABELS_MAGIC, (3,), bytes([1, 2, 3]))
    return d


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_valid_small_split_loads(split_dir):
    s = load_mnist(split_dir.parent, "train")
    assert s.images.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert s.labels.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "damage, file, expect",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), "images", "is truncated"),
        (lambda p: p.write_bytes(p.read_bytes() + b"x"), "images", "followed by extra bytes"),
        (lambda p: p.write_bytes(p.read_bytes()[:10]), "images", "header needs 16 bytes"),
        (lambda p: p.write_bytes(b"\x00\x00"), "labels", "too short"),
        (lambda p: p.write_bytes(gzip.compress(p.read_bytes())), "images", "magic number 0x1f8b08"),
        (lambda p: p.write_bytes(struct.pack(">I", IDX_LABELS_MAGIC) + p.read_bytes()[4:]), "images",
         "expected 0x00000803"),
    ],
)
def test_damaged_files_fail_in_one_line_naming_the_file(split_dir, damage, file, expect):
    path = split_dir / f"train-{file}-idx{3 if file == 'images' else 1}-ubyte"
    damage(path)
    with pytest.raises(DataError) as e:
        load_mnist(split_dir.parent, "train")
    msg = one_line(e)
    assert str(path) in msg and expect in msg


def test_count_mismatch_and_bad_labels_are_named(split_dir):
    labels = split_dir / "train-labels-idx1-ubyte"
    write_idx(labels, IDX_LABELS_MAGIC, (2,), bytes([1, 2]))
    with pytest.raises(DataError) as e:
        load_mnist(split_dir.parent, "train")
    assert "3 images but train-labels-idx1-ubyte has 2 labels" in one_line(e)
    write_idx(labels, IDX_LABELS_MAGIC, (3,), bytes([1, 12, 3]))
    with pytest.raises(DataError) as e:
        load_mnist(split_dir.parent, "train")
    assert str(labels) in one_line(e) and "label 12 at index 1" in str(e.value)


def test_missing_directory_and_files_say_to_set_data_path(tmp_path, split_dir):
    with pytest.raises(DataError) as e:
        load_mnist(tmp_path / "nowhere", "train")
    assert "DATA_PATH" in one_line(e) and "does not exist" in str(e.value)
    (split_dir / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError) as e:
        load_mnist(split_dir.parent, "train")
    assert "no *-labels-idx1-ubyte file" in one_line(e)
    with pytest.raises(DataError) as e:
        read_idx(split_dir / "absent", IDX_IMAGES_MAGIC)
    assert "no such file" in one_line(e)
