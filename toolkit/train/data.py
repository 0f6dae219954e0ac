"""Data for a worker: an MNIST IDX reader. (The position in the data after a fault is the loader's: a function of
the step, toolkit.train.loader, with torch's own DistributedSampler.)

Why an IDX reader of our own: the MindSpore samples read ``MNIST_Data/train/*-idx3-ubyte`` directly, nothing can
be downloaded at run time, and a damaged file must fail with one line naming the file, not a numpy reshape error.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolkit.train.faults import DataError

IDX_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions (count, rows, cols)
IDX_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension (count)
IMAGES_SUFFIX = "-images-idx3-ubyte"
LABELS_SUFFIX = "-labels-idx1-ubyte"


# ----------------------------------------------------------------------------------------------------------
# IDX files


def read_idx(path: str | Path, magic: int) -> np.ndarray:
    """Read one IDX file of unsigned bytes, checking the magic number, the header and the exact file size.

    Why exact: a truncated download or a file with junk appended would otherwise train on garbage silently.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file; set DATA_PATH to the MNIST_Data directory") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror}); check the path and its permissions") from None
    ndim = magic & 0xFF
    header_len = 4 + 4 * ndim
    if len(raw) < 4:
        raise DataError(f"{path}: {len(raw)} bytes is too short for an IDX file; the file is truncated")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        raise DataError(
            f"{path}: magic number 0x{found:08x}, expected 0x{magic:08x} "
            f"({'images' if magic == IDX_IMAGES_MAGIC else 'labels'}, unsigned bytes, {ndim} dimension(s)); "
            "not an MNIST IDX file of this kind (gzipped? swapped images and labels?)"
        )
    if len(raw) < header_len:
        raise DataError(f"{path}: header needs {header_len} bytes, file has {len(raw)}; the file is truncated")
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    expected = header_len + math.prod(dims)
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "followed by extra bytes"
        raise DataError(
            f"{path}: header says {' x '.join(map(str, dims))} bytes of data ({expected} in all), "
            f"file has {len(raw)}; the file is {what}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims)


@dataclass(frozen=True)
class MnistSplit:
    """One split of an IDX dataset held in memory: images ``(N, rows, cols)`` and labels ``(N,)``, both uint8."""

    images: np.ndarray
    labels: np.ndarray
    images_file: Path
    labels_file: Path

    def __len__(self) -> int:
        return len(self.labels)


def _one_file(directory: Path, suffix: str) -> Path:
    found = sorted(p for p in directory.iterdir() if p.name.endswith(suffix) and p.is_file())
    if not found:
        raise DataError(f"{directory}: no *{suffix} file; expected the MNIST_Data/<split>/ layout of the samples")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise DataError(f"{directory}: several *{suffix} files ({names}); keep exactly one per split")
    return found[0]


def load_mnist(root: str | Path, split: str = "train", num_classes: int = 10) -> MnistSplit:
    """Load ``<root>/<split>/*-images-idx3-ubyte`` and ``*-labels-idx1-ubyte`` (the MindSpore samples' layout).

    Like MindSpore's ``MnistDataset``, files are found by suffix, so both ``train-`` and ``t10k-`` prefixes work.
    """
    root = Path(root)
    directory = root / split
    if not directory.is_dir():
        hint = "" if root.is_dir() else f" ({root} itself does not exist)"
        raise DataError(f"{directory}: not a directory{hint}; set DATA_PATH to the MNIST_Data directory")
    images_file = _one_file(directory, IMAGES_SUFFIX)
    labels_file = _one_file(directory, LABELS_SUFFIX)
    images = read_idx(images_file, IDX_IMAGES_MAGIC)
    labels = read_idx(labels_file, IDX_LABELS_MAGIC)
    if len(images) != len(labels):
        raise DataError(
            f"{directory}: {images_file.name} has {len(images)} images but {labels_file.name} has "
            f"{len(labels)} labels; the two files are from different datasets"
        )
    if len(labels) == 0:
        raise DataError(f"{directory}: the dataset is empty")
    bad = np.flatnonzero(labels >= num_classes)
    if bad.size:
        raise DataError(
            f"{labels_file}: label {int(labels[bad[0]])} at index {int(bad[0])} is outside 0..{num_classes - 1}"
        )
    return MnistSplit(images=images, labels=labels, images_file=images_file, labels_file=labels_file)
