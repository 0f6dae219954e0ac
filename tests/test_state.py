"""The scheduler's persisted state (toolkit.scheduler.state) on real files in a tmp dir, driven by a real
Membership on a fake clock: a base plus an append-only journal of the records that changed, compacted when the
journal outgrows the base; what a restarted scheduler reads back (after a kill -9 at any moment, a write cut
short, a crash between the two files of a compaction) is what was last written, and damage is refused in one line.
The marks the roster keeps for it are held to the whole snapshot over the membership's trace in
tests/test_membership_trace.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from toolkit.contracts import protocol as P
from toolkit.scheduler import state as S
from toolkit.scheduler.membership import Membership

NODE_TIMEOUT, TOPO_TIMEOUT = 3.0, 60.0


def membership(world: int) -> Membership:
    m = Membership("job", world, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "10.0.0.1:8118",
                   {P.worker_node_id(r): f"host{r // 8}" for r in range(world)}, 0.0)
    m.started(0.0)
    return m


def register(m: Membership, peer: int, rank: int, now: float) -> None:
    m.register(peer, f"10.0.0.2:{peer}", {
        "op": P.REGISTER, "node_id": P.worker_node_id(rank), "rank": rank, "world_size": m.world_size,
        "incarnation": f"inc{peer}", "pid": 1000 + peer, "host": f"host{rank // 8}",
        "recovery": P.RECOVERY_IN_PLACE}, now)


def plain(doc: Any) -> Any:
    return json.loads(json.dumps(doc))


class Persisted:
    """A Membership and a StateWriter on `path`, persisted as the server does (Server._persist): the changes, then
    the roster's marks cleared."""

    def __init__(self, path: Path, world: int) -> None:
        self.m, self.path, self.writer = membership(world), path, S.StateWriter(path)

    def save(self) -> None:
        self.writer.save(S.changes(self.m), self.m.snapshot)
        self.m.roster.unsaved.clear()

    def loaded(self) -> dict[str, Any] | None:
        return S.load(self.path, "job", self.m.world_size)

    def journal(self) -> list[str]:
        return self.writer.journal.read_text().splitlines()


def formed(tmp_path: Path, world: int) -> Persisted:
    """A job of `world` ranks, formed and persisted (whole: the writer's first write)."""
    p = Persisted(tmp_path / "recovery" / S.STATE_FILE, world)
    for rank in range(world):
        register(p.m, rank + 1, rank, 1.0)
    p.save()
    assert p.m.formed
    return p


def one_incident(p: Persisted, rank: int, peer: int) -> int:
    """Rank `rank` dies, its replacement registers, the job forms again; the bytes this wrote to the files."""
    before = p.path.stat().st_size + p.writer.journal.stat().st_size
    p.m.lost(rank + 1, "connection closed", 5.0)
    p.save()
    register(p.m, peer, rank, 6.0)
    p.save()
    return p.path.stat().st_size + p.writer.journal.stat().st_size - before


def test_what_is_read_back_is_what_was_written_at_every_step(tmp_path: Path) -> None:
    p = Persisted(tmp_path / "recovery" / S.STATE_FILE, 3)
    assert p.loaded() is None  # nothing yet
    steps = [lambda: register(p.m, 1, 0, 1.0), lambda: register(p.m, 2, 1, 1.0), lambda: register(p.m, 3, 2, 1.0),
             lambda: p.m.message(1, {"op": P.COMMIT, "step": 10}, 2.0),
             lambda: p.m.message(2, {"op": P.COMMIT, "step": 10}, 2.0),
             lambda: p.m.message(3, {"op": P.COMMIT, "step": 10}, 2.0),
             lambda: p.m.lost(2, "connection closed", 3.0),  # a death: generation 1
             lambda: register(p.m, 4, 1, 4.0),  # its replacement: formed again
             lambda: p.m.message(1, {"op": P.DONE}, 5.0)]
    for step in steps:
        step()
        p.save()
        assert p.loaded() == plain(p.m.snapshot())
    doc = p.loaded()
    assert doc is not None and doc["generation"] == 1 and doc["formed"] and doc["done"] == [0]
    assert doc["fenced"] == ["inc2"] and doc["committed_step"] == 10
    assert [m["incarnation"] for m in doc["members"]] == ["inc4", "inc3"]
    assert len(p.journal()) == len(steps)  # the first write made the base, each later one a line
    assert p.path.stat().st_mode & 0o777 == 0o600 and p.writer.journal.stat().st_mode & 0o777 == 0o600

    restarted = membership(3)  # a scheduler started again goes on from it
    restarted.restore(doc, 10.0)
    assert plain(restarted.snapshot()) == doc


