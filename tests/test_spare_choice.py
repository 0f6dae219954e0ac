"""The scheduler's spare-host decisions (toolkit.scheduler.sparehosts) on a fake clock: which hosts are lost and which
spare takes a host's ranks. The membership's use of them (the takeover, the fencing, the operator's replace) is in
tests/test_membership.py; the flow on real hosts in tests/e2e/test_spares.py."""

from __future__ import annotations

from toolkit.scheduler.roster import Member, Roster
from toolkit.scheduler.sparehosts import Lost, LostCheck, Refusal, choose_spare, find_lost

PLAN = {"sched": "hostA", "worker_0": "hostA", "worker_1": "hostB", "worker_2": "hostC", "worker_3": "hostC"}
TIMEOUT = 10.0


def roster() -> Roster:
    """hostA runs the scheduler and worker_0; hostB worker_1; hostC worker_2-3: all started at 0, none said hello."""
    r = Roster(PLAN, spares=("s2", "s1"))
    for host in ("hostA", "hostB", "hostC"):
        r.start_clock(host, 0.0)
    r.connect_agent("hostA", 99, spare=False, now=0.0, scheduler=True)  # then silent, but never lost
    return r


def test_a_host_is_lost_once_unheard_for_the_timeout_with_every_rank_dead() -> None:
    r = roster()
    assert find_lost(r, TIMEOUT - 0.01, TIMEOUT) == []
    assert find_lost(r, TIMEOUT, TIMEOUT) == [  # the bound is >=; never the scheduler's host
        Lost("hostB", 0.0, ["worker_1"]), Lost("hostC", 0.0, ["worker_2", "worker_3"])]
    r.admit(Member(3, "worker_3", "inc3", 13, "hostC", "a:1", 0.0))  # one rank still held: not lost
    assert [lost.host for lost in find_lost(r, TIMEOUT, TIMEOUT)] == ["hostB"]


def test_a_connected_agents_silence_counts_and_hosts_go_in_order() -> None:
    r = roster()
    r.connect_agent("hostC", 1, spare=False, now=1.0)  # connected, then silent (a pulled cable)
    r.connect_agent("hostB", 2, spare=False, now=1.0)
    r.disconnect_agent("hostB", 2, 2.0)
    assert find_lost(r, 11.0, TIMEOUT) == [Lost("hostC", 1.0, ["worker_2", "worker_3"])]
    assert [lost.host for lost in find_lost(r, 12.0, TIMEOUT)] == ["hostB", "hostC"]  # disconnected first
    r.heard("hostC", 1, 11.5)
    assert [lost.host for lost in find_lost(r, 12.0, TIMEOUT)] == ["hostB"]


def test_a_replaced_host_or_one_without_workers_is_never_lost() -> None:
    r = roster()
    r.connect_agent("s1", 5, spare=True, now=0.0)
    r.replace("hostB", "s1", "lost")
    r.start_clock("idle", 0.0)  # watched, holds nothing
    assert [lost.host for lost in find_lost(r, 100.0, TIMEOUT)] == ["hostC", "s1"]  # s1 holds worker_1 now


def test_spares_go_in_the_inventorys_order_then_in_hello_order() -> None:
    r = roster()
    for peer, host in enumerate(("s9", "s1", "s2"), 1):
        r.connect_agent(host, peer, spare=True, now=0.0)
    assert r.spare_order == ["s2", "s1", "s9"]
    assert choose_spare(r, None, "hostB") == "s2"
    assert choose_spare(r, "s9", "hostB") == "s9"  # the operator may name any free one
    r.replace("hostB", "s2", "lost")
    assert choose_spare(r, None, "hostC") == "s1"


def test_a_spare_in_use_fenced_disconnected_or_unknown_is_refused_with_why() -> None:
    r = roster()
    r.connect_agent("s1", 1, spare=True, now=0.0)
    r.connect_agent("s2", 2, spare=True, now=0.0)
    r.replace("hostB", "s1", "lost")
    r.disconnect_agent("s2", 2, 1.0)
    r.connect_agent("hostD", 3, spare=False, now=0.0)
    refusals = {asked: choose_spare(r, asked, "hostC") for asked in ("s1", "s2", "hostD", "s9", 7)}
    assert all(isinstance(x, Refusal) for x in refusals.values())
    why = {asked: x.reason for asked, x in refusals.items() if isinstance(x, Refusal)}
    assert why["s1"] == "s1 cannot take over hostC: it already holds ranks; free spares: none"
    assert why["s2"] == "s2 cannot take over hostC: its agent is not connected; free spares: none"
    assert "hostD cannot take over hostC: it is not a spare host of this job" in why["hostD"]
    assert "s9 cannot take over hostC: it is not a spare host of this job" in why["s9"]
    assert why[7] == "malformed replace: spare is not a host name"
    none = choose_spare(r, None, "hostC")
    assert isinstance(none, Refusal) and none.reason.startswith(
        "no spare is free to take over hostC (spares with an agent: s1); add a host to the inventory's [spares]")
    r.place("worker_1", "hostE")  # s1's rank moved on (an agent's hello): it took over once, so it stays used
    assert r.worker_hosts().get("s1") is None and isinstance(choose_spare(r, "s1", "hostC"), Refusal)


def test_the_lost_host_scan_is_due_only_when_a_host_may_have_become_lost() -> None:
    r, check = roster(), LostCheck()
    assert check.due(r, 0.0)  # never scanned
    r.connect_agent("hostB", 2, spare=False, now=1.0)
    r.connect_agent("hostC", 3, spare=False, now=2.0)
    check.scanned(r, r.changes, 2.0, TIMEOUT)
    assert check.deadline(r) == 10.0  # hostA, heard last at 0.0 (the scheduler's host: watched, never lost)
    assert not check.due(r, 9.9)
    r.heard("hostB", 2, 9.0)  # a heartbeat changes nothing the check depends on: it only moves silence later
    assert not check.due(r, 9.9) and check.due(r, 10.0)
    check.scanned(r, r.changes, 10.0, TIMEOUT)
    assert check.deadline(r) == 12.0  # hostC's silence, now the earliest still to come
    assert find_lost(r, 12.0, TIMEOUT) == [Lost("hostC", 2.0, ["worker_2", "worker_3"])] and check.due(r, 12.0)
    r.admit(Member(0, "worker_0", "inc0", 10, "hostA", "a:1", 10.5))  # the roster changed: due at once
    assert check.deadline(r) == float("-inf") and check.due(r, 10.5)
    check.idle(r)  # nothing is replaced in this phase: not due until asked again
    assert check.deadline(r) == float("inf") and not check.due(r, 1e9)
