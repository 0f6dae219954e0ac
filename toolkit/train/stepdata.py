"""Each step's batch and randomness as functions of the step and the logical rank, so that a replacement needs
nothing else to go on, and a step's result does not depend on which process serves which logical rank: the loader
is positioned at the step's batch (toolkit.train.loader), a step redone after a fault gets its batch again, and
torch's, Python's and numpy's global generators are seeded from (seed, logical rank, step) before each step's batch
is drawn (and from (seed, logical rank, epoch) before an epoch's iterator starts: its order and its workers' seeds).

Logical ranks (toolkit.contracts.logical): the job has L of them and this process serves one or more. Each has its
own lane: its shard of the data (the loader's DistributedSampler over L replicas, at that logical rank), its
iterator and its replayed batch. The first logical rank served uses the script's own loader, its sampler set to
(L, that logical rank) in place; each further one a copy of the loader with its own copy of the sampler (a copy
of the loader's worker processes too, while it is served). When L is the world size and rank r serves r, the
script's loader is used as the script built it: nothing changes from a job without logical ranks (a sampler the
script set to other replicas than its world's stays so).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.utils.data as tud

from toolkit.train.faults import LoaderError
from toolkit.train.loader import Positioner, Replay


class StepData:
    """The batches of `loader` by step and logical rank; `seed` None leaves the generators alone (then a recovered
    run is not bitwise the same). `serve` says which logical ranks this process serves (the Trainer calls it at each
    re-formation); `position` is the loader's position arithmetic (batches per epoch of a shard of L)."""

    def __init__(self, loader: Any, seed: int | None, logical_world: int, logical_ranks: Sequence[int],
                 as_built: bool) -> None:
        self.seed = seed
        self._loader = loader
        self._pristine = copy.copy(loader.sampler) if getattr(loader, "sampler", None) is not None else None
        self._lanes: dict[int, _Lane] = {}
        self._first: tuple[int, bool] | None = None  # the logical rank the script's own loader serves, as built?
        self.logical_world = logical_world
        if not as_built:
            check_splittable(loader, logical_world)
            retarget(loader.sampler, logical_world, logical_ranks[0])
        self.position = Positioner(loader)
        self.serve(logical_world, logical_ranks, as_built)

    def serve(self, logical_world: int, logical_ranks: Sequence[int], as_built: bool) -> None:
        """Serve `logical_ranks` of `logical_world` from now on: lanes no longer served go (their iterators and
        worker processes), new ones are made; the script's loader serves the first, as the script built it if
        `as_built` (one logical rank each, rank r serving r), else set to that logical rank."""
        if logical_world != self.logical_world:
            raise LoaderError(f"the job's logical ranks changed from {self.logical_world} to {logical_world}: they "
                              "are fixed for a job's life")
        if not as_built:
            check_splittable(self._loader, logical_world)
        first = (logical_ranks[0], as_built)
        lanes: dict[int, _Lane] = {}
        for lr in logical_ranks:
            lane = self._lanes.get(lr)
            was_first = self._first is not None and self._first[0] == lr
            if lane is not None and was_first == (lr == first[0]) and (not was_first or first == self._first):
                lanes[lr] = lane  # the same loader, set the same way: its iterator goes on
            elif lr == first[0]:
                if as_built:
                    _restore(self._loader.sampler, self._pristine)
                else:
                    retarget(self._loader.sampler, logical_world, lr)
                lanes[lr] = _Lane(self._loader, self.position)
            else:
                clone = clone_loader(self._loader, self._pristine, logical_world, lr)
                lanes[lr] = _Lane(clone, Positioner(clone))
        self._lanes, self._first = lanes, first

    def batch(self, step: int, logical_rank: int) -> Any:
        """The batch of `logical_rank` for the step after `step` (the job's optimizer steps done), its randomness
        seeded (what the step body draws next, dropout included, is seeded by it too)."""
        lane = self._lanes[logical_rank]
        at = lane.position.where(step)
        again = lane.replay.get(at)
        if again is not None:  # the step redone after a fault: its batch, and the iterator stays where it is
            self._seed(logical_rank, "step", step + 1)
            return again[0]
        if lane.batches is None or lane.batches_at != at:
            lane.batches = None  # a worker pool of the old iterator goes before the next one starts
            self._seed(logical_rank, "epoch", at[0])  # the epoch's order and the workers' seeds, as when resumed
            lane.batches = lane.position.iterate(*at)
        self._seed(logical_rank, "step", step + 1)
        batch = next(lane.batches)
        lane.batches_at = (at[0], at[1] + 1)  # past the epoch's end this matches no step: a new iterator then
        lane.replay.keep(at, batch)
        return batch

    def close(self) -> None:
        """Let the loaders' iterators (their worker processes) go."""
        for lane in self._lanes.values():
            lane.batches = None

    def _seed(self, logical_rank: int, what: str, number: int) -> None:
        if self.seed is None:
            return
        value = mix(self.seed, logical_rank, 0 if what == "step" else 1, number)
        torch.manual_seed(value)
        random.seed(value)
        np.random.seed(value % (1 << 32))


