"""The scheduler's decisions (toolkit.scheduler.membership), driven directly with a fake clock: the hard sequences
(a death during formation, a fenced incarnation coming back, a second claim, commit races, a scheduler restart,
deaths in a storm) in milliseconds, checking the actions returned. The process-level flows are in
tests/test_scheduler.py."""

from __future__ import annotations

import math
from typing import Any

import pytest

from toolkit.contracts import protocol as P
from toolkit.scheduler import kvstore
from toolkit.scheduler.membership import Close, DropKeys, Exit, Log, Membership, Note, Send, rank_of

NODE_TIMEOUT, TOPO_TIMEOUT = 3.0, 60.0


def membership(world: int = 2, now: float = 0.0) -> Membership:
    m = Membership("job", world, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "10.0.0.1:8118", {"worker_0": "hostA"}, now)
    m.started(now)
    return m


def register(m: Membership, peer: int, rank: int, now: float, incarnation: str | None = None,
             pid: int | None = None, recovery: str = P.RECOVERY_IN_PLACE) -> list[Any]:
    msg = {"op": P.REGISTER, "node_id": P.worker_node_id(rank), "rank": rank, "world_size": m.world_size,
           "incarnation": incarnation or f"inc{peer}", "pid": pid or 1000 + peer, "host": "hostA",
           "recovery": recovery}
    return m.register(peer, f"10.0.0.2:{peer}", msg, now)


def sent(actions: list[Any], op: str | None = None) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and (op is None or a.op == op)]


def logged(actions: list[Any]) -> str:
    return "\n".join(a.text for a in actions if isinstance(a, Log))


def form(m: Membership, now: float = 0.0) -> None:
    for rank in range(m.world_size):
        register(m, 10 + rank, rank, now)
    assert m.formed


def test_a_rank_is_ascii_digits_only() -> None:
    """str.isdigit takes "²" (and int() then raises): a node id a peer sends must not crash the scheduler."""
    assert [rank_of(n) for n in ("worker_3", "worker_\u00b2", "worker_\u0661", "worker_1\n", "sched")] == \
        [3, None, None, None, None]


def test_formation_waits_for_every_rank_then_tells_each_the_prefix() -> None:
    m = membership(3)
    assert sent(register(m, 10, 0, 0.1), P.WELCOME) and not m.formed
    register(m, 11, 1, 0.2)
    out = register(m, 12, 2, 0.3)
    formed = sent(out, P.FORMED)
    assert {s.peer for s in formed} == {10, 11, 12} and m.formed
    assert {s.fields["prefix"] for s in formed} == {P.store_prefix("job", "boot", 0)}
    assert "generation 0 formed: 3 workers in 0.300 s" in logged(out)


def test_a_death_while_formed_starts_one_generation_and_a_second_while_gathering_none() -> None:
    m = membership(3)
    form(m)
    out = m.lost(11, "connection closed", 5.0)
    assert [s.fields["generation"] for s in sent(out, P.GENERATION)] == [1, 1]
    assert {s.peer for s in sent(out, P.GENERATION)} == {10, 12}
    out = m.lost(12, "connection closed", 5.1)  # a second fault during the recovery: no cascade
    assert not sent(out, P.GENERATION) and m.generation == 1
    assert "generation 1 still gathering" in logged(out)
    register(m, 21, 1, 6.0)
    out = register(m, 22, 2, 6.1)
    assert m.formed and m.generation == 1
    assert DropKeys(P.store_prefix("job", "boot", 0)) in out  # generation 0's store keys can go


def test_restart_recovery_survivors_leaving_to_be_relaunched_are_not_counted_nor_a_new_fault() -> None:
    """Issue 41: a torchrun-style script's survivor exits 76 on the next generation. A replacement registering
    before that exit is seen must not form the generation with the leaving survivor (whose exit then began another
    generation: a phantom incident); its exit is noted as relaunched, not as the beginning of a fault."""
    m = membership(2)
    for rank in range(2):
        register(m, 10 + rank, rank, 0.0, recovery=P.RECOVERY_RESTART)
    assert m.formed
    m.lost(10, "connection closed", 5.0)  # rank 0 killed: generation 1 begins
    out = register(m, 20, 0, 5.1, recovery=P.RECOVERY_RESTART)  # its warm replacement, before rank 1 has left
    assert not m.formed and not sent(out, P.FORMED), "formed with a survivor about to exit 76"
    out = m.lost(11, "connection closed", 5.2)  # the survivor exits 76 for its relaunch
    (death,) = [a for a in out if isinstance(a, Note) and a.kind == "death"]
    assert death.fields["relaunched"] is True and death.fields["begins"] is False
    assert m.generation == 1 and not sent(out, P.GENERATION)
    out = register(m, 21, 1, 5.5, recovery=P.RECOVERY_RESTART)  # its relaunch
    assert m.formed and m.generation == 1 and {s.peer for s in sent(out, P.FORMED)} == {20, 21}
    out = m.lost(20, "connection closed", 9.0)  # a real fault later is one again
    (death,) = [a for a in out if isinstance(a, Note) and a.kind == "death"]
    assert death.fields["begins"] is True and death.fields["relaunched"] is False and m.generation == 2


