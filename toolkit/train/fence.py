"""Abandon a process group from another thread, so that a call blocked in it returns at once.

Why: gloo cannot interrupt a collective (pytorch#130345). When a rank dies mid-collective the survivors can be
left waiting on each other (one may have finished the collective the others did not) until the collective
timeout: minutes by default. The scheduler tells every survivor within milliseconds that the job moved to a new
generation, on the worker's control thread; this module lets that thread make the main thread's blocked call
fail right then, so recovery costs the same wherever in a step the fault lands.

How: on CPU (gloo) a group's transport is its TCP connections. The sockets a group build opened are recorded
(`SocketSet.opened_since`), and `Fence.trip()` shuts them down: every pending read and write on them fails as
if the peer had vanished, gloo raises, and the call returns with an error (which the runtime turns into
GenerationChanged). Shutting a socket down is all the side thread does; closing and freeing stay with the main
thread (`destroy_process_group`), so no descriptor is ever closed under a thread using it. A recorded socket is
identified by descriptor and inode: a descriptor number reused after the group closed is never touched. On CUDA
(NCCL) the group's own abort is the tool (`ProcessGroupNCCL` aborts its communicators, ncclCommAbort): that path
is written here but was not run on this project's CPU-only machines.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

FD_DIR = "/proc/self/fd"


def tcp_sockets() -> dict[int, int]:
    """{descriptor: inode} of this process's TCP sockets (IPv4 and IPv6), from /proc/self/fd."""
    out: dict[int, int] = {}
    for name in os.listdir(FD_DIR):
        try:
            target = os.readlink(f"{FD_DIR}/{name}")
        except OSError:
            continue  # closed meanwhile
        if not target.startswith("socket:["):
            continue
        fd = int(name)
        inode = int(target[len("socket:["):-1])
        if _is_tcp(fd):
            out[fd] = inode
    return out


def _is_tcp(fd: int) -> bool:
    """A TCP connection, not a listener: gloo's accept loop treats a failing listener as fatal (it aborts the
    process), and a listener carries no collective anyway."""
    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if probe.family not in (socket.AF_INET, socket.AF_INET6) or probe.type != socket.SOCK_STREAM:
            return False
        return not probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    finally:
        probe.close()  # closes the duplicate only


@dataclass
class Fence:
    """What to cut to abandon the process group of one generation: its TCP sockets (gloo) or the group itself
    (NCCL).

    Thread-safe: the main thread arms it for the generation it builds and records what the build opened
    (`arm`, `add_sockets`, `add_group`), and disarms it before destroying the group; the control thread calls
    `overtaken(announced)` whenever the scheduler announces a generation. A fence overtaken while its group is
    still being built trips what is recorded later as well, so a build that a new generation overtook fails
    fast too."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _sockets: dict[int, int] = field(default_factory=dict)
    _groups: list[Any] = field(default_factory=list, repr=False)
    generation: int | None = None  # the generation whose group is recorded; None: disarmed
    tripped: bool = False

    def arm(self, generation: int) -> None:
        """Start recording the group being built for `generation`: forget what was recorded before, clear a trip."""
        with self._lock:
            self._sockets, self._groups = {}, []
            self.generation, self.tripped = generation, False

    def disarm(self) -> None:
        """Forget the group (it is being destroyed): a later trip must not touch descriptors reused since."""
        with self._lock:
            self._sockets, self._groups = {}, []
            self.generation, self.tripped = None, False

    def add_sockets(self, sockets: dict[int, int]) -> None:
        """Record sockets the group's build opened ({descriptor: inode}, from `opened_since`); if the fence has
        already tripped, shut them down at once."""
        with self._lock:
            self._sockets.update(sockets)
            if self.tripped:
                _shutdown(sockets)

    def add_group(self, group: Any) -> None:
        """A group whose backend can abort itself (NCCL)."""
        with self._lock:
            self._groups.append(group)
            if self.tripped:
                _abort(group)

    def overtaken(self, announced: int) -> int:
        """The job moved to generation `announced`: if that is newer than the armed one, make every call
        blocked in its group fail now. Returns the number of sockets shut down (0 if nothing was tripped)."""
        with self._lock:
            if self.tripped or self.generation is None or announced <= self.generation:
                return 0
            self.tripped = True
            for group in self._groups:
                _abort(group)
            return _shutdown(self._sockets)


def opened_since(before: dict[int, int]) -> dict[int, int]:
    """The TCP sockets opened since `before` (a tcp_sockets() result) that are still open."""
    return {fd: inode for fd, inode in tcp_sockets().items() if before.get(fd) != inode}


def _shutdown(sockets: dict[int, int]) -> int:
    done = 0
    for fd, inode in sockets.items():
        try:
            if os.fstat(fd).st_ino != inode:
                continue  # the group closed it and the number now names something else
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            probe.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # not connected (yet, or any more): nothing blocks on it
        finally:
            probe.close()
    return done


def _abort(group: Any) -> None:
    """NCCL: abort the group's communicators; its blocked collectives return with an error."""
    abort = getattr(group, "abort", None)
    if callable(abort):
        try:
            abort()
        except RuntimeError:
            pass
        return
    import torch.distributed.distributed_c10d as c10d

    try:
        c10d._abort_process_group(group)
    except (RuntimeError, AttributeError):
        pass
