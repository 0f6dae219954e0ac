"""The scheduler's state on disk when the disk says no: the server (in-process, a fake clock, no sockets served)
keeps going, says so at most once per LOG_EVERY, and tries again PERSIST_RETRY s later, not on every loop pass
(before: 5,388-30,283 "cannot persist" lines and 34.5 CPU-s in 45 s at 256 ranks)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from toolkit.scheduler import server as srv
from toolkit.scheduler import state
from toolkit.scheduler.config import Config


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_server(recovery_path: Path, clock: Clock) -> srv.Server:
    return srv.Server(Config(job="j", host="127.0.0.1", port=1, store_port=2, world_size=2, topo_timeout=60.0,
                             node_timeout=3.0, recovery=True, recovery_path=recovery_path, token="t" * 32), clock)


def test_a_state_that_cannot_be_written_is_retried_after_a_pause_and_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the recovery directory should be\n")
    clock = Clock()
    server = make_server(blocker / "recovery", clock)  # every write fails: ENOTDIR, even for root
    saves: list[float] = []
    writer = server.state_writer
    assert writer is not None
    real_save = writer.save

    def counting_save(changed: Any, snapshot: Any) -> None:
        saves.append(clock.now)
        real_save(changed, snapshot)

    writer.save = counting_save  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="toolkit.scheduler"):
            for _ in range(1000):  # a thousand loop passes within the same instant, the membership changed
                server.members.dirty = True
                server._persist()
            assert saves == [100.0]  # one try, not one per pass
            assert server.persist_retry_at == 100.0 + srv.PERSIST_RETRY  # a deadline of the loop's select()
            for _ in range(30):  # 30 s of passes, one every 0.1 s
                for _ in range(10):
                    clock.now += 0.1
                    server._persist()
                    server.said.flush(clock.now)
        # one try per PERSIST_RETRY (the next pass after it is due: one every 0.1 s here), not 300
        assert 30 / (srv.PERSIST_RETRY + 0.1) <= len(saves) <= 31, saves
        said = [r.getMessage() for r in caplog.records if "cannot persist" in r.getMessage()]
        assert 1 < len(said) <= 4 and "Not a directory" in said[0], said  # the first at once, then a summary per 10 s
        assert server.members.dirty  # not written: still to be written

        blocker.unlink()  # the disk is back
        clock.now += srv.PERSIST_RETRY
        server._persist()
        assert json.loads((blocker / "recovery" / "scheduler.json").read_text())["job"] == "j"
        assert state.load(blocker / "recovery" / "scheduler.json", "j", 2)["generation"] == 0
        assert not server.members.dirty and server.persist_retry_at == 0.0
    finally:
        writer.save = real_save  # type: ignore[method-assign]
