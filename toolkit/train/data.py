"""Data for a worker: a sharded sampler that resumes at the exact sample, and an MNIST IDX reader.

Why a sampler of our own: recovery rolls every rank back to a checkpoint and must continue with exactly the
samples the uninterrupted run would have seen. torch's ``DistributedSampler`` can only restart an epoch from its
first sample; this one carries ``(epoch, position)`` in its state, saved with each checkpoint.

Why an IDX reader of our own: the MindSpore samples read ``MNIST_Data/train/*-idx3-ubyte`` directly, nothing can
be downloaded at run time, and a damaged file must fail with one line naming the file, not a numpy reshape error.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

IDX_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions (count, rows, cols)
IDX_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension (count)
IMAGES_SUFFIX = "-images-idx3-ubyte"
LABELS_SUFFIX = "-labels-idx1-ubyte"


class DataError(ValueError):
    """A dataset file or directory that cannot be used; the message names it and says what to do."""


class SamplerStateError(ValueError):
    """A saved sampler state that does not fit this sampler (another world size, dataset or seed)."""


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


# ----------------------------------------------------------------------------------------------------------
# Sharded, resumable sampler


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch). Why hashed: ``seed + epoch`` (torch's choice) makes run
    (seed=1, epoch=0) replay run (seed=0, epoch=1)."""
    digest = hashlib.sha256(f"toolkit-sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ShardedSampler(torch.utils.data.Sampler[int]):
    """Yields this shard's dataset indices for the current epoch, from the saved position on.

    - Shards: the epoch's permutation is split round-robin, rank ``shard_id`` gets items ``shard_id, shard_id +
      num_shards, ...`` (``num_shards``/``shard_id`` as MindSpore's ``DistributedSampler`` calls them).
    - Equal lengths, so every rank runs the same number of steps (DDP needs it): by default the permutation is
      **padded** by repeating its first ``total_size - dataset_size`` items (every sample is seen, fewer than
      ``num_shards`` are seen twice per epoch); with ``drop_remainder=True`` its tail is **dropped** instead (no
      sample twice, up to ``num_shards - 1`` samples not seen that epoch).
    - Shuffle: ``torch.randperm`` with a generator seeded from ``(seed, epoch)``; the same on every rank and on
      every restart. ``shuffle=False`` keeps dataset order.
    - Position: the number of this shard's samples already handed out in this epoch. Iteration advances it *as
      it yields*, so at a step boundary it counts exactly the samples trained on, provided indices are pulled
      on demand (direct iteration, ``iter_batches``, or a ``DataLoader`` with ``num_workers=0``; a prefetching
      DataLoader pulls ahead and its position would be too far).
    """

    def __init__(
        self,
        dataset_size: int,
        num_shards: int = 1,
        shard_id: int = 0,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_remainder: bool = False,
    ) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id must be in 0..{num_shards - 1}, got {shard_id}")
        if drop_remainder and dataset_size < num_shards:
            raise ValueError(
                f"drop_remainder with {dataset_size} samples and {num_shards} shards leaves every shard empty; "
                "use padding (drop_remainder=False) or fewer shards"
            )
        self.dataset_size = dataset_size
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.seed = seed
        self.shuffle = shuffle
        self.drop_remainder = drop_remainder
        if drop_remainder:
            self.num_samples = dataset_size // num_shards
        else:
            self.num_samples = -(-dataset_size // num_shards)
        self.total_size = self.num_samples * num_shards
        self.epoch = 0
        self.position = 0

    def epoch_order(self, epoch: int) -> list[int]:
        """The whole epoch's index list (all shards, padded or cut to ``total_size``), identical on every rank."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(epoch_seed(self.seed, epoch))
            order = torch.randperm(self.dataset_size, generator=g).tolist()
        else:
            order = list(range(self.dataset_size))
        if self.total_size <= len(order):
            return order[: self.total_size]
        pad = self.total_size - len(order)
        reps = -(-pad // len(order))
        return order + (order * reps)[:pad]

    def shard_indices(self, epoch: int) -> list[int]:
        """This shard's full index sequence for ``epoch``."""
        return self.epoch_order(epoch)[self.shard_id : self.total_size : self.num_shards]

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its first sample; the same epoch keeps the position (that is the resume)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def __len__(self) -> int:
        return self.num_samples

    def remaining(self) -> int:
        """Samples of this epoch not yet handed out."""
        return self.num_samples - self.position

    def __iter__(self) -> Iterator[int]:
        indices = self.shard_indices(self.epoch)
        while self.position < self.num_samples:
            i = indices[self.position]
            self.position += 1
            yield i

    def iter_batches(self, batch_size: int, drop_last: bool = False) -> Iterator[list[int]]:
        """Batches of indices from the current position; the position covers a batch as soon as it is yielded.

        With ``drop_last`` a final short batch is not yielded and the position stays before it (the epoch ends
        there; ``set_epoch`` of the next epoch starts over)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        indices = self.shard_indices(self.epoch)
        while self.position < self.num_samples:
            end = min(self.position + batch_size, self.num_samples)
            if drop_last and end - self.position < batch_size:
                return
            batch = indices[self.position : end]
            self.position = end
            yield batch

    def batches_per_epoch(self, batch_size: int, drop_last: bool = False) -> int:
        """Steps per epoch for this batch size; the same on every rank since shards have equal lengths."""
        return self.num_samples // batch_size if drop_last else -(-self.num_samples // batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools only, so it loads with ``torch.load(weights_only=True)``."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_shards": self.num_shards,
            "shard_id": self.shard_id,
            "dataset_size": self.dataset_size,
            "shuffle": self.shuffle,
            "drop_remainder": self.drop_remainder,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``(epoch, position)``. Refuses a state from another sharding: its position would point at
        other samples, and the result would silently differ."""
        for key in ("seed", "num_shards", "shard_id", "dataset_size", "shuffle", "drop_remainder"):
            if key in state and state[key] != getattr(self, key):
                raise SamplerStateError(
                    f"checkpoint's sampler has {key}={state[key]!r} but this run has {key}={getattr(self, key)!r}; "
                    "resume with the same world size, dataset and seed, or start fresh with an empty CKPT_DIR"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise SamplerStateError(
                f"checkpoint's sampler position {position} of epoch {epoch} is outside 0..{self.num_samples}"
            )
        self.epoch = epoch
        self.position = position
