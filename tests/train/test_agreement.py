"""Which state the ranks go on from after a (re-)formation (toolkit.train.agreement.choose_source), without processes:
what each rank tells (the step it holds in memory or -1, whether its state is still the initial one) and the newest
checkpoint decide the source, the ranks that give it, and the newest step reached. The collective around it runs in
tests/train/test_recovery.py and the e2e fault tests."""

from __future__ import annotations

import pytest

from toolkit.train.agreement import (
    FROM_CHECKPOINT,
    FROM_INITIAL,
    FROM_PEER,
    Source,
    choose_source,
    recomputed_steps,
)
from toolkit.train.faults import TrainerError


def test_the_lowest_rank_at_the_highest_held_step_wins() -> None:
    # A fault inside a collective left rank 2 and 3 a step ahead (their optimizer step ran); rank 1 is a replacement.
    source = choose_source([(40, 0), (-1, 1), (41, 0), (41, 0)])
    assert source == Source(FROM_PEER, (2, 3), 41)
    assert source.rank == 2
    assert choose_source([(7, 0), (7, 0)]).rank == 0


def test_a_held_state_beats_a_newer_checkpoint() -> None:
    # A checkpoint is asked for only when nobody holds a state; were one given, memory still wins.
    source = choose_source([(-1, 1), (12, 0)], checkpoint=(20, 0))
    assert (source.kind, source.holders, source.reached) == (FROM_PEER, (1,), 12)


def test_a_checkpoint_only_when_nobody_holds_a_state() -> None:
    source = choose_source([(-1, 1), (-1, 1), (-1, 0)], checkpoint=(30, 2))
    assert source == Source(FROM_CHECKPOINT, (2,), 30)
    assert source.rank == 2


def test_the_initial_state_when_neither() -> None:
    # Rank 0 received part of a transfer that failed: its state is no longer the one it was built with.
    source = choose_source([(-1, 0), (-1, 1), (-1, 1)])
    assert source == Source(FROM_INITIAL, (1,), -1)
    assert choose_source([(-1, 1)]) == Source(FROM_INITIAL, (0,), -1)


def test_nothing_to_go_on_from_says_restart() -> None:
    with pytest.raises(TrainerError, match="no rank holds a training state .* and there is no checkpoint: restart"):
        choose_source([(-1, 0), (-1, 0)])


def test_recomputed_steps_are_known_from_memory_only() -> None:
    assert recomputed_steps(Source(FROM_PEER, (1,), 41), 41) == 0
    assert recomputed_steps(Source(FROM_PEER, (1,), 41), 40) == 1  # a rank redoes the step its peers completed
    assert recomputed_steps(Source(FROM_CHECKPOINT, (0,), 30), 30) == -1  # the scheduler knows: not this rank
    assert recomputed_steps(Source(FROM_INITIAL, (0,), -1), 0) == 0
