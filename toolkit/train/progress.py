"""`toolkit.train.report(step, loss=None, checkpoint=False)`: how far a script got, for `fleet status` (step, steps/s,
loss), `fleet status --watch` and `fleet report` (the loss plot, the goodput ledger), in one line of the script.

Why: a torchrun-style script runs under toolkit unmodified, but then the scheduler knows nothing of its steps: its
rows show "-" all run long, the ledger cannot tell when it trained again after a fault nor what the fault cost. One
added line fixes that without a port to `toolkit.train.Trainer` (which reports on its own):

    from toolkit.train import report
    ...
            loss.backward(); optimizer.step(); step += 1
            report(step, loss=loss)                    # loss: a float or a one-element tensor, optional
            if rank == 0 and step % 50 == 0:
                save(...)
                report(step, checkpoint=True)          # a checkpoint of `step` is durable: the ledger's resume point

It works with or without toolkit: under toolkit (a worker run by `python -m toolkit.train`) the figures go with the
worker's heartbeats to the scheduler and with its progress datagrams to its host's agent; under torchrun, alone, or
before the script's process group exists, it does nothing. Importing it starts nothing (no thread, no socket) and
it costs a few microseconds a call: call it every step. Steps reported every k-th step are fine (the step time is
the time between two reports over the steps between them). The loss is read at most once a second (a device
tensor waits for the device when read).

A script without toolkit installed can keep the line:

    try:
        from toolkit.train import report
    except ImportError:
        def report(*args, **kwargs): pass
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

from toolkit import protocol as P
from toolkit.train.channel import Channel
from toolkit.train.pace import StepPace
from toolkit.train.runtime import PROGRESS_INTERVAL, Runtime, WorkerEnv, notify_agent


class Reporter(Protocol):
    """Where report() sends its figures in this process (installed by whoever joined the job here)."""

    def report(self, step: int, loss: Any, checkpoint: bool) -> None: ...


# The process's reporter, installed once by what joins the job in this process (the wrapper's rendezvous for a
# torchrun-style script, init() for a toolkit.train one). Module state on purpose: report() is a free function that a
# plain script calls without any handle, as it would call logging's root logger.
_installed: list[Reporter] = []


def report(step: int, loss: Any = None, *, checkpoint: bool = False) -> None:
    """Training reached `step` (a whole number, the script's own count; `loss` a float or a one-element tensor, None:
    not reported); with `checkpoint`, a checkpoint of `step` is durable. A no-op outside toolkit (see the module
    docstring). ValueError for a step that is not a whole number >= 0, under any launcher, so a wrong call shows on
    the first run."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"toolkit.train.report(step={step!r}): give the step as a whole number >= 0")
    if _installed:
        _installed[-1].report(step, loss, checkpoint)


def install(reporter: Reporter) -> None:
    """Make `reporter` the one report() uses in this process (a later one replaces it)."""
    _installed[:] = [reporter]


class ScriptReporter:
    """report() for a torchrun-style script: its steps, pace and loss go into the heartbeats of the registration the
    wrapper made for it (`channel`), with the newest checkpoint reported (`ckpt_step`, also sent as a `commit`), the
    first step this process reported (`first_step`: after a restart, the one after where it resumed; a heartbeat
    carries the latest) and the stride of its reports (`stride`: how far that may be from where it resumed), and its
    step to the host's agent at most once per PROGRESS_INTERVAL. Called on the script's thread; the heartbeat thread
    only reads what is set here."""

    def __init__(self, cfg: WorkerEnv, channel: Channel) -> None:
        self.cfg = cfg
        self.channel = channel
        self.pace = StepPace(strided=True)
        self.sent = -math.inf
        self.checkpoint: int | None = None
        self.first: int | None = None  # the first step this process reported (after a restart: where it resumed)
        self.last: int | None = None
        self.stride: int | None = None  # the smallest step between two reports: 1 when every step is reported

    def report(self, step: int, loss: Any, checkpoint: bool) -> None:
        """See `report`."""
        now = time.monotonic()
        if self.cfg.pace:
            self.pace.step(step, now)
            if loss is not None and self.pace.wants_loss(now):
                self.pace.sample_loss(loss, now)
        self.channel.step = step
        if self.first is None:
            self.first = step
        if self.last is not None and step > self.last:
            self.stride = step - self.last if self.stride is None else min(self.stride, step - self.last)
        self.last = step
        if checkpoint:
            self.checkpoint = step if self.checkpoint is None else max(self.checkpoint, step)
            self.channel.send(P.COMMIT, step=step)
        if checkpoint or now - self.sent >= PROGRESS_INTERVAL:
            self.sent = now
            extra = {k: v for k, v in (("ckpt_step", self.checkpoint), ("stride", self.stride),
                                        ("first_step", self.first)) if v is not None}
            self.channel.beat = {**self.channel.beat, **(self.pace.summary() if self.cfg.pace else {}), **extra}
            notify_agent(self.cfg, {"node_id": self.cfg.node_id, "step": step, "recovery": P.RECOVERY_RESTART})


class RuntimeReporter:
    """report() for a script on toolkit.train.init() that does not use the Trainer (which reports on its own)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def report(self, step: int, loss: Any, checkpoint: bool) -> None:
        """See `report`: Runtime.report, and Runtime.committed for a checkpoint."""
        self.rt.report(step, loss=loss)
        if checkpoint:
            self.rt.committed(step)
