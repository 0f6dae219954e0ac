"""The checkpoint interval chosen from the job's own data (`Trainer(ckpt_every="auto")`, `--ckpt-every auto`).

Young's approximation of the interval that loses the least time to checkpoints and to the work redone after a
failure: T = sqrt(2 x C x MTBF), C the time one checkpoint stalls training, MTBF the mean time between failures
(J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 1974). In steps: T over the
step time, rounded, within the user's bounds.

- C is measured: a moving average of the stalls of this rank's checkpoints so far (the first checkpoint is taken at
  `lo` steps, so there is a measurement early).
- MTBF is observed: the job's time since it started over the faults it has had (the scheduler's goodput ledger
  sends both to every worker when a generation forms). Until the first fault, `prior_mtbf` stands in (default a
  day; a fault-free run is no evidence of a short MTBF). With faults, the observed figure is blended with the prior
  as if the prior were one fault's worth of evidence: (prior + uptime) / (1 + faults), so one early fault does not
  swing the interval to its floor.

Pure: `choose` is a function of its inputs, tested directly. Why an interval was chosen is said in one line, which
the worker sends with its heartbeats and the scheduler's ledger keeps.
Only CheckFreq (FAST'21) adapts its interval online among the systems in REFERENCE.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_BOUNDS = (10, 10_000)  # steps: the interval never goes below or above these unless the user says
DEFAULT_PRIOR_MTBF = 86_400.0  # s: assumed until a fault is seen (one a day)
STALL_SMOOTHING = 0.3  # weight of the newest stall in the moving average


@dataclass(frozen=True)
class Choice:
    """An interval in steps and the one line that says why."""

    steps: int
    why: str


def choose(stall: float | None, step_time: float | None, faults: int, uptime: float,
           bounds: tuple[int, int] = DEFAULT_BOUNDS, prior_mtbf: float = DEFAULT_PRIOR_MTBF) -> Choice:
    """The interval for a checkpoint stall of `stall` s and steps of `step_time` s, after `faults` faults in
    `uptime` s of the job. Without a stall or step time measured yet: the lower bound (measure early)."""
    lo, hi = bounds
    if stall is None or step_time is None or step_time <= 0:
        return Choice(lo, f"{lo} steps: the lower bound, until a checkpoint's stall and the step time are measured")
    if faults > 0:
        mtbf = (prior_mtbf + uptime) / (1 + faults)
        basis = (f"MTBF {mtbf:.0f} s from {faults} fault(s) in {uptime:.0f} s, blended with the prior "
                 f"{prior_mtbf:.0f} s")
    else:
        mtbf = prior_mtbf
        basis = f"MTBF {mtbf:.0f} s assumed (no fault yet)"
    seconds = math.sqrt(2.0 * max(stall, 1e-6) * mtbf)
    steps = max(1, round(seconds / step_time))
    bounded = min(max(steps, lo), hi)
    where = "" if bounded == steps else f", held to the {'lower' if bounded == lo else 'upper'} bound"
    return Choice(bounded, f"{bounded} steps: Young sqrt(2 x {stall:.3f} s stall x {basis}) = {seconds:.1f} s at "
                           f"{step_time:.4f} s/step = {steps} steps{where}")


class IntervalChooser:
    """The Trainer's running choice: fed each checkpoint's stall and the scheduler's fault history, it says when
    the next checkpoint is due."""

    def __init__(self, bounds: tuple[int, int] = DEFAULT_BOUNDS, prior_mtbf: float = DEFAULT_PRIOR_MTBF) -> None:
        lo, hi = bounds
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"ckpt_bounds={bounds!r}: give (lo, hi) whole numbers of steps with 1 <= lo <= hi")
        if not (math.isfinite(prior_mtbf) and prior_mtbf > 0):
            raise ValueError(f"prior_mtbf={prior_mtbf!r}: give a positive number of seconds")
        self.bounds = bounds
        self.prior_mtbf = prior_mtbf
        self.stall: float | None = None
        self.faults = 0
        self.uptime = 0.0
        self.current = Choice(lo, f"{lo} steps: the lower bound, until a checkpoint's stall is measured")

    def stalled(self, seconds: float) -> None:
        """One checkpoint stalled training `seconds`."""
        s = max(0.0, seconds)
        self.stall = s if self.stall is None else (1 - STALL_SMOOTHING) * self.stall + STALL_SMOOTHING * s

    def history(self, faults: int, uptime: float) -> None:
        """The job's faults so far and its age in seconds (from the scheduler's ledger)."""
        self.faults, self.uptime = max(0, faults), max(0.0, uptime)

    def update(self, step_time: float | None) -> Choice:
        """Choose again with what is known now; returns (and keeps) the choice."""
        self.current = choose(self.stall, step_time, self.faults, self.uptime, self.bounds, self.prior_mtbf)
        return self.current