class _Lane:
    """One logical rank's loader, its position arithmetic, its iterator and the batch it last gave."""

    def __init__(self, loader: Any, position: Positioner) -> None:
        self.position = position
        self.batches: Iterator[Any] | None = None
        self.batches_at: tuple[int, int] | None = None  # (epoch, batch) the iterator yields next
        self.replay = Replay(loader)


def check_splittable(loader: Any, logical_world: int) -> None:
    """LoaderError, one line, for a loader whose data cannot be split by logical rank: its batches come from the
    script's own batch_sampler (not drawn per logical rank from a sampler), or its dataset has fewer samples than
    the logical ranks (a logical rank's batch would be padding only)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and type(batch_sampler) is not tud.BatchSampler:
        raise LoaderError(f"the DataLoader's batches come from its own batch_sampler ({type(batch_sampler).__name__}),"
                          " which cannot be split by logical rank: give it a sampler (DistributedSampler) and a "
                          "batch_size instead")
    dataset = getattr(loader, "dataset", None)
    if isinstance(getattr(loader, "sampler", None), tud.DistributedSampler) and len(dataset) < logical_world:
        raise LoaderError(f"the dataset's {len(dataset)} samples cannot be split evenly over the job's "
                          f"{logical_world} logical ranks: give at least one sample per logical rank")


def retarget(sampler: Any, logical_world: int, logical_rank: int) -> None:
    """Make a DistributedSampler the shard of `logical_rank` of `logical_world` replicas, as DistributedSampler
    itself would be constructed with them (the same padding or dropping); another sampler is left as it is."""
    if not isinstance(sampler, tud.DistributedSampler):
        return
    if (sampler.num_replicas, sampler.rank) == (logical_world, logical_rank):
        return
    sampler.num_replicas, sampler.rank = logical_world, logical_rank
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.drop_last and n % logical_world:
        sampler.num_samples = math.ceil((n - logical_world) / logical_world)
    else:
        sampler.num_samples = math.ceil(n / logical_world)
    sampler.total_size = sampler.num_samples * logical_world


def _restore(sampler: Any, pristine: Any) -> None:
    """Give a DistributedSampler back the replicas and rank the script made it with (`pristine`: a copy then)."""
    if isinstance(sampler, tud.DistributedSampler):
        for name in ("num_replicas", "rank", "num_samples", "total_size"):
            setattr(sampler, name, getattr(pristine, name))


def clone_loader(loader: tud.DataLoader, sampler: Any, logical_world: int, logical_rank: int) -> tud.DataLoader:
    """A copy of `loader` drawing from a copy of `sampler` (the script's sampler as it was made) set to
    `logical_rank`: the same dataset, collate function, workers and options. DataLoader refuses a new sampler by
    assignment after construction; the copy's are set past that check, before it is ever iterated."""
    own = copy.copy(sampler)
    retarget(own, logical_world, logical_rank)
    clone = copy.copy(loader)
    object.__setattr__(clone, "_iterator", None)
    object.__setattr__(clone, "sampler", own)
    if loader.batch_sampler is not None:
        object.__setattr__(clone, "batch_sampler", tud.BatchSampler(own, loader.batch_sampler.batch_size,
                                                                    loader.batch_sampler.drop_last))
    return clone


def mix(*numbers: int) -> int:
    """A 63-bit seed from a few integers (splitmix64 steps): neighbouring steps and ranks get unrelated seeds."""
    x = 0x9E3779B97F4A7C15
    for n in numbers:
        x = (x ^ (n & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x >> 1
