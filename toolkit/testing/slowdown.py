"""A process slowed from outside, as a straggler is: SIGSTOP and SIGCONT in turn, finer than a training step, so
that it runs at a third of its speed. The observation tests (local and on the namespace hosts) slow one rank this
way and check that it is named."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable

BURST_STOP, BURST_RUN = 0.06, 0.03  # s stopped, then running, in turn, finer than a step: a third of its speed


def bursts(pid_of: Callable[[], int | None], stop: threading.Event) -> None:
    """Stop and continue the process `pid_of()` names (looked up again each turn: a replacement is followed; None
    while there is none) until `stop` is set; never leaves it stopped."""
    while not stop.is_set():
        pid = pid_of()
        if not pid:
            stop.wait(BURST_RUN)
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
            stop.wait(BURST_STOP)
        finally:
            with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                os.kill(pid, signal.SIGCONT)
        stop.wait(BURST_RUN)
