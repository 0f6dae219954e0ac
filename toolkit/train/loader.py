"""Resume a `torch.utils.data.DataLoader` at an exact batch of an exact epoch, without loading what is skipped.

Why: after a fault a rank continues from step s of the job, which is batch s % len(loader) of epoch
s // len(loader) (every rank has the same number of batches per epoch: DistributedSampler pads its shards). A
DataLoader has no position to set, and iterating past the first batches would read and decode them all. The
indices of a batch come from the loader's sampler, in the main process, whatever num_workers is; so the sampler
is made to skip the indices of the batches already done, and the workers never see them.

How: the sampler instance gets a subclass of its own class whose next `__iter__` yields an order drawn in
advance, from the first index not yet done. DataLoader forbids replacing its sampler after construction, and a
class of the same family keeps every attribute and `set_epoch` working. Where that cannot work (a user's own
batch_sampler) the loader's iterator is advanced instead: the same batches, at the cost of loading the skipped
ones (exact where the sampler's order depends only on the epoch, as DistributedSampler's does).

Randomness: DistributedSampler's order depends only on (seed, epoch); a RandomSampler's and the workers' base seed
come from torch's global generator, which the caller seeds per epoch before each new iterator, and the order is
drawn at that moment, so it is the same whether an epoch starts at batch 0 or is resumed in the middle. Random
augmentation inside worker processes is not replayed exactly after a mid-epoch resume (a batch may land on another
worker): seed it from the sample index for that.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import torch
import torch.utils.data as tud

from toolkit.train.faults import LoaderError


class Positioner:
    """Iterates a DataLoader from a given (epoch, batch) on, epoch by epoch, calling the sampler's set_epoch."""

    def __init__(self, loader: tud.DataLoader) -> None:
        try:
            self.per_epoch = len(loader)
        except TypeError:
            raise LoaderError("the DataLoader has no length (an iterable dataset?): toolkit resumes a loader at "
                              "an exact batch through its sampler; give it a map-style dataset") from None
        if self.per_epoch < 1:
            raise LoaderError("the DataLoader yields no batch: the dataset is empty or smaller than one batch "
                              "with drop_last")
        self.loader = loader
        self.sampler, self.per_batch = _index_source(loader)
        self._prepare = _make_preparable(self.sampler) if self.sampler is not None else None

    def where(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of the batch that step `step + 1` trains on."""
        return divmod(step, self.per_epoch)

    def iterate(self, epoch: int, batch: int) -> Iterator[Any]:
        """A fresh iterator over `epoch`'s batches from `batch` on. The epoch's order is drawn here, now (seed the
        global generators first): the same order whether the epoch starts at batch 0 or is resumed mid-way."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if self._prepare is not None:
            self._prepare(batch * self.per_batch)
            return iter(self.loader)
        it = iter(self.loader)
        for _ in range(batch):  # no sampler to seek: load and drop what was done
            next(it)
        return it


def _index_source(loader: tud.DataLoader) -> tuple[Any, int]:
    """The sampler whose indices make the batches, and how many indices one batch takes (None: cannot seek)."""
    if isinstance(loader.dataset, tud.IterableDataset):
        return None, 0
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:  # automatic batching off: each index is one batch
        return loader.sampler, 1
    if type(batch_sampler) is tud.BatchSampler:
        return batch_sampler.sampler, batch_sampler.batch_size
    return None, 0  # the user's own batch sampler: its batches cannot be counted in indices


def _make_preparable(sampler: Any) -> Callable[[int], None] | None:
    """Let `sampler`'s next __iter__ yield an order drawn in advance: returns `prepare(skip)`, which draws the
    sampler's own order now and keeps it from index `skip` on; None where its class cannot be extended."""
    base = type(sampler)

    class Prepared(base):  # type: ignore[misc, valid-type]
        _toolkit_order: list[Any] | None = None

        def __iter__(self) -> Iterator[Any]:
            order, self._toolkit_order = self._toolkit_order, None
            return iter(order) if order is not None else super().__iter__()

    Prepared.__name__ = Prepared.__qualname__ = base.__name__
    try:
        sampler.__class__ = Prepared
    except TypeError:
        return None

    def prepare(skip: int) -> None:
        sampler._toolkit_order = list(itertools.islice(base.__iter__(sampler), skip, None))

    return prepare


class Replay:
    """The batch last given out and its (epoch, batch) position, to give it again when the step that trained on
    it is redone after a fault.

    Why: the other way to get that batch again is a new iterator, which for a loader with worker processes means
    shutting the old pool down and forking a new one before the first batch: 0.2 s of a recovery that otherwise
    takes a tenth of that (measured on the ported example). Only for loaders with workers: without them a new
    iterator costs about a millisecond, and a batch made in this process may have drawn from the global generators
    (random augmentation), which giving the batch again would not repeat. A batch whose tensors were changed in
    place since (their version counters moved) is not given again."""

    def __init__(self, loader: tud.DataLoader) -> None:
        self.enabled = getattr(loader, "num_workers", 0) > 0
        self._at: tuple[int, int] | None = None
        self._batch: Any = None
        self._versions: list[int] = []

    def keep(self, at: tuple[int, int], batch: Any) -> None:
        if self.enabled:
            self._at, self._batch, self._versions = at, batch, _versions(batch)

    def get(self, at: tuple[int, int]) -> tuple[Any] | None:
        """(the batch,) if the one kept is at `at` and unchanged, else None."""
        if self._at != at or _versions(self._batch) != self._versions:
            return None
        return (self._batch,)


def _versions(batch: Any) -> list[int]:
    """The version counters of the tensors in a batch (nested in lists, tuples and dicts)."""
    if isinstance(batch, torch.Tensor):
        return [batch._version]
    if isinstance(batch, (list, tuple)):
        return [v for item in batch for v in _versions(item)]
    if isinstance(batch, dict):
        return [v for item in batch.values() for v in _versions(item)]
    return []
