"""Bit-reproducible data-parallel training, so that a run interrupted and resumed (in place or from a checkpoint)
ends with exactly the parameters of an uninterrupted one.

Why each piece is needed:

- DDP's default gradient allreduce is not bit-reproducible across a restart. A freshly built DDP reduces its
  first iteration with buckets in parameter order, then rebuilds them in the order gradients became ready;
  and gloo's ring allreduce adds each element's contributions in an order that depends on where the element
  sits in the bucket (its chunk). Resume at step k and step k+1 runs with the initial layout where the
  uninterrupted run had the rebuilt one; with 3+ ranks the float sums differ in the last bits.
  ``OrderedReducer`` sums each element's contributions in rank order 0..n-1 and divides by n, the same
  arithmetic on every rank whatever the bucket layout, and moves what a ring allreduce moves: each rank owns an
  n-th of the bucket, receives the others' slices of it (a reduce-scatter by point-to-point sends), sums them in
  rank order, and sends its sum to every other rank (an all-gather): 2(n-1)/n of the bucket out and in, and n
  slices of extra memory (the n-1 received and their sum: one bucket's worth, kept from bucket to bucket).
  (gloo's own reduce-scatter is an allreduce underneath, and its allreduce sums in chunk order: neither gives a
  layout-independent order.)
- Thread count changes how CPU kernels split their reductions: ``configure`` pins it.
- ``torch.use_deterministic_algorithms`` rejects (rather than silently runs) kernels with no deterministic
  implementation.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as real objects.
import queue
import random
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from toolkit.train.newmemory import unfilled

CLOSE_WAIT = 10.0  # s for the reducer's thread to finish the buckets queued when its wrapper goes
# DDP's bucket size (MB) for this reduction on gloo, where DDP's default is 25. Each bucket costs a fixed exchange
# (its hand-over to the thread, two rounds of messages, the sum's wait for the last slice); fewer, larger buckets
# pay it less often. Measured (bench/bitwise_allreduce.py, docs/benchmarks.md), steps/s over DDP's defaults at
# world 3: 0.91-1.02x at 25 MB, 1.00-1.09x at 50 MB (a few percent, about this machine's run-to-run spread), both
# with gradients copied into the buckets; as views of them (ddpmodel.ddp_arguments) 1.14x.
# Memory: the scratch holds one bucket. NCCL keeps DDP's default.
GLOO_BUCKET_MB = 50


def configure(threads: int = 1) -> None:
    """Pin intra-op threads and demand deterministic kernels. Inter-op threads can only be set before any
    parallel work has started; if that moment has passed the previous setting stays (it does not affect the
    arithmetic of a single op)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass
    torch.use_deterministic_algorithms(True)


