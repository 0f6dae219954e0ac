"""The one way toolkit replaces a file: readers see the old content or the new, never a part of either.

How: the data goes to a temporary file in the same directory (created with its final mode, so a secret is never
readable under a looser one), which is renamed over the target. Durability is named, because the callers need
different things and the difference costs fsyncs:

- VISIBLE: rename only. For documents rewritten often and worth only their newest version (agent.json, the local
  job record): after a crash the file may be the old one, never a torn one.
- DURABLE: fsync the file before the rename and the directory after it. For what must survive a machine crash
  once written (the scheduler's persisted state: a restarted scheduler must never hand out a generation twice).
"""

from __future__ import annotations

import enum
import os
import threading
from pathlib import Path

TMP_PREFIX = ".tmp-"


class Durability(enum.Enum):
    """How far a `write` must get before it returns (module docstring): VISIBLE renames only, DURABLE also
    fsyncs the file and its directory."""

    VISIBLE = "visible"
    DURABLE = "durable"


def write(path: str | Path, data: bytes | bytearray | memoryview | str, mode: int = 0o600,
          durability: Durability = Durability.VISIBLE) -> None:
    """Replace `path` with `data`, atomically, with `mode` (not subject to the umask). OSError on failure, with
    the temporary file removed."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            if durability is Durability.DURABLE:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    if durability is Durability.DURABLE:
        fsync_dir(path.parent)


def fsync_dir(directory: str | Path) -> None:
    """fsync `directory` itself, so that renames and unlinks in it survive a machine crash; OSError on failure."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
