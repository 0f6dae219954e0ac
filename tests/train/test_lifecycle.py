"""The worker's lifecycle table (toolkit.train.lifecycle): the paths a worker takes are legal, others are refused
naming both phases; pure, no process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.train.lifecycle import MOVES, TERMINAL, Lifecycle, LifecycleError, Phase, legal


def walk(*moves: tuple[Phase, int | None]) -> Lifecycle:
    life = Lifecycle()
    for to, generation in moves:
        life.move(to, generation)
    return life


def test_a_worker_joins_forms_loses_a_peer_reforms_receives_and_finishes() -> None:
    life = walk((Phase.FORMED, 0), (Phase.RECEIVING, None), (Phase.FORMED, None),  # the first agreement
                (Phase.ABANDONED, 1), (Phase.ABANDONED, 2),  # a second death before re-forming began
                (Phase.REFORMING, None), (Phase.FORMED, 2), (Phase.RECEIVING, None),
                (Phase.ABANDONED, 3),  # a death during the agreement
                (Phase.REFORMING, None), (Phase.FORMED, 3), (Phase.RECEIVING, None), (Phase.FORMED, None),
                (Phase.FINISHED, None))
    assert life.now() == (Phase.FINISHED, 3)
    assert str(life) == "finished (generation 3)"


def test_a_plain_loop_reforms_without_receiving() -> None:
    """A script on Runtime.guard and reform (no Trainer) never takes state through the Trainer's agreement."""
    life = walk((Phase.FORMED, 0), (Phase.ABANDONED, 1), (Phase.REFORMING, None), (Phase.FORMED, 1))
    assert life.now() == (Phase.FORMED, 1)


@pytest.mark.parametrize("phase", [p for p in Phase if p not in TERMINAL])
def test_stop_from_every_live_phase_and_nothing_after_the_end(phase: Phase) -> None:
    assert legal(phase, Phase.STOPPED)
    for end in TERMINAL:
        assert not any(legal(end, to) for to in Phase), f"{end} is an end"


def test_an_illegal_move_is_refused_naming_both_phases_and_leaves_the_state() -> None:
    life = walk((Phase.FORMED, 4))
    with pytest.raises(LifecycleError, match=r"formed -> re-forming is not a legal move \(generation 4"):
        life.move(Phase.REFORMING)  # re-forming only after the group was abandoned
    assert life.now() == (Phase.FORMED, 4)
    with pytest.raises(LifecycleError, match="joining -> receiving"):
        Lifecycle().move(Phase.RECEIVING)  # no state is taken before a group exists


def test_every_phase_has_a_row_and_every_live_phase_a_way_on() -> None:
    assert set(MOVES) == set(Phase)
    for phase in Phase:
        assert phase in TERMINAL or MOVES[phase], f"{phase} leads nowhere but stopped"


def test_a_new_generation_abandons_only_a_group_held() -> None:
    """Runtime.check after close(), or a word while the first group is built: nothing held, nothing moves."""
    life = walk((Phase.FORMED, 0), (Phase.STOPPED, None))
    life.abandon(1)
    assert life.now() == (Phase.STOPPED, 0)
    life = Lifecycle()
    life.abandon(1)
    assert life.now() == (Phase.JOINING, None)
    life = walk((Phase.FORMED, 0))
    life.abandon(1)
    assert life.now() == (Phase.ABANDONED, 1)


def test_the_architecture_doc_names_every_phase() -> None:
    """docs/architecture.md's table of phases (the newcomer's map) lists each phase the code has."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| ")}
    assert {p.value for p in Phase} <= rows
