"""The IDX reader, on the committed digits and on damaged copies of them."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from toolkit.train.data import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, load_mnist, read_idx
from toolkit.train.faults import DataError

REPO = Path(__file__).resolve().parents[2]
MNIST = REPO / "examples" / "MNIST_Data"



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
