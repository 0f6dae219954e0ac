"""The worker's faults: TrainerError (the training loop uses the Trainer wrongly), how a worker tells a failed
collective from the script's own error, and how it names an error in one line. TrainerError lives here, not in
trainer.py, so that the Trainer's parts (agreement, checkpointing) raise it without importing the Trainer."""

from __future__ import annotations

import torch.distributed as dist


class TrainerError(RuntimeError):
    """The training loop uses the Trainer wrongly (a loop, an argument or a state that cannot work); the message
    says how to fix it."""


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
