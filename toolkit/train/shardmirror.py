"""Redundancy in memory for pure FSDP (one replica): each rank keeps a copy of another host's rank's shard in host
RAM, refreshed in the background every K steps, so that a lost rank's shard exists somewhere after all.

Why: with `fully_shard` over one replica a rank's shard of the parameters and optimizer state is nowhere else; a
lost rank would cost a restart from the newest checkpoint (every rank's progress since it). Host RAM is usually far
larger than the accelerators' memory, and a copy of one shard per rank costs 1/world of the state per rank.

The ring: rank r keeps the copy of rank (r + L) mod W (`kept_by`), L the ranks per host, so the copy is on another
host (the ranks of a host are numbered together, as toolkit and torchrun do); rank r's own copy is kept by rank
(r - L) mod W (`holder_of`). One host lost costs no copy: its ranks' copies are on the next host. Two hosts next to
each other in the ring lost together lose a copy: then the checkpoint serves.

What a refresh of step s is (`refresh`): this rank copies its shard's tensors into one flat byte buffer in host
memory (its own snapshot, kept: every rank must be able to go back to step s, not only the lost one), on the
training thread at the step boundary (the stall: one memory copy of 1/world of the state); a background thread then
sends it to its holder and receives its ward's into another buffer, over a gloo group of its own (`regroup`: one per
generation, so that the exchange never interleaves with the training's collectives), then passes a barrier on that
group. Why a send/recv in the background rather than copies during the step: the copy of the own shard is the only
part that must see the state at the step boundary; the transfer may take several steps' time without holding
training, and the barrier tells every rank that every exchange of step s completed.

Which steps are whole (`held`): a refresh is complete on a rank when its snapshot is taken and its ward's copy has
arrived. The previous refresh is dropped only after the barrier: a rank that passed it knows every rank completed
step s, and one that did not still holds the previous refresh. So the ranks always have a step in common, and after
a fault they go back to the newest step every survivor holds (`rollback_step`): the survivors copy their own
snapshot back into their tensors (`restore`), each lost rank's replacement receives its shard from its holder
(`hand_over`), and every rank redoes the steps since (at most K + the refresh in flight), bitwise as the data and
randomness of a step are functions of the step (toolkit.train.stepdata).

Memory: two refreshes at once (the held one and the one in flight), each an own snapshot and a ward's copy: four
shards per rank, for every rank of the host (`room`). Without that much (the host's MemAvailable and the memory
cgroup's headroom), the mirror says so in one line at the start and stays off: a fault then restarts from the newest
checkpoint.

K (`choose_every`): the refresh's cost, measured each time (the stall on the training thread plus the exchange's
wall time: an upper bound, as the exchange overlaps training), over the step time, so that it is at most `budget`
(3%) of the steps' time: K = ceil(cost / (budget x step time)). Every rank must refresh at the same steps (the
exchange pairs them), so each proposes its K in the exchange's closing all-reduce (the barrier above), all take the
largest, and every rank applies it at its next refresh, a step they all reach alike; `regroup` agrees on it again
(a replacement starts with FIRST_EVERY).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from toolkit import memcgroup

log = logging.getLogger(__name__)

BUDGET = 0.03  # the refresh's share of step time at most
FIRST_EVERY = 10  # steps between refreshes until a refresh and a step were measured
MAX_EVERY = 10_000
COPIES = 4  # shards in host memory per rank at most: the held refresh and the one in flight, own and ward's
EXCHANGE_TIMEOUT = 600.0  # s for one exchange (bounded: a dead peer ends it sooner, its sockets reset)


def holder_of(rank: int, world: int, per_host: int) -> int:
    """The rank that keeps `rank`'s copy: on the previous host of the ring."""
    return (rank - per_host) % world


def kept_by(rank: int, world: int, per_host: int) -> int:
    """The rank whose copy `rank` keeps (its ward): on the next host of the ring."""
    return (rank + per_host) % world


