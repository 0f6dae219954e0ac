"""A worker's latest step, shared with its agent through a small file both map (TOOLKIT_STEP_FILE, in the agent's
0700 state directory): the one definition of that document.

The restart budget forgives a crash only when the incarnation got past the step at which the previous one failed
(toolkit.contracts.hostspec.RestartPolicy), so the agent must know the step a worker reached when it died, exactly,
however it died (SIGKILL, SIGSEGV and the OOM killer included). Progress datagrams come at most once a second and may
lag by a second of steps; this file is written in place at every step (one store into shared memory, no system call)
and read by the agent after the death. The agent makes it before each launch holding NO_STEP; a worker that reports
no step (a plain script) leaves it so, and then every crash counts."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

NO_STEP = -1
_FORMAT = "<q"  # one signed 64-bit step, little-endian
SIZE = struct.calcsize(_FORMAT)


def reset(path: Path) -> None:
    """(The agent, before a launch.) Make `path` hold NO_STEP, replacing what was there; never follows a link.
    Raises OSError."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, struct.pack(_FORMAT, NO_STEP))
    finally:
        os.close(fd)


def read(path: Path) -> int | None:
    """(The agent, after an exit.) The step the worker last reported, or None: no file, no step, or not a step."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, SIZE)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) != SIZE:
        return None
    (step,) = struct.unpack(_FORMAT, data)
    return step if step >= 0 else None


class Writer:
    """(The worker.) The mapped file: `set` stores a step in place. Open it with `open`."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self._map = mapped

    @classmethod
    def open(cls, path: str | None) -> Writer | None:
        """The file the agent made at `path`, mapped; None without a path, or if it is not a regular file of SIZE
        bytes that can be opened without following a link (the worker then reports no step; nothing fails)."""
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != SIZE:
                return None
            return cls(mmap.mmap(fd, SIZE))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def set(self, step: int) -> None:
        """Store `step` (a completed step, >= 0) where the agent will read it."""
        struct.pack_into(_FORMAT, self._map, 0, step)

    def close(self) -> None:
        self._map.close()
