"""How a Trainer process stops: SIGTERM noted by its handler and agreed on at the next step boundary (every rank
learns whether any got it), or, where there is nothing to agree with (blocked forming a group, waiting for the
scheduler's word), raised at once as Terminated; and, under torchrun or alone, the end of the process for the
launcher to restart the world when a peer is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator, NoReturn

import torch
import torch.distributed as dist

from toolkit.train.checkpoint import CheckpointManager
from toolkit.train.faults import first_line
from toolkit.train.runtime import MODE_TOOLKIT, Runtime

EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_PEER_LOST = 1  # under torchrun or alone: a peer is gone, the launcher restarts the world


class Terminated(SystemExit):
    """SIGTERM: the last-words checkpoint is durable (or there was no group to save with); the process ends."""


class Stopping:
    """This process's SIGTERM: taken where nobody else took it (the main thread, the default action), noted, and
    raised as Terminated only inside `interruptible()`. `release()` puts back what was there before."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._interrupt = False  # SIGTERM raises Terminated at once (while blocked forming a group)
        self._previous_handler = _install_sigterm(self._on_sigterm)

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
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            anyone, agreed = bool(flag[0].item()), int(flag[1].item())
        else:
            anyone, agreed = bool(mine), proposal
        if not anyone:
            return None, agreed
        return rt.mode != MODE_TOOLKIT or bool(mine), agreed

    def release(self) -> None:
        """Give SIGTERM back to the handler it had before, if this took it."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)


def end_for_restart(manager: CheckpointManager, rank: int, why: str) -> NoReturn:
    """Under torchrun or alone a peer is gone: the checkpoint in flight made durable, `why` on stderr, exit code 1
    at once, for the launcher to restart the world. os._exit, not SystemExit: the interpreter's teardown would
    destroy the broken gloo group, whose transport thread may then throw (std::terminate: SIGABRT instead of
    exit 1, seen in CI)."""
    try:
        manager.flush()
    except Exception as e:  # noqa: BLE001 - the restart resumes from the newest checkpoint that is whole
        print(f"rank {rank}: the checkpoint in flight was not saved: {first_line(e)}", file=sys.stderr)
    print(why, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


def _install_sigterm(handler: Any) -> Any:
    """Take SIGTERM where nobody else did (the default action), from the main thread only; returns what to put
    back, or None if the Trainer did not take it."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        print("toolkit.train.Trainer: SIGTERM already has a handler: no last-words checkpoint", file=sys.stderr,
              flush=True)
        return None
    return signal.signal(signal.SIGTERM, handler)
