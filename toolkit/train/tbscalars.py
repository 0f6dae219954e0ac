"""TensorBoard scalars of a run, written by rank 0 through torch's own SummaryWriter when `tensorboard` is installed
(pip install 'toolkit[tensorboard]'): where a lab already looks at its experiments.

What: `loss` and `steps_per_s` at every step the Trainer runs (the loss as the script reported it with
trainer.report; steps/s from the rank's recent step times, toolkit.train.pace), `goodput` at each formation of the
group (the scheduler's ledger sends it with `formed`: so after every recovery), and each recovery as text
(`incidents`: the generation change and the step it happened at). The incidents' causes and their cost are the
scheduler's (its ledger, `fleet report`, the Prometheus endpoint).

Where: `tensorboard_dir` of the Trainer, else `$CKPT_DIR/../tb`, else `./tb`: the job's directory on the host of
rank 0 (`tensorboard --logdir` there, or copy it). Without tensorboard installed, nothing is written and nothing
is said but one line at the start.

Cost: reading the loss each step waits for the device (on a GPU a synchronisation per step on rank 0 only); the
writer queues events and flushes every FLUSH_SECS in its own thread.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from toolkit import envvars
from toolkit.train import log

FLUSH_SECS = 10  # s between the writer's flushes to disk


class Scalars:
    """A SummaryWriter on `directory` with the few things the Trainer writes."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when it is installed

        self.directory = directory
        self.writer = SummaryWriter(log_dir=str(directory), flush_secs=FLUSH_SECS)

    def step(self, step: int, loss: Any, steps_per_s: float | None) -> None:
        """Step `step` ended: its loss (a float or a one-element tensor; None: not reported) and the pace."""
        if loss is not None:
            detach = getattr(loss, "detach", None)
            value = float(detach() if callable(detach) else loss)
            if math.isfinite(value):
                self.writer.add_scalar("loss", value, step)
        if steps_per_s:
            self.writer.add_scalar("steps_per_s", steps_per_s, step)

    def goodput(self, step: int, goodput: float | None) -> None:
        """The job's goodput so far, as the scheduler said when the group formed at `step` (None: not said)."""
        if goodput is not None:
            self.writer.add_scalar("goodput", goodput, step)

    def incident(self, step: int, text: str) -> None:
        """A recovery at `step`, as one line of text."""
        self.writer.add_text("incidents", text, step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def directory(tensorboard_dir: str | Path | None) -> Path:
    """Where the scalars go: `tensorboard_dir`, else $CKPT_DIR/../tb, else ./tb."""
    if tensorboard_dir is not None:
        return Path(tensorboard_dir)
    ckpt = os.environ.get(envvars.CKPT_DIR)
    return Path(ckpt).resolve().parent / "tb" if ckpt else Path("tb")


def open_scalars(rank: int, tensorboard_dir: str | Path | None) -> Scalars | None:
    """Rank 0's Scalars, or None: another rank, or tensorboard not installed (said once)."""
    if rank != 0:
        return None
    if importlib.util.find_spec("tensorboard") is None:
        log.line("rank 0: no TensorBoard scalars: tensorboard is not installed (pip install 'toolkit[tensorboard]')")
        return None
    return Scalars(directory(tensorboard_dir))
