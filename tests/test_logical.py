"""The assignment of logical ranks to processes (toolkit.contracts.logical): balanced, stable, deterministic."""

import itertools
import random

import pytest

from toolkit.contracts import logical


def sizes(a):
    return sorted(len(v) for v in a.values())


@pytest.mark.parametrize("n,L", [(1, 1), (2, 6), (4, 6), (5, 6), (3, 7), (6, 6), (7, 64)])
def test_balanced_partition(n, L):
    a = logical.assign([f"p{i}" for i in range(n)], L)
    logical.check_partition(a.values(), L)
    assert max(sizes(a)) - min(sizes(a)) <= 1
    assert all(list(v) == sorted(v) for v in a.values())


def test_identity_when_one_each():
    a = logical.assign(list(range(6)), 6)
    assert a == {i: (i,) for i in range(6)}


def test_shrink_moves_only_the_lost_logical_ranks():
    start = logical.assign([f"h{h}/{s}" for h in range(3) for s in range(2)], 6)
    survivors = [k for k in start if not k.startswith("h1/")]
    after = logical.assign(survivors, 6, start)
    assert logical.moved(start, after) == 2
    for k in survivors:
        assert set(start[k]) <= set(after[k])
    assert sizes(after) == [1, 1, 2, 2]


def test_grow_moves_only_what_newcomers_take():
    start = {"a": (0, 1), "b": (2, 3), "c": (4,), "d": (5,)}
    after = logical.assign(["a", "b", "c", "d", "e", "f"], 6, start)
    assert sizes(after) == [1] * 6
    assert logical.moved(start, after) == 2
    assert after["c"] == (4,) and after["d"] == (5,)


def test_random_shrink_and_grow_sequences_stay_balanced_and_minimal():
    rnd = random.Random(7)
    L = 12
    procs = [f"p{i:02d}" for i in range(L)]
    current = logical.assign(procs, L)
    for _ in range(200):
        n = rnd.randint(1, L)
        nxt = sorted(rnd.sample(procs, n))
        after = logical.assign(nxt, L, {k: v for k, v in current.items()})
        logical.check_partition(after.values(), L)
        assert max(sizes(after)) - min(sizes(after)) <= 1
        # minimal: every logical rank whose owner survived and still had room stays
        lower = sum(max(0, len(current.get(k, ())) - len(after[k])) for k in nxt) + sum(
            len(v) for k, v in current.items() if k not in after)
        assert logical.moved(current, after) == lower
        current = after


def test_deterministic_whatever_the_order():
    procs = ["b", "a", "d", "c"]
    prev = {"a": (0, 1, 2), "b": (3, 4), "c": (5,), "d": (6,)}
    results = {tuple(sorted(logical.assign(list(p), 7, prev).items())) for p in itertools.permutations(procs)}
    assert len(results) == 1


@pytest.mark.parametrize("procs,L,prev,message", [
    ([], 4, None, "no process"),
    (["a", "b", "c"], 2, None, "would serve none"),
    (["a", "a"], 4, None, "named twice"),
    (["a"], 0, None, "logical ranks"),
    (["a", "b"], 3, {"a": (0, 1), "b": (1, 2)}, "exactly once"),
])
def test_refusals(procs, L, prev, message):
    with pytest.raises(ValueError, match=message):
        logical.assign(procs, L, prev)


@pytest.mark.parametrize("value,world,L", [
    ([[0], [1]], 3, 2), ([[0], [0]], 2, 2), ([[0, 1], []], 2, 2), ([[0], ["1"]], 2, 2), ("x", 1, 1),
    ([[0], [True]], 2, 2), ([[0]], 1, 0), ([[0]], 1, True),
])
def test_hostile_formed_assignments_are_refused(value, world, L):
    with pytest.raises(ValueError):
        logical.parse_formed(value, world, L)


def test_formed_assignment_parses():
    assert logical.parse_formed([[2, 0], [1]], 2, 3) == ((0, 2), (1,))