def test_a_write_appends_only_the_records_that_changed_whatever_the_size(tmp_path: Path) -> None:
    p = formed(tmp_path / "a", 8)
    p.m.message(4, {"op": P.COMMIT, "step": 50}, 2.0)
    p.save()
    assert json.loads(p.journal()[-1]) == {"set": {"commit/3": 50}, "del": []}
    p.save()  # nothing changed: nothing written
    assert json.loads(p.journal()[-1]) == {"set": {"commit/3": 50}, "del": []}

    p.m.lost(6, "connection closed", 5.0)
    p.save()
    assert json.loads(p.journal()[-1]) == {"set": {"generation": 1, "formed": False, "fenced/inc6": True},
                                           "del": ["member/5"]}
    small, large = one_incident(formed(tmp_path / "b", 8), 5, 100), one_incident(formed(tmp_path / "c", 512), 5, 600)
    assert 0 < small <= large <= small + 16  # one incident writes the same at 8 ranks and at 512 (peer digits aside)
    assert large * 50 < formed(tmp_path / "d", 512).path.stat().st_size  # where the whole document was rewritten


def test_the_journal_is_compacted_into_the_base_once_it_outgrows_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "JOURNAL_FLOOR", 0)  # bound by the base's size alone
    p = formed(tmp_path, 8)
    base = json.loads(p.path.read_text())
    epochs = {base["epoch"]}
    for step in range(1, 60):
        for peer in range(1, 9):
            p.m.message(peer, {"op": P.COMMIT, "step": step}, 2.0)
        p.save()
        assert p.writer.journal.stat().st_size <= S.JOURNAL_RATIO * p.path.stat().st_size + 200
        epochs.add(json.loads(p.path.read_text())["epoch"])
        assert json.loads(p.journal()[0]) == {"version": S.VERSION, "epoch": json.loads(p.path.read_text())["epoch"]}
    assert len(epochs) > 3  # compacted several times
    doc = p.loaded()
    assert doc == plain(p.m.snapshot()) and doc is not None and doc["committed_step"] == 59


def test_a_restart_after_kill_9_at_any_moment_reads_the_last_complete_write(tmp_path: Path) -> None:
    p = formed(tmp_path / "job", 4)
    before = plain(p.m.snapshot())
    p.m.lost(2, "connection closed", 5.0)
    p.save()
    after = plain(p.m.snapshot())
    journal = p.writer.journal.read_bytes()
    last = journal.rindex(b"\n", 0, len(journal) - 1) + 1  # where the last write began
    copy = tmp_path / "copy"
    for cut in range(last, len(journal) + 1):  # killed after `cut` bytes of it reached the file
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(p.path.parent, copy)
        (copy / S.JOURNAL_FILE).write_bytes(journal[:cut])
        assert S.load(copy / S.STATE_FILE, "job", 4) == (after if cut == len(journal) else before), cut

    again = S.StateWriter(copy / S.STATE_FILE)  # the restarted scheduler's first write replaces the cut journal
    restarted = membership(4)
    restarted.restore(before, 10.0)
    restarted.message(1, {"op": P.COMMIT, "step": 7}, 11.0)
    again.save(S.changes(restarted), restarted.snapshot)
    assert S.load(copy / S.STATE_FILE, "job", 4) == plain(restarted.snapshot())
    assert len((copy / S.JOURNAL_FILE).read_text().splitlines()) == 1


def test_a_journal_of_another_base_is_ignored(tmp_path: Path) -> None:
    """A crash between a compaction's rewrite of the base and of the journal; or a base moved away by hand."""
    p = formed(tmp_path, 4)
    p.m.lost(2, "connection closed", 5.0)
    p.save()
    old_journal = p.writer.journal.read_bytes()
    p.writer.written = None  # the next write is a compaction
    p.m.message(1, {"op": P.COMMIT, "step": 3}, 6.0)
    p.save()
    p.writer.journal.write_bytes(old_journal)  # as if killed before the journal was replaced
    assert p.loaded() == plain(p.m.snapshot())

    p.path.unlink()  # the base moved away: no state, whatever the journal says
    assert p.loaded() is None
    fresh = Persisted(p.path, 4)
    register(fresh.m, 1, 0, 1.0)
    fresh.save()
    assert fresh.loaded() == plain(fresh.m.snapshot())


def test_a_failed_append_is_followed_by_a_whole_rewrite(tmp_path: Path) -> None:
    p = formed(tmp_path, 4)
    p.writer.journal.unlink()  # the append cannot happen (never created on append)
    p.m.lost(2, "connection closed", 5.0)
    with pytest.raises(OSError):
        p.save()
    assert p.writer.written is None and p.m.roster.unsaved  # nothing counted as written
    p.save()
    assert p.loaded() == plain(p.m.snapshot()) and len(p.journal()) == 1