def seed_all(seed: int) -> None:
    """Seed torch, Python and numpy's global generators (the ones ``checkpoint.capture_rng_state`` saves)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


class OrderedReducer:
    """DDP comm hook state for the rank-ordered mean of a bucket. Register with
    ``ddp.register_comm_hook(OrderedReducer(group), ordered_allreduce_hook)`` (``group`` None: the default group)
    and ``close()`` it when the DDP wrapper goes.

    On CPU (gloo) one thread per wrapper does each bucket's exchange while backward goes on, as DDP's own
    allreduce does on gloo's threads: gloo matches point-to-point messages by peer and tag (the bucket's index),
    so this thread cannot cross a collective issued by the training thread. On a GPU (NCCL) the exchange is issued
    from the hook itself, in bucket order: NCCL orders it on the device, and the host does not wait. Device buckets
    on gloo (several ranks on one GPU, where NCCL refuses to run) are copied to the host, exchanged there from the
    hook and copied back: gloo's sends read host memory only.

    `fence` (toolkit.train.fence.Fence, optional): when it trips, the buckets not yet reduced fail at once, and a
    bucket handed over after that raises in the hook, which ends the backward there (a survivor would otherwise
    compute the rest of its gradients, up to a whole backward, before it could re-form); the thread, which may be
    stuck in a receive gloo never wakes (see the fence module), is left to its timeout."""

    def __init__(self, group: Any = None, fence: Any = None, order: Any = None) -> None:
        self.group = group
        self.order = list(order) if order is not None else None  # the ranks in the order their parts are summed
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._device_link = dist.get_backend(group) == "nccl"  # device buffers travel as themselves (else via host)
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: list[torch.futures.Future] = []  # futures handed to DDP and not yet completed
        self._failed: BaseException | None = None  # an exchange failed or the group was abandoned
        self._scratch = Scratch()  # the thread's receive and sum buffers, reused bucket after bucket
        self._unwatch = fence.watch(self._abandon) if fence is not None else None

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buf = bucket.buffer()
        if buf.device.type != "cpu":
            fut = torch.futures.Future(devices=[buf.device])  # waiting on it orders the waiter's stream after ours
            if self._device_link:
                _exchange(buf, self.group, self.rank, self.world, 0, self.order)
            else:  # gloo's point-to-point messages move host memory only: the bucket goes through a host copy
                host = buf.cpu()
                _exchange(host, self.group, self.rank, self.world, 0, self.order)
                buf.copy_(host)
            fut.set_result(buf)
            return fut
        fut = torch.futures.Future()
        with self._lock:
            if self._failed is not None:
                raise self._failed
            self._pending.append(fut)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="toolkit-ordered-allreduce", daemon=True)
            self._thread.start()
        self._queue.put((buf, 2 * bucket.index(), fut))
        return fut

    def close(self, timeout: float = CLOSE_WAIT) -> None:
        """Stop watching the fence and end the thread: once the buckets queued are done (bounded), or, if the group
        failed, without waiting (its thread may be stuck in a receive gloo never wakes; it ends at its timeout)."""
        if self._unwatch is not None:
            self._unwatch()
        if self._thread is not None:
            self._queue.put(None)
            if self._failed is None:
                self._thread.join(timeout)
            self._thread = None

    def _abandon(self) -> None:
        """The fence tripped: fail every bucket not yet reduced (from the thread that tripped it)."""
        self._finish(None, RuntimeError("gloo: the rank-ordered allreduce was abandoned: the group's connections "
                                        "were shut down (a new generation began, or a peer is gone)"))

    def _finish(self, fut: torch.futures.Future | None, error: BaseException | None, buf: Any = None) -> None:
        """Complete `fut` with `buf`, or fail it with `error` (every pending one if `fut` is None); once."""
        with self._lock:
            if error is not None and self._failed is None:
                self._failed = error
            todo = self._pending if fut is None else [fut]
            for f in todo:
                if f in self._pending:
                    self._pending.remove(f)
                    if error is None:
                        f.set_result(buf)
                    else:
                        f.set_exception(self._failed or error)

    def _run(self) -> None:
        """Bucket after bucket, in the order DDP hands them over. A bucket's results (the second phase) stay in
        flight while the next bucket, if one is queued already, is sent and summed: the wait overlaps that work
        instead of idling the thread (the scratch is free again once a bucket is summed)."""
        flight: tuple[torch.futures.Future, torch.Tensor, list[Any]] | None = None
        while True:
            if flight is not None and self._queue.empty():
                self._land(*flight)
                flight = None
            item = self._queue.get()
            if item is None:
                if flight is not None:
                    self._land(*flight)
                return
            buf, tag, fut = item
            if self._failed is not None:  # the group is broken: no more traffic on it
                self._finish(fut, self._failed)
                continue
            try:
                works = _exchange_start(buf, self.group, self.rank, self.world, tag, self._scratch, self.order)
            except Exception as e:  # noqa: BLE001 - a peer died: the bucket fails, and DDP raises it in backward
                self._finish(fut, e)
                continue
            if flight is not None:
                self._land(*flight)
            flight = (fut, buf, works)

    def _land(self, fut: torch.futures.Future, buf: torch.Tensor, works: list[Any]) -> None:
        """Wait for a bucket's results and complete its future (or fail it)."""
        if self._failed is not None:
            self._finish(fut, self._failed)
            return
        try:
            for work in works:
                work.wait()
        except Exception as e:  # noqa: BLE001 - as in _run
            self._finish(fut, e)
        else:
            self._finish(fut, None, buf)


