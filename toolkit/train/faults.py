"""How a worker tells a failed collective from the script's own error, and how it names an error in one line."""

from __future__ import annotations

import torch.distributed as dist

COLLECTIVE_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer")  # in a transport's error text


def looks_collective(e: BaseException) -> bool:
    """Whether `e` may be a collective broken by a peer (its death, a stop, or the fence): torch's DistError, or a
    RuntimeError whose text names the transport or a lost connection. A guess by design: the caller then waits
    (bounded) for the scheduler's word, which settles it."""
    if isinstance(e, dist.DistError):
        return True
    if not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return any(w in text for w in COLLECTIVE_WORDS)


def first_line(e: BaseException) -> str:
    """The first line of `e`'s text, or its type's name when it has none: enough for one log line."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