def damaged(p: Persisted) -> str:
    with pytest.raises(S.StateError) as e:
        p.loaded()
    message = str(e.value)
    assert "\n" not in message and "move" in message
    return message


def test_damage_is_refused_in_one_line_naming_the_file_and_line(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    p = formed(tmp_path, 4)
    for peer in (1, 2):
        p.m.message(peer, {"op": P.COMMIT, "step": 5}, 2.0)
        p.save()
    good = p.writer.journal.read_bytes()
    lines = good.split(b"\n")
    for number, line in ((2, b'{"set": {"commit/0": 5}, "de'), (3, b'{"set": [], "del": []}'),
                         (3, b'{"set": {}, "del": [1]}'), (2, b"\xff\xfe"), (1, b'{"version": 1, "epoch": "x"}'),
                         (3, b"[" * 100_000), (3, b'{"set":{"generation":1e400},"del":[]}'),
                         (3, b'{"set":{"generation":NaN},"del":[]}'), (3, b'{"set":{"commit/1":-Infinity},"del":[]}')):
        p.writer.journal.write_bytes(b"\n".join(lines[:number - 1] + [line] + lines[number:]))
        message = damaged(p)
        assert message.startswith(f"{p.writer.journal}: line {number} is damaged"), message
        assert "away to start the job afresh" in message and S.STATE_FILE in message
    for record in ('{"set": {"member/x": {}}, "del": []}', '{"set": {"what": 1}, "del": []}',
                   '{"set": {"done/1": false}, "del": []}', '{"set": {"member/1": {"rank": 1}}, "del": []}',
                   '{"set": {"commit/0001": 5}, "del": []}', '{"set": {"replaced/01": {}}, "del": []}'):
        p.writer.journal.write_bytes(good + record.encode() + b"\n")  # well-formed lines, records that are not
        assert damaged(p).startswith(f"{p.path} (with {S.JOURNAL_FILE}): damaged scheduler state"), record
    p.writer.journal.write_bytes(good)
    assert p.loaded() == plain(p.m.snapshot())

    for base in (b"{", b"[]", json.dumps({"version": 3}).encode(), json.dumps({"version": 2, "members": 5}).encode(),
                 json.dumps({**p.m.snapshot(), "version": 2, "generation": 1e400}).encode()):
        p.path.write_bytes(base)
        assert damaged(p).startswith(str(p.path))
    monkeypatch.setattr(S, "MAX_FILE_BYTES", 100)
    p.path.write_bytes(b" " * 101)
    assert "larger than" in damaged(p)


def test_the_other_job_or_size_and_a_state_of_the_toolkit_before(tmp_path: Path) -> None:
    p = formed(tmp_path, 2)
    with pytest.raises(S.StateError, match=r"is the state of job 'job' with 2 workers, not of 'job' with 3: a run "
                                           r"cannot change its size; 'fleet train --fresh' starts the job over"):
        S.load(p.path, "job", 3)
    legacy = tmp_path / "legacy" / S.STATE_FILE  # version 1: one document, rewritten whole, no journal
    legacy.parent.mkdir()
    legacy.write_text(json.dumps({"version": 1, **p.m.snapshot()}, indent=1))
    assert S.load(legacy, "job", 2) == plain(p.m.snapshot())


def test_the_server_writes_the_whole_state_once_then_a_line_per_pass_that_changed_it(tmp_path: Path) -> None:
    from toolkit.scheduler import server as srv
    from toolkit.scheduler.config import Config

    now = [100.0]
    server = srv.Server(Config(job="job", host="127.0.0.1", port=1, store_port=2, world_size=2, topo_timeout=60.0,
                               node_timeout=3.0, recovery=True, recovery_path=tmp_path, token="t" * 32),
                        lambda: now[0])
    journal = tmp_path / S.JOURNAL_FILE
    register(server.members, 1, 0, now[0])
    server._persist()
    assert len(journal.read_text().splitlines()) == 1  # the first write: the base, whole
    register(server.members, 2, 1, now[0])  # the job forms
    server._persist()
    server._persist()  # a pass that changed nothing
    lines = journal.read_text().splitlines()
    assert len(lines) == 2 and set(json.loads(lines[1])["set"]) == {"member/1", "formed"}
    server.members.message(1, {"op": P.COMMIT, "step": 5}, now[0])
    server._persist()  # commits wait for COMMIT_PERSIST_INTERVAL
    now[0] += srv.COMMIT_PERSIST_INTERVAL
    server._persist()
    assert journal.read_text().splitlines()[2:] == ['{"set":{"commit/0":5},"del":[]}']
    assert S.load(tmp_path / S.STATE_FILE, "job", 2) == plain(server.members.snapshot())
