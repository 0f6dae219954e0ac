"""report() for a torchrun-style script (toolkit.train.progress): its steps, pace and loss go into the heartbeats of
the registration the wrapper made for it, and its step to the host's agent. Apart from progress.py so that the
public report() imports nothing of the runtime, which installs its own reporter there."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol
from toolkit.train import stacks
from toolkit.train.channel import Channel
from toolkit.train.pace import StepPace
from toolkit.train.runtime import PROGRESS_INTERVAL, WorkerEnv, notify_agent


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

    def report(self, step: int, loss: Any, checkpoint: bool, total: int | None = None) -> None:
        """See `report`."""
        now = time.monotonic()
        if total is not None:
            self.pace.total = total
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
            self.channel.send(wire.Commit(step))
        if checkpoint or now - self.sent >= PROGRESS_INTERVAL:
            self.sent = now
            extra = {k: v for k, v in (("ckpt_step", self.checkpoint), ("stride", self.stride),
                                        ("first_step", self.first)) if v is not None}
            self.channel.beat = {**self.channel.beat, **(self.pace.summary() if self.cfg.pace else {}), **extra}
            notify_agent(self.cfg, {"node_id": self.cfg.node_id, "step": step, "recovery": protocol.RECOVERY_RESTART})

    def long_phase(self, what: str) -> contextlib.AbstractContextManager[None]:
        """See `progress.long_phase`: the heartbeats say `long` while in it."""
        return stacks.long_phase(self.channel, what)
