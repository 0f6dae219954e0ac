"""The background writer of checkpoint files: one thread, one write in flight and one job queued at most (the single
slot), used by the replicated checkpoints (toolkit.train.ckpt.manager) and the sharded ones
(toolkit.train.ckpt.shards).

Why one slot: a checkpoint's job holds a host copy of the tensors it writes; a queue would hold one per job while a
slow disk falls behind, so the next `put` waits (bounded) for the slot instead, and a disk too slow for the interval
is said in one line. Why a staging flag: a job may leave some tensors for the writer to copy (the replicated
checkpoints copy the parameters and optimizer state while the next forward and backward run); `wait_staged` is how
the training thread waits for that copy before it changes them. An error of a background write is kept and raised
by the next `put`, `flush` or `close` on the training thread, one line (CheckpointError)."""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Generic, Protocol, TypeVar

from toolkit.train.faults import CheckpointError

log = logging.getLogger("toolkit.train.ckpt.manager")


class Job(Protocol):
    """What the writer needs of a job: its step (for the lines), and `stage` (copy what `put` left to the writer)."""

    @property
    def step(self) -> int: ...

    def stage(self) -> None: ...


J = TypeVar("J", bound=Job)


class SlotWriter(Generic[J]):
    """Writes jobs with `write(job)` (True: written and durable, then `committed(step)`; False: skipped, e.g. a full
    disk) on a thread of its own; `what` names the files in the lines ("checkpoint", "sharded checkpoint"),
    `directory` where they go. Bounded waits of `timeout` s. An atexit hook finishes the write in flight for a
    process that forgets to close."""

    def __init__(self, write: Callable[[J], bool], committed: Callable[[int], None], *, what: str, directory: Path,
                 timeout: float) -> None:
        self._write = write
        self._committed = committed
        self.what = what
        self.directory = directory
        self.timeout = timeout
        self._cond = threading.Condition()
        self._queued: J | None = None
        self._busy = False
        self._staging = False  # the writer still has to copy tensors the training loop must not change yet
        self._closed = False
        self._error: CheckpointError | None = None
        self.thread = threading.Thread(target=self._run, name=f"{what} writer:{directory}", daemon=True)
        self.thread.start()
        self._at_exit = functools.partial(_close_quietly, self)
        atexit.register(self._at_exit)

    def slot(self) -> bool:
        """Wait (bounded) for the slot to be free; returns whether a write is still in flight (then the job to queue
        should not leave tensors to stage: the copy would wait behind that write). CheckpointError if closed, or
        if the slot is not free in time."""
        with self._cond:
            if self._closed:
                raise CheckpointError(f"{self.what}s in {self.directory} are closed")
            if not self._cond.wait_for(lambda: self._queued is None, timeout=self.timeout):
                raise CheckpointError(f"previous {self.what} in {self.directory} still being written after "
                                      f"{self.timeout:.0f} s; the disk is too slow for this checkpoint interval: "
                                      "save less often")
            return self._busy

    def put(self, job: J, staging: bool) -> None:
        """Queue `job` in the free slot (`slot` first); `staging`: it leaves tensors for the writer to copy."""
        with self._cond:
            self._queued = job
            self._staging = staging
            self._cond.notify_all()

    def wait_staged(self, timeout: float | None = None) -> float:
        """Block (bounded) until the writer has copied what the queued job left to it; the seconds waited."""
        began = time.monotonic()
        limit = self.timeout if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: not self._staging, timeout=limit):
                raise CheckpointError(f"{self.what} in {self.directory} not staged after {limit:.0f} s")
        return time.monotonic() - began

    def flush(self, timeout: float | None = None) -> None:
        """Wait (bounded) until every queued write is durable; raise a background write's error."""
        limit = self.timeout if timeout is None else timeout
        with self._cond:
            done = self._cond.wait_for(lambda: self._queued is None and not self._busy, timeout=limit)
        if not done:
            raise CheckpointError(f"{self.what} write in {self.directory} not finished after {limit:.0f} s")
        self.raise_pending()

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the thread."""
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self.thread.join(timeout=self.timeout if timeout is None else timeout)
            atexit.unregister(self._at_exit)

    def raise_pending(self) -> None:
        """Raise the error a background write left, once."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closed)
                if self._queued is None:
                    return
                job, self._queued = self._queued, None
                self._busy = True
                self._cond.notify_all()
            error: CheckpointError | None = None
            written = False
            try:
                try:
                    job.stage()
                finally:
                    with self._cond:
                        self._staging = False
                        self._cond.notify_all()
                written = self._write(job)
            except CheckpointError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - keep the thread alive; the training thread raises it
                error = CheckpointError(f"{self.what} of step {job.step} in {self.directory} failed: {e!r}")
            finally:
                step = job.step
                del job
                if written:
                    self._committed(step)  # before the flush below returns: flush() means "committed and told"
                with self._cond:
                    if error is not None:
                        self._error = error
                    self._busy = False
                    self._cond.notify_all()


def _close_quietly(writer: SlotWriter) -> None:
    """At interpreter exit: finish what is in flight; an error is logged (there is no caller left to raise to)."""
    try:
        writer.close()
    except CheckpointError as e:
        log.error("%s", e)
