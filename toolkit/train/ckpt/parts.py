"""A state dict cut into the parts that the ranks of one host write, and put together again.

Why: in data parallelism every rank holds the same model, optimizer and extra state, so a host needs one copy of
it, not one per rank; and the ranks of a host can share the writing (each stages and writes about 1/L of the
bytes, L the ranks on the host), so a checkpoint costs each of them 1/L of the copy and of the memory.

A part holds the state's structure (the skeleton: every container and plain value, each tensor replaced by an
empty one of its dtype: a few KB) and its own tensors with their ordinals (their places in the order in which the
skeleton is walked). Tensors go to parts whole, largest first to the lightest part (LPT), so the parts' sizes are
within one tensor of each other; every rank computes the same assignment from its identical replica.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable

import torch

SKELETON, COUNT, ORDINALS, TENSORS = "skeleton", "count", "ordinals", "tensors"


@dataclass(frozen=True)
class Split:
    """`state` cut for `parts` writers: the skeleton, every tensor in walking order, and the part of each."""

    skeleton: Any
    tensors: tuple[torch.Tensor, ...]
    owner: tuple[int, ...]

    def ordinals(self, part: int) -> list[int]:
        """The ordinals of the tensors that `part` writes."""
        return [i for i, p in enumerate(self.owner) if p == part]

    def payload(self, part: int, tensors: list[torch.Tensor] | None = None) -> dict[str, Any]:
        """What the file of `part` holds: the skeleton, the number of tensors, its ordinals and tensors (given,
        e.g. staged copies in the order of `ordinals(part)`, or else the split's own)."""
        ordinals = self.ordinals(part)
        own = [self.tensors[i] for i in ordinals] if tensors is None else tensors
        return {SKELETON: self.skeleton, COUNT: len(self.tensors), ORDINALS: ordinals, TENSORS: own}


def _walk(obj: Any, leaf: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` rebuilt with every tensor replaced by `leaf(tensor)`, in a fixed order (dicts in insertion order)."""
    if isinstance(obj, torch.Tensor):
        return leaf(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _walk(v, leaf)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_walk(v, leaf) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_walk(v, leaf) for v in obj)
    return obj


def split(state: Any, parts: int) -> Split:
    """Cut `state` for `parts` writers (module docstring). The tensors are the state's own (not copied)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    tensors: list[torch.Tensor] = []

    def hole(t: torch.Tensor) -> torch.Tensor:
        tensors.append(t)
        return torch.empty(0, dtype=t.dtype)

    skeleton = _walk(state, hole)
    owner = [0] * len(tensors)
    loads = [(0, p) for p in range(parts)]
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].nbytes):
        load, p = heapq.heappop(loads)
        owner[i] = p
        heapq.heappush(loads, (load + tensors[i].nbytes, p))
    return Split(skeleton, tuple(tensors), tuple(owner))


def merge(payloads: list[dict[str, Any]]) -> Any:
    """The state the payloads of every part of one copy make together. ValueError (why) when they do not fit:
    different tensor counts, an ordinal missing, twice or out of range, or a malformed payload."""
    if not payloads:
        raise ValueError("no parts")
    try:
        count = payloads[0][COUNT]
        slots: list[torch.Tensor | None] = [None] * count
        for payload in payloads:
            if payload[COUNT] != count or len(payload[ORDINALS]) != len(payload[TENSORS]):
                raise ValueError("the parts disagree on the number of tensors")
            for i, t in zip(payload[ORDINALS], payload[TENSORS], strict=True):
                if not (isinstance(i, int) and 0 <= i < count) or slots[i] is not None:
                    raise ValueError(f"tensor {i} is out of range or in two parts")
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"tensor {i} is not a tensor")
                slots[i] = t
        skeleton = payloads[0][SKELETON]
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed part ({e!r})") from None
    missing = [i for i, t in enumerate(slots) if t is None]
    if missing:
        raise ValueError(f"{len(missing)} tensor(s) in no part (first: {missing[0]})")
    filled = iter(slots)

    def fill(_: torch.Tensor) -> torch.Tensor:
        t = next(filled, None)
        if t is None:
            raise ValueError("the skeleton holds more tensors than the parts")
        return t

    state = _walk(skeleton, fill)
    if next(filled, None) is not None:
        raise ValueError("the skeleton holds fewer tensors than the parts")
    return state
