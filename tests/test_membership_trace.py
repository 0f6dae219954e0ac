"""A characterization trace of the scheduler's decisions (toolkit.scheduler.membership), so that its insides can be
reshaped with its behaviour held still: scripted sequences on a fake clock (formation, deaths while formed and
while gathering, a second claim, a reconnect, a silent member vouched for and not, commits, exit reports, an agent
lost and its host taken over by a spare, the operator's replace and its refusals, a lost host waiting for a spare,
a restore from the snapshot, the end by `done`, by `gave_up`, by a formation timeout, unmanaged scripts, a death
after a rank finished). Each step's actions, the flags the server reads (`dirty`, `commits_dirty`), its queries
(`next_deadline`, `worker_hosts`, `fenced_hosts`) and the persisted document, as scheduler.json's writer would
write it (key and list order included), are compared with tests/data/membership_trace.json.

That file was recorded once from the Membership before the refactor of issue 28 (`python
tests/test_membership_trace.py --record`); re-record it only for a change of behaviour that is meant, and say so in
the commit."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from toolkit.contracts import protocol as P
from toolkit.scheduler import state as S
from toolkit.scheduler.actions import Send
from toolkit.scheduler.membership import Membership
from toolkit.scheduler.roster import Roster, problems


def fenced_hosts(roster: Roster) -> dict[str, str]:
    """Every replaced host -> the spare that took its ranks, in the order they were replaced."""
    return {r["host"]: str(r["by"]) for r in roster.replacements()}

DATA = Path(__file__).parent / "data" / "membership_trace.json"
NODE_TIMEOUT, TOPO_TIMEOUT, HOST_TIMEOUT = 3.0, 60.0, 10.0


def _plain(value: Any) -> Any:
    """JSON's view of an action's field: mappings as dicts, enums by value (an Enum may replace a string)."""
    return json.loads(json.dumps(value, default=lambda o: dict(o) if isinstance(o, Mapping) else str(o)))


def _action(a: Any) -> dict[str, Any]:
    """An action as recorded: its fields; a Send's message as it goes on the wire (op and fields), so the trace also
    holds the wire format still (toolkit.contracts.messages)."""
    if isinstance(a, Send):
        return {"action": "Send", "peer": a.peer, "op": a.op, "fields": _plain(a.fields), "close": a.close}
    return {"action": type(a).__name__, **{f.name: _plain(getattr(a, f.name)) for f in dataclasses.fields(a)}}


class Trace:
    """Records each event's outcome on one Membership, as the server would read it, then clears the flags as the
    server does once it has persisted."""

    def __init__(self, m: Membership, steps: list[dict[str, Any]], name: str) -> None:
        self.m, self.steps, self.name = m, steps, name
        self.persisted = ""
        self.records: dict[str, Any] | None = None  # as state.StateWriter keeps them: whole first, then changes

    def follow(self, event: str) -> None:
        """Keep the records as the state's writer would (the roster's marks, not the whole snapshot) and check
        that they are the whole snapshot's, and that the document comes back from them unchanged."""
        m, whole = self.m, S.records(self.m.snapshot())
        if self.records is None:
            self.records = dict(whole)
        for key, value in S.changes(m).items():
            if value is None:
                self.records.pop(key, None)
            else:
                self.records[key] = value
        m.roster.unsaved.clear()
        assert self.records == whole, event  # no change the roster did not mark
        assert S.document(whole) == _plain(m.snapshot()), event

    def __call__(self, event: str, actions: list[Any] | None) -> list[Any]:
        m = self.m
        assert problems(m.roster) == [], event  # the roster's invariants hold after every event
        persisted = json.dumps({"version": S.VERSION, **m.snapshot()}, indent=1)
        self.steps.append({
            "event": f"{self.name}: {event}",
            "actions": [_action(a) for a in actions or []],
            "dirty": m.dirty, "commits_dirty": m.commits_dirty, "next_deadline": m.next_deadline(),
            "worker_hosts": m.roster.worker_hosts(), "fenced_hosts": fenced_hosts(m.roster),
            "persisted": persisted if persisted != self.persisted else None,  # only when it changed
        })
        self.persisted = persisted
        self.follow(event)
        m.dirty = m.commits_dirty = False
        return actions or []