def ordered_allreduce_hook(state: OrderedReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the mean of the ranks' gradients, summed in rank order on every rank (see OrderedReducer)."""
    return state(bucket)


class Scratch:
    """The exchange's working memory on one thread: the n-1 slices received and their sum, carved from one buffer
    that is kept and grown to the largest bucket seen. Buckets are reduced one at a time there, so this is O(bucket)
    memory; fresh buffers per bucket would make every step pay their page faults again (a bucket's worth of new
    memory per bucket)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def take(self, count: int, length: int, like: torch.Tensor) -> list[torch.Tensor]:
        """`count` tensors of `length` elements of `like`'s dtype and device (contents undefined), valid until the
        next call."""
        need = count * length * like.element_size()
        if self.buf is None or self.buf.numel() < need or self.buf.device != like.device:
            self.buf = unfilled((need,), torch.uint8, like.device)  # received into, summed into: never read first
        flat = self.buf[:need].view(like.dtype)
        return [flat[i * length:(i + 1) * length] for i in range(count)]


def _exchange(buf: torch.Tensor, group: Any, rank: int, world: int, tag: int, order: Any = None) -> None:
    """Replace `buf` by the rank-ordered mean of every rank's `buf` (`_exchange_start`, then its results waited
    for)."""
    for work in _exchange_start(buf, group, rank, world, tag, None, order):
        work.wait()


def _exchange_start(buf: torch.Tensor, group: Any, rank: int, world: int, tag: int,
                    scratch: Scratch | None = None, order: Any = None) -> list[Any]:
    """Start replacing `buf` by the rank-ordered mean of every rank's `buf`: rank r owns the r-th of n near-equal
    slices, receives every rank's copy of it, sums them in rank order and divides by n (the arithmetic of
    ``sum(parts[0..n-1]) / n`` element by element), then every rank receives every slice's result. Returns once
    this rank's slice is summed and sent, with the works to wait for before `buf` holds every result. `scratch`:
    where the received slices and the sum go, free again on return (None: new tensors, as on a GPU, whose caching
    allocator reuses them). `order`: the ranks in the order their parts are summed (None: 0..n-1); the Trainer
    gives the order of the logical ranks they serve (toolkit.train.logicalgrad)."""
    n = buf.numel()
    bounds = [n * i // world for i in range(world + 1)]
    slices = [buf[bounds[p]:bounds[p + 1]] for p in range(world)]
    mine = slices[rank]
    size = mine.numel()
    room = scratch.take(world, size, mine) if scratch is not None else [torch.empty_like(mine) for _ in range(world)]
    total = room[-1]  # the others: the n-1 slices received
    parts = [mine if p == rank else room[p if p < rank else p - 1] for p in range(world)]
    peers = [p for p in range(world) if p != rank]
    # The results' receives are posted with the first phase: gloo moves a message's bytes only once its receive is
    # posted, so they are waiting when the owners send. Slice p is free for p's result by then: p sums only after
    # every rank's copy of slice p has left.
    scatter = [dist.P2POp(op, t, p, group=group, tag=tag) for p in peers
               for op, t in ((dist.irecv, parts[p]), (dist.isend, slices[p]))]
    works = dist.batch_isend_irecv(scatter + [dist.P2POp(dist.irecv, slices[p], p, group=group, tag=tag + 1)
                                              for p in peers]) if peers else []
    for work in works[:len(scatter)]:
        work.wait()
    summed = parts if order is None else [parts[p] for p in order]
    if world > 1:
        torch.add(summed[0], summed[1], out=total)
    else:
        total.copy_(summed[0])
    for part in summed[2:]:
        total.add_(part)
    torch.div(total, world, out=mine)
    sends = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, p, group=group, tag=tag + 1)
                                    for p in peers]) if peers else []
    return [*sends, *works[len(scatter):]]
