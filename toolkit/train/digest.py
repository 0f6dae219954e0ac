"""A digest of a training state over every byte of it, computed where the state lives: what the replicas compare
(toolkit.train.replicas), what a state transfer carries (toolkit.train.transfer) and what a checkpoint records.

Why not a cryptographic hash: the state is gigabytes on an accelerator, and the check runs every few hundred steps
on every rank; moving it to the host to hash it would cost more than the check may. Why not a sum of each tensor
(the divergence check's fingerprint before this module): it is blind to position, so two rows of a weight swapped
summed the same.

What: the bytes of each tensor are a stream of 64-bit words (a tensor whose size is not a multiple of 8 bytes ends
in one word of its last bytes). Each word is multiplied by an odd weight that depends on its position within a
chunk of CHUNK words; each chunk's wrapping sum goes into the tensor's running value by Horner's rule (value * MULT
+ sum, wrapping), so the chunk's position counts too; the tensors' values, each with its size, go through blake2b
in order (so the same bytes give the same digest on any device). Everything else is integer arithmetic on the
tensor's own device (torch kernels, no copy to the host): 100 MB in 9-11 ms of CPU here, against 70-73 ms for
blake2b and 48-49 ms for sha256 (bench/replica_check.py). Guarantee: a change confined to one 64-bit word (any bit
flip, any number of flips in one word) always changes the digest (an odd weight is invertible modulo 2^64); a swap
of two elements, or a random change of several words, leaves it equal with a probability of about 2^-63. The
state's structure and its plain values (names, shapes, dtypes, numbers) go through blake2b and into the same digest.
Not a defence against an attacker who chooses the bytes: the transfer and the checkpoint have their own
authentication for that.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Iterable

import numpy as np
import torch

CHUNK = 1 << 20  # words per chunk: the weight table's size (8 MB on each device that holds state)
MULT = 0x9E3779B97F4A7C15  # odd: the Horner multiplier between chunks
MASK = (1 << 64) - 1
MAX_DEPTH = 64  # nesting of a state (as toolkit.train.transfer accepts)


def _signed(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


@functools.cache
def weights(device: torch.device) -> torch.Tensor:
    """CHUNK odd 64-bit weights on `device` (splitmix64 of the position), the same everywhere. A constant, built once
    per process and device (8 MB; 10-70 ms of one core): a replacement digests what it received, then its whole
    state for the replica check, and would otherwise build it twice on the recovery's critical path."""
    x = torch.arange(CHUNK, dtype=torch.int64, device=device) * _signed(MULT) + 0x2545F491
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _signed(0x94D049BB133111EB)
    return x | 1


class Digester:
    """Digests of states and tensors. Keeps one scratch chunk per device it has seen (8 MB, on first use; the weight
    table is shared: `weights`); not for two threads at once."""

    def __init__(self) -> None:
        self._scratch: dict[torch.device, torch.Tensor] = {}  # a chunk's products (no allocation per chunk)

    def tensors(self, tensors: Iterable[torch.Tensor]) -> int:
        """The digest (63 bits) of the tensors' bytes, in order, wherever each lives (the same bytes on another
        device give the same digest); their shapes and dtypes are not part of it (see `state`)."""
        values: list[tuple[torch.device, torch.Tensor, int]] = []
        for t in tensors:
            flat = as_bytes(t)
            if flat.numel():
                values.append((flat.device, self._value(flat), flat.numel()))
        on_host: dict[torch.device, list[int]] = {}
        for dev in dict.fromkeys(d for d, _, _ in values):  # one wait per device
            on_host[dev] = torch.stack([v for d, v, _ in values if d == dev]).tolist()
        total = hashlib.blake2b(digest_size=8)
        taken = {dev: iter(vs) for dev, vs in on_host.items()}
        for dev, _, size in values:
            total.update(next(taken[dev]).to_bytes(8, "little", signed=True) + size.to_bytes(8, "little"))
        return int.from_bytes(total.digest(), "little") >> 1

    def _value(self, flat: torch.Tensor) -> torch.Tensor:
        """The running value (a 0-d int64 tensor on its device) of one tensor's bytes `flat` (uint8)."""
        w = weights(flat.device)
        scratch = self._scratch.get(flat.device)
        if scratch is None:
            scratch = self._scratch[flat.device] = torch.empty(CHUNK, dtype=torch.int64, device=flat.device)
        acc = torch.zeros((), dtype=torch.int64, device=flat.device)
        n8 = flat.numel() // 8 * 8
        main = _as_words(flat[:n8])
        mult = _signed(MULT)
        for start in range(0, main.numel(), CHUNK):
            part = main[start:start + CHUNK]
            products = torch.mul(part, w[:part.numel()], out=scratch[:part.numel()])
            acc = acc * mult + products.sum()
        tail = flat[n8:]
        if tail.numel():  # the last 1-7 bytes as one word
            shifts = torch.arange(tail.numel(), dtype=torch.int64, device=flat.device) * 8
            acc = acc * mult + (tail.to(torch.int64) << shifts).sum() * w[0]
        return acc

    def state(self, state: Any) -> int:
        """The digest of a state (nested dicts, lists and tuples of tensors, numpy arrays and plain values, as a
        checkpoint or a transfer holds it): its structure, plain values, dtypes and shapes through blake2b, its
        tensors' bytes through `tensors`, both in one 63-bit integer."""
        tensors: list[torch.Tensor] = []
        shape: list[str] = []
        _walk(state, tensors, shape)
        h = hashlib.blake2b("\0".join(shape).encode(errors="surrogatepass"), digest_size=8)
        h.update(self.tensors(tensors).to_bytes(8, "little"))
        return int.from_bytes(h.digest(), "little") >> 1


def _walk(obj: Any, tensors: list[torch.Tensor], shape: list[str], depth: int = 0) -> None:
    """`obj`'s tensors (numpy's as tensors) into `tensors`, the rest of it as text into `shape`, in order."""
    if depth > MAX_DEPTH:
        raise ValueError(f"a state nested deeper than {MAX_DEPTH}")
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        shape.append(f"T{obj.dtype}{tuple(obj.shape)}")
    elif isinstance(obj, (np.ndarray, np.generic)):
        arr = np.ascontiguousarray(obj)
        tensors.append(torch.from_numpy(arr.reshape(-1).view(np.uint8)))
        shape.append(f"N{arr.dtype.str}{arr.shape}")
    elif isinstance(obj, dict):
        shape.append(f"D{len(obj)}")
        for k, v in obj.items():
            shape.append(repr(k))
            _walk(v, tensors, shape, depth + 1)
    elif isinstance(obj, (list, tuple)):
        shape.append(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}")
        for v in obj:
            _walk(v, tensors, shape, depth + 1)
    else:
        shape.append(f"{type(obj).__name__}:{obj!r}")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its device: a view of its storage when it is contiguous, else a
    contiguous copy."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.reshape(-1).view(torch.uint8)


def _as_words(b: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor whose size is a multiple of 8, as int64 words: a view where its storage offset allows, else a
    copy."""
    try:
        return b.view(torch.int64)
    except RuntimeError:
        return b.clone().view(torch.int64)
