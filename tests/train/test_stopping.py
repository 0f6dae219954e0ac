"""toolkit.train.stopping's one decision under torchrun: a group abandoned at the launcher's SIGTERM (a peer died)
and the ranks' agreement to stop exclude each other, whichever comes first. Abandoning after the agreement would
shut connections that the stopping peers close on purpose, and this process, which then ends through the
interpreter, would abort in gloo's teardown (seen in CI).

The SIGTERM is the Trainer's handler called as the signal would call it: a real one to a test process would meet
whatever handler the session installed (tests/conftest.py's cluster turns it into KeyboardInterrupt). The real
signal, under the real torchrun, is tests/train/test_runtime.py's."""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch

from toolkit.train.faults import looks_collective
from toolkit.train.stopping import Stopping


@pytest.fixture
def stopping() -> Iterator[Stopping]:
    s = Stopping()
    yield s
    s.release()


def alone() -> SimpleNamespace:
    return SimpleNamespace(world_size=1, mode="torchrun", device=torch.device("cpu"))


def sigterm(s: Stopping) -> None:
    s._on_sigterm(signal.SIGTERM, None)
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
