#!/usr/bin/env python3
"""Write scikit-learn's bundled 8x8 handwritten digits as MNIST IDX files, in the MindSpore samples' layout.

Why: the demo and the tests need a small *real* dataset with no download at run time, in the exact format and
directory layout the MindSpore MNIST samples read (``MNIST_Data/train/train-images-idx3-ubyte`` ...). The 1,797
digits scikit-learn ships inside its wheel (UCI "Optical Recognition of Handwritten Digits", 8x8, values 0..16)
fit in ~115 KB; the output is committed, so this script only documents where the files came from.

How it was run (the output under examples/MNIST_Data is committed; nothing else needs scikit-learn):

    python3 -m venv /tmp/skvenv && /tmp/skvenv/bin/pip install scikit-learn    # scikit-learn 1.9.1 was used
    /tmp/skvenv/bin/python scripts/make_digits.py examples/MNIST_Data

The split is a fixed permutation (numpy RandomState(0)): 1,440 training images (divisible by 2, 3, 4, 5, 6, 8 ...
so shard sizes are easy to reason about) and the remaining 357 as the test set. Pixels are scaled from 0..16 to
0..255 (round(v * 255 / 16)) so they look like MNIST's unsigned bytes; images stay 8x8 (IDX stores the size).
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

TRAIN_SIZE = 1440
IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801


def write_idx(path: Path, magic: int, dims: tuple[int, ...], payload: bytes) -> None:
    """Big-endian header (magic, then one uint32 per dimension), then the raw unsigned bytes."""
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(header + payload)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the MNIST_Data directory to (re)write")
    args = parser.parse_args(argv)

    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images * 255.0 / 16.0).clip(0, 255).astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    order = np.random.RandomState(0).permutation(len(labels))
    splits = {
        "train": ("train", order[:TRAIN_SIZE]),
        "test": ("t10k", order[TRAIN_SIZE:]),
    }
    for split, (prefix, idx) in splits.items():
        d = args.out / split
        d.mkdir(parents=True, exist_ok=True)
        imgs, labs = images[idx], labels[idx]
        write_idx(d / f"{prefix}-images-idx3-ubyte", IMAGES_MAGIC, imgs.shape, imgs.tobytes())
        write_idx(d / f"{prefix}-labels-idx1-ubyte", LABELS_MAGIC, labs.shape, labs.tobytes())
        print(f"{d}: {len(labs)} images of {imgs.shape[1]}x{imgs.shape[2]}, labels {np.bincount(labs).tolist()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
