"""Do the replicas still hold the same training state? A periodic check that finds silent corruption, names the rank
that holds it, and heals it in place.

Why: with the rank-ordered reduction every data-parallel replica holds the same bits after every step, so any
difference between replicas is a fault: a bit flipped in memory, a device that computed wrong without an error, or
state the script forgot to hand over after a recovery (an LR scheduler outside `state=`). Found by a loss curve, if
at all, it is found days late; compared here, it is found within K steps, and the majority names the odd rank.

When (`Schedule`): every K steps (`verify_every`: a number, 0 for never, or "auto": the ranks measure what a check
costs and what a step takes and agree on the largest of their proposals, so that checking costs about BUDGET of the
step time, below 1%), and after every recovery at once (the state a rank took from a peer is compared with the others'
before a step trains on it: a transfer that went wrong past its own digest, or memory that failed right after it),
then at the steps since + 1, 2, 4, 8, ... until the gap reaches K (forgotten state shows once the object acts, which
may be every step or once an epoch). A heal's received state is checked at once too.

What (`fingerprint`): a hash of each param group's learning rate, one of the other hyperparameters, the digest of
the state (toolkit.train.digest: every byte of the parameters, the buffers unless DDP broadcasts them from rank 0
before each forward (then only rank 0's count, and the others' differ by design after a BatchNorm), the optimizer's
state and the extra state handed over), rank 0's first learning rate to name it, and this rank's proposal for K.
One all_gather of five integers, outside the step.

What then (`verdict`, pure): a learning rate or hyperparameter that differs is a forgotten `state=` entry: one line
naming it, and the job stops (EXIT_FATAL; a restart would go on from one rank's checkpoint and the divergence would
go on unseen). A state digest that differs is corruption. With a majority (three replicas or more), the others are
named (host, rank, the steps since the last good check it started in); every rank goes back to the state of the last
good check, kept in host memory, the named ones receiving it from a healthy peer (toolkit.train.transfer: their own
copy lives in the memory that failed), and the steps are redone: bitwise what a run without the fault gives, when
the fault came after that check (a fault's gradients reach every replica through the allreduce, so the healthy ones
go back too). Without a majority (two replicas, or a tie), every rank goes back to its own copy and redoes the steps;
differing again at the same check, with nothing to tell the faulty one from the healthy one, stops the job with one
line. A rank named twice is fenced: its host is not to be trusted with the job's state. The scheduler, told, hands
the host's ranks to a free spare of the inventory's [spares] (toolkit.scheduler.membership.fence_corrupt), whose
workers take the state from a peer, and the job goes on; with none free an elastic job shrinks without the host,
otherwise it stops the job with one line naming the host. The fenced rank waits for that word (bounded) instead of
training on; outside toolkit, or with no word, it leaves with one line (EXIT_FATAL) and the job stops. Every finding
is reported to the scheduler (one rank reports it), whose ledger keeps it as a `corruption` incident (`fleet status`,
`fleet report`).

A sharded model (toolkit.train.sharded): under HSDP (a (R, S) mesh) the replicas are each shard's column, the R ranks
holding it (toolkit.train.shardmodel.Layout.column), which hold the same bits after every step since the
reduce-scatter and the sum across replica groups run in a fixed order (toolkit.train.shardcomm). Each rank's digest
is of its own shard (`sharded_covered`: parameter slices, their optimizer state, the hyperparameters, the extra
state; not the buffers, which FSDP2 does not synchronize) and each column is judged on its own (`verdict`'s
`columns`; the hyperparameters across every rank). The same all_gather, the same steps: a rank outside its column's
majority (R >= 3) is named and receives the last good check's shard from a healthy rank of its column (as the
in-place recovery moves a shard: toolkit.train.shardstate), every rank going back to that check (the fault's
gradients reached every shard through the reductions); with R = 2 a column that differs has no majority, which the
line says, and every rank goes back to its own copy, as for two DDP replicas. Pure FSDP (R = 1) holds each shard
once: there is nothing to compare, the check never runs, and rank 0 says so in one line at the start (unless
`verify_every` is 0).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, NoReturn, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from toolkit.contracts.protocol import CORRUPT_FENCED, EXIT_FATAL
from toolkit.train import log, transfer
from toolkit.train.agreement import TrainingState
from toolkit.train.digest import Digester
from toolkit.train.faults import GenerationChanged
from toolkit.train.runtime import MODE_TOOLKIT, Runtime, await_word, report_corruption
from toolkit.train.shardmodel import Layout

LR, HYPER, STATE, LR0, PROPOSAL = range(5)  # the fields of a fingerprint
AUTO = "auto"
BUDGET = 0.008  # the share of the step time "auto" aims the checks at: below 1%, since a check's cost varies by a
#                quarter from one to the next on a loaded host (bench/replica_check.py)
AUTO_BOUNDS = (5, 10_000)  # steps: the interval "auto" chooses stays within these
AUTO_FIRST = 20  # steps: with "auto", the first check (nothing measured before it)
AGREE, CONFIG, ODD, SPLIT = "agree", "config", "odd", "split"
NO_REPLICA = ("replica check: pure FSDP holds each shard once (one replica group): there is no replica to compare a "
              "shard with, so the check does not run for this job (HSDP, a (replicate, shard) mesh, has one)")


def parse_every(value: int | str) -> int | None:
    """`verify_every` checked: None for "auto", else the fixed interval (0: never). ValueError with the fix."""
    if value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"verify_every={value!r}: give a number of steps (0: never) or \"auto\"")
    return value


class Schedule:
    """When to check (see the module docstring); a world of one never checks (nothing to compare with)."""

    def __init__(self, world_size: int, every: int | None) -> None:
        self.world_size = world_size
        self.fixed = every  # None: auto
        self.every = every if every is not None else AUTO_FIRST
        self.since: int | None = None  # the step of the latest recovery; None: none since the job's first formation
        self.next: int | None = None
        self.last: int | None = None  # the step of the latest check
        self.again: int | None = None  # a step to check again once reached (the one a heal went back from)

    def arm(self, generation: int | None, step: int) -> None:
        """The group was (re-)formed at `step` (generation 0: the job's first formation; a later one follows a
        fault). The same on every rank: both values are agreed."""
        self.since = step if generation and self.world_size > 1 else None
        self.again = None
        if self.world_size < 2:
            self.next = None
        elif self.since is not None:
            self.next = step  # the state taken in the recovery checked before a step trains on it
        else:
            self.next = step + self.every if self.every else None

    def due(self, step: int) -> bool:
        return self.next is not None and step >= self.next

    def final(self, step: int) -> bool:
        """Whether training ending at `step` needs a last check (so that the final state is verified too)."""
        return self.next is not None and self.last != step

    def checked(self, step: int, proposals: Sequence[int]) -> None:
        """A check at `step` gathered the ranks' `proposals` for the interval: the next check."""
        self.last = step
        if self.fixed is None and proposals:
            self.every = max(proposals)
        gap = self.every
        if self.since is not None and step - self.since < gap:
            gap = max(1, step - self.since)  # the doubling after a recovery
        self.next = step + gap if gap else None
        if self.again is not None and self.again > step:
            self.next = self.again if self.next is None else min(self.next, self.again)
        elif self.again is not None:
            self.again = None

    def recheck(self, now: int, later: int) -> None:
        """A heal gave ranks a state from a peer at step `now` (going back from `later`): check it at once, before a
        step trains on it, and `later` again once the steps are redone."""
        self.next = now
        self.again = later if later > now else None

    def proposal(self, check_seconds: float, step_seconds: float | None) -> int:
        """This rank's interval for "auto": checks costing at most BUDGET of the step time, within AUTO_BOUNDS."""
        if self.fixed is not None:
            return self.fixed
        if not step_seconds or step_seconds <= 0:
            return self.every
        return min(max(math.ceil(check_seconds / (BUDGET * step_seconds)), AUTO_BOUNDS[0]), AUTO_BOUNDS[1])


