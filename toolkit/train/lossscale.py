"""The script's GradScalers (torch.amp.GradScaler, and torch.cuda.amp's, its subclass) during a step, found among
the extra state the script hands the Trainer (`state=`): no new line in a port.

Under DDP (one logical rank per process) `scaler.scale(loss).backward()` leaves in `.grad` the mean of every
rank's SCALED gradient; `unscale_` divides that mean, `found_inf` is checked on it (so every rank agrees whether
to skip the optimizer step), and `update()` runs once a step. A process serving several logical ranks
(toolkit.train.logicalgrad) runs the step body once per logical rank; left alone, a scaler there would unscale
each one's own gradient before the reduction, check it alone for an overflow, and update once per logical rank.
So, on the instance, for the step body's duration (as `logicalgrad.deferred` does for the optimizer):

- on a logical rank that is not the process's last of the step, `unscale_` keeps that logical rank's gradient as it
  is, scaled (a `clip_grad_norm_` after it then sees no gradient: the clipping is the mean's, on the last);
  `step` and `update` do nothing;
- on the last, the first of `unscale_` and `step` reduces every logical rank's scaled gradient to their mean first
  (the optimizer's pre-hook does not reduce again), and the scaler's own logic runs on that mean: unscale, the
  overflow check, the optimizer step skipped on an overflow, and `update()` once.

That is the arithmetic of L processes under DDP, so the result is bitwise theirs, an overflowing step included.

In every step, whatever the number of logical ranks: an `update()` that ran counts as the step's state change
(`updated`), as an optimizer step does: a step whose optimizer step was skipped for an overflow has still moved the
scaler (its scale backed off), so a fault after it must keep that step, not redo it from the moved scaler.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch

from toolkit.train.logicalgrad import LogicalGrad

SHADOWED = ("unscale_", "step", "update")
_MISSING = object()


def scalers_in(extra: Mapping[str, Any]) -> tuple[torch.amp.GradScaler, ...]:
    """The GradScalers among the script's extra state (a scaler not handed over in `state=` is left alone)."""
    return tuple(obj for obj in extra.values() if isinstance(obj, torch.amp.GradScaler))


@contextlib.contextmanager
def in_step(scalers: tuple[torch.amp.GradScaler, ...], logical: LogicalGrad | None, lane: int, last: bool,
            updated: Callable[[], Any]) -> Iterator[None]:
    """The step body of lane `lane` (`last`: the process's last logical rank of the step; `logical` None: it serves
    one) with `scalers`' methods shadowed as the module docstring says; whatever was on the instances before is put
    back after."""
    if not scalers:
        yield
        return
    saved = []
    for s in scalers:
        methods = _methods(s, logical, lane, last, updated)
        saved.append((s, {name: s.__dict__.get(name, _MISSING) for name in methods}))
        for name, method in methods.items():
            setattr(s, name, method)
    try:
        yield
    finally:
        for s, methods in saved:
            for name, value in methods.items():
                if value is _MISSING:
                    delattr(s, name)
                else:
                    setattr(s, name, value)


def _methods(scaler: torch.amp.GradScaler, logical: LogicalGrad | None, lane: int, last: bool,
             updated: Callable[[], Any]) -> dict[str, Callable[..., Any]]:
    """The shadowing methods of `scaler` for one lane."""
    unscale, step, update = (getattr(scaler, name) for name in SHADOWED)  # the instance's own, or the class's

    def counted_update(*args: Any, **kwargs: Any) -> None:
        update(*args, **kwargs)
        if scaler.is_enabled():
            updated()

    if logical is None:
        return {"update": counted_update}
    if not last:
        def keep_scaled(_optimizer: torch.optim.Optimizer) -> None:
            logical.keep(lane)

        return {"unscale_": keep_scaled, "step": _nothing, "update": _nothing}

    def reduced_unscale(optimizer: torch.optim.Optimizer) -> None:
        logical.reduce()
        unscale(optimizer)

    def reduced_step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        logical.reduce()
        return step(optimizer, *args, **kwargs)

    return {"unscale_": reduced_unscale, "step": reduced_step, "update": counted_update}


def _nothing(*_: Any, **__: Any) -> None:
    return None
