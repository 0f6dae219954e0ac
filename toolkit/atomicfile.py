"""The one way toolkit replaces a file: readers see the old content or the new, never a part of either.

How: the data goes to a temporary file in the same directory (created with its final mode, so a secret is never
readable under a looser one), which is renamed over the target. The temporary name is random and the file is
created with O_EXCL | O_NOFOLLOW: a link or file planted at a name the writer will use is never followed or
truncated (another user who could predict the name could otherwise make the writer overwrite a file of theirs
choosing). Durability is named, because the callers need
different things and the difference costs fsyncs:

- VISIBLE: rename only. For documents rewritten often and worth only their newest version (agent.json, the local
  job record): after a crash the file may be the old one, never a torn one.
- DURABLE: fsync the file before the rename and the directory after it. For what must survive a machine crash
  once written (the scheduler's persisted state: a restarted scheduler must never hand out a generation twice).
"""

from __future__ import annotations

import enum
import errno
import os
import secrets
from pathlib import Path

TMP_PREFIX = ".tmp-"
CREATE_ATTEMPTS = 8  # random temporary names tried before giving up (a collision means someone is planting them)


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
    fd, name = create_temp(str(path), mode)
    tmp = path.with_name(name)
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


def temp_name(final: str) -> str:
    """A fresh temporary name for a file that will be renamed to `final`: TMP_PREFIX, `final`, 64 random bits."""
    return f"{TMP_PREFIX}{final}.{secrets.token_hex(8)}"


def create_temp(final: str, mode: int = 0o600, dir_fd: int | None = None) -> tuple[int, str]:
    """Create a new empty file named `temp_name` of `final`'s name, next to `final` (a path, relative to `dir_fd`
    if given), with O_EXCL and O_NOFOLLOW, so that nothing already there is followed or truncated. Returns the fd
    and the new file's name (without the directory). OSError on failure."""
    head, tail = os.path.split(final)
    for _ in range(CREATE_ATTEMPTS):
        name = os.path.join(head, temp_name(tail))
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=dir_fd)
        except FileExistsError:
            continue
        return fd, os.path.basename(name)
    raise OSError(errno.EEXIST, f"{CREATE_ATTEMPTS} random temporary names for {final} were all taken")


def fsync_dir(directory: str | Path) -> None:
    """fsync `directory` itself, so that renames and unlinks in it survive a machine crash; OSError on failure."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