def covered(module: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any],
            buffers: bool) -> dict[str, Any]:
    """What must be the same on every rank: parameters, buffers (when they are not broadcast), optimizer state,
    extra state. References, not copies."""
    return {"params": dict(module.named_parameters()),
            "buffers": dict(module.named_buffers()) if buffers else {},
            "optimizer": optimizer.state_dict()["state"],
            "extra": {name: obj.state_dict() for name, obj in extra.items()}}


def fingerprint(digester: Digester, module: nn.Module, optimizer: torch.optim.Optimizer,
                extra: dict[str, Any] | None = None, buffers: bool = True, proposal: int = 0) -> list[int]:
    """[hash of every param group's lr, hash of their other hyperparameters, the state's digest, the first group's
    lr as the bits of a double, `proposal`]: the same on ranks that hold the same state (but the proposal)."""
    return fingerprint_of(digester, optimizer, covered(module, optimizer, extra or {}, buffers), proposal)


def fingerprint_of(digester: Digester, optimizer: torch.optim.Optimizer, state: Any, proposal: int = 0) -> list[int]:
    """`fingerprint` of `state` (what must be the same on the ranks compared: `covered`, or a shard's
    `sharded_covered`) with `optimizer`'s hyperparameters."""
    groups = optimizer.param_groups
    lrs = [_plain(g.get("lr")) for g in groups]
    others = [sorted((k, _plain(v)) for k, v in g.items() if k not in ("params", "lr")) for g in groups]
    first = lrs[0] if lrs and isinstance(lrs[0], float) else float("nan")
    return [_hash(repr(lrs)), _hash(repr(others)), digester.state(state),
            struct.unpack("<q", struct.pack("<d", first))[0], proposal]


