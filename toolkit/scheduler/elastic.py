"""The job's world across generations when it may shrink and grow (issue 42): which of its ranks take part in the
next generation, their numbering in it, and which of the L logical ranks each serves. Pure: the membership
(toolkit.scheduler.membership) asks and applies.

Names: a *slot* is one of the job's MS_WORKER_NUM places, `worker_<slot>`, on a fixed host slot (the plan's host and
local rank, or the spare that took them over): the stable process identity the assignment is keyed by. A generation's
world is the slots not *benched*, in ascending order; a slot's rank in that generation is its index there (0..n-1).
A slot is benched when its host is lost, no spare can take it and the survivors may shrink (`shrink_refusal`); it is
back in the next generation once a worker registers for it again (its host came back, `fleet restart --host`).

- Shrink is allowed when `min_workers` (TOOLKIT_MIN_WORKERS: --min-workers, or torchrun's --nnodes MIN:MAX) is below
  MS_WORKER_NUM, the survivors are at least `min_workers`, and no survivor would serve more logical ranks than it
  said it can hold (`capacity`, sent with its heartbeats: the Trainer's estimate of the per-logical gradient copies
  its memory holds). Otherwise the job waits for its hosts (or a spare), as it did before, and says why in one line.
- The assignment is contracts.logical.assign over the world's slots with the previous generation's: a shrink moves
  only the lost slots' logical ranks, a grow only what the returning slots take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from toolkit.contracts import envvars, logical


@dataclass(frozen=True)
class World:
    """One generation's world: `slots` in rank order (rank i is slots[i]), L logical ranks and what each rank
    serves (`logical[i]`, ascending)."""

    slots: tuple[int, ...]
    logical_world: int
    logical: tuple[tuple[int, ...], ...]

    def rank_of(self, slot: int) -> int | None:
        """The slot's rank in this generation, None if it is not in it."""
        try:
            return self.slots.index(slot)
        except ValueError:
            return None

    def formed_fields(self, slot: int) -> dict[str, object]:
        """What `formed` tells the process in `slot`: its rank and the world size of this generation, L and the
        whole assignment (one ascending list per rank, index = rank; contracts.logical.parse_formed reads it)."""
        return {"rank": self.rank_of(slot), "world_size": len(self.slots), "logical_world": self.logical_world,
                "logical": [list(part) for part in self.logical]}

    def by_slot(self) -> dict[int, tuple[int, ...]]:
        """The assignment keyed by slot (what the next generation's assignment starts from)."""
        return dict(zip(self.slots, self.logical, strict=True))


def plan_world(slots: Sequence[int], logical_world: int,
               previous: Mapping[int, Sequence[int]] | None) -> World:
    """The world of a generation of `slots` (any order), stable with respect to `previous` (keyed by slot; the slots
    it names that are not in `slots` are the lost ones: their logical ranks are freed)."""
    ordered = sorted(slots)
    kept = None if previous is None else {s: lrs for s, lrs in previous.items() if s in ordered}
    if kept is not None:  # a lost slot's logical ranks are free: assign() wants a partition of what is kept
        owned = {lr for lrs in kept.values() for lr in lrs}
        free = [lr for lr in range(logical_world) if lr not in owned]
        kept = _with_free(kept, free)
    mapping = logical.assign(ordered, logical_world, kept)
    return World(tuple(ordered), logical_world, tuple(mapping[s] for s in ordered))


def _with_free(kept: Mapping[int, Sequence[int]], free: list[int]) -> dict[object, tuple[int, ...]]:
    """`kept` plus one pseudo-process (sorted last, never in the result) holding the free logical ranks, so that
    assign() sees a partition of range(L) (its contract) and treats the free ones as a lost process's."""
    out: dict[object, tuple[int, ...]] = {s: tuple(lrs) for s, lrs in kept.items()}
    if free:
        out[("freed",)] = tuple(free)
    return out


def shrink_refusal(survivors: Collection[int], world_size: int, min_workers: int, logical_world: int,
                   capacity: Mapping[int, int]) -> str | None:
    """Why the survivors (`survivors`: the slots left in the world) may not go on without the lost ones, or None
    when they may. `capacity`: the logical ranks a slot said it can hold (absent: no bound known)."""
    n = len(survivors)
    if min_workers >= world_size:
        return (f"the job may not shrink ({envvars.TOOLKIT_MIN_WORKERS}={min_workers} of {world_size} workers; "
                "--min-workers or --nnodes MIN:MAX lets it)")
    if n < min_workers:
        return (f"{n} workers would be left, below --min-workers {min_workers} "
                f"({envvars.TOOLKIT_MIN_WORKERS})")
    share = -(-logical_world // n)  # the most logical ranks a survivor would serve
    short = sorted(s for s in survivors if capacity.get(s, share) < share)
    if short:
        names = ", ".join(f"worker_{s} (holds {capacity[s]})" for s in short[:8])
        return (f"a survivor would serve {share} logical ranks, more than its memory holds: {names}; free memory "
                "on those hosts or add one")
    return None


def assignment_doc(world: World) -> list[list[object]] | None:
    """What is persisted of a formed world's assignment: [[slot, [logical ranks]], ...], or None when it is the
    plain one (every slot in, serving its own number: nothing a restarted scheduler could not compute)."""
    if world.logical_world == len(world.slots) and all(part == (s,) for s, part in zip(world.slots, world.logical,
                                                                                        strict=True)):
        return None
    return [[s, list(part)] for s, part in zip(world.slots, world.logical, strict=True)]


def read_assignment(doc: object, world_size: int, logical_world: int) -> dict[int, tuple[int, ...]] | None:
    """The persisted assignment (`assignment_doc`) as {slot: logical ranks}; ValueError if it is malformed (the
    state file is hostile input), None for None."""
    if doc is None:
        return None
    if not isinstance(doc, list) or not all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int
                                            and 0 <= e[0] < world_size for e in doc):
        raise ValueError("assignment: not a list of [slot, [logical ranks]]")
    logical.check_partition([e[1] for e in doc], logical_world)
    return {int(e[0]): tuple(sorted(e[1])) for e in doc}


def read_benched(doc: object, world_size: int) -> list[int]:
    """The persisted benched slots; ValueError if malformed."""
    if doc is None:
        return []
    if not isinstance(doc, list) or not all(type(s) is int and 0 <= s < world_size for s in doc):
        raise ValueError("benched: not a list of slots")
    return sorted(set(doc))


def active(world_size: int, benched: Collection[int]) -> list[int]:
    """The slots in the next generation's world: every one not benched, ascending."""
    return [s for s in range(world_size) if s not in benched]


def previous(doc: object, world_size: int, logical_world: int) -> dict[int, tuple[int, ...]] | None:
    """The assignment the next one starts from: the persisted one, or when none is (`assignment_doc` gave None) the
    plain one if L = MS_WORKER_NUM (every slot serving its own number), else None (the first formation)."""
    if doc is not None:
        return read_assignment(doc, world_size, logical_world)
    return {s: (s,) for s in range(world_size)} if logical_world == world_size else None
