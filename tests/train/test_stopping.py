"""toolkit.train.stopping's one decision under torchrun, with a real SIGTERM to this process: a group abandoned at
the launcher's SIGTERM (a peer died) and the ranks' agreement to stop exclude each other, whichever comes first.
Abandoning after the agreement would shut connections that the stopping peers close on purpose, and this process,
which then ends through the interpreter, would abort in gloo's teardown (seen in CI)."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch

from toolkit.train.faults import looks_collective
from toolkit.train.stopping import Stopping

BOUND = 30.0  # s for this process's own SIGTERM to reach its handler


@pytest.fixture
def stopping() -> Iterator[Stopping]:
    assert threading.current_thread() is threading.main_thread()
    s = Stopping()
    yield s
    s.release()


def alone() -> SimpleNamespace:
    return SimpleNamespace(world_size=1, mode="torchrun", device=torch.device("cpu"))


def sigterm(s: Stopping) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    s._stop.wait(BOUND)
    assert s.requested


def test_once_the_ranks_agreed_to_stop_nothing_is_abandoned(stopping: Stopping) -> None:
    sigterm(stopping)
    assert stopping.agree(alone(), 7) == (True, 7)  # under torchrun every rank leaves
    assert stopping._claim_abandon() is False


def test_a_group_abandoned_first_fails_the_agreement_as_a_broken_collective(stopping: Stopping) -> None:
    assert stopping._claim_abandon() is True
    sigterm(stopping)
    with pytest.raises(RuntimeError) as raised:
        stopping.agree(alone(), 7)
    assert looks_collective(raised.value)  # so the step ends for a restart, as after any broken collective