def test_a_dead_incarnation_is_fenced_when_it_comes_back() -> None:
    m = membership(2)
    form(m)
    m.tick(2.0)
    register_again = {"op": P.HEARTBEAT}
    m.message(10, register_again, 2.5)  # rank 0 heartbeats; rank 1 (peer 11, inc11) went silent
    out = m.tick(0.1 + NODE_TIMEOUT + 0.5)
    assert "worker_1 (pid 1011 on hostA) is dead: sent no heartbeat" in logged(out)
    assert sent(out, P.FENCED)[0].peer == 11 and sent(out, P.FENCED)[0].close
    back = register(m, 30, 1, 4.0, incarnation="inc11", pid=1011)  # SIGCONT, or a healed partition
    assert [s.op for s in sent(back)] == [P.FENCED] and sent(back)[0].close
    assert "fenced worker_1" in logged(back)
    fresh = register(m, 31, 1, 4.1, incarnation="new")
    assert sent(fresh, P.WELCOME) and sent(fresh, P.FORMED)[0].fields["generation"] == 1


def test_a_second_claim_of_a_live_rank_is_rejected_with_retry() -> None:
    m = membership(2)
    register(m, 10, 0, 0.0)
    out = register(m, 11, 0, 1.0, incarnation="other")
    (reject,) = sent(out, P.REJECT)
    assert reject.fields["retry"] is True and "held by a live process (pid 1010" in reject.fields["reason"]
    out = m.lost(10, "connection closed", 2.0)  # its holder died: the claim succeeds at once
    assert sent(register(m, 12, 0, 2.1, incarnation="other"), P.WELCOME)


def test_a_reconnect_of_the_same_incarnation_replaces_its_old_connection() -> None:
    m = membership(2)
    form(m)
    out = register(m, 40, 0, 1.0, incarnation="inc10")
    assert Close(10) in out and sent(out, P.FORMED)  # same generation: it goes on where it was
    assert "worker_0 reconnected" in logged(out)
    assert m.lost(10, "closed", 1.1) == []  # the replaced connection's end is no death


