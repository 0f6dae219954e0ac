"""Abandon a process group from another thread, so that a call blocked in it returns at once.

Why: gloo cannot interrupt a collective (pytorch#130345). When a rank dies mid-collective the survivors can be
left waiting on each other (one may have finished the collective the others did not) until the collective
timeout: minutes by default. The scheduler tells every survivor within milliseconds that the job moved to a new
generation, on the worker's control thread; this module lets that thread make the main thread's blocked call
fail right then, so recovery costs the same wherever in a step the fault lands. Under torchrun there is no such
word: the launcher's SIGTERM and a connection whose peer hung up are the cue (toolkit.train.stopping).

How: on CPU (gloo) a group's transport is its TCP connections. The sockets a group build opened are recorded
(`opened_since`), and `Fence.abandon()` shuts them down: every pending read and write on them fails as if the
peer had vanished, gloo raises, and the call returns with an error (which the runtime turns into
GenerationChanged, or under torchrun into the end for a restart). Shutting a socket down is all the side thread
does; closing and freeing stay with the main thread (`destroy_process_group`), so no descriptor is ever closed
under a thread using it. A recorded socket is identified by descriptor and inode: a descriptor number reused after
the group closed is never touched. On CUDA (NCCL) the group's own abort is the tool (`ProcessGroupNCCL` aborts its
communicators, ncclCommAbort): that path is written here but was not run on this project's CPU-only machines.

One case the sockets cannot settle: a gloo receive whose message had started to arrive when its connection broke
waits out the collective timeout (gloo's `Pair::signalException` wakes every pending operation of the pair but the
one it is reading; measured: a 2 GB receive from a peer killed mid-way returned after the full timeout). Large
messages are exactly where that happens (the state transfer, a gradient bucket). So waits on large transfers run
in a helper thread (`Fence.call`) or complete futures that a trip fails (`Fence.watch`): the training thread goes
on at the trip, and the abandoned helper ends at its own timeout without touching anything (its connections are
shut). Small collectives were thought safe, until CI (2026-11-26) saw a survivor's 32-byte all_gather outlive the
trip by the whole 120 s timeout while every other rank waited for it to re-form; so the training thread's own
collectives are waited on here too (`Fence.wait`), whatever their size.

A collective that gloo cannot interrupt also holds its group: gloo's destructor waits for the group's queued
collectives, so destroying the group would block the re-forming thread for the rest of the timeout (measured:
`destroy_process_group()` beside a collective no peer answers returned only at its timeout; with one more reference
to the group held, at once). So a collective abandoned by `Fence.wait` is kept with its group ("stranded") until
it ends on its own; the group is freed then, at a later `arm` or `disarm`.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from toolkit.train.faults import Abandoned

T = TypeVar("T")


WAIT_MARGIN = 30.0  # s past the group's timeout before `Fence.wait` gives a collective up itself


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
    _watchers: dict[int, Callable[[], None]] = field(default_factory=dict, repr=False)
    _next_watcher: int = 0
    _stranded: list[tuple[Any, Any]] = field(default_factory=list, repr=False)  # (group, future) abandoned by `wait`
    generation: int | None = None  # the generation whose group is recorded; None: disarmed
    tripped: bool = False
    timeout: float = 1800.0  # s: the group's collective timeout (gloo fails a collective by then: `wait`'s bound)

    def arm(self, generation: int) -> None:
        """Start recording the group being built for `generation`: forget what was recorded before, clear a trip."""
        with self._lock:
            self._sockets, self._groups, self._watchers = {}, [], {}
            self.generation, self.tripped = generation, False
            self._release_ended()

    def disarm(self) -> None:
        """Forget the group (it is being destroyed): a later trip must not touch descriptors reused since."""
        with self._lock:
            self._sockets, self._groups, self._watchers = {}, [], {}
            self.generation, self.tripped = None, False
            self._release_ended()

    @property
    def stranded(self) -> int:
        """Collectives abandoned by `wait` that gloo has not ended yet (each holds its group)."""
        with self._lock:
            self._release_ended()
            return len(self._stranded)

    def _release_ended(self) -> None:
        self._stranded = [(group, future) for group, future in self._stranded if not future.done()]

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (quick, thread-safe: it runs on the thread that trips the fence) when the armed group is
        abandoned, or now if it already was. Returns the function that stops watching. Forgotten at arm/disarm."""
        with self._lock:
            if not self.tripped:
                key, self._next_watcher = self._next_watcher, self._next_watcher + 1
                self._watchers[key] = callback
                return lambda: self._unwatch(key)
        callback()
        return lambda: None

    def _unwatch(self, key: int) -> None:
        with self._lock:
            self._watchers.pop(key, None)

    def call(self, fn: Callable[[], T], what: str) -> T:
        """`fn()` (blocking calls on this fence's group) run in a helper thread; its result or its exception. If
        the fence trips first, Abandoned at once, naming `what`; the helper is left to end at its own timeout."""
        done = threading.Event()
        out: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                out.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out.append((False, e))
            done.set()

        stop = self.watch(done.set)
        try:
            if not done.is_set():
                threading.Thread(target=run, name=f"toolkit-{what}", daemon=True).start()
                done.wait()
        finally:
            stop()
        if not out:
            raise Abandoned.during(what)
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def wait(self, work: Any, what: str, group: Any = None) -> None:
        """Wait for `work` (a collective issued with async_op=True on the group this fence guards; `group`: that
        group, None for the default one) and raise its error, if any. If the fence trips first, Abandoned at once,
        naming `what`, and the work is kept with its group until gloo ends it (module docstring). Bounded: gloo
        fails a collective at the group's timeout, and a work still pending `timeout` + WAIT_MARGIN s after the
        call fails here as a broken collective. With NCCL (a group recorded to abort) the trip aborts the group,
        which fails the wait itself: plain `work.wait()`."""
        with self._lock:
            nccl = bool(self._groups)
        if nccl:
            work.wait()
            return
        done = threading.Event()
        future = work.get_future()
        future.add_done_callback(lambda _: done.set())
        stop = self.watch(done.set)
        try:
            done.wait(self.timeout + WAIT_MARGIN)
        finally:
            stop()
        if future.done():  # (the work's own is_completed() may still say False at this moment)
            work.wait()  # raises the collective's error, if it failed
            return
        import torch.distributed as dist

        with self._lock:
            self._stranded.append((dist.group.WORLD if group is None else group, future))
        if self.tripped:
            raise Abandoned.during(what)
        raise Abandoned(f"gloo: {what} still pending {self.timeout + WAIT_MARGIN:.0f} s after it began, past the "
                        "group's timeout: the connection is taken for broken")

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
        generation = self.generation
        if generation is None or announced <= generation:
            return 0
        return self.abandon(generation)

    def abandon(self, generation: int) -> int:
        """Make every call blocked in the group of `generation` fail now, if that group is the one armed and the
        fence has not tripped yet. Returns the number of sockets shut down (0 if nothing was tripped)."""
        with self._lock:
            if self.tripped or self.generation != generation:
                return 0
            self.tripped = True
            for group in self._groups:
                _abort(group)
            done = _shutdown(self._sockets)
            watchers, self._watchers = list(self._watchers.values()), {}
        for callback in watchers:
            callback()
        return done

    def wait_hangup(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a recorded connection to lose its peer: True once the peer has closed or reset
        one (or it is no longer open: gloo closed it on an error), False at the timeout or with nothing recorded
        (NCCL). The kernel says it (poll for POLLRDHUP; data arriving does not wake it): a peer's death is seen
        the moment its connections close. Only reads: it never touches the group."""
        with self._lock:
            sockets = dict(self._sockets)
        if not sockets:
            return False
        poller = select.poll()
        for fd, inode in sockets.items():
            try:
                if os.fstat(fd).st_ino != inode:
                    return True
            except OSError:
                return True
            poller.register(fd, select.POLLRDHUP)
        return bool(poller.poll(max(0, int(timeout * 1000))))


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
