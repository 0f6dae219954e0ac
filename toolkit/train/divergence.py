"""After a recovery, do the ranks still hold the same training state? A cheap check that stops a silent divergence.

Why: data parallelism needs everything replicated to be the same on every rank. The Trainer hands a replacement
the model, the optimizer and the `state={...}` objects; anything else that changes the training (an LR scheduler
left out of `state=`) starts from scratch on the replacement. Its LambdaLR then sets the learning rate of epoch 0
at its first step while the survivors' set that of epoch N: the ranks train on, each with its own learning rate,
and the result is neither bitwise the uninterrupted run's nor correct, with nothing said. That shows only once the
object acts (the scheduler steps), which may be every step or once an epoch.

What: after every recovery (a formation past generation 0), at the steps `since + 1, 2, 4, 8, ...` after it (a
handful over a run, so a per-epoch scheduler is caught too, within twice the time it took to act), every rank
gathers a fingerprint of what must be the same everywhere: a hash of each param group's learning rate, one of the
other hyperparameters, one of the parameters' bits (an integer sum per tensor: exact, whatever the summation
order), and rank 0's first learning rate to name it. One all_gather of four integers per rank, outside the step (a
fault during it is recovered like any), plus one pass over the parameters. On a mismatch every rank prints one line
naming what differs and the likely missing `state=` entry, and exits EXIT_FATAL: its agent gives up at once (a
restart would resume every rank from one checkpoint, and the divergence would go on unseen).
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from toolkit.protocol import EXIT_FATAL
from toolkit.train import log
from toolkit.train.runtime import GenerationChanged, Runtime

INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
LR, HYPER, PARAMS, LR0 = range(4)  # the fields of a fingerprint


class DivergenceCheck:
    """When to check (see the module docstring); `world_size` 1 never checks (nothing to compare with)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.since: int | None = None  # the step of the latest recovery; None: none yet

    def arm(self, generation: int | None, step: int) -> None:
        """The group was (re-)formed at `step`: generation 0 is the job's first formation, any later one follows a
        fault (or a start again) and arms the checks. The same on every rank: both values are agreed."""
        self.since = step if generation and self.world_size > 1 else None

    def due(self, step: int) -> bool:
        """Whether `step` (the steps done, before the next) is one of since + 1, 2, 4, 8, ..."""
        if self.since is None:
            return False
        k = step - self.since
        return k >= 1 and k & (k - 1) == 0

    def check(self, rt: Runtime, module: nn.Module, optimizer: torch.optim.Optimizer, step: int,
              guard: Callable[[], ContextManager[None]] | None = None) -> bool:
        """Collective: compare every rank's fingerprint. True when they agree; False when a new generation cut the
        check short (re-form, then go on); on a mismatch the process ends here with one line and EXIT_FATAL.
        `guard` wraps the collective (default rt.guard(); the Trainer passes its own, which also leaves with last
        words when SIGTERM comes while it waits for the scheduler's word: peers that left on a stop fail it too)."""
        mine = torch.tensor(fingerprint(module, optimizer), dtype=torch.int64, device=rt.device)
        every = [torch.empty_like(mine) for _ in range(rt.world_size)]
        try:
            with (guard or rt.guard)():
                rt.fence.wait(dist.all_gather(every, mine, async_op=True), "the divergence check")
        except GenerationChanged as e:
            log.line(f"rank {rt.rank}: generation {rt.generation} -> {e.new} at step {step} (between two steps: "
                     "nothing in flight): re-forming the group")
            return False
        table = [[int(v) for v in t.tolist()] for t in every]
        line = verdict(table, self.since if self.since is not None else step, step)
        if line is None:
            return True
        log.line(f"rank {rt.rank}: {line}", sys.stderr)
        sys.stdout.flush()
        os._exit(EXIT_FATAL)  # not SystemExit: the script must not go on, nor catch it and save a checkpoint


def fingerprint(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """[hash of every param group's lr, hash of their other hyperparameters, hash of the parameters' bits, the first
    group's lr as the bits of a double]: 63-bit integers, the same on ranks that hold the same state."""
    groups = optimizer.param_groups
    lrs = [_plain(g.get("lr")) for g in groups]
    others = [sorted((k, _plain(v)) for k, v in g.items() if k not in ("params", "lr")) for g in groups]
    digest = hashlib.blake2b(digest_size=8)
    for name, p in module.named_parameters():
        t = p.detach().reshape(-1)
        bits = t.view(INT_OF_SIZE.get(t.element_size(), torch.uint8)) if t.numel() else t
        total = int(bits.sum(dtype=torch.int64)) if t.numel() else 0
        digest.update(name.encode() + b"\0" + struct.pack("<q", total))
    first = lrs[0] if lrs and isinstance(lrs[0], float) else float("nan")
    return [_hash(repr(lrs)), _hash(repr(others)), int.from_bytes(digest.digest(), "little") >> 1,
            struct.unpack("<q", struct.pack("<d", first))[0]]


def verdict(table: Sequence[Sequence[int]], since: int, step: int) -> str | None:
    """The one line for a gathered table of fingerprints (rank r's at index r), or None if they agree. Pure."""
    differs = [field for field in (LR, HYPER, PARAMS) if len({row[field] for row in table}) > 1]
    if not differs:
        return None
    if LR in differs:
        by_lr: dict[float, list[int]] = {}
        for rank, row in enumerate(table):
            by_lr.setdefault(struct.unpack("<d", struct.pack("<q", row[LR0]))[0], []).append(rank)
        what = "the learning rate differs between ranks (" + ", ".join(
            f"{lr:.6g} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            for lr, ranks in by_lr.items()) + ")"
        likely = ("an LR scheduler is likely not handed over: pass it to the Trainer, e.g. "
                  "Trainer(..., state={\"sched\": scheduler})")
    elif HYPER in differs:
        what = "the optimizer's hyperparameters (other than the learning rate) differ between ranks"
        likely = ("an object that sets them (a scheduler of momentum or weight decay) is likely not handed over: "
                  "pass it in Trainer(..., state={...})")
    else:
        what = "the parameters differ between ranks"
        likely = ("some state the step depends on is likely not handed over (a GradScaler, a schedule of the loss): "
                  "pass it in Trainer(..., state={...})")
    return (f"toolkit.train: after the recovery at step {since}, at step {step} {what}: {likely}; stopping the job "
            f"(it would go on with ranks that disagree; checkpoints after step {since} carry the difference)")


def _plain(value: Any) -> Any:
    """A hyperparameter as a value whose repr is exact (a tensor's repr rounds)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    return value


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
