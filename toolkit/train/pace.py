"""How fast this rank trains, for the scheduler's straggler tracking, `fleet status` and the goodput ledger.

A rank's own figures, measured on its training thread and sent with its heartbeats (toolkit.contracts.protocol
HEARTBEAT):

- `step_time`: the median wall time of its recent steps (consecutive steps only: the gap across a recovery is
  not a step). In synchronous data parallelism every rank has about the same, the slowest rank's pace.
- `busy`: the median time of its recent steps that the rank spent on its own work (loading the batch, forward,
  backward) before it handed its last gradient bucket to the allreduce, i.e. without waiting for its peers. This
  is what tells a straggler from the ranks that wait for it: the slow rank's `busy` is high, the others' low.
  Known only where toolkit's comm hook is in the step (the Trainer); else absent.
- `loss`: the last loss the script reported, sampled at most once a SAMPLE_INTERVAL (turning a tensor into a
  float waits for the device, so not at every step).
- `ckpt_stall`: seconds the training thread has spent blocked in checkpoint saves, in total, and `ckpts` how many.
- `step_p99`: the 99th percentile of the wall time between two reported steps over the last P99_WINDOW (checkpoints
  and evaluations included, as they happen): what the progress watchdog scales its bound by
  (protocol.stall_bound; toolkit.scheduler.watchdog).

Pure: the caller passes the times (perf_counter seconds), so tests drive it with a fake clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

WINDOW = 32  # steps: the medians are over this many recent steps (robust to one slow step, a GC pause)
SAMPLE_INTERVAL = 1.0  # s: the loss is turned into a float at most this often
P99_WINDOW = 512  # intervals between reported steps the p99 is taken over (a slow one in under 100 is in it)


class StepPace:
    """Rolling figures of one rank's steps; `summary()` is what its heartbeat carries. `strided`: steps may be
    reported every k-th step (toolkit.train.report), and the time between two reports counts as k steps."""

    def __init__(self, window: int = WINDOW, strided: bool = False) -> None:
        self.strided = strided
        self.walls: deque[float] = deque(maxlen=window)
        self.busies: deque[float] = deque(maxlen=window)
        self.intervals: deque[float] = deque(maxlen=P99_WINDOW)  # s between two reported steps, not divided
        self.last_step: int | None = None
        self.last_at: float | None = None
        self.loss: float | None = None
        self.loss_sampled_at = -math.inf
        self.ckpt_stall = 0.0
        self.ckpts = 0
        self.ckpt_bytes = 0  # bytes of this rank's part of its newest checkpoint
        self.total: int | None = None  # the steps the run will take, when the script knows (ETA in fleet status)

    def step(self, step: int, now: float, busy: float | None = None) -> None:
        """Step `step` ended at `now`; `busy` is the rank's own time in it (None: not measured). A step that does
        not follow the previous one (a recovery or a restart in between) starts the timing again."""
        if self.last_step is not None and self.last_at is not None and (
                step == self.last_step + 1 or (self.strided and step > self.last_step)):
            self.walls.append(max(0.0, now - self.last_at) / (step - self.last_step))
            self.intervals.append(max(0.0, now - self.last_at))
            if busy is not None and math.isfinite(busy) and busy >= 0 and step == self.last_step + 1:
                self.busies.append(busy)
        self.last_step, self.last_at = step, now

    def restart(self) -> None:
        """The group was re-formed: the next step, even if its number follows, does not follow in time (the gap
        holds the fault, its detection and the recovery, which are no step's time)."""
        self.last_step = self.last_at = None

    def wants_loss(self, now: float) -> bool:
        """Whether a loss reported now should be sampled (SAMPLE_INTERVAL passed since the last sample)."""
        return now - self.loss_sampled_at >= SAMPLE_INTERVAL

    def sample_loss(self, value: Any, now: float) -> None:
        """Keep `value` (a float, or a one-element tensor: float() of it) as the latest loss; non-finite is kept as
        None (a diverged loss is shown as missing, never as NaN in a JSON document)."""
        self.loss_sampled_at = now
        detach = getattr(value, "detach", None)  # a loss with its graph: float() of it warns (requires_grad)
        try:
            loss = float(detach() if callable(detach) else value)
        except (TypeError, ValueError, RuntimeError):
            return
        self.loss = loss if math.isfinite(loss) else None

    def checkpoint(self, stalled: float, nbytes: int = 0) -> None:
        """The training thread was blocked `stalled` seconds by one checkpoint save of `nbytes` (this rank's part)."""
        self.ckpt_stall += max(0.0, stalled)
        self.ckpts += 1
        self.ckpt_bytes = max(0, nbytes)

    def p99(self) -> float | None:
        """The 99th percentile of the time between two reported steps (None before two steps in a row)."""
        if not self.intervals:
            return None
        ordered = sorted(self.intervals)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    def summary(self) -> dict[str, Any]:
        """The heartbeat's pace fields (absent when not known yet)."""
        out: dict[str, Any] = {"ckpt_stall": round(self.ckpt_stall, 4), "ckpts": self.ckpts,
                               "ckpt_bytes": self.ckpt_bytes}
        if self.total is not None:
            out["total"] = self.total
        p99 = self.p99()
        if p99 is not None:
            out["step_p99"] = round(p99, 6)
        if self.walls:
            out["step_time"] = round(statistics.median(self.walls), 6)
        if self.busies:
            out["busy"] = round(statistics.median(self.busies), 6)
        if self.loss is not None:
            out["loss"] = self.loss
        return out
