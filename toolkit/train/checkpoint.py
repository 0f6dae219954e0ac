"""Verified, atomic, per-rank checkpoints and the rollback agreement between ranks.

Why: recovery is only as good as the checkpoint it resumes from. A worker killed mid-write, a full disk or a
flipped bit must never cost more than falling back to the previous checkpoint, and ranks must never resume from
different steps (the replicas would silently diverge). So:

- one file per step, ``step_<012d>.ckpt`` in the rank's directory (``<CKPT_DIR>/rank_<r>/``), written to a
  temporary name in the same directory, fsynced, renamed, and the directory fsynced: a file under its final name
  is complete, one rename is the commit;
- the file carries its own checksum: a header ``TKCKPT01 | step | payload length | sha256(payload)`` followed by
  the ``torch.save`` payload, so truncation, corruption and a misnamed file are all caught by one check and no
  sidecar can disagree with its data;
- at least ``keep_max >= 2`` files are kept (MindSpore's rule), the oldest pruned only after the new one is
  durable;
- on start each rank lists the steps it has intact, the ranks agree on the newest step *every* rank has
  (``agree_on_step``), and files newer than that (an abandoned timeline) are removed;
- an asynchronous mode snapshots the state (cloned to CPU memory, never aliased) at the step boundary and writes
  it in a background thread, so the training loop stalls only for the copy.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import io
import logging
import os
import random
import re
import shutil
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from toolkit import atomicfile
from toolkit.atomicfile import TMP_PREFIX, Durability

log = logging.getLogger(__name__)

MAGIC = b"TKCKPT01"
HEADER = struct.Struct("<8sQQ32s")  # magic, step, payload length, sha256 of the payload
FILE_RE = re.compile(r"^step_(\d{12})\.ckpt$")
MIN_KEEP = 2
DEFAULT_WRITE_TIMEOUT = 600.0

_REASONS = MappingProxyType({
    errno.ENOSPC: ("no space left on device", "free space there or point CKPT_DIR at a larger disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space there or point CKPT_DIR at a larger disk"),
    errno.EACCES: ("permission denied", "make the directory writable for this user or point CKPT_DIR elsewhere"),
    errno.EPERM: ("operation not permitted", "make the directory writable for this user or point CKPT_DIR elsewhere"),
    errno.EROFS: ("read-only file system", "point CKPT_DIR at a writable file system"),
})


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read. One line: which directory/file, why, and what to do."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file failed verification (truncated, corrupted, or not a checkpoint)."""


@dataclass(frozen=True)
class Damaged:
    """A checkpoint file that did not verify, and why; reported, then skipped for an older one."""

    path: Path
    reason: str


@dataclass(frozen=True)
class Scan:
    """What a rank's directory holds: the steps that verified (ascending) and the files that did not."""

    intact: tuple[int, ...]
    damaged: tuple[Damaged, ...]


# ----------------------------------------------------------------------------------------------------------
# File format


def checkpoint_name(step: int) -> str:
    """The file name of `step`'s checkpoint, ``step_<012d>.ckpt``: zero-padded, so names sort as steps do."""
    return f"step_{step:012d}.ckpt"


