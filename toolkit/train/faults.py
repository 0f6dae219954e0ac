"""The worker's exceptions, all in one place, and how a worker tells a failed collective from the script's own error
and names an error in one line.

- The job moved on (control flow of the recovery, caught by the Trainer's one guard, Runtime.guard):
  GenerationChanged, JobStopped, Abandoned (a wait the fence ended).
- Joining the job: RegistrationError (one line for the user), Rejected (the scheduler's word on one attempt),
  RuntimeConfigError (the worker's environment).
- Moving state: TransferError, StoreError / StoreRefused.
- Checkpoints: CheckpointError / CorruptCheckpoint, DirectoryError, BadPart (one file not to use).
- The script's own inputs: TrainerError (the loop uses the Trainer wrongly), DataError, LoaderError,
  InjectionError (the operator's fault injector)."""

from __future__ import annotations

import torch.distributed as dist

from toolkit.errors import UserError

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


class GenerationChanged(Exception):
    """The job moved to a new generation (a member died or was replaced): the current process group is no longer
    valid. Call `Runtime.reform()`, then roll back to the newest common checkpoint."""

    def __init__(self, old: int | None, new: int) -> None:
        super().__init__(f"generation changed from {old} to {new}: call reform() and roll back")
        self.old = old
        self.new = new


class JobStopped(RuntimeError):
    """The scheduler ended the job (a node gave up, or formation timed out); the message says why."""


class Abandoned(RuntimeError):
    """The group was abandoned (a new generation began, or under torchrun a peer is gone) while this call waited on
    it. Its text names gloo and the connection, as a collective's failure does, so that the runtime treats it as
    one."""

    @classmethod
    def during(cls, what: str) -> "Abandoned":
        """The error of a wait on `what` (a collective's name) that the trip ended."""
        return cls(f"gloo: {what} abandoned: the group's connections were shut down (a new generation began, or a "
                   "peer is gone)")


class RegistrationError(UserError, RuntimeError):
    """This worker could not join the job: scheduler unreachable, wrong token, or its node id is held by a live
    process. The message says which and what to do."""


class Rejected(Exception):
    """The scheduler refused a registration: its reason, and whether a later attempt may succeed."""

    def __init__(self, reason: str, retry: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry


class RuntimeConfigError(UserError, ValueError):
    """The MS_*/torchrun environment of this worker is incomplete or contradictory."""


class TransferError(RuntimeError):
    """The state cannot be described (a value of a type that cannot travel), or a peer's description is not one
    this module wrote. The message names the place in the state or what is wrong."""


class StoreError(RuntimeError):
    """The store refused a request, or it timed out; torch reports it like a TCPStore error."""


class StoreRefused(StoreError):
    """The store proved the job token and refused this connection; `retry` is its word on trying again."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read. One line: which directory/file, why, and what to do."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint failed verification (truncated, corrupted, not a checkpoint, or not this job's)."""


class DirectoryError(RuntimeError):
    """The directory cannot be used (another user can change it, or it cannot be made); one line saying so."""


class BadPart(Exception):
    """A checkpoint file that must not be used: why (truncated, not a checkpoint, fails authentication, ...)."""


class TrainerError(RuntimeError):
    """The training loop uses the Trainer wrongly (a loop, an argument or a state that cannot work); the message
    says how to fix it."""


class DataError(ValueError):
    """A dataset file or directory that cannot be used; the message names it and says what to do."""


class LoaderError(ValueError):
    """The loader cannot be positioned (no length); the message says what to change."""


class InjectionError(UserError, ValueError):
    """TOOLKIT_INJECT_CORRUPTION cannot be read; the message names the entry and what to write."""
