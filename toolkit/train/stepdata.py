"""Each step's batch and randomness as functions of the step, so that a replacement needs nothing else to go on:
the loader is positioned at the step's batch (toolkit.train.loader), a step redone after a fault gets its batch
again, and torch's, Python's and numpy's global generators are seeded from (seed, rank, step) before each step's
batch is drawn (and from (seed, rank, epoch) before an epoch's iterator starts: its order and its workers' seeds)."""

from __future__ import annotations

import random
from typing import Any, Iterator

import numpy as np
import torch

from toolkit.train.loader import Positioner, Replay
from toolkit.train.runtime import Runtime


class StepData:
    """The batches of `loader` by step, for `rt`'s rank; `seed` None leaves the generators alone (then a recovered
    run is not bitwise the same)."""

    def __init__(self, loader: Any, seed: int | None, rt: Runtime) -> None:
        self.position = Positioner(loader)
        self.seed = seed
        self.rt = rt
        self._batches: Iterator[Any] | None = None
        self._batches_at: tuple[int, int] | None = None  # (epoch, batch) the iterator yields next
        self._replay = Replay(loader)  # the batch last given out, for a step redone after a fault

    def batch(self, step: int) -> Any:
        """The batch of the step after `step` (the job's optimizer steps done), its randomness seeded."""
        at = self.position.where(step)
        again = self._replay.get(at)
        if again is not None:  # the step redone after a fault: its batch, and the iterator stays where it is
            self._seed("step", step + 1)
            return again[0]
        if self._batches is None or self._batches_at != at:
            self._batches = None  # a worker pool of the old iterator goes before the next one starts
            self._seed("epoch", at[0])  # the epoch's order and the workers' seeds, the same for a resumed epoch
            self._batches = self.position.iterate(*at)
        self._seed("step", step + 1)
        batch = next(self._batches)
        self._batches_at = (at[0], at[1] + 1)  # past the epoch's end this matches no step: a new iterator then
        self._replay.keep(at, batch)
        return batch

    def close(self) -> None:
        """Let the loader's iterator (its worker processes) go."""
        self._batches = None

    def _seed(self, what: str, number: int) -> None:
        if self.seed is None:
            return
        value = mix(self.seed, self.rt.rank, 0 if what == "step" else 1, number)
        torch.manual_seed(value)
        random.seed(value)
        np.random.seed(value % (1 << 32))


def mix(*numbers: int) -> int:
    """A 63-bit seed from a few integers (splitmix64 steps): neighbouring steps and ranks get unrelated seeds."""
    x = 0x9E3779B97F4A7C15
    for n in numbers:
        x = (x ^ (n & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x >> 1
