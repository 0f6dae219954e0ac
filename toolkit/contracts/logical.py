"""Logical ranks: which process serves which of a job's L logical ranks. The one definition, shared by the scheduler
(which decides it for every generation and sends it in `formed`) and the workers (which read it and compute each of
their logical ranks' gradients).

A job on toolkit.train has a fixed number L of logical ranks. Everything that makes a step's result belongs to a
logical rank (its data shard, its random streams, its micro-batch's gradient), and a step's reduction sums the
logical ranks' gradients in logical-rank order, so the result does not depend on how many processes served them.
When a host is lost with no spare, the survivors serve its logical ranks (shrink); when hosts come back, they take
their share again (grow). Both are `assign` with the next generation's processes.

`assign` is pure and:
- balanced: every process serves floor(L/n) or ceil(L/n) logical ranks (L need not be a multiple of n);
- stable: a process keeps the logical ranks it served, as far as balance allows, so a shrink moves only the lost
  processes' logical ranks and a grow moves only what the newcomers must take;
- deterministic: the same inputs give the same assignment on every host (processes are named by sortable keys).
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence, TypeVar

Key = TypeVar("Key", bound=Hashable)

MAX_LOGICAL_RANKS = 65536  # bound of L accepted from a hostile message or flag


def assign(processes: Sequence[Key], logical_world: int,
           previous: Mapping[Key, Sequence[int]] | None = None) -> dict[Key, tuple[int, ...]]:
    """The logical ranks each of `processes` serves (each tuple ascending), L = `logical_world`.

    `previous`: what each process served in the last generation (processes not in it, or absent from `processes`,
    are new or lost). Survivors keep what they served up to their share; the shares one above floor(L/n) go first to
    the processes already holding the most (fewest moves), ties by key order; freed logical ranks go, in ascending
    order, to the processes with room, in key order. Raises ValueError when there are no processes, more processes
    than logical ranks, repeated keys, or a `previous` that is not a partition of range(L)."""
    keys = sorted(processes, key=_sort_key)
    n = len(keys)
    if not 1 <= logical_world <= MAX_LOGICAL_RANKS:
        raise ValueError(f"{logical_world} logical ranks: give 1 to {MAX_LOGICAL_RANKS}")
    if n == 0:
        raise ValueError("no process to serve the logical ranks")
    if len(set(keys)) != n:
        raise ValueError("a process is named twice")
    if n > logical_world:
        raise ValueError(f"{n} processes for {logical_world} logical ranks: a process would serve none "
                         "(give --logical-ranks at least the number of workers)")
    prev = {k: sorted(v) for k, v in (previous or {}).items()}
    if previous is not None:
        check_partition(prev.values(), logical_world)
    base, extra = divmod(logical_world, n)
    by_holding = sorted(keys, key=lambda k: (-len(prev.get(k, ())), _sort_key(k)))
    quota = {k: base + (1 if i < extra else 0) for i, k in enumerate(by_holding)}
    kept = {k: prev.get(k, [])[:quota[k]] for k in keys}
    taken = {lr for lrs in kept.values() for lr in lrs}
    free = iter(lr for lr in range(logical_world) if lr not in taken)
    result: dict[Key, tuple[int, ...]] = {}
    for k in keys:
        mine = list(kept[k])
        while len(mine) < quota[k]:
            mine.append(next(free))
        result[k] = tuple(sorted(mine))
    return result


def moved(before: Mapping[Any, Sequence[int]], after: Mapping[Any, Sequence[int]]) -> int:
    """How many logical ranks changed process between two assignments (a grow's or shrink's cost)."""
    owner = {lr: k for k, lrs in before.items() for lr in lrs}
    return sum(1 for k, lrs in after.items() for lr in lrs if owner.get(lr) != k)


def check_partition(parts: Any, logical_world: int) -> None:
    """Raise ValueError unless `parts` (an iterable of sequences of ints) holds every logical rank of range(L)
    exactly once: what a worker checks of the assignment a `formed` message carries (hostile input)."""
    seen: list[int] = []
    for part in parts:
        if not isinstance(part, (list, tuple)) or not all(type(lr) is int for lr in part):
            raise ValueError("an assignment's part is not a list of integers")
        seen.extend(part)
    if sorted(seen) != list(range(logical_world)):
        raise ValueError(f"the assignment does not cover each of the {logical_world} logical ranks exactly once")


def parse_formed(value: Any, world_size: int, logical_world: Any) -> tuple[tuple[int, ...], ...]:
    """The assignment of a `formed` message: a list, one entry per rank of the generation (`world_size` of them),
    each the ascending list of logical ranks that rank serves. Raises ValueError naming what is wrong."""
    if type(logical_world) is not int or not 1 <= logical_world <= MAX_LOGICAL_RANKS:
        raise ValueError("formed: logical_world is not an integer in range")
    if not isinstance(value, list) or len(value) != world_size:
        raise ValueError(f"formed: logical is not a list of {world_size} parts")
    check_partition(value, logical_world)
    if any(not part for part in value):
        raise ValueError("formed: a rank serves no logical rank")
    return tuple(tuple(sorted(part)) for part in value)


def _sort_key(key: Any) -> tuple[str, Any]:
    return (type(key).__name__, key)