def sharded_covered(shard: dict[str, Any]) -> dict[str, Any]:
    """What must be the same on the ranks of a shard's column (HSDP): the shard as a state capture holds it
    (toolkit.train.shardstate: parameter slices, their optimizer state, the hyperparameters, the extra state), without
    its step (the same by the agreement) and its buffers (FSDP2 does not synchronize them: a BatchNorm's running
    statistics differ between ranks by design, each from its own batches)."""
    return {k: v for k, v in shard.items() if k not in ("step", "buffers")}


@dataclass(frozen=True)
class Verdict:
    """What a gathered table says: `kind` AGREE, CONFIG (`line`: stop the job), ODD (`odd`: the ranks outside their
    column's majority; `healthy`: every other rank) or SPLIT (a column with no majority: `groups` of ranks holding
    the same state, of every column that differs)."""

    kind: str
    line: str = ""
    odd: tuple[int, ...] = ()
    healthy: tuple[int, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()


def verdict(table: Sequence[Sequence[int]], since: int | None, step: int,
            columns: Sequence[Sequence[int]] | None = None) -> Verdict:
    """The verdict on a gathered table of fingerprints (rank r's at index r). `columns`: the sets of ranks that must
    hold the same state, each judged on its own (None: every rank, as in DDP; HSDP: each shard's column,
    toolkit.train.shardmodel.Layout.column); the hyperparameters must be the same on every rank. ODD: each column
    that differs has a majority (`odd` outside it, `healthy` every other rank); SPLIT: one at least has none
    (`groups`: the groups of every column that differs). Pure."""
    if len({row[LR] for row in table}) > 1 or len({row[HYPER] for row in table}) > 1:
        return Verdict(CONFIG, line=_config_line(table, since, step))
    differing: list[tuple[int, ...]] = []
    odd: list[int] = []
    split = False
    for column in columns if columns is not None else (range(len(table)),):
        groups: dict[int, list[int]] = {}
        for rank in column:
            groups.setdefault(table[rank][STATE], []).append(rank)
        if len(groups) == 1:
            continue
        ordered = sorted((tuple(g) for g in groups.values()), key=lambda g: (-len(g), g))
        differing += ordered
        if len(ordered[0]) * 2 > len(column):
            odd += [r for g in ordered[1:] for r in g]
        else:
            split = True
    if not differing:
        return Verdict(AGREE)
    if split:
        return Verdict(SPLIT, groups=tuple(differing))
    named = set(odd)
    return Verdict(ODD, odd=tuple(sorted(named)), healthy=tuple(r for r in range(len(table)) if r not in named),
                   groups=tuple(differing))


def _config_line(table: Sequence[Sequence[int]], since: int | None, step: int) -> str:
    when = f"after the recovery at step {since}, at step {step}" if since is not None else f"at step {step}"
    if len({row[LR] for row in table}) > 1:
        by_lr: dict[float, list[int]] = {}
        for rank, row in enumerate(table):
            by_lr.setdefault(struct.unpack("<d", struct.pack("<q", row[LR0]))[0], []).append(rank)
        what = "the learning rate differs between ranks (" + ", ".join(
            f"{lr:.6g} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            for lr, ranks in by_lr.items()) + ")"
        likely = ("an LR scheduler is likely not handed over: pass it to the Trainer, e.g. "
                  "Trainer(..., state={\"sched\": scheduler})")
    else:
        what = "the optimizer's hyperparameters (other than the learning rate) differ between ranks"
        likely = ("an object that sets them (a scheduler of momentum or weight decay) is likely not handed over: "
                  "pass it in Trainer(..., state={...})")
    return f"toolkit.train: {when} {what}: {likely}; stopping the job (it would go on with ranks that disagree)"


class Verified:
    """The state of the last good check, in host memory (a copy), with its step: what the ranks go back to."""

    def __init__(self, step: int, state: Any, into: Any = None) -> None:
        self.step = step
        self.state = host_copy(state, into)

    def fresh(self) -> Any:
        """A copy of the kept state to load (a loaded optimizer state may alias what it is given, and the kept
        copy must stay as it was for the next roll-back)."""
        return host_copy(self.state)


def host_copy(state: Any, into: Any = None) -> Any:
    """`state` with every tensor and array copied to host memory: into the tensors of `into` (an earlier copy of a
    state of the same shape, whose host tensors are then reused where they fit: no new memory to fault in at each
    check), else new ones."""
    skeleton, leaves = transfer.flatten(state)
    reuse: list[Any] = []
    if into is not None:
        _, old = transfer.flatten(into)  # leaf i of the state goes into the earlier copy's leaf i if that fits it
        if len(old) == len(leaves):
            reuse = old
    copies = [reuse[i].copy_(leaf.detach()) if reuse and _same_tensor(leaf, reuse[i]) else
              leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else np.array(leaf, copy=True)
              for i, leaf in enumerate(leaves)]
    copies = [c[()] if isinstance(leaf, np.generic) else c for c, leaf in zip(copies, leaves, strict=True)]
    return transfer.inflate(skeleton, copies)


def _same_tensor(leaf: Any, kept: Any) -> bool:
    """Whether `kept` (a leaf of an earlier copy) is a host tensor `leaf` can be copied into."""
    return isinstance(leaf, torch.Tensor) and isinstance(kept, torch.Tensor) and kept.device.type == "cpu" and \
        leaf.shape == kept.shape and leaf.dtype == kept.dtype


def _plain(value: Any) -> Any:
    """A hyperparameter as a value whose repr is exact (a tensor's repr rounds)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    return value


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


HOST_BYTES = 64  # a host's name as the replicas gather it on a mismatch (longer names are cut)


class ReplicaCheck:
    """The check's executor for one rank: `run` at a due step (the Trainer calls it between two steps). Holds the
    schedule, the verified state (`verified`, None before the first good check since the group formed) and how often
    each rank (on its host) was named (the same on every rank: every rank sees the same verdicts).

    `layout`: a sharded model's (toolkit.train.shardmodel), None for DDP. Under HSDP the ranks compared are each
    shard's column (its R replicas), each on the digest of its own shard (`sharded_covered`), and a named rank
    receives its shard from a healthy rank of its column; with R = 2 a column that differs has no majority (the
    roll-back of `_split`). Pure FSDP (R = 1) holds each shard once: nothing to compare, so it never checks, and
    rank 0 says so at the start unless the check is off (`every` 0)."""

    def __init__(self, rt: Runtime, state: TrainingState, every: int | None, buffers: bool, host: str,
                 layout: Layout | None = None) -> None:
        self.rt = rt
        self.state = state
        self.layout = layout
        alone = layout is not None and layout.replicas < 2
        self.schedule = Schedule(1 if alone else rt.world_size, every)  # (a world of one never checks)
        if alone and every != 0 and rt.rank == 0:
            log.line(f"rank 0: {NO_REPLICA}")
        self.buffers = buffers
        self.host = host
        self.digester = Digester()
        self.verified: Verified | None = None
        self._kept: Any = None  # an earlier verified copy, no longer valid: host memory the next copy reuses
        self.named: dict[str, int] = {}  # "rank R on HOST" -> times named
        self.last_split: int | None = None  # the step of a check that found no majority, until one agrees
        self._cost = 0.0  # s the last check took here
        self._last: tuple[float, int] | None = None  # (when, step) of the last check's end

    def arm(self, generation: int | None, step: int) -> None:
        """The group was (re-)formed at `step` with a state every rank agreed on: no verified copy until a check
        (whose copy goes into the memory of the one dropped here: the check after a recovery runs before the step
        in flight is redone, and a fresh copy would fault in the whole state's size there)."""
        self.schedule.arm(generation, step)
        if self.verified is not None:
            self._kept = self.verified.state
        self.verified = None

    def due(self, step: int, end: bool = False) -> bool:
        """Whether to check at `step` (`end`: training ends there: a last check unless `step` was checked)."""
        return self.schedule.final(step) if end else self.schedule.due(step)

    def run(self, step: int, guard: Callable[[], ContextManager[None]]) -> int | None:
        """Collective: compare, and on a mismatch heal. Returns the step every rank goes on from (`step`, or the
        last good check's after a roll-back); None when a new generation cut it short (re-form, then go on). Stops
        the process (one line, EXIT_FATAL) for forgotten state, for a split that repeats, and on a fenced host."""
        began = time.monotonic()
        step_seconds = None
        if self._last is not None and step > self._last[1]:
            step_seconds = max(0.0, began - self._last[0]) / (step - self._last[1])
        proposal = self.schedule.proposal(self._cost, step_seconds)
        s = self.state
        shard = s.capture(step) if self.layout is not None else None  # views: the verified copy is taken of it
        compared = covered(s.module, s.optimizer, dict(s.extra), self.buffers) if shard is None else \
            sharded_covered(shard)
        mine = torch.tensor(fingerprint_of(self.digester, s.optimizer, compared, proposal), dtype=torch.int64,
                            device=self.rt.device)
        try:
            with guard():
                every = self._gather(mine)
                found = verdict(every, self.schedule.since, step, self._columns())
                if found.kind == AGREE:
                    if self.rt.world_size > 1:
                        into = self.verified.state if self.verified is not None else self._kept
                        self.verified, self._kept = Verified(step, s.capture(step) if shard is None else shard,
                                                             into), None
                    self.last_split = None
                    went = step
                elif found.kind == CONFIG:
                    _fatal(f"rank {self.rt.rank}: {found.line}")
                else:
                    went = self._heal(found, step, self._hosts())
        except GenerationChanged as e:
            log.line(f"rank {self.rt.rank}: generation {self.rt.generation} -> {e.new} at step {step} (between two "
                     "steps: nothing in flight): re-forming the group")
            return None
        self.schedule.checked(step, [row[PROPOSAL] for row in every])
        if found.kind == ODD:
            self.schedule.recheck(went, step)  # what the named ranks received, checked before a step uses it
        elif went != step:
            self.schedule.next = step  # the same check again once the steps are redone
        self._cost = time.monotonic() - began
        self._last = (time.monotonic(), went)
        if found.kind == ODD and went == step:  # the state just received checked before a step trains on it
            return self.run(step, guard)  # bounded: a rank named twice is fenced
        return went

    def _gather(self, mine: torch.Tensor) -> list[list[int]]:
        every = [torch.empty_like(mine) for _ in range(self.rt.world_size)]
        self.rt.fence.wait(dist.all_gather(every, mine, async_op=True), "the replica check")
        return [[int(v) for v in t.tolist()] for t in every]

    def _columns(self) -> tuple[tuple[int, ...], ...]:
        """The sets of ranks that must hold the same state: every rank (DDP), or each shard's column (HSDP)."""
        if self.layout is None:
            return (tuple(range(self.rt.world_size)),)
        return tuple(self.layout.column(s) for s in range(self.layout.shards))

    def _hosts(self) -> list[str]:
        """Every rank's host name (gathered as fixed-size bytes, never unpickled)."""
        raw = self.host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
        mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.rt.device)
        every = [torch.empty_like(mine) for _ in range(self.rt.world_size)]
        self.rt.fence.wait(dist.all_gather(every, mine, async_op=True), "the replica check's host names")
        return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in every]

    def _heal(self, found: Verdict, step: int, hosts: list[str]) -> int:
        """A state digest differs: name, go back to the verified state (the odd ranks receiving it from a healthy
        peer of their column), say so; the step every rank goes on from (checked again there before a step trains
        on it: `run`)."""
        rank, s = self.rt.rank, self.state
        good = self.verified
        since = good.step if good is not None else None
        window = f"steps {since + 1}-{step}" if since is not None else f"at or before step {step}"
        if found.kind == SPLIT:
            return self._split(found, step, hosts, window)
        names = {r: f"rank {r} on {hosts[r]}" for r in found.odd}
        for who in names.values():
            self.named[who] = self.named.get(who, 0) + 1
        fenced = [r for r, who in names.items() if self.named[who] >= 2]
        column = next(c for c in self._columns() if rank in c)
        holders = [r for r in column if r in found.healthy]
        if good is None:  # no verified copy: the odd ranks take the healthy ones' current state
            sent = s.capture(step)
            back = step
        else:
            sent = good.state if rank in holders else s.capture(step)
            back = since
        received, nbytes = transfer.share(sent, holders, rank=rank, world=self.rt.world_size, device=self.rt.device,
                                          fence=self.rt.fence, members=column)
        if rank in holders:
            if good is not None:
                s.restore(good.fresh())
        else:
            s.restore(received)
        if good is None and step == self.schedule.since:
            window = f"the recovery at step {step} (the state taken then changed in or after the transfer)"
        log.line(f"rank {rank}: corruption found at step {step}: {self.heal_line(found, names, window, back, good)}"
                 + (f" ({nbytes / 1e6:.2f} MB received)" if rank not in holders else ""))
        healed = [r for r in found.odd if r not in fenced]
        for ranks, action in ((healed, "healed"), (fenced, CORRUPT_FENCED)):
            if ranks:
                self._report(found.healthy[0], step, since, ranks, [hosts[r] for r in ranks], action)
        if fenced:
            self._fenced(", ".join(names[r] for r in fenced), rank in fenced)
        return back

    def heal_line(self, found: Verdict, names: dict[int, str], window: str, back: int, good: Verified | None) -> str:
        """What `_heal` found and does, for the log: `names` the odd ranks, going `back` to that step (`good`'s, or
        the one checked when there is no verified state)."""
        named = ", ".join(names.values())
        verb = "differs" if len(found.odd) == 1 else "differ"
        if self.layout is None:
            whom = f"the majority (ranks {', '.join(map(str, found.healthy))})"
            took, again = f"receiving it from rank {found.healthy[0]}", f"receiving rank {found.healthy[0]}'s state"
            taking = f"{named} taking rank {found.healthy[0]}'s state"
        else:
            columns = [c for c in self._columns() if any(r in found.odd for r in c)]
            whose = "its shard's" if len(names) == 1 else "their shards'"
            whom = f"the majority of {whose} replicas (" + "; ".join(
                f"shard {self.layout.shard_of(c[0])}: ranks {', '.join(str(r) for r in c if r in found.healthy)}"
                for c in columns) + ")"
            senders = {r: who for c in columns
                       for r, who in transfer.assign([r for r in c if r in found.healthy], self.rt.world_size, c)
                       .items()}
            took = again = "receiving its shard from " + ", ".join(f"rank {senders[r]}" for r in names)
            taking = f"{named} {took}"
        if good is not None:
            how = f"goes back to step {back} (the last good check), {named} {took}, and redoes the steps"
        elif back == self.schedule.since:
            how = f"goes on from step {back}, {named} {again} again"
        else:
            how = (f"goes on from step {back}, {taking} (no verified state to go back to: the steps since the fault "
                   "are not redone)")
        return f"{named} {verb} from {whom}; it started in {window}; every rank {how}"

    def _fenced(self, who: str, mine: bool) -> None:
        """`who` was found corrupt twice: its host is not to be trusted with the job's state. Under toolkit the
        scheduler (told by `_report`) hands its host's ranks to a spare, which ends this process if it is one of
        them (`fenced`), or stops the job where no spare can take them: a fenced rank waits for that word
        (bounded) instead of training on; elsewhere, or with no word in time, it leaves with one line (EXIT_FATAL)
        and the job stops, for the operator to replace its host."""
        rank = self.rt.rank
        line = f"{who} found corrupt twice: fenced (its host is not to be trusted with the job's state)"
        if self.rt.mode != MODE_TOOLKIT:
            if mine:
                _fatal(f"rank {rank}: toolkit.train: {line}: it leaves and the job stops; replace its host")
            log.line(f"rank {rank}: {line}: it leaves and the job stops")
            return
        log.line(f"rank {rank}: {line}: the scheduler hands its host's ranks to a spare, shrinks the job without it, "
                 "or stops the job")
        if not mine:
            return
        bound = self.rt.cfg.word_wait
        said = await_word(self.rt, bound)
        _fatal(f"rank {rank}: toolkit.train: {line}, and " + (
            f"the scheduler stopped the job: {said}" if said is not None else
            f"no word from the scheduler within {bound:g} s: it leaves and the job stops; replace its host (e.g. "
            "fleet replace)"))

    def _split(self, found: Verdict, step: int, hosts: list[str], window: str) -> int:
        """No majority: every rank goes back to its own verified state and redoes the steps; a second split at the
        same check, or none to go back to, stops the job."""
        rank, good = self.rt.rank, self.verified
        since = good.step if good is not None else None
        what = split_line(found.groups, hosts, self.layout)
        suspects = sorted(r for g in found.groups for r in g)
        if good is None or self.last_split == step:
            self._report(0, step, since, suspects, [hosts[r] for r in suspects], "stopped")
            again = f"again after going back to step {since}" if self.last_split == step else "with no verified state"
            _fatal(f"rank {rank}: toolkit.train: at step {step} {what}, {again}: no healthy replica to tell the "
                   "faulty one; stopping the job (restart it from a checkpoint of a verified step)")
        self.last_split = step
        self._report(0, step, since, suspects, [hosts[r] for r in suspects], "rolled back")
        log.line(f"rank {rank}: corruption found at step {step}: {what}; it started in {window}: every rank goes "
                 f"back to step {since} (its last good check) and redoes the steps")
        self.state.restore(good.fresh())
        return since

    def _report(self, by: int, step: int, since: int | None, ranks: list[int], hosts: list[str], action: str) -> None:
        """Rank `by` tells the scheduler (its ledger: `fleet status`, `fleet report`): `ranks` and their `hosts`."""
        if self.rt.rank == by:
            report_corruption(self.rt, step=step, since=since, ranks=ranks, hosts=hosts, action=action)


