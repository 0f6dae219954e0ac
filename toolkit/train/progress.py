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

import contextlib
from typing import Any, ContextManager, Iterator, Protocol

from toolkit.contracts.protocol import is_int


class Reporter(Protocol):
    """Where report() sends its figures in this process (installed by whoever joined the job here: the wrapper's
    scriptreport.ScriptReporter, init()'s runtime.RuntimeReporter)."""

    def report(self, step: int, loss: Any, checkpoint: bool, total: int | None = None) -> None: ...

    def long_phase(self, what: str) -> ContextManager[None]: ...


# The process's reporter, installed once by what joins the job in this process (the wrapper's rendezvous for a
# torchrun-style script, init() for a toolkit.train one). Module state on purpose: report() is a free function that a
# plain script calls without any handle, as it would call logging's root logger.
_installed: list[Reporter] = []


def report(step: int, loss: Any = None, *, checkpoint: bool = False, total: int | None = None) -> None:
    """Training reached `step` (a whole number, the script's own count; `loss` a float or a one-element tensor, None:
    not reported); with `checkpoint`, a checkpoint of `step` is durable; `total`, the steps the run will take (for
    the progress bar and ETA of `fleet status`), once is enough. A no-op outside toolkit (see the module
    docstring). ValueError for a step or total that is not a whole number >= 0, under any launcher, so a wrong call
    shows on the first run."""
    if not is_int(step) or step < 0:
        raise ValueError(f"toolkit.train.report(step={step!r}): give the step as a whole number >= 0")
    if total is not None and (not is_int(total) or total < 0):
        raise ValueError(f"toolkit.train.report(total={total!r}): give the total steps as a whole number >= 0")
    if _installed:
        _installed[-1].report(step, loss, checkpoint, total)


@contextlib.contextmanager
def long_phase(what: str = "evaluation") -> Iterator[None]:
    """`with toolkit.train.long_phase("evaluation"):` around a part of the loop that may take much longer than a step
    on some ranks while the others wait for them (an evaluation, a save of the script's own): the progress watchdog
    (which names a rank that stopped making progress while its peers wait, after max(10 x the p99 step time, 5 s))
    blames no rank while any rank is in one. A no-op outside toolkit. The Trainer marks its own checkpoints."""
    if not isinstance(what, str) or not what:
        raise ValueError(f"toolkit.train.long_phase(what={what!r}): name the phase, e.g. \"evaluation\"")
    if not _installed:
        yield
        return
    with _installed[-1].long_phase(what):
        yield


def install(reporter: Reporter) -> None:
    """Make `reporter` the one report() uses in this process (a later one replaces it)."""
    _installed[:] = [reporter]
