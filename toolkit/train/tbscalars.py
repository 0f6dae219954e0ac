"""TensorBoard scalars of a run, written by rank 0 through torch's own SummaryWriter when `tensorboard` is installed
(pip install 'toolkit[tensorboard]'): where a lab already looks at its experiments.

What: `loss` and `steps_per_s` at every step the Trainer runs (the loss as the script reported it with
trainer.report; steps/s from the rank's recent step times, toolkit.train.pace), `goodput` at each formation of the
group (the scheduler's ledger sends it with `formed`: so after every recovery), and each recovery as text
(`incidents`: the new generation, the step resumed from and where the state came from). The incidents' causes and
their cost are the scheduler's (its ledger, `fleet report`, the Prometheus endpoint).

Where: `tensorboard_dir` of the Trainer, else `$CKPT_DIR/../tb`, else `./tb`: the job's directory on the host of
rank 0 (`tensorboard --logdir` there, or copy it). Without tensorboard installed, nothing is written and nothing
is said but one line at the start.

Cost: reading the loss each step waits for the device (on a GPU a synchronisation per step on rank 0 only); the
writer queues events and flushes every FLUSH_SECS in its own thread. Importing tensorboard takes 0.5-0.9 s here, so
the writer is opened in a thread of its own and what comes before it is ready waits in a bounded queue: a rank 0
that starts (or replaces a dead one) does not train later for it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from toolkit.contracts import envvars
from toolkit.train import log

FLUSH_SECS = 10  # s between the writer's flushes to disk
MAX_EARLY = 100_000  # events kept while the writer opens (the oldest go first)
OPEN_WAIT = 30.0  # s close() waits for a writer still opening


class Scalars:
    """A SummaryWriter on `directory` (opened in a thread: `_open`) with the few things the Trainer writes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.writer: Any = None
        self.failed = False
        self._early: deque[tuple[str, tuple[Any, ...]]] = deque(maxlen=MAX_EARLY)
        self._lock = threading.Lock()
        self._opener = threading.Thread(target=self._open, name="tensorboard", daemon=True)
        self._opener.start()

    def _open(self) -> None:
        """Import tensorboard, open the writer and write what came before it."""
        try:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when it is installed

            writer = SummaryWriter(log_dir=str(self.directory), flush_secs=FLUSH_SECS)
        except Exception as e:  # noqa: BLE001 - the scalars are a view: training goes on without them
            log.line(f"rank 0: no TensorBoard scalars: cannot write to {self.directory} ({e})")
            self.failed = True
            return
        with self._lock:
            for what, args in self._early:
                getattr(writer, what)(*args)
            self._early.clear()
            self.writer = writer

    def _add(self, what: str, *args: Any) -> None:
        """writer.`what`(*args) now, or once the writer is open."""
        if self.writer is None:
            with self._lock:
                if self.writer is None:
                    if not self.failed:
                        self._early.append((what, args))
                    return
        getattr(self.writer, what)(*args)

    def step(self, step: int, loss: Any, steps_per_s: float | None) -> None:
        """Step `step` ended: its loss (a float or a one-element tensor; None: not reported) and the pace."""
        if loss is not None:
            detach = getattr(loss, "detach", None)
            value = float(detach() if callable(detach) else loss)
            if math.isfinite(value):
                self._add("add_scalar", "loss", value, step)
        if steps_per_s:
            self._add("add_scalar", "steps_per_s", steps_per_s, step)

    def goodput(self, step: int, goodput: float | None) -> None:
        """The job's goodput so far, as the scheduler said when the group formed at `step` (None: not said)."""
        if goodput is not None:
            self._add("add_scalar", "goodput", goodput, step)

    def incident(self, step: int, text: str) -> None:
        """A recovery at `step`, as one line of text."""
        self._add("add_text", "incidents", text, step)

    def close(self) -> None:
        """Flush and close the event file (after waiting up to OPEN_WAIT s for it to open)."""
        self._opener.join(OPEN_WAIT)
        with self._lock:
            if self.writer is not None:
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
