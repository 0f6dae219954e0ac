"""Shrink and grow decided by the scheduler (issue 42: toolkit.scheduler.elastic, toolkit.scheduler.membership),
driven with a fake clock: a host lost with no spare -> the survivors form a smaller generation serving every logical
rank; the host back -> the next generation grows; the refusals (--min-workers, memory) and the edges (a spare still
preferred, a restarted scheduler, the end while shrunk). The end-to-end flow is tests/e2e/test_elastic_on_hosts.py."""

from __future__ import annotations

from typing import Any

import pytest

from toolkit.contracts import logical
from toolkit.contracts import protocol as P
from toolkit.scheduler import elastic
from toolkit.scheduler.config import Config, ConfigError
from toolkit.scheduler.membership import Log, Membership, Note, Send

NODE_TIMEOUT, TOPO_TIMEOUT, HOST_TIMEOUT = 3.0, 60.0, 10.0
HOSTS = {"hostA": (0, 1), "hostB": (2, 3), "hostC": (4, 5)}


def job(min_workers: int | None = 4, spares: tuple[str, ...] = (), now: float = 0.0) -> Membership:
    """6 ranks, 2 per host on hostA (with the scheduler), hostB and hostC; formed at `now`."""
    placement = {P.worker_node_id(r): h for h, ranks in HOSTS.items() for r in ranks}
    m = Membership("job", 6, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "10.0.0.1:8118", placement, now,
                   host_timeout=HOST_TIMEOUT, spares=spares, min_workers=min_workers)
    m.started(now)
    for peer, (host, ranks) in enumerate(HOSTS.items(), 1):
        agent(m, peer, host, ranks, now)
    for h, ranks in HOSTS.items():
        for r in ranks:
            register(m, 10 + r, r, h, f"inc{r}", now)
    assert m.formed and m.generation == 0
    return m


def agent(m: Membership, peer: int, host: str, ranks: tuple[int, ...], now: float, spare: bool = False) -> list[Any]:
    names = ["sched"] if host == "hostA" else []
    return m.agent_hello(peer, f"10.0.0.9:{peer}", {"op": P.AGENT_HELLO, "host": host, "spare": spare,
                                                   "node_ids": names + [P.worker_node_id(r) for r in ranks]}, now)


def register(m: Membership, peer: int, rank: int, host: str, inc: str, now: float) -> list[Any]:
    return m.register(peer, f"10.0.0.2:{peer}", {
        "op": P.REGISTER, "node_id": P.worker_node_id(rank), "rank": rank, "world_size": 6, "incarnation": inc,
        "pid": 1000 + peer, "host": host, "recovery": P.RECOVERY_IN_PLACE}, now)


def sent(actions: list[Any], op: str) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and a.op == op]


def logged(actions: list[Any]) -> str:
    return "\n".join(a.text for a in actions if isinstance(a, Log))


def crash_c(m: Membership, now: float, beat_until: float) -> list[Any]:
    """hostC goes down (its agent's and workers' connections end); the others heartbeat until `beat_until`, then
    time passes to it."""
    out = m.lost(3, "connection closed", now) + m.lost(14, "connection closed", now) + \
        m.lost(15, "connection closed", now)
    for peer in (1, 2, 10, 11, 12, 13):
        m.message(peer, {"op": P.HEARTBEAT, "step": 7}, beat_until)
    return out + m.tick(beat_until)


def formed_by_peer(actions: list[Any]) -> dict[int, dict[str, Any]]:
    return {s.peer: dict(s.fields) for s in sent(actions, P.FORMED)}


def test_a_lost_host_with_no_spare_shrinks_the_job_then_its_return_grows_it_back() -> None:
    m = job()
    assert not sent(crash_c(m, 5.0, 5.0 + HOST_TIMEOUT - 0.1), P.FORMED)  # not before host_timeout
    out = m.tick(5.0 + HOST_TIMEOUT)
    assert "host hostC is lost" in logged(out) and "shrinking to 4 of 6 workers, serving 6 logical ranks" in \
        logged(out)
    assert [a.fields["slots"] for a in out if isinstance(a, Note) and a.kind == "shrink"] == [[4, 5]]
    formed = formed_by_peer(out)
    assert m.formed and m.generation == 1 and sorted(formed) == [10, 11, 12, 13]
    assert [formed[p]["rank"] for p in (10, 11, 12, 13)] == [0, 1, 2, 3]
    assert {f["world_size"] for f in formed.values()} == {4} and formed[10]["logical_world"] == 6
    parts = logical.parse_formed(formed[10]["logical"], 4, 6)
    assert parts == ((0, 4), (1, 5), (2,), (3,))  # only the lost slots' logical ranks moved
    assert "generation 1 formed: 4 workers, serving 6 logical ranks" in logged(out)
    assert m.snapshot()["benched"] == [4, 5]
    # hostC comes back ('fleet restart --host'): its agent, then its workers; the job grows at the next boundary
    agent(m, 30, "hostC", (4, 5), 40.0)
    back = register(m, 34, 4, "hostC", "new4", 41.0)
    assert sorted(s.peer for s in sent(back, P.GENERATION)) == [10, 11, 12, 13]  # the survivors re-form
    assert "worker_4, worker_5 back on hostC: generation 2 grows to 6 of 6 workers" in logged(back)
    assert not m.formed
    out = register(m, 35, 5, "hostC", "new5", 41.2)
    formed = formed_by_peer(out)
    assert m.generation == 2 and sorted(formed) == [10, 11, 12, 13, 34, 35]
    assert {f["world_size"] for f in formed.values()} == {6} and formed[34]["rank"] == 4
    assert logical.parse_formed(formed[10]["logical"], 6, 6) == tuple((r,) for r in range(6))
    assert "benched" not in m.snapshot() and "assignment" not in m.snapshot()  # the plain world again