def ring_problem(world: int, per_host: int) -> str | None:
    """Why the ring cannot keep a copy on another host (one host only, or hosts of unequal sizes), None if it can."""
    if per_host < 1 or world % per_host:
        return f"{world} ranks are not hosts of {per_host} ranks each"
    if world == per_host:
        return "the job runs on one host: no other host's memory to keep a copy in"
    return None


def choose_every(cost: float, step_time: float, budget: float = BUDGET) -> int:
    """Steps between refreshes so that a refresh costing `cost` s is at most `budget` of `step_time`-s steps."""
    if step_time <= 0 or cost <= 0:
        return 1
    return max(1, min(MAX_EVERY, math.ceil(cost / (budget * step_time))))


def rollback_step(held: Sequence[Sequence[int]], lost: Sequence[int], world: int, per_host: int) -> int | None:
    """The step every rank goes back to after losing the ranks `lost`: the newest step every survivor holds whole
    (`held[r]`: the steps rank r holds, any order; ignored for a lost rank), provided every lost rank's holder
    survived. None when no such step exists (a lost rank's holder is lost too, or nothing is held): the checkpoint
    serves then."""
    gone = set(lost)
    if any(holder_of(d, world, per_host) in gone for d in gone):
        return None
    survivors = [set(held[r]) for r in range(world) if r not in gone]
    common = set.intersection(*survivors) if survivors else set()
    common.discard(-1)
    return max(common) if common else None


