"""How a Trainer process stops: SIGTERM noted by its handler and agreed on at the next step boundary (every rank
learns whether any got it), or, where there is nothing to agree with (blocked forming a group, waiting for the
scheduler's word), raised at once as Terminated; under torchrun, a SIGTERM that comes with a peer gone abandons the
group at once (PeerLossWatch); and, under torchrun or alone, the end of the process for the launcher to restart
the world when a peer is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.distributed as dist

from toolkit.train import log
from toolkit.train.ckpt.manager import CheckpointManager
from toolkit.train.faults import first_line
from toolkit.train.fence import Fence
from toolkit.train.runtime import MODE_TOOLKIT, MODE_TORCHRUN, Runtime

EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_PEER_LOST = 1  # under torchrun or alone: a peer is gone, the launcher restarts the world
# s after torchrun's SIGTERM to see a peer's connection closed: the death that made torchrun send it closed them
# before torchrun knew (room for a loaded machine and for the FIN from another host); a stop has none closed
HANGUP_WINDOW = 2.0


class Terminated(SystemExit):
    """SIGTERM: the last-words checkpoint is durable (or there was no group to save with); the process ends."""


class Stopping:
    """This process's SIGTERM: taken where nobody else took it (the main thread, the default action), noted, and
    raised as Terminated only inside `interruptible()`. `release()` puts back what was there before."""

    def __init__(self, rt: Runtime | None = None) -> None:
        self._stop = threading.Event()
        self._interrupt = False  # SIGTERM raises Terminated at once (while blocked forming a group)
        self._previous_handler = _install_sigterm(self._on_sigterm)
        # Under torchrun: whether the ranks agreed to stop (peers leaving then is no fault) or the group was
        # abandoned (a peer died), decided once, under the lock, by whichever comes first.
        self._lock = threading.Lock()
        self._agreed = False
        self._abandoned = False
        self._watch: PeerLossWatch | None = None
        if self._previous_handler is not None and rt is not None and rt.mode == MODE_TORCHRUN and rt.world_size > 1:
            self._watch = PeerLossWatch.start(rt.fence, rt.generation or 0, rt.rank, self._claim_abandon)

    @property
    def requested(self) -> bool:
        """Whether this process got SIGTERM."""
        return self._stop.is_set()

    def _on_sigterm(self, _signum: int, _frame: Any) -> None:
        self._stop.set()
        if self._interrupt:
            self._interrupt = False
            raise Terminated(EXIT_TERMINATED)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """While blocked forming a group or waiting for the scheduler's word there is nothing to agree with:
        SIGTERM (come already, or while blocked) raises Terminated at once; the caller leaves with its last words."""
        if self._stop.is_set():
            raise Terminated(EXIT_TERMINATED)
        self._interrupt = True
        try:
            yield
        finally:
            self._interrupt = False

    def agree(self, rt: Runtime, proposal: int) -> tuple[bool | None, int]:
        """Collective at the end of every step: did any rank get SIGTERM? None if not; else whether this rank is one
        that leaves (outside toolkit every rank does: the launcher restarts the world). The same collective agrees on
        the checkpoint interval: each rank proposes its own (`proposal`, in steps) and all take the largest, returned
        second."""
        mine = 1 if self._stop.is_set() else 0
        if rt.world_size > 1:
            flag = torch.tensor([mine, proposal], dtype=torch.int64, device=rt.device)
            rt.fence.wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), "the stop agreement")
            anyone, agreed = bool(flag[0].item()), int(flag[1].item())
        else:
            anyone, agreed = bool(mine), proposal
        with self._lock:
            if self._abandoned:  # a peer died and the group is shut: leave as after any broken collective
                raise RuntimeError("gloo: the group was abandoned at the launcher's SIGTERM: a peer's connection "
                                   "closed")
            self._agreed = self._agreed or anyone
        if not anyone:
            return None, agreed
        return rt.mode != MODE_TOOLKIT or bool(mine), agreed

    def _claim_abandon(self) -> bool:
        """PeerLossWatch's question: may the group be abandoned? Not once the ranks agreed to stop (their leaving
        closes connections on purpose, and this process ends through the interpreter, whose teardown of a shut
        gloo group aborts it); once said yes, `agree` raises instead of agreeing."""
        with self._lock:
            if self._agreed:
                return False
            self._abandoned = True
            return True

    def release(self) -> None:
        """Give SIGTERM back to the handler it had before, if this took it (and stop watching for a peer's loss)."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)


class PeerLossWatch:
    """Under torchrun: the launcher's SIGTERM, when a connection of the group has lost its peer, abandons the group
    (its fence), so that a call blocked in it fails at once and the process ends for the restart (`end_for_restart`,
    the checkpoint in flight made durable).

    Why: torchrun SIGTERMs the survivors when a worker dies and SIGKILLs them 30 s later. A survivor blocked in a
    collective never runs Python's SIGTERM handler (its main thread waits in C++), and gloo leaves a receive whose
    message had started to arrive waiting out the collective timeout (toolkit.train.fence). Measured with
    bench/transformer.py (671 MB of state, 25 MB buckets) under torchrun: after a kill -9 the survivors sat in
    their backward until torchrun's SIGKILL, and the restart took 37 s where it takes 7 s.

    How: a thread learns of the signal as it arrives: signal.set_wakeup_fd, where CPython's C-level handler writes
    the signal's number whatever the main thread is doing. A worker's death closes its connections before
    torchrun even learns of it (the kernel closes a dying process's files before it tells the parent), so when the
    SIGTERM says a worker died, a connection has lost its peer already: the thread looks for that for HANGUP_WINDOW
    (the kernel says it: poll), and if it is there and the ranks have not agreed to stop (`claim`), trips the
    fence. A stop (torchrun itself told to stop) comes with every peer alive: nothing is abandoned, the
    step-boundary agreement and its last words follow as before.

    The wakeup descriptor is one per process: if something else holds it (an asyncio loop in the main thread),
    nothing is watched and stderr says so."""

    def __init__(self, fence: Fence, generation: int, rank: int, claim: Callable[[], bool], wake_write: int) -> None:
        self._fence = fence
        self._generation = generation
        self._rank = rank
        self._claim = claim
        self._wake_write = wake_write

    @classmethod
    def start(cls, fence: Fence, generation: int, rank: int, claim: Callable[[], bool]) -> PeerLossWatch | None:
        """Watch from now (called on the main thread, which alone may set the wakeup descriptor); None if the
        wakeup descriptor is taken. `claim()`: whether the group may be abandoned now (asked once, at the trip)."""
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)  # the C handler must never block
        previous = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(wake_read)
            os.close(wake_write)
            log.line(f"rank {rank}: signal.set_wakeup_fd is taken (an asyncio loop?): a survivor blocked in a "
                     "collective when torchrun stops it waits for torchrun's SIGKILL", sys.stderr)
            return None
        watch = cls(fence, generation, rank, claim, wake_write)
        threading.Thread(target=watch._run, args=(wake_read,), name="toolkit-peer-loss", daemon=True).start()
        return watch

    def _run(self, wake_read: int) -> None:
        """Read signals until close() closes the other end (reading on after the SIGTERM: a pipe whose reader
        is gone would make CPython report every later signal's write as an error)."""
        answered = False
        try:
            while signals := os.read(wake_read, 64):
                if answered or int(signal.SIGTERM) not in signals:
                    continue
                answered = True
                if self._fence.wait_hangup(HANGUP_WINDOW) and self._claim():
                    # Said first: the abandon wakes the main thread, which may leave (os._exit) before a line after it.
                    log.line(f"rank {self._rank}: SIGTERM from the launcher with a peer's connection closed: the "
                             "peer is gone, the group is abandoned", sys.stderr)
                    self._fence.abandon(self._generation)
        finally:
            os.close(wake_read)

    def close(self) -> None:
        """Stop watching (on the main thread; elsewhere nothing changes): the wakeup descriptor given back, and the
        thread ended."""
        try:
            current = signal.set_wakeup_fd(-1)
        except ValueError:
            return  # not the main thread: the descriptor must stay open while the C handler may write to it
        if current != self._wake_write:
            signal.set_wakeup_fd(current)  # someone else's since: theirs stays
        os.close(self._wake_write)


def end_for_restart(manager: CheckpointManager, rank: int, why: str) -> NoReturn:
    """Under torchrun or alone a peer is gone: the checkpoint in flight made durable, `why` on stderr, exit code 1
    at once, for the launcher to restart the world. os._exit, not SystemExit: the interpreter's teardown would
    destroy the broken gloo group, whose transport thread may then throw (std::terminate: SIGABRT instead of
    exit 1, seen in CI)."""
    try:
        manager.flush()
    except Exception as e:  # noqa: BLE001 - the restart resumes from the newest checkpoint that is whole
        log.line(f"rank {rank}: the checkpoint in flight was not saved: {first_line(e)}", sys.stderr)
    log.line(why, sys.stderr)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


def _install_sigterm(handler: Any) -> Any:
    """Take SIGTERM where nobody else did (the default action), from the main thread only; returns what to put
    back, or None if the Trainer did not take it."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        log.line("toolkit.train.Trainer: SIGTERM already has a handler: no last-words checkpoint", sys.stderr)
        return None
    return signal.signal(signal.SIGTERM, handler)