def test_below_min_workers_or_beyond_memory_the_job_waits_and_says_why_once() -> None:
    m = job(min_workers=5)
    said = logged(crash_c(m, 5.0, 5.0 + HOST_TIMEOUT)) + logged(m.tick(5.0 + HOST_TIMEOUT + 0.1))
    assert not m.formed and "4 workers would be left, below --min-workers 5 (TOOLKIT_MIN_WORKERS)" in said
    assert said.count("host hostC is lost") == 1 and "benched" not in m.snapshot()
    m = job()
    for peer in (10, 11, 12, 13):  # their memory holds one logical rank each (the Trainer's heartbeat says so)
        m.message(peer, {"op": P.HEARTBEAT, "step": 3, "capacity": 1}, 1.0)
    m.message(12, {"op": P.HEARTBEAT, "capacity": "lots"}, 1.0)  # a hostile value is ignored, not trusted
    said = logged(crash_c(m, 5.0, 5.0 + HOST_TIMEOUT)) + logged(m.tick(5.0 + HOST_TIMEOUT + 1))
    assert not m.formed and m.capacity[2] == 1
    assert said.count("a survivor would serve 2 logical ranks, more than its memory holds: worker_0 (holds 1)") == 1


def test_a_spare_is_still_preferred_and_a_job_without_min_workers_never_shrinks() -> None:
    m = job(spares=("s1",))
    m.agent_hello(9, "10.0.0.9:9", {"op": P.AGENT_HELLO, "host": "s1", "node_ids": [], "spare": True}, 0.0)
    out = crash_c(m, 5.0, 5.0 + HOST_TIMEOUT)
    assert [s.fields["host"] for s in sent(out, P.TAKEOVER)] == ["hostC"] and "benched" not in m.snapshot()
    m = job(min_workers=None)
    out = crash_c(m, 5.0, 5.0 + HOST_TIMEOUT)
    assert not m.formed and "shrinking" not in logged(out) and "not shrinking" not in logged(out)


def test_a_restarted_scheduler_goes_on_shrunk_and_the_job_finishes_with_its_world() -> None:
    m = job()
    crash_c(m, 5.0, 5.0 + HOST_TIMEOUT)
    assert m.formed and m.world is not None and len(m.world.slots) == 4
    again = Membership("job", 6, NODE_TIMEOUT, TOPO_TIMEOUT, "boot2", "a:1", {}, 30.0, host_timeout=HOST_TIMEOUT,
                       min_workers=4)
    again.restore(m.snapshot(), 30.0)
    assert again.benched == [4, 5] and again.world == m.world
    out = again.register(10, "x:1", {"op": P.REGISTER, "node_id": "worker_1", "rank": 1, "world_size": 6,
                                     "incarnation": "inc1", "pid": 1011, "host": "hostA",
                                     "recovery": P.RECOVERY_IN_PLACE}, 31.0)
    assert [(f["rank"], f["world_size"]) for f in formed_by_peer(out).values()] == [(1, 4)]
    for peer in (10, 11, 12, 13):
        out = m.message(peer, {"op": P.DONE}, 40.0)
    assert "all 4 workers finished" in logged(out) and m.status == "finished"


def test_the_world_plan_is_stable_balanced_and_refuses_in_one_line() -> None:
    w = elastic.plan_world([0, 1, 3], 6, {0: (0, 1), 1: (2, 3), 2: (4,), 3: (5,)})
    assert w.slots == (0, 1, 3) and w.logical == ((0, 1), (2, 3), (4, 5)) and w.rank_of(3) == 2
    assert elastic.shrink_refusal([0, 1, 2, 3], 6, 6, 6, {}) is not None
    assert elastic.shrink_refusal([0, 1, 2, 3], 6, 4, 6, {0: 2}) is None
    with pytest.raises(ValueError, match="benched"):
        elastic.read_benched([7], 6)
    with pytest.raises(ValueError, match="exactly once"):
        elastic.read_assignment([[0, [0]], [1, [0]]], 6, 2)


@pytest.mark.parametrize("value", ["7", "0", "-1"])
def test_min_workers_out_of_range_is_refused_naming_the_variable(value: str, tmp_path: Any) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    env = {"MS_WORKER_NUM": "6", "TOOLKIT_TOKEN_FILE": str(token), "TOOLKIT_MIN_WORKERS": value}
    with pytest.raises(ConfigError, match="TOOLKIT_MIN_WORKERS=.*give 1 to 6"):
        Config.from_env(env)
    assert Config.from_env({**env, "TOOLKIT_MIN_WORKERS": "4"}).min_workers == 4