def available_bytes() -> int | None:
    """What this host lets the process allocate: the least of MemAvailable and the memory cgroup's headroom."""
    found: list[int] = []
    text = memcgroup.read_text("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            found.append(int(line.split()[1]) * 1024)
    group = memcgroup.of_process()
    headroom = group.headroom(memcgroup.read_text) if group is not None else None
    if headroom is not None:
        found.append(headroom)
    return min(found) if found else None


def room(nbytes: int, per_host: int, available: int | None) -> str | None:
    """Why the host cannot keep the copies of shards of `nbytes` for its `per_host` ranks, None if it can."""
    need = COPIES * nbytes * per_host
    if available is not None and need > available:
        return (f"the copies need {need / 1e9:.2f} GB of host memory ({COPIES} x {nbytes / 1e6:.1f} MB for each of "
                f"{per_host} ranks), {available / 1e9:.2f} GB is available")
    return None


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bytes of `tensors`, one after another, in one flat uint8 CPU buffer (`out` reused if its size fits)."""
    size = sum(t.nbytes for t in tensors)
    if out is None or out.numel() != size:
        out = torch.empty(size, dtype=torch.uint8)
    at = 0
    for t in tensors:
        n = t.nbytes
        out[at:at + n].view(t.dtype).view(t.shape).copy_(t.detach())
        at += n
    return out


def unpack(buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `buf` (from `pack` of tensors of these shapes and dtypes) into `tensors`, in place. ValueError if the
    sizes differ (a shard of another layout)."""
    size = sum(t.nbytes for t in tensors)
    if buf.numel() != size:
        raise ValueError(f"a copy of {buf.numel()} bytes cannot fill a shard of {size} bytes")
    at = 0
    with torch.no_grad():
        for t in tensors:
            n = t.nbytes
            t.copy_(buf[at:at + n].view(t.dtype).view(t.shape))
            at += n


@dataclass
class _Refresh:
    """One refresh: this rank's snapshot of `step`, and its ward's copy once it arrived."""

    step: int
    own: torch.Tensor
    ward: torch.Tensor | None = None


class ShardMirror:
    """One rank's end of the ring (module docstring). `nbytes`: this rank's shard in bytes (for the memory check);
    `every`: steps between refreshes, or "auto" (K measured against `budget`). `available`: the bytes the host may
    allocate (default: measured, `available_bytes`). `enabled` False when the ring or the memory does not allow
    the copies; `why_not` then says why (the caller says it at start, with the fallback)."""

    def __init__(self, rank: int, world: int, per_host: int, nbytes: int, *, every: int | str = "auto",
                 budget: float = BUDGET, available: int | None = None) -> None:
        if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every={every!r}: give a number of steps of at least 1, or \"auto\"")
        self.rank, self.world, self.per_host = rank, world, per_host
        self.auto = every == "auto"
        self.every = FIRST_EVERY if self.auto else int(every)
        self.budget = budget
        self.why_not = ring_problem(world, per_host) or room(
            nbytes, per_host, available if available is not None else available_bytes())
        self.enabled = self.why_not is None
        self.holder = holder_of(rank, world, per_host)
        self.ward = kept_by(rank, world, per_host)
        self._cond = threading.Condition()
        self._held: dict[int, _Refresh] = {}  # complete refreshes by step (at most two)
        self._flight: threading.Thread | None = None
        self._group: Any = None
        self._generation = 0  # a regroup voids the exchange in flight
        self._ward_bytes: int | None = None
        self._next_every = 0  # the interval every rank agreed on in the last exchange (0: none), from the next refresh
        self._spare_own: torch.Tensor | None = None  # buffers of a retired refresh, for the next one
        self._spare_ward: torch.Tensor | None = None
        self.last_cost = 0.0  # s: the last refresh's stall plus its exchange's wall time
        self.last_stall = 0.0
        self.last_error: str | None = None  # why the last exchange failed (a peer died mid-way), for the log

    # --- the group

    def regroup(self, timeout: float = EXCHANGE_TIMEOUT) -> None:
        """Collective over the default group (every rank, after each (re-)formation): a gloo group of its own for
        the exchanges, and the interval every rank agrees on. An exchange in flight in the old group is void."""
        with self._cond:
            self._generation += 1
            self._flight = None  # an exchange of the old group that has not ended is abandoned with it (a peer
            # it waits for may be alive but gone on: it ends at the old group's timeout, changing nothing)
        if not self.enabled:
            return
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self._ward_bytes = None
        every = torch.tensor([max(self.every, self._next_every)])
        dist.all_reduce(every, op=dist.ReduceOp.MAX, group=self._group)
        self.every, self._next_every = int(every), 0

    # --- refreshing

    def due(self, step: int) -> bool:
        """Whether `step` is one to refresh at."""
        return self.enabled and step > 0 and step % self.every == 0

    def refresh(self, step: int, tensors: Sequence[torch.Tensor], step_time: float | None = None) -> float:
        """Take this rank's snapshot of `step` (its shard's tensors, in the order every incarnation gives them) and
        start its exchange in the background; returns the seconds the training thread stalled (the previous
        exchange, if still in flight, is waited for first). `step_time`: the steps' mean wall time, for "auto"."""
        began = time.monotonic()
        with self._cond:
            if not self._cond.wait_for(lambda: self._flight is None, timeout=EXCHANGE_TIMEOUT):
                raise RuntimeError(f"rank {self.rank}: the refresh before step {step} did not end in "
                                   f"{EXCHANGE_TIMEOUT:.0f} s")
            if self._next_every:  # agreed by every rank in the last exchange: every rank applies it at this step
                self.every, self._next_every = self._next_every, 0
            if len(self._held) > 1:  # the last barrier failed: the older refresh goes, its buffers serve again
                self._retire(min(self._held))
            own, self._spare_own = self._spare_own, None
        own = pack(tensors, own)
        stall = time.monotonic() - began
        with self._cond:
            generation = self._generation
            self._flight = threading.Thread(target=self._exchange, args=(_Refresh(step, own), generation, stall,
                                                                         step_time), daemon=True,
                                            name=f"shard-mirror:{self.rank}")
            self._flight.start()
        self.last_stall = stall
        return stall

    def wait(self, timeout: float = EXCHANGE_TIMEOUT) -> bool:
        """Wait (bounded) for the exchange in flight; False if it did not end in time."""
        with self._cond:
            return self._cond.wait_for(lambda: self._flight is None, timeout=timeout)

    def settle(self, timeout: float = EXCHANGE_TIMEOUT) -> list[int]:
        """At a recovery, before the ranks compare what they hold: wait (bounded) for the exchange in flight to end
        (a dead peer ends it: its connections are gone), then void whatever it would still do, so that what this
        rank holds does not change under the roll-back. Returns `held()`."""
        self.wait(timeout)
        with self._cond:
            self._generation += 1
        return self.held()

    def held(self) -> list[int]:
        """The steps this rank holds whole (its snapshot and its ward's copy), ascending."""
        with self._cond:
            return sorted(s for s, r in self._held.items() if r.ward is not None)

    def _exchange(self, refresh: _Refresh, generation: int, stall: float, step_time: float | None) -> None:
        began = time.monotonic()
        ok = False
        try:
            group = self._group
            if self._ward_bytes is None:
                sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
                dist.all_gather(sizes, torch.tensor([refresh.own.numel()]), group=group)
                self._ward_bytes = int(sizes[self.ward])
            with self._cond:
                ward, self._spare_ward = self._spare_ward, None
            if ward is None or ward.numel() != self._ward_bytes:
                ward = torch.empty(self._ward_bytes, dtype=torch.uint8)
            ops = [dist.P2POp(dist.isend, refresh.own, self.holder, group),
                   dist.P2POp(dist.irecv, ward, self.ward, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            refresh.ward = ward
            with self._cond:
                if generation != self._generation:
                    return
                self._held[refresh.step] = refresh
            cost = stall + time.monotonic() - began
            proposal = torch.tensor([choose_every(cost, step_time, self.budget) if self.auto and step_time else 0])
            # the barrier: once it completes, every rank completed this refresh and the older ones can go; it also
            # agrees on the next interval (the largest proposal), which every rank applies at its next refresh
            dist.all_reduce(proposal, op=dist.ReduceOp.MAX, group=group)
            with self._cond:
                if generation == self._generation:
                    for s in [s for s in self._held if s < refresh.step]:
                        self._retire(s)
                    self._next_every = int(proposal)
            ok = True
        except Exception as e:  # noqa: BLE001 - a peer died mid-exchange: this refresh is void, the held ones stay
            self.last_error = f"the refresh of step {refresh.step} failed: {str(e).splitlines()[0][:200]}"
            log.warning("rank %d: %s; the copies of the previous refresh stay", self.rank, self.last_error)
        finally:
            with self._cond:
                if self._flight is threading.current_thread():  # not an abandoned exchange (`regroup`)
                    self._flight = None
                if ok:
                    self.last_cost = stall + time.monotonic() - began
                self._cond.notify_all()

    def _retire(self, step: int) -> None:
        """Drop the refresh of `step`; its buffers serve the next one (no new allocation, no page faults). Under
        the lock."""
        old = self._held.pop(step)
        self._spare_own, self._spare_ward = old.own, old.ward

    # --- going back

    def drop_after(self, step: int) -> None:
        """After going back to `step`: drop the refreshes of later steps (they are taken again as the steps are
        redone)."""
        with self._cond:
            for s in [s for s in self._held if s > step]:
                self._retire(s)

    def restore(self, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this rank's snapshot of `step` back into `tensors`, in place."""
        with self._cond:
            refresh = self._held[step]
        unpack(refresh.own, tensors)

    def hand_over(self, step: int, lost: Sequence[int], tensors: Sequence[torch.Tensor] | None,
                  group: Any = None) -> None:
        """Collective over `group` (the re-formed one: every rank calls it, the lost ranks' replacements with
        their `tensors` to fill, the others with None or their own): each lost rank's holder sends its copy of
        `step`, the replacement receives it into its tensors, in place."""
        ops = []
        inbox: torch.Tensor | None = None
        me = self.rank
        for d in sorted(lost):
            holder = holder_of(d, self.world, self.per_host)
            if me == holder:
                with self._cond:
                    copy = self._held[step].ward
                ops.append(dist.P2POp(dist.isend, copy, d, group))
            elif me == d:
                if tensors is None:
                    raise ValueError("a replacement must give the tensors its shard goes into")
                inbox = torch.empty(sum(t.nbytes for t in tensors), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, inbox, holder, group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if inbox is not None and tensors is not None:
            unpack(inbox, tensors)

    def close(self) -> None:
        """Wait (bounded) for the exchange in flight and drop the copies."""
        self.wait()
        with self._cond:
            self._held.clear()