def test_commits_only_move_forward_and_finished_workers_end_the_job() -> None:
    m = membership(2)
    form(m)
    for peer, step in ((10, 8), (10, 4), (11, 8), (11, 12)):  # a late commit of an older step changes nothing
        m.message(peer, {"op": P.COMMIT, "step": step}, 1.0)
    assert m.roster.commits == {0: 8, 1: 12} and m.snapshot()["committed_step"] == 8
    m.agent_hello(50, "10.0.0.3:1", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0"]})
    assert m.message(10, {"op": P.DONE}, 2.0)[-1:] != [Exit(0)]
    out = m.message(11, {"op": P.DONE}, 2.1)
    assert Exit(0) in out and sent(out, P.FINISHED)[0].peer == 50
    assert m.lost(10, "closed", 2.2) == [] and m.lost(11, "closed", 2.2) == []  # done: their EOF is no death


def test_a_commit_racing_the_death_of_its_sender_changes_nothing() -> None:
    m = membership(2)
    form(m)
    m.message(11, {"op": P.COMMIT, "step": 8}, 1.0)
    silent = m.tick(NODE_TIMEOUT + 0.5)  # worker_0 fell silent: dead, its incarnation fenced; worker_1 was heard
    assert "worker_0 (pid 1010 on hostA) is dead: sent no heartbeat" in logged(silent)
    assert sorted(m.roster.members) == [1] and m.generation == 1
    assert m.message(10, {"op": P.COMMIT, "step": 40}, 3.6) == []  # in flight when it was declared dead
    assert m.roster.commits == {1: 8} and m.snapshot()["committed_step"] is None
    out = register(m, 20, 0, 3.7, incarnation="inc10")  # and the fenced incarnation cannot come back to commit
    assert sent(out, P.FENCED) and m.roster.commits == {1: 8}


def test_an_agents_exit_report_is_as_good_as_the_closed_connection() -> None:
    m = membership(2)
    form(m)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0", "worker_1"]})
    out = m.message(50, {"op": P.EXITED, "node_id": "worker_1", "pid": 1011, "code": None, "signal": "SIGKILL"},
                    1.0)
    assert m.generation == 1 and "its agent on hostA saw it end: killed by SIGKILL" in logged(out)
    assert not sent(out, P.KILL)  # it is known dead: nothing to kill
    stale = m.message(50, {"op": P.EXITED, "node_id": "worker_1", "pid": 999, "code": 1}, 1.1)
    assert m.generation == 1 and not sent(stale)  # an older incarnation's exit moves nothing


def test_heartbeat_silence_has_the_agent_kill_what_may_still_run() -> None:
    m = membership(2)
    form(m)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0", "worker_1"]})
    m.message(11, {"op": P.HEARTBEAT, "step": 3}, NODE_TIMEOUT)
    out = m.tick(NODE_TIMEOUT + 0.01)
    (kill,) = sent(out, P.KILL)
    assert kill.peer == 50 and kill.fields == {"node_id": "worker_0", "pid": 1010, "cause": "heartbeat silence"}


def agent_beat(m: Membership, now: float, running: dict[str, Any], peer: int = 50) -> list[Any]:
    return m.message(peer, {"op": P.HEARTBEAT, "running": running}, now)


def test_a_member_its_agent_vouches_for_is_alive_though_silent_until_topo_timeout() -> None:
    # A call that holds the worker's GIL stops its heartbeats, not its process: its agent, which sees the process
    # running (not stopped), vouches for it every second, and the scheduler waits (up to MS_TOPO_TIMEOUT).
    m = membership(2)
    form(m)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0", "worker_1"]})
    said = []
    t = 1.0
    while t < TOPO_TIMEOUT - 1:
        m.message(11, {"op": P.HEARTBEAT, "step": 3}, t)  # rank 1 heartbeats; rank 0 is silent from 0.0 on
        agent_beat(m, t, {"worker_0": 1010, "worker_1": 1011})
        out = m.tick(t)
        assert not sent(out, P.KILL) and not sent(out, P.GENERATION), (t, out)
        said.append(logged(out))
        t += 1.0
    assert m.generation == 0 and 0 in m.roster.members
    busy = [line for line in said if line]
    assert len(busy) == 1 and "worker_0 (pid 1010 on hostA) sent no heartbeat for 3.0 s, but its agent sees it " \
                               "running (not stopped)" in busy[0], said
    m.message(10, {"op": P.HEARTBEAT}, t)  # heard again: a later silence is said again
    assert not sent(m.tick(t))
    out = m.tick(t + TOPO_TIMEOUT)  # silent for the whole bound, vouched or not: hung
    assert sent(out, P.KILL) and m.generation == 1


def test_a_stopped_member_is_dead_after_node_timeout_even_while_its_agent_heartbeats() -> None:
    # SIGSTOP: the agent leaves the process out of its vouches (its /proc state is T), so its silence is a death.
    m = membership(2)
    form(m)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0", "worker_1"]})
    agent_beat(m, 0.5, {"worker_0": 1010, "worker_1": 1011})  # vouched, then stopped at about 0.5 s
    for t in (1.0, 2.0, 3.0):
        m.message(11, {"op": P.HEARTBEAT}, t)
        agent_beat(m, t, {"worker_1": 1011})
        assert not sent(m.tick(t), P.KILL)
    m.message(11, {"op": P.HEARTBEAT}, 3.4)
    out = m.tick(3.6)  # unheard for node_timeout by itself and by its agent (since 0.5)
    (kill,) = sent(out, P.KILL)
    assert kill.fields == {"node_id": "worker_0", "pid": 1010, "cause": "heartbeat silence"} and m.generation == 1


def test_only_an_agent_of_the_members_host_vouches_for_its_very_pid() -> None:
    m = membership(2)
    form(m)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0"]})
    m.agent_hello(51, "b", {"op": P.AGENT_HELLO, "host": "hostB", "node_ids": ["worker_1"]})
    for t in (1.0, 2.0, 3.0):
        m.message(11, {"op": P.HEARTBEAT}, t)
        agent_beat(m, t, {"worker_0": 1010}, peer=51)  # another host's agent: not a witness
        agent_beat(m, t, {"worker_0": 999, "worker_9": 5, "x": True, 7: 1}, peer=50)  # not its pid, junk
    out = m.tick(3.1)
    assert sent(out, P.KILL) and m.generation == 1


def test_a_closed_connection_is_a_death_now_and_a_kill_only_if_the_exit_goes_unreported() -> None:
    # A failing script closes its connection a moment before it exits: killing it then would make SIGKILL its cause.
    m = membership(3)
    form(m)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0", "worker_1", "worker_2"]})
    out = m.lost(11, "connection closed", 1.0)
    assert m.generation == 1 and not sent(out, P.KILL)
    assert m.next_deadline() <= 1.0 + NODE_TIMEOUT
    out = m.message(50, {"op": P.EXITED, "node_id": "worker_1", "pid": 1011, "code": 1,
                         "cause": "RuntimeError: boom at step 5 (exit code 1)\nTraceback ..."}, 1.2)
    (note,) = [a for a in out if isinstance(a, Note) and a.kind == "exited"]
    assert note.fields["cause"] == "RuntimeError: boom at step 5 (exit code 1)"
    assert "worker_1 (pid 1011 on hostA) exited: RuntimeError: boom at step 5 (exit code 1)" in logged(out)
    m.message(10, {"op": P.HEARTBEAT}, 1.5)
    out = m.lost(12, "connection closed", 2.0)  # this one lingers, its exit unreported
    m.message(10, {"op": P.HEARTBEAT}, 4.5)
    assert not sent(m.tick(2.0 + NODE_TIMEOUT - 0.1), P.KILL)  # worker_1's exit was reported: never killed
    (kill,) = sent(m.tick(2.0 + NODE_TIMEOUT), P.KILL)
    assert kill.fields == {"node_id": "worker_2", "pid": 1012, "cause": "connection closed"}


def test_the_agents_first_cause_names_the_death_and_the_failure() -> None:
    m = membership(2)
    form(m)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0", "worker_1"]})
    out = m.message(50, {"op": P.EXITED, "node_id": "worker_1", "pid": 1011, "code": None, "signal": "SIGKILL",
                         "cause": "heartbeat silence: fenced by the scheduler (killed by SIGKILL)"}, 1.0)
    assert "saw it end: heartbeat silence: fenced by the scheduler (killed by SIGKILL)" in logged(out)
    (death,) = [a for a in out if isinstance(a, Note) and a.kind == "death"]
    assert death.fields["cause"] == "heartbeat silence: fenced by the scheduler (killed by SIGKILL)"
    out = m.message(50, {"op": P.GAVE_UP, "node_id": "worker_1", "code": 1, "signal": None,
                         "cause": "ValueError: bad shape (exit code 1)", "log_tail": "a\nb"}, 2.0)
    assert "worker_1 on hostA failed after its last allowed restart (ValueError: bad shape (exit code 1)); last " \
           "log lines: a | b" in sent(out, P.STOP)[0].fields["reason"]


def test_formation_timeout_names_who_never_came_and_where() -> None:
    m = membership(3)
    register(m, 10, 1, 1.0)
    for t in range(2, int(TOPO_TIMEOUT)):  # the one that came keeps its heartbeat
        m.message(10, {"op": P.HEARTBEAT}, float(t))
        assert m.tick(float(t)) == []
    out = m.tick(TOPO_TIMEOUT)
    assert Exit(3) in out
    reason = sent(out, P.STOP)[0].fields["reason"]
    assert "2 of 3 workers never registered: worker_0 (expected on hostA), worker_2" in reason


def test_a_gave_up_report_fails_the_job_and_stops_everyone() -> None:
    m = membership(2)
    form(m)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0"]})
    out = m.message(50, {"op": P.GAVE_UP, "node_id": "worker_0", "code": 1, "signal": None,
                         "log_tail": "a\nValueError: bad data"}, 1.0)
    assert Exit(1) in out and {s.peer for s in sent(out, P.STOP)} == {50, 10, 11}
    assert "ValueError: bad data" in sent(out, P.STOP)[0].fields["reason"]
    assert sent(register(m, 60, 0, 2.0, incarnation="late"), P.REJECT)  # a failed job takes nobody


def test_a_restarted_scheduler_gives_members_node_timeout_to_reconnect() -> None:
    m = membership(2)
    form(m)
    m.lost(11, "closed", 1.0)  # generation 1 gathering, worker_1 gone
    again = membership(2, now=100.0)
    again.restore(m.snapshot(), 100.0)
    again.started(100.0)
    assert again.generation == 1 and "inc11" in again.roster.fenced
    out = register(again, 70, 0, 100.5, incarnation="inc10")
    assert "worker_0 reconnected" in logged(out)
    out = again.tick(100.0 + NODE_TIMEOUT + 0.1)
    assert not logged(out)  # worker_0 reconnected in time; worker_1 was never a member of the new state


def test_restored_restart_recovery_members_that_never_reconnect_are_not_taken_for_leaving_ones() -> None:
    """After a stop and a start again, the restored members of a torchrun-style script are ghosts: the first one
    found not back begins a generation, but the others are no processes about to exit for a relaunch; their absence
    is judged as such (`did not reconnect`), never noted as relaunched."""
    m = membership(2)
    for rank in range(2):
        register(m, 10 + rank, rank, 0.0, recovery=P.RECOVERY_RESTART)
    again = membership(2, now=100.0)
    again.restore(m.snapshot(), 100.0)
    again.started(100.0)
    out = again.tick(100.0 + NODE_TIMEOUT + 0.1)  # neither came back
    deaths = [a for a in out if isinstance(a, Note) and a.kind == "death"]
    assert len(deaths) == 2 and not any(d.fields["relaunched"] for d in deaths), deaths


@pytest.mark.parametrize("field,value", [("rank", True), ("rank", "1"), ("pid", 2.5), ("incarnation", ""),
                                         ("node_id", ["worker_0"]), ("world_size", 3), ("rank", 7)])
def test_a_malformed_or_wrong_registration_is_refused_without_retry(field: str, value: Any) -> None:
    m = membership(2)
    msg = {"op": P.REGISTER, "node_id": "worker_1", "rank": 1, "world_size": 2, "incarnation": "i", "pid": 1,
           "host": "h", field: value}
    (reject,) = sent(m.register(10, "a", msg, 0.0))
    assert reject.op == P.REJECT and reject.fields["retry"] is False and reject.close
    assert m.roster.members == {}


# --- the store's core ------------------------------------------------------------------------------------------


def test_a_get_waits_for_its_key_and_times_out() -> None:
    kv = kvstore.KVStore()
    assert kv.request(1, {"id": 1, "cmd": "get", "key": "k", "timeout": 5}, 0.0) == []
    replies = {r.peer: r for r in kv.request(2, {"id": 9, "cmd": "set", "key": "k", "value": "dmFsdWU="}, 1.0)}
    assert set(replies) == {1, 2}  # the set is answered, and it wakes the get waiting on its key
    assert replies[1].ok and replies[1].fields["value"] == "dmFsdWU=" and replies[2].ok
    assert kv.request(1, {"id": 2, "cmd": "get", "key": "other", "timeout": 5}, 2.0) == []
    assert kv.next_deadline() == 7.0
    (expired,) = kv.expire(7.0)
    assert (expired.peer, expired.id, expired.ok, expired.fields["error"]) == (1, 2, False, "timeout")


def test_the_store_is_bounded_and_forgets_generations() -> None:
    kv = kvstore.KVStore(max_keys=2, max_bytes=1000)
    assert kv.request(1, {"id": 1, "cmd": "set", "key": "job/b/gen0/a", "value": "eA=="}, 0)[0].ok
    assert kv.request(1, {"id": 2, "cmd": "set", "key": "job/b/gen1/a", "value": "eA=="}, 0)[0].ok
    full = kv.request(1, {"id": 3, "cmd": "set", "key": "job/b/gen1/b", "value": "eA=="}, 0)[0]
    assert not full.ok and "full" in full.fields["error"]
    assert kv.drop_prefix("job/b/gen0/") == 1
    assert kv.request(1, {"id": 4, "cmd": "set", "key": "job/b/gen1/b", "value": "eA=="}, 0)[0].ok
    add = kv.request(1, {"id": 5, "cmd": "add", "key": "n", "amount": 3}, 0)[0]
    assert not add.ok  # a third key: refused, nothing half-done
    for bad in ({"cmd": "get", "key": "k", "timeout": float("inf")}, {"cmd": "set", "key": "", "value": ""},
                {"cmd": "set", "key": "k", "value": "!!"}, {"cmd": "wait", "keys": "k", "timeout": 1},
                {"cmd": "drop_all"}):
        assert not kv.request(1, {"id": 6, **bad}, 0)[0].ok, bad


@pytest.mark.parametrize("recovery", [P.RECOVERY_IN_PLACE, P.RECOVERY_RESTART])
def test_a_death_after_a_rank_finished_ends_the_job_at_once(recovery: str) -> None:
    m = membership(2)
    for rank in range(2):
        msg = {"op": P.REGISTER, "node_id": P.worker_node_id(rank), "rank": rank, "world_size": 2,
               "incarnation": f"inc{rank}", "pid": 1000 + rank, "host": "hostA", "recovery": recovery}
        m.register(10 + rank, f"10.0.0.2:{rank}", msg, 0.0)
    assert m.formed
    m.message(10, {"op": P.DONE}, 1.0)  # rank 0 passed the final barrier and said so
    out = m.lost(11, "closed", 1.1)  # rank 1 dies before saying it: no generation can form without rank 0
    assert m.generation == 0 and not sent(out, P.GENERATION)
    if recovery == P.RECOVERY_IN_PLACE:  # past the final barrier, its final checkpoint is durable
        assert Exit(0) in out and "counts as finished" in logged(out)
    else:
        assert Exit(1) in out and "worker_1 (pid 1001 on hostA) is dead" in logged(out)
        assert "cannot form a new generation" in logged(out)


# --- spares: a lost host's ranks taken over, the lost host fenced ------------------------------------------------

HOST_TIMEOUT = 10.0


def spare_job(now: float = 0.0, spares: tuple[str, ...] = ()) -> Membership:
    """4 ranks: the scheduler and worker_0-1 on hostA, worker_2-3 on hostB; spares s1 and s2 (`spares`: the
    inventory's order, else their agents'). Formed at `now`."""
    m = Membership("job", 4, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "10.0.0.1:8118",
                   {"worker_0": "hostA", "worker_1": "hostA", "worker_2": "hostB", "worker_3": "hostB"}, now,
                   host_timeout=HOST_TIMEOUT, spares=spares)
    m.started(now)
    agent(m, 1, "hostA", ["sched", "worker_0", "worker_1"], now)
    agent(m, 2, "hostB", ["worker_2", "worker_3"], now)
    agent(m, 3, "s1", [], now, spare=True)
    agent(m, 4, "s2", [], now, spare=True)
    for rank in range(4):
        m.register(10 + rank, f"10.0.0.2:{rank}", {
            "op": P.REGISTER, "node_id": P.worker_node_id(rank), "rank": rank, "world_size": 4,
            "incarnation": f"inc{rank}", "pid": 1010 + rank, "host": "hostA" if rank < 2 else "hostB",
            "recovery": P.RECOVERY_IN_PLACE}, now)
    assert m.formed
    return m


def agent(m: Membership, peer: int, host: str, node_ids: list[str], now: float, spare: bool = False) -> list[Any]:
    return m.agent_hello(peer, f"10.0.0.9:{peer}", {"op": P.AGENT_HELLO, "host": host, "node_ids": node_ids,
                                                   "spare": spare}, now)


def beat(m: Membership, now: float) -> None:
    """hostA's workers (peers 10 and 11) heartbeat at `now`."""
    for peer in (10, 11):
        m.message(peer, {"op": P.HEARTBEAT, "step": 1}, now)


def crash_host_b(m: Membership, now: float) -> list[Any]:
    """hostB's link goes down: its agent's connection and its workers' heartbeats stop."""
    out = m.lost(2, "connection closed", now)
    for peer in (12, 13):
        out += m.lost(peer, "connection closed", now)
    return out


def test_a_lost_host_is_taken_over_by_a_spare_after_host_timeout_and_fenced_for_good() -> None:
    m = spare_job()
    crash_host_b(m, 5.0)
    assert m.generation == 1 and not m.formed
    beat(m, 5.0 + HOST_TIMEOUT - 0.1)
    assert not sent(m.tick(5.0 + HOST_TIMEOUT - 0.1), P.TAKEOVER)  # not yet: the host may come back
    assert m.next_deadline() == pytest.approx(5.0 + HOST_TIMEOUT)  # when it is lost, the server wakes
    out = m.tick(5.0 + HOST_TIMEOUT)
    takeover = sent(out, P.TAKEOVER)
    assert [(t.peer, t.fields["host"], t.fields["node_ids"], t.fields["seq"]) for t in takeover] == [
        (3, "hostB", ["worker_2", "worker_3"], 1)]
    reason = m.roster.replacements()[0]["reason"]
    assert m.dirty and m.snapshot()["replaced"] == [
        {"host": "hostB", "by": "s1", "node_ids": ["worker_2", "worker_3"], "reason": reason}]
    assert "host hostB replaced by spare s1" in logged(out)
    assert [a.kind for a in out if isinstance(a, Note)] == ["replaced"]
    assert m.roster.host_of("worker_2") == "s1"  # the formation-timeout message would name the spare now
    # the spare's workers register for the ranks and the generation forms: the job goes on
    for rank in (2, 3):
        msg = {"op": P.REGISTER, "node_id": P.worker_node_id(rank), "rank": rank, "world_size": 4,
               "incarnation": f"spare{rank}", "pid": 50 + rank, "host": "s1", "recovery": P.RECOVERY_IN_PLACE}
        out = m.register(30 + rank, "10.0.0.8:1", msg, 15.5)
    assert m.formed and m.generation == 1
    # hostB comes back: its agent is told to stop (after a proven welcome), its workers to exit
    back = agent(m, 40, "hostB", ["worker_2", "worker_3"], 30.0)
    assert [(s.op, s.close) for s in sent(back)] == [(P.WELCOME, False), (P.STOP, True)]
    assert "replaced by s1" in sent(back, P.STOP)[0].fields["reason"]
    assert "refused the agent of hostB" in logged(back) and m.roster.hosts["hostB"].agent is None
    old = {"op": P.REGISTER, "node_id": "worker_2", "rank": 2, "world_size": 4, "incarnation": "fresh", "pid": 7,
           "host": "hostB", "recovery": P.RECOVERY_IN_PLACE}
    assert [s.op for s in sent(m.register(41, "10.0.0.3:1", old, 30.0))] == [P.FENCED]
    # a restarted scheduler keeps refusing it
    again = Membership("job", 4, NODE_TIMEOUT, TOPO_TIMEOUT, "boot2", "10.0.0.1:8118", {}, 40.0,
                       host_timeout=HOST_TIMEOUT)
    again.restore(m.snapshot(), 40.0)
    assert [s.op for s in sent(again.register(1, "10.0.0.3:1", old, 41.0))] == [P.FENCED]
    assert sent(agent(again, 2, "hostB", [], 41.0), P.STOP)
    assert sent(agent(again, 3, "s1", [], 41.0, spare=True), P.TAKEOVER)  # a restarted spare agent is told again
    assert not sent(agent(again, 4, "s1", ["worker_2", "worker_3"], 42.0, spare=True), P.TAKEOVER)


def test_no_replacement_while_the_hosts_agent_is_connected_or_its_ranks_live() -> None:
    m = spare_job()
    for peer in (12, 13):  # both workers die, the agent stays (and heartbeats): it relaunches them
        m.lost(peer, "connection closed", 1.0)
    for t in range(1, 40):
        m.message(2, {"op": P.HEARTBEAT}, float(t))
        assert not sent(m.tick(float(t)), P.TAKEOVER)
    m = spare_job()
    m.lost(2, "connection closed", 1.0)  # the agent alone was killed: its workers train on
    m.message(12, {"op": P.HEARTBEAT}, 1.0 + HOST_TIMEOUT)
    m.message(13, {"op": P.HEARTBEAT}, 1.0 + HOST_TIMEOUT)
    m.message(10, {"op": P.HEARTBEAT}, 1.0 + HOST_TIMEOUT)
    m.message(11, {"op": P.HEARTBEAT}, 1.0 + HOST_TIMEOUT)
    assert not sent(m.tick(1.0 + HOST_TIMEOUT + 0.1), P.TAKEOVER)
    m = spare_job()
    m.lost(1, "connection closed", 1.0)  # the scheduler's host is never replaced (its agent may be restarting)
    for peer in (10, 11):
        m.lost(peer, "connection closed", 1.0)
    for peer in (2, 12, 13):  # hostB is well
        m.message(peer, {"op": P.HEARTBEAT}, 1.0 + 10 * HOST_TIMEOUT)
    assert not sent(m.tick(1.0 + 10 * HOST_TIMEOUT), P.TAKEOVER)


def test_a_host_cut_off_is_lost_when_its_agent_falls_silent_with_its_connection_open() -> None:
    m = spare_job()
    m.message(2, {"op": P.HEARTBEAT}, 1.0)  # hostB's agent, last heard at 1.0; then its cable is pulled
    beat(m, 2.0)
    m.message(12, {"op": P.HEARTBEAT}, 1.0)
    m.message(13, {"op": P.HEARTBEAT}, 1.0)
    out = m.tick(1.0 + NODE_TIMEOUT)  # its workers die by silence: no connection closed
    assert "worker_2 (pid 1012 on hostB) is dead: sent no heartbeat" in logged(out)
    beat(m, 1.0 + HOST_TIMEOUT - 0.1)
    assert not sent(m.tick(1.0 + HOST_TIMEOUT - 0.1), P.TAKEOVER)
    out = m.tick(1.0 + HOST_TIMEOUT)
    assert [(s.peer, s.fields["host"]) for s in sent(out, P.TAKEOVER)] == [(3, "hostB")]
    assert [(s.peer, s.close) for s in sent(out, P.STOP)] == [(2, True)]  # its silent link is told and dropped
    assert "its agent unheard for 10.0 s" in m.roster.replacements()[0]["reason"]


def test_before_the_job_formed_a_missing_host_is_left_to_the_formation_timeout() -> None:
    m = Membership("job", 2, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "a:1", {"worker_0": "hostA", "worker_1": "hostB"},
                   0.0, host_timeout=HOST_TIMEOUT)
    m.started(0.0)
    agent(m, 3, "s1", [], 0.0, spare=True)
    assert not sent(m.tick(2 * HOST_TIMEOUT), P.TAKEOVER)


def test_without_a_free_spare_a_lost_host_waits_and_a_spare_that_connects_later_takes_it() -> None:
    m = spare_job()
    m.lost(3, "connection closed", 0.5)  # both spares' agents are gone
    m.lost(4, "connection closed", 0.5)
    crash_host_b(m, 1.0)
    out = m.tick(1.0 + HOST_TIMEOUT)
    assert not sent(out, P.TAKEOVER) and "no spare is free" in logged(out)
    assert not logged(m.tick(2.0 + HOST_TIMEOUT))  # said once, and no busy deadline
    assert m.next_deadline() == math.inf or m.next_deadline() > 2.0 + HOST_TIMEOUT
    out = agent(m, 5, "s2", [], 30.0, spare=True)
    assert [(s.peer, s.fields["host"]) for s in sent(out, P.TAKEOVER)] == [(5, "hostB")]


def test_automatic_replacement_is_off_with_host_timeout_zero() -> None:
    m = spare_job()
    m.host_timeout = 0
    crash_host_b(m, 1.0)
    assert not sent(m.tick(1e6), P.TAKEOVER)


def replace(m: Membership, host: Any, spare: Any = None, now: float = 5.0) -> list[Any]:
    return m.replace(99, {"op": P.REPLACE, "node_id": "operator", "host": host, "spare": spare}, now)


def test_the_operators_replace_moves_a_live_hosts_ranks_to_the_named_spare_at_once() -> None:
    m = spare_job()
    out = replace(m, "hostB", "s2")
    reply = sent(out)[0]
    assert (reply.peer, reply.op, reply.close) == (99, P.WELCOME, True)
    assert reply.fields == {"host": "hostB", "spare": "s2", "node_ids": ["worker_2", "worker_3"]}
    assert [(s.peer, s.fields["reason"][:26]) for s in sent(out, P.STOP)] == [(2, "host hostB was replaced by")]
    assert {s.peer for s in sent(out, P.FENCED)} == {12, 13}  # its live workers are fenced
    assert m.generation == 1 and [s.peer for s in sent(out, P.TAKEOVER)] == [4]
    assert "replaced by the operator" in m.roster.replacements()[0]["reason"]


@pytest.mark.parametrize(("host", "spare", "why"), [
    ("hostC", None, "host hostC runs no worker of the job; the hosts with workers: hostA, hostB"),
    ("hostA", None, "host hostA runs the scheduler"),
    ("hostB", "hostA", "hostA cannot take over hostB: it is not a spare host of this job"),
    ("hostB", "s9", "s9 cannot take over hostB: it is not a spare host"),
])
def test_the_operators_replace_is_refused_with_a_reason(host: str, spare: str | None, why: str) -> None:
    m = spare_job()
    out = replace(m, host, spare)
    assert [(s.op, s.close) for s in sent(out)] == [(P.REJECT, True)]
    assert why in sent(out)[0].fields["reason"] and not m.roster.replacements()


def test_a_spare_is_used_once_and_a_replaced_host_cannot_be_replaced_again() -> None:
    m = spare_job()
    replace(m, "hostB", "s1")
    assert "s1 cannot take over s1: it already holds ranks" in sent(replace(m, "s1", "s1"))[0].fields["reason"]
    assert "already replaced by s1" in sent(replace(m, "hostB"))[0].fields["reason"]
    out = replace(m, "s1")  # the spare that took over is a worker host now: another spare can replace it
    assert sent(out)[0].op == P.WELCOME and sent(out, P.TAKEOVER)[0].fields == {
        "host": "s1", "node_ids": ["worker_2", "worker_3"], "seq": 2}
    assert "no spare is free" in sent(replace(m, "s2"))[0].fields["reason"]


def test_the_ledger_names_the_replacement_in_the_lost_hosts_incident() -> None:
    from toolkit.scheduler.ledger import Ledger

    m = spare_job()
    ledger = Ledger("job", 4, 0.0)
    out = crash_host_b(m, 5.0)
    beat(m, 5.0 + HOST_TIMEOUT)
    out += m.tick(5.0 + HOST_TIMEOUT)
    for note in (a for a in out if isinstance(a, Note)):
        ledger.note(note.kind, note.fields, 100.0)
    assert [i.cause for i in ledger.faults.incidents] == ["host hostB lost, replaced by spare s1"]


def test_spares_are_used_in_the_inventorys_order_not_the_order_their_agents_connected() -> None:
    m = spare_job(spares=("s2", "s1"))  # as TOOLKIT_SPARES gives them (Config.spares); s1's agent said hello first
    out = replace(m, "hostB")
    assert sent(out)[0].fields["spare"] == "s2" and [s.peer for s in sent(out, P.TAKEOVER)] == [4]


def test_agents_beat_every_second_until_thousands_of_ranks_then_as_the_workers_do() -> None:
    # The welcome tells the agent its heartbeat interval: at 4096 ranks 512 agents a second would be a sixth of
    # the scheduler's steady messages; stretched as the workers' (envvars.heartbeat_interval), never past a third
    # of MS_NODE_TIMEOUT (an agent's vouching must stay fresh within it).
    def beat(world: int, node_timeout: float = 6.0) -> float:
        m = Membership("j", world, node_timeout, 60.0, "b", "a:1")
        out = m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0"]})
        welcome = sent(out, P.WELCOME)[0].fields
        return P.beat_interval(welcome, -1.0)

    assert beat(16) == beat(2048) == 1.0
    assert beat(4096) == 2.0 and beat(4096, node_timeout=3.0) == 1.0
    assert beat(65536) == 2.0  # a third of the 6 s node timeout


def test_numbers_past_a_floats_range_from_a_worker_are_dropped_not_raised() -> None:
    # An OverflowError here would end the scheduler's loop: one authenticated worker could stop the job's control.
    m = membership(2)
    form(m)
    huge = P.decode(b'{"op":"recovered","generation":1,"step":3,"source":"peer","seconds":1' + b"0" * 400 + b"}")
    notes = [a for a in m.message(10, huge, 1.0) if isinstance(a, Note)]
    assert notes and notes[0].fields["seconds"] is None and notes[0].fields["step"] == 3
    beat = P.decode(b'{"op":"heartbeat","step":4,"loss":1' + b"0" * 400 + b',"busy":0.25}')
    notes = [a for a in m.message(10, beat, 1.1) if isinstance(a, Note)]
    assert notes[0].fields["step"] == 4 and notes[0].fields["busy"] == 0.25 and "loss" not in notes[0].fields


def test_formed_tells_every_rank_the_logical_ranks_each_serves_and_a_late_reconnect_gets_the_same() -> None:
    m = Membership("job", 2, NODE_TIMEOUT, TOPO_TIMEOUT, "boot", "a:1", {}, 0.0, logical_world=5)
    m.started(0.0)
    register(m, 10, 0, 0.1)
    out = register(m, 11, 1, 0.2)
    formed = sent(out, P.FORMED)
    assert len(formed) == 2 and all(s.fields["logical_world"] == 5 and s.fields["logical"] == [[0, 1, 2], [3, 4]]
                                    for s in formed)
    assert "2 workers, serving 5 logical ranks" in logged(out)
    again = sent(register(m, 12, 1, 0.3, incarnation="inc11"), P.FORMED)  # the same incarnation reconnects
    assert again[0].fields["logical"] == [[0, 1, 2], [3, 4]]


def test_by_default_each_rank_serves_its_own_logical_rank() -> None:
    m = membership(3)
    form(m)
    assert m.world is not None and m.world.by_slot() == {0: (0,), 1: (1,), 2: (2,)}
