"""The agent's progress path, unit by unit: hostile datagrams on a real unix datagram socket
(toolkit.agent.progressinbox), and when agent.json is rewritten for them, on a fake clock (toolkit.agent.docwriter):
a change of state at once, progress alone at most once per PROGRESS_WRITE_INTERVAL."""

from __future__ import annotations

import json
import selectors
import socket
import stat
from pathlib import Path

import pytest

from toolkit.agent import progressinbox
from toolkit.agent.docwriter import PROGRESS_WRITE_INTERVAL, DocWriter
from toolkit.agent.progressinbox import ProgressInbox, Report
from toolkit.agent.timers import Timers
from toolkit.contracts import protocol as P
from toolkit.contracts.agentdoc import AgentDoc, progress
from toolkit.testing.clock import FakeClock


@pytest.mark.parametrize("data, report", [
    (json.dumps(progress("worker_0", 7, 1, P.RECOVERY_IN_PLACE)).encode(),
     Report("worker_0", 7, 1, P.RECOVERY_IN_PLACE)),
    (b'{"node_id": "worker_1", "recovery": "restart"}', Report("worker_1", recovery=P.RECOVERY_RESTART)),
    (b'{"node_id": "w", "step": true, "epoch": "2", "recovery": "sideways"}', Report("w")),  # wrong types left out
    (b'{"node_id": "w", "step": 1.5, "recovery": ["in-place"]}', Report("w")),
    (b'{"node_id": "w", "done": true}', Report("w", done=True)),
    (b'{"node_id": "w", "done": 1}', Report("w")),  # only the JSON value true says done
    (b'{"node_id": 3, "step": 1}', None),
    (b'{"step": 1}', None),
    (b'["worker_0", 1]', None),
    (b'"worker_0"', None),
    (b"\xff\xfe", None),
    (b"", None),
    (b"[" * 3000, None),
])
def test_parse_keeps_only_well_typed_fields_of_an_object_naming_a_node(data: bytes, report: Report | None) -> None:
    assert progressinbox.parse(data) == report


def test_the_inbox_reads_a_bounded_batch_per_wake_and_drops_the_hostile(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progressinbox, "READS_PER_WAKE", 4)  # the kernel queues few datagrams (max_dgram_qlen)
    sel = selectors.DefaultSelector()
    batches: list[list[Report]] = []
    inbox = ProgressInbox(tmp_path / "progress.sock", sel, batches.append)
    inbox.open()
    try:
        assert stat.S_IMODE((tmp_path / "progress.sock").stat().st_mode) == 0o600
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.connect(str(tmp_path / "progress.sock"))
        sender.send(b"garbage")
        sender.send(b"x" * 60000)  # longer than one read: cut, then not JSON
        for step in range(6):
            sender.send(json.dumps(progress("worker_0", step)).encode())
        sender.close()
        while sum(map(len, batches)) < 6:
            for key, mask in sel.select(5.0):
                key.data(mask)
        assert [len(b) for b in batches] == [2, 4]  # two of the first wake's four reads were the dropped ones
        assert [r.step for b in batches for r in b] == list(range(6))
    finally:
        inbox.close()
        sel.close()
    assert not (tmp_path / "progress.sock").exists()


class Doc:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock()
        self.timers = Timers(self.clock)
        self.path = tmp_path / "agent.json"
        self.n = 0
        self.writer = DocWriter(self.path, self.timers, self.build)

    def build(self) -> AgentDoc:
        self.n += 1
        return AgentDoc(version=self.n)

    def written(self) -> int:
        return json.loads(self.path.read_text())["version"]


def test_progress_alone_is_written_at_most_once_per_interval(tmp_path: Path) -> None:
    d = Doc(tmp_path)
    d.writer.progressed()  # nothing written yet: at once (at the next run of the timers)
    d.timers.run_due()
    assert d.written() == 1
    for _ in range(10):
        d.clock.advance(PROGRESS_WRITE_INTERVAL / 10 - 1e-6)
        d.writer.progressed()
        d.timers.run_due()
    assert d.n == 1  # ten reports within the interval: no write yet
    d.clock.advance(1e-5)
    d.timers.run_due()
    assert d.n == 2 and d.written() == 2  # one write carried them all
    d.clock.advance(10 * PROGRESS_WRITE_INTERVAL)
    d.timers.run_due()
    assert d.n == 2  # nothing pending: nothing written


def test_a_change_of_state_is_written_at_once_and_carries_pending_progress(tmp_path: Path) -> None:
    d = Doc(tmp_path)
    d.writer.write()
    assert d.written() == 1
    d.writer.progressed()
    d.clock.advance(PROGRESS_WRITE_INTERVAL / 2)
    d.writer.write()  # a change of state: now, whatever the rate limit
    assert d.written() == 2
    d.clock.advance(PROGRESS_WRITE_INTERVAL)
    d.timers.run_due()
    assert d.n == 2  # the progress went out with the change of state
    d.writer.write()
    d.writer.write()
    assert d.n == 4  # changes of state are never rate-limited