def encode(step: int, state: dict[str, Any]) -> bytes:
    """Header with the payload's sha256, then the ``torch.save`` payload."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    header = HEADER.pack(MAGIC, step, len(payload), hashlib.sha256(payload).digest())
    return header + payload


def decode(data: bytes, path: Path, expect_step: int | None = None) -> dict[str, Any]:
    """Verify and unpickle one checkpoint file's bytes; ``CorruptCheckpoint`` says what is wrong with it."""
    reason = verify_bytes(data, expect_step)
    if reason is not None:
        raise CorruptCheckpoint(f"{path}: {reason}")
    try:
        return torch.load(io.BytesIO(memoryview(data)[HEADER.size :]), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the checksum matched, so this is a file we did not write
        raise CorruptCheckpoint(f"{path}: checksum matches but the payload does not load ({e})") from None


def verify_bytes(data: bytes, expect_step: int | None = None) -> str | None:
    """None if ``data`` is a complete checkpoint (of ``expect_step``), else the reason it is not."""
    if len(data) < HEADER.size:
        return f"truncated: {len(data)} bytes, shorter than the {HEADER.size}-byte header"
    magic, step, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not a toolkit checkpoint (bad magic)"
    if expect_step is not None and step != expect_step:
        return f"holds step {step}, not the step {expect_step} its name says"
    body = memoryview(data)[HEADER.size :]
    if len(body) != length:
        state = "truncated" if len(body) < length else "has trailing bytes"
        return f"{state}: payload is {len(body)} bytes, header says {length}"
    if hashlib.sha256(body).digest() != digest:
        return "corrupt: sha256 of the payload does not match the header"
    return None


# ----------------------------------------------------------------------------------------------------------
# Snapshots and RNG state


def snapshot(obj: Any) -> Any:
    """Deep copy with every tensor cloned to CPU memory. Why clone: a snapshot that aliases live parameters or
    optimizer buffers changes under the writer (or, on load, shares one buffer between two owners — DLRover's
    resume bug)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v) for v in obj)
    return obj


def capture_rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), Python and numpy global generators, in types ``torch.load(weights_only=True)``
    accepts; restoring them makes dropout and any random augmentation replay exactly."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set torch's, Python's and numpy's global generators (CUDA's too, if saved and available here) to a
    ``capture_rng_state`` result, so the randomness that followed the capture replays exactly."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------------------
# Durable writes


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def write_error(e: OSError, directory: Path, what: str, size: int | None = None) -> CheckpointError:
    """One line for a failed write: where, why, what to do; and that the older files were left alone."""
    reason, fix = _REASONS.get(e.errno or 0, (e.strerror or str(e), "check the directory"))
    detail = ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT) and size is not None:
        free = _free_bytes(directory)
        detail = f" (needs {size / 1e6:.1f} MB" + (f", {free / 1e6:.1f} MB free)" if free is not None else ")")
    return CheckpointError(
        f"cannot write {what} in {directory}: {reason}{detail}; {fix}; the previous checkpoints are untouched"
    )


def write_atomic(path: Path, data: bytes | memoryview, what: str | None = None) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either its old content or all of ``data``, durably
    (toolkit.atomicfile, Durability.DURABLE). On failure nothing else is touched; the error is a
    ``CheckpointError`` that says where, why and what to do."""
    try:
        atomicfile.write(path, data, mode=0o600, durability=Durability.DURABLE)
    except OSError as e:
        raise write_error(e, path.parent, what or path.name, len(data)) from None


# ----------------------------------------------------------------------------------------------------------
# Rollback agreement


def newest_common_step(step_lists: Iterable[Iterable[int]]) -> int | None:
    """The newest step present in every list; None if there is none (or no list): then all start fresh."""
    common: set[int] | None = None
    for steps in step_lists:
        common = set(steps) if common is None else common & set(steps)
    return max(common) if common else None


def agree_on_step(local_steps: Iterable[int], group: Any = None) -> int | None:
    """Every rank of ``group`` calls this with the steps it has intact; all get the same answer: the newest
    step all of them have. A rank that lost its newest checkpoint pulls everyone back to an older one instead
    of splitting the cluster. Without an initialised process group it is this process alone."""
    mine = sorted(set(int(s) for s in local_steps))
    if not (dist.is_available() and dist.is_initialized()):
        return newest_common_step([mine])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return newest_common_step(gathered)


# ----------------------------------------------------------------------------------------------------------
# The manager


class CheckpointManager:
    """One rank's checkpoint directory: save every N steps (sync or async), scan, load, prune, discard.

    Use it as a context manager (or call ``close()``) so that an asynchronous write in flight is finished before
    the process exits; an ``atexit`` hook does the same for a process that forgets. One manager per directory:
    on start it deletes temp files left by a previous incarnation that died mid-write.

    ``on_commit(step)`` is called once the file of ``step`` is durable (after the rename and the directory
    fsync): on the caller's thread for a synchronous save, on the writer thread for an asynchronous one. Why a
    hook: ``save`` returning is not the commit in async mode, and the job's record of the newest durable step
    (``Runtime.committed``) must never run ahead of the disk. An exception from the hook is logged, never
    turned into a failed checkpoint (the file is durable).
    """

    def __init__(
        self,
        directory: str | Path,
        keep_max: int = 2,
        *,
        async_write: bool = False,
        write_timeout: float = DEFAULT_WRITE_TIMEOUT,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        if keep_max < MIN_KEEP:
            raise ValueError(
                f"keep_max must be >= {MIN_KEEP}, got {keep_max}: with one checkpoint a damaged newest file "
                "leaves nothing to fall back to"
            )
        if write_timeout <= 0:
            raise ValueError(f"write_timeout must be > 0 seconds, got {write_timeout}")
        self.directory = Path(directory)
        self.keep_max = keep_max
        self.async_write = async_write
        self.write_timeout = write_timeout
        self.on_commit = on_commit
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(e, self.directory.parent, f"checkpoint directory {self.directory.name}") from None
        probe = self.directory / f"{TMP_PREFIX}probe.{os.getpid()}"
        try:  # fail at start, not at the first save hours later (root passes os.access on a read-only mount)
            with open(probe, "wb"):
                pass
            probe.unlink()
        except OSError as e:
            raise write_error(e, self.directory, "checkpoints") from None
        self._remove_stale_temps()
        self._cond = threading.Condition()
        self._queued: tuple[int, dict[str, Any]] | None = None
        self._busy = False
        self._error: CheckpointError | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if async_write:
            self._thread = threading.Thread(target=self._writer, name=f"ckpt-writer:{self.directory}", daemon=True)
            self._thread.start()
            atexit.register(self._close_at_exit)

    # --- listing and reading ---

    def path_for(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is, or would be, in this rank's directory."""
        return self.directory / checkpoint_name(step)

    def steps_on_disk(self) -> list[int]:
        """Steps with a file under its final name, ascending, verified or not."""
        steps = []
        for p in self.directory.iterdir():
            m = FILE_RE.match(p.name)
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def verify(self, step: int) -> str | None:
        """None if the file of ``step`` is complete and matches its checksum, else why not."""
        path = self.path_for(step)
        try:
            data = path.read_bytes()
        except OSError as e:
            return f"unreadable ({e.strerror})"
        return verify_bytes(data, step)

    def scan(self) -> Scan:
        """Verify every file; damaged ones are logged (the MindX "integrity check with fallback")."""
        intact, damaged = [], []
        for step in self.steps_on_disk():
            reason = self.verify(step)
            if reason is None:
                intact.append(step)
            else:
                bad = Damaged(self.path_for(step), reason)
                damaged.append(bad)
                log.warning("checkpoint %s is damaged (%s); it will not be used", bad.path, reason)
        return Scan(tuple(intact), tuple(damaged))

    def load(self, step: int) -> dict[str, Any]:
        """The verified state of ``step``'s checkpoint, tensors on CPU. ``CheckpointError`` if the file is missing
        or unreadable, ``CorruptCheckpoint`` if it fails verification or does not load; nothing falls back here
        (``load_latest`` and ``resume`` do)."""
        path = self.path_for(step)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no checkpoint of step {step} in {self.directory}") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        return decode(data, path, step)

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """Newest checkpoint that verifies, falling back past damaged ones; None for a fresh start. For a single
        process; ranks of a group use ``resume`` so that they agree."""
        for step in reversed(self.steps_on_disk()):
            try:
                return step, self.load(step)
            except CorruptCheckpoint as e:
                log.warning("%s; falling back to the previous checkpoint", e)
        return None

    def discard_after(self, step: int | None) -> list[int]:
        """Remove checkpoints newer than ``step`` (all of them for None): after a rollback they belong to a
        timeline that no longer exists, and left in place they would be resumed from (or keep newer files from
        being pruned). Returns the removed steps."""
        self.flush()
        removed = [s for s in self.steps_on_disk() if step is None or s > step]
        for s in removed:
            self.path_for(s).unlink(missing_ok=True)
        if removed:
            atomicfile.fsync_dir(self.directory)
        return removed

    # --- writing ---

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Make ``state`` the checkpoint of ``step``. Synchronous: returns once the file is durable. Async:
        returns after cloning the state to memory (waiting first, bounded, if the previous write is still
        queued); a failed background write is raised by the next ``save``/``flush``/``close``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._raise_pending()
        if not self.async_write:
            self._write(step, state)
            self._committed(step)
            return
        with self._cond:
            if self._closed:
                raise CheckpointError(f"checkpoint manager for {self.directory} is closed")
            if not self._cond.wait_for(lambda: self._queued is None, timeout=self.write_timeout):
                raise CheckpointError(
                    f"previous checkpoint in {self.directory} still being written after {self.write_timeout:.0f} s; "
                    "the disk is too slow for this checkpoint interval: save less often"
                )
        copy = snapshot(state)
        with self._cond:
            self._queued = (step, copy)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait (bounded) until every queued write is durable; raise a background write's error."""
        if self._thread is not None:
            limit = self.write_timeout if timeout is None else timeout
            with self._cond:
                done = self._cond.wait_for(lambda: self._queued is None and not self._busy, timeout=limit)
            if not done:
                raise CheckpointError(f"checkpoint write in {self.directory} not finished after {limit:.0f} s")
        self._raise_pending()

    def close(self, timeout: float | None = None) -> None:
        """Flush and stop the writer thread."""
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join(timeout=self.write_timeout if timeout is None else timeout)
                atexit.unregister(self._close_at_exit)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prune(self) -> list[int]:
        """Remove the oldest files beyond ``keep_max``; returns the removed steps."""
        steps = self.steps_on_disk()
        removed = steps[: max(0, len(steps) - self.keep_max)]
        for s in removed:
            try:
                self.path_for(s).unlink(missing_ok=True)
            except OSError as e:
                log.warning("could not prune %s: %s", self.path_for(s), e.strerror)
        return removed

    # --- internals ---

    def _write(self, step: int, state: dict[str, Any]) -> None:
        data = encode(step, state)
        write_atomic(self.path_for(step), data, what=f"checkpoint of step {step}")
        self.prune()

    def _writer(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closed)
                if self._queued is None:
                    return
                step, state = self._queued
                self._queued = None
                self._busy = True
                self._cond.notify_all()
            error: CheckpointError | None = None
            try:
                self._write(step, state)
            except CheckpointError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - keep the thread alive; the training thread raises it
                error = CheckpointError(f"checkpoint of step {step} in {self.directory} failed: {e!r}")
            finally:
                del state
                if error is None:
                    self._committed(step)  # before the flush below returns: flush() means "committed and told"
                with self._cond:
                    if error is not None:
                        self._error = error
                    self._busy = False
                    self._cond.notify_all()

    def _committed(self, step: int) -> None:
        if self.on_commit is None:
            return
        try:
            self.on_commit(step)
        except Exception as e:  # noqa: BLE001 - the user's hook: a failure of it is logged, the commit stands
            log.error("on_commit hook for step %d in %s failed: %r", step, self.directory, e)

    def _raise_pending(self) -> None:
        with self._cond:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except CheckpointError as e:
            log.error("%s", e)

    def _remove_stale_temps(self) -> None:
        """Temp files of a previous incarnation that died mid-write: never committed, safe to delete."""
        for p in self.directory.iterdir():
            if p.name.startswith(TMP_PREFIX):
                try:
                    p.unlink()
                except OSError:
                    pass


# ----------------------------------------------------------------------------------------------------------
# Resume


@dataclass(frozen=True)
class Resume:
    """The outcome of the start-up agreement: the step every rank resumes from (None = fresh start), its state,
    what this rank had to skip, and what it removed as newer than the agreed step."""

    step: int | None
    state: dict[str, Any] | None
    damaged: tuple[Damaged, ...]
    discarded: tuple[int, ...]


def resume(manager: CheckpointManager, group: Any = None) -> Resume:
    """Scan, agree with the other ranks of ``group`` on the newest step all have intact, load it, and remove this
    rank's files newer than it. Collective: every rank of ``group`` must call it."""
    scan = manager.scan()
    step = agree_on_step(scan.intact, group)
    state = manager.load(step) if step is not None else None
    discarded = manager.discard_after(step)
    return Resume(step, state, scan.damaged, tuple(discarded))