def split_line(groups: Sequence[Sequence[int]], hosts: Sequence[str], layout: Layout | None) -> str:
    """The replicas that differ with no majority, in words: the `groups` of ranks holding the same state (DDP:
    every rank's; HSDP: each differing shard's column's, named by shard). Pure."""
    def ranks(g: Sequence[int]) -> str:
        return "ranks " + ", ".join(f"{r} ({hosts[r]})" for r in g)

    if layout is None:
        return f"the replicas' states differ with no majority ({'; '.join(ranks(g) for g in groups)})"
    shards: dict[int, list[Sequence[int]]] = {}
    for g in groups:
        shards.setdefault(layout.shard_of(g[0]), []).append(g)
    what = "; ".join(f"shard {s}'s replicas differ"
                     f"{' with no majority' if max(map(len, gs)) * 2 <= layout.replicas else ''} "
                     f"({'; '.join(map(ranks, gs))})" for s, gs in shards.items())
    if layout.replicas == 2:
        what += ": with two replica groups no majority can name the faulty one"
    return what


def _fatal(line: str) -> NoReturn:
    """One line, then the end of the process with EXIT_FATAL (not SystemExit: the script must not go on, nor catch
    it and save a checkpoint of a state known to be wrong)."""
    log.line(line, sys.stderr)
    sys.stdout.flush()
    os._exit(EXIT_FATAL)