def reg(m: Membership, peer: int, rank: int, now: float, inc: str | None = None, host: str = "hostA",
        recovery: str = P.RECOVERY_IN_PLACE, **extra: Any) -> list[Any]:
    msg = {"op": P.REGISTER, "node_id": P.worker_node_id(rank), "rank": rank, "world_size": m.world_size,
           "incarnation": inc or f"inc{peer}", "pid": 1000 + peer, "host": host, "recovery": recovery, **extra}
    return m.register(peer, f"10.0.0.2:{peer}", msg, now)


def hello(m: Membership, peer: int, host: str, node_ids: list[Any], now: float, spare: bool = False) -> list[Any]:
    return m.agent_hello(peer, f"10.0.0.9:{peer}", {"op": P.AGENT_HELLO, "host": host, "node_ids": node_ids,
                                                   "spare": spare}, now)


def hb(m: Membership, peer: int, now: float, **fields: Any) -> list[Any]:
    return m.message(peer, {"op": P.HEARTBEAT, **fields}, now)


def formation_and_deaths(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Three ranks on two hosts: formation with a second claim, deaths while formed and while gathering, exit
    reports, vouches, a reconnect, commits, the end by done. Returns a snapshot taken mid-way (for `restore`)."""
    m = Membership("job", 3, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "10.0.0.1:8118",
                   {"worker_0": "hostA", "worker_1": "hostA", "worker_2": "hostB"}, 0.0, host_timeout=HOST_TIMEOUT)
    t = Trace(m, steps, "deaths")
    m.started(0.5)
    t("started", [])
    t("hello hostA", hello(m, 50, "hostA", ["sched", "worker_0", "worker_1", 7, "x" * 300], 0.6))
    t("hello hostB", hello(m, 51, "hostB", ["worker_2"], 0.6))
    t("malformed hello", m.agent_hello(52, "a", {"op": P.AGENT_HELLO, "host": "", "node_ids": []}, 0.6))
    t("register 0", reg(m, 10, 0, 1.0))
    t("second claim of 0", reg(m, 11, 0, 1.1, inc="other"))
    t("register 1", reg(m, 12, 1, 1.2, recovery=P.RECOVERY_RESTART))
    t("malformed register", m.register(13, "a", {"op": P.REGISTER, "node_id": "worker_2", "rank": "2"}, 1.2))
    t("wrong world", reg(m, 14, 2, 1.2, world_size=4))
    t("register 2", reg(m, 15, 2, 1.3, host="hostB", recovery="weird"))
    t("heartbeat 0", hb(m, 10, 2.0, step=4, step_time=0.5))
    t("commit 0", m.message(10, {"op": P.COMMIT, "step": 8}, 2.0))
    t("commit 0 older", m.message(10, {"op": P.COMMIT, "step": 4}, 2.0))
    t("commit 1", m.message(12, {"op": P.COMMIT, "step": 8}, 2.1))
    t("commit 2", m.message(15, {"op": P.COMMIT, "step": 12}, 2.1))
    t("unknown worker op", m.message(15, {"op": "dance"}, 2.2))
    t("unknown agent op", m.message(51, {"op": "dance"}, 2.2))
    t("unknown peer", m.message(99, {"op": P.HEARTBEAT}, 2.2))
    t("agent vouches", hb(m, 50, 2.5, running={"worker_0": 1010, "worker_1": 1012, "worker_2": 1015, "x": True}))
    t("agent B vouches", hb(m, 51, 2.5, running={"worker_2": 1015}))
    for now in (3.0, 4.0, 5.0):
        t(f"beats {now}", hb(m, 12, now) + hb(m, 15, now) + hb(m, 50, now, running={"worker_0": 1010})
          + hb(m, 51, now))
        t(f"tick {now}", m.tick(now))
    t("reconnect 0", reg(m, 20, 0, 5.5, inc="inc10"))
    t("old connection of 0 ends", m.lost(10, "connection closed", 5.6))
    t("lost worker 1", m.lost(12, "connection closed", 6.0))
    t("exited worker 1", m.message(50, {"op": P.EXITED, "node_id": "worker_1", "pid": 1012, "code": 1,
                                        "cause": "RuntimeError: boom\nTraceback"}, 6.1))
    t("stale exit", m.message(50, {"op": P.EXITED, "node_id": "worker_1", "pid": 5, "code": 1}, 6.1))
    t("sched exit", m.message(50, {"op": P.EXITED, "node_id": "sched", "pid": 5, "code": None, "signal": "SIGTERM"},
                              6.1))
    t("lost worker 2 while gathering", m.lost(15, "connection closed", 6.2))
    t("beat 0", hb(m, 20, 8.0) + hb(m, 50, 8.0) + hb(m, 51, 8.0))
    t("tick: worker 2 unreported", m.tick(9.2))
    t("fenced incarnation back", reg(m, 21, 1, 9.3, inc="inc12"))
    t("register 1 again", reg(m, 22, 1, 9.4))
    mid = m.snapshot()
    t("register 2 again", reg(m, 23, 2, 9.5, host="hostB"))
    t("recovered", m.message(22, {"op": P.RECOVERED, "generation": 1, "step": 8, "source": "peer", "from_rank": 0,
                                  "seconds": 0.25, "recomputed": 2}, 9.6))
    t("recovered junk", m.message(23, {"op": P.RECOVERED, "source": 3, "seconds": "x"}, 9.6))
    t("beats", hb(m, 20, 10.0) + hb(m, 22, 10.0) + hb(m, 50, 10.0) + hb(m, 51, 10.0))
    t("tick: 2 silent", m.tick(12.6))
    t("agent B lost", m.lost(51, "connection closed", 12.7))
    t("register 2 third", reg(m, 24, 2, 13.0, host="hostB"))
    t("done 0", m.message(20, {"op": P.DONE}, 14.0))
    t("done 0 eof", m.lost(20, "closed", 14.1))
    t("exit 0 of 1", m.message(50, {"op": P.EXITED, "node_id": "worker_1", "pid": 1022, "code": 0}, 14.2))
    t("done 2", m.message(24, {"op": P.DONE}, 14.3))
    t("late register", reg(m, 25, 1, 14.4, inc="late"))
    t("hello after finish", hello(m, 53, "hostB", ["worker_2"], 14.5))
    t("tick after finish", m.tick(100.0))
    return mid


def restore(steps: list[dict[str, Any]], mid: dict[str, Any]) -> None:
    """A restarted scheduler goes on from a mid-way snapshot; another finds a finished run and starts it over."""
    m = Membership("job", 3, NODE_TIMEOUT, TOPO_TIMEOUT, "boot2", "10.0.0.1:8118", {"worker_0": "hostA"}, 50.0,
                   host_timeout=HOST_TIMEOUT)
    t = Trace(m, steps, "restore")
    t("restore", m.restore(mid, 50.0))
    m.started(51.0)
    t("started", [])
    t("hello", hello(m, 50, "hostA", ["sched", "worker_0", "worker_1"], 51.1))
    t("reconnect 0", reg(m, 60, 0, 51.5, inc="inc10"))
    t("tick", m.tick(54.5))
    t("register 2", reg(m, 61, 2, 55.0, host="hostB"))
    t("register 1", reg(m, 62, 1, 55.1))
    ended = {**mid, "status": "finished", "committed_step": 8}
    m2 = Membership("job", 3, NODE_TIMEOUT, TOPO_TIMEOUT, "boot3", "a:1", {}, 0.0)
    t2 = Trace(m2, steps, "restore finished")
    t2("restore", m2.restore(ended, 0.0))
    m2.started(0.0)
    t2("fenced back", reg(m2, 10, 1, 1.0, inc="inc12"))
    t2("fresh", reg(m2, 11, 1, 1.0))


def spares(steps: list[dict[str, Any]]) -> None:
    """Four ranks on hostA (with the scheduler) and hostB, spares s1 and s2: hostB lost and taken over, its agent and
    workers refused, the operator's replace and its refusals, a lost host waiting for a spare, a restore."""
    m = Membership("job", 4, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "10.0.0.1:8118",
                   {"worker_0": "hostA", "worker_1": "hostA", "worker_2": "hostB", "worker_3": "hostB"}, 0.0,
                   host_timeout=HOST_TIMEOUT, spares=("s2", "s1"))
    t = Trace(m, steps, "spares")
    m.started(0.0)
    t("started", [])
    t("replace before formed", m.replace(98, {"host": "hostB"}, 0.1))
    t("hello A", hello(m, 1, "hostA", ["sched", "worker_0", "worker_1"], 0.0))
    t("hello B", hello(m, 2, "hostB", ["worker_2", "worker_3"], 0.0))
    t("hello s1", hello(m, 3, "s1", [], 0.0, spare=True))
    t("hello s3 not spare", hello(m, 5, "s3", [], 0.0))
    for rank in range(4):
        t(f"register {rank}", reg(m, 10 + rank, rank, 0.1, host="hostA" if rank < 2 else "hostB"))
    t("hostB agent silent, link down", hb(m, 2, 1.0) + hb(m, 12, 1.0) + hb(m, 13, 1.0))
    for now in (2.0, 4.0, 6.0, 8.0, 10.9, 11.0):
        t(f"beats {now}", hb(m, 1, now) + hb(m, 3, now) + hb(m, 5, now) + hb(m, 10, now) + hb(m, 11, now))
        t(f"tick {now}", m.tick(now))
    t("s1 workers register 2", reg(m, 32, 2, 11.5, inc="s1w2", host="s1"))
    t("s1 workers register 3", reg(m, 33, 3, 11.6, inc="s1w3", host="s1"))
    t("hostB back", hello(m, 40, "hostB", ["worker_2", "worker_3"], 12.0))
    t("hostB worker back", reg(m, 41, 2, 12.0, inc="fresh", host="hostB"))
    for host, spare in (("hostC", None), ("hostA", None), ("hostB", None), ("s1", "hostA"), ("s1", "s9"),
                        ("s1", 5), (None, None), ("s1", "s2"), ("s1", "s1")):
        t(f"replace {host} by {spare}", m.replace(99, {"op": P.REPLACE, "host": host, "spare": spare}, 12.5))
    t("hello s2 late", hello(m, 4, "s2", [], 13.0, spare=True))
    t("replace s1", m.replace(99, {"op": P.REPLACE, "host": "s1"}, 13.5))
    t("s2 takes 2", reg(m, 42, 2, 14.0, inc="s2w2", host="s2"))
    t("s2 takes 3", reg(m, 43, 3, 14.0, inc="s2w3", host="s2"))
    t("s2 lost, no spare", m.lost(4, "connection closed", 15.0) + m.lost(42, "connection closed", 15.0)
      + m.lost(43, "connection closed", 15.0))
    for now in (16.0, 20.0, 25.0, 26.0):
        t(f"beats {now}", hb(m, 1, now) + hb(m, 5, now) + hb(m, 10, now) + hb(m, 11, now))
        t(f"tick {now}", m.tick(now))
    t("hello s4 spare", hello(m, 6, "s4", [], 27.0, spare=True))
    snap = m.snapshot()
    again = Membership("job", 4, NODE_TIMEOUT, TOPO_TIMEOUT, "boot2", "10.0.0.1:8118", {}, 40.0,
                       host_timeout=HOST_TIMEOUT)
    t2 = Trace(again, steps, "spares restored")
    t2("restore", again.restore(snap, 40.0))
    again.started(40.0)
    t2("started", [])
    t2("hostB refused", hello(again, 2, "hostB", [], 41.0))
    t2("s1 refused", hello(again, 3, "s1", [], 41.0, spare=True))
    t2("s4 told again", hello(again, 7, "s4", [], 41.0, spare=True))
    t2("s4 again with its nodes", hello(again, 8, "s4", ["worker_2", "worker_3"], 42.0, spare=True))
    t2("tick", again.tick(60.0))


def endings(steps: list[dict[str, Any]]) -> None:
    """The job's other ends: gave_up, a formation timeout, unmanaged scripts ended by their exits, a death after a
    rank finished (in place: counts as finished; restart: fails)."""
    m = Membership("job", 2, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "a:1", {"worker_0": "hostA"}, 0.0)
    t = Trace(m, steps, "gave_up")
    m.started(0.0)
    t("hello", hello(m, 50, "hostA", ["worker_0", "worker_1"], 0.0))
    t("register", reg(m, 10, 0, 0.1) + reg(m, 11, 1, 0.1))
    t("gave up", m.message(50, {"op": P.GAVE_UP, "node_id": "worker_0", "code": 1, "signal": None,
                                "log_tail": "a\nb\nValueError: bad"}, 1.0))
    t("register after", reg(m, 12, 0, 2.0, inc="late"))
    t("hello after", hello(m, 51, "hostA", [], 2.0))

    m = Membership("job", 3, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "a:1", {"worker_0": "hostA"}, 0.0)
    t = Trace(m, steps, "formation timeout")
    m.started(0.0)
    t("register 1", reg(m, 10, 1, 1.0))
    for now in (20.0, 40.0, 59.0):
        t(f"beat {now}", hb(m, 10, now))
        t(f"tick {now}", m.tick(now))
    t("timeout", m.tick(TOPO_TIMEOUT))

    m = Membership("job", 2, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "a:1", {"worker_0": "hostA", "worker_1": "hostB"},
                   0.0)
    t = Trace(m, steps, "unmanaged")
    m.started(0.0)
    t("hello A", hello(m, 50, "hostA", ["worker_0"], 0.0))
    t("hello B", hello(m, 51, "hostB", ["worker_1"], 0.0))
    t("timeout", m.tick(TOPO_TIMEOUT))
    t("exit 0", m.message(50, {"op": P.EXITED, "node_id": "worker_0", "pid": 7, "code": 0}, 70.0))
    t("exit 1", m.message(51, {"op": P.EXITED, "node_id": "worker_1", "pid": 8, "code": 0}, 71.0))

    for recovery in (P.RECOVERY_IN_PLACE, P.RECOVERY_RESTART):
        m = Membership("job", 2, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "a:1", {}, 0.0)
        t = Trace(m, steps, f"after done {recovery}")
        m.started(0.0)
        t("register", reg(m, 10, 0, 0.0, recovery=recovery) + reg(m, 11, 1, 0.0, recovery=recovery))
        t("done 0", m.message(10, {"op": P.DONE}, 1.0))
        t("lost 1", m.lost(11, "closed", 1.1))


SCENARIOS: tuple[Callable[[list[dict[str, Any]]], Any], ...] = (spares, endings)


def trace() -> list[dict[str, Any]]:
    """Every scenario's steps, in order."""
    steps: list[dict[str, Any]] = []
    restore(steps, formation_and_deaths(steps))
    for scenario in SCENARIOS:
        scenario(steps)
    return steps


def test_the_membership_decides_as_it_did_when_the_trace_was_recorded() -> None:
    expected = json.loads(DATA.read_text())
    got = _plain(trace())
    assert len(got) == len(expected)
    for was, now in zip(expected, got, strict=True):
        assert now == was, was["event"]  # the first step that differs, named


def test_the_trace_covers_every_kind_of_action_and_decision() -> None:
    """The recorded trace exercises what a refactor could break: each action type, each Note kind, each op sent."""
    steps = json.loads(DATA.read_text())
    actions = [a for s in steps for a in s["actions"]]
    assert {a["action"] for a in actions} == {"Send", "Close", "Log", "Exit", "DropKeys", "Note"}
    assert {a["kind"] for a in actions if a["action"] == "Note"} == {
        "restored", "fenced", "refused", "pace", "death", "exited", "agent_lost", "formed", "recovered", "replaced",
        "finished", "failed"}
    assert {a["op"] for a in actions if a["action"] == "Send"} >= {
        P.WELCOME, P.REJECT, P.FENCED, P.FORMED, P.GENERATION, P.KILL, P.STOP, P.FINISHED, P.TAKEOVER}
    assert {a["code"] for a in actions if a["action"] == "Exit"} == {0, 1, 3}


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(_plain(trace()), indent=1) + "\n")
    print(f"recorded {DATA}")
