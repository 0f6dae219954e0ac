"""A host the replica check found corrupt twice (issue 44): the scheduler's decision on the `corruption` report whose
action is `fenced` (toolkit.scheduler.membership.fence_corrupt, spares.fenced_host_spare), driven with a fake clock.
Its ranks go to a free spare as `fleet replace` would send them; with none free, an elastic job (--min-workers) shrinks
without it and keeps it out until the operator starts it again; otherwise, or on the scheduler's own host, the job
stops with one line naming the host and why it could not shrink. The flow on real hosts is
tests/e2e/test_corruption_on_hosts.py."""

from __future__ import annotations

from typing import Any

import pytest
from test_elastic_membership import agent, formed_by_peer, job, register
from test_membership import logged, sent, spare_job

from toolkit.contracts import protocol as P
from toolkit.scheduler.corrupthosts import read_corrupt
from toolkit.scheduler.membership import Exit, Log, Membership, Note


def report(m: Membership, rank: int, host: str, action: str = P.CORRUPT_FENCED, generation: int = 0,
           by: int = 10) -> list[Any]:
    """The replica check's report, sent by the worker on connection `by` (rank 0's)."""
    return m.message(by, {"op": P.CORRUPTION, "generation": generation, "step": 16, "since": 12, "ranks": [rank],
                          "hosts": [host], "action": action}, 5.0)


def test_a_host_found_corrupt_twice_is_handed_to_a_spare_at_once() -> None:
    m = spare_job()
    assert not sent(report(m, 2, "hostB", action="healed"))  # found once: healed in place, nothing to do here
    out = report(m, 2, "hostB")
    assert [(t.peer, t.fields["host"], t.fields["node_ids"]) for t in sent(out, P.TAKEOVER)] == [
        (3, "hostB", ["worker_2", "worker_3"])]
    assert {s.peer for s in sent(out, P.FENCED)} == {12, 13}  # both of its workers leave, not only the named one
    assert [(s.peer, s.close) for s in sent(out, P.STOP)] == [(2, True)]  # its agent is stopped
    assert m.generation == 1 and {s.peer for s in sent(out, P.GENERATION)} >= {10, 11}  # the others re-form
    assert ("host hostB replaced by spare s1: fenced: found corrupt twice by the replica check (rank 2 on hostB; "
            "the second time in steps 13-16)") in logged(out)
    assert [a.kind for a in out if isinstance(a, Note)][:2] == ["corruption", "replaced"]
    # a report while the next generation gathers, or placing a rank where it no longer is, moves nothing
    assert not sent(report(m, 2, "hostB", generation=1, by=11), P.TAKEOVER)
    assert "not fencing" in logged(report(m, 3, "hostB", generation=1, by=11))  # not formed yet
    m.formed = True
    assert "it places rank 3 on hostB, the scheduler on s1" in logged(report(m, 3, "hostB", generation=1, by=11))
    assert m.roster.replaced_by("s1") is None


def test_without_a_free_spare_or_on_the_schedulers_host_the_job_stops_naming_the_host() -> None:
    m = spare_job()
    m.lost(3, "connection closed", 1.0)  # both spares' agents are gone
    m.lost(4, "connection closed", 1.0)
    out = report(m, 3, "hostB")
    assert Exit(1) in out and not sent(out, P.TAKEOVER)
    assert ("job job failed: host hostB is fenced: found corrupt twice by the replica check (rank 3 on hostB; the "
            "second time in steps 13-16), and no spare is free to take over hostB (spares with an agent: none); add a "
            "host to the inventory's [spares], deploy and train; not shrinking instead: the job may not shrink "
            "(TOOLKIT_MIN_WORKERS=4 of 4 workers; --min-workers or --nnodes MIN:MAX lets it)") in logged(out)
    assert {s.peer for s in sent(out, P.STOP)} >= {1, 2, 10, 11, 12, 13}
    m = spare_job()
    out = report(m, 1, "hostA")
    assert Exit(1) in out and "host hostA is fenced" in logged(out)
    assert "host hostA runs the scheduler: it cannot be replaced while the job runs" in logged(out)


# --- an elastic job (--min-workers below the world): with no spare free, the fenced host's ranks are benched ---


def test_with_no_spare_an_elastic_job_shrinks_without_the_fenced_host_which_stays_out_until_restarted() -> None:
    m = job(min_workers=4)  # 6 ranks, 2 per host on hostA (the scheduler's), hostB, hostC; no spares
    out = report(m, 2, "hostB")
    assert Exit(1) not in out and not sent(out, P.TAKEOVER)
    assert ("host hostB is fenced: found corrupt twice by the replica check (rank 2 on hostB; the second time in steps "
            "13-16), and no spare is free to take over hostB (spares with an agent: none); add a host to the "
            "inventory's [spares], deploy and train: shrinking to 4 of 6 workers, serving 6 logical ranks; it stays "
            "out until the operator starts it again ('fleet restart --host hostB')") in logged(out)
    assert {s.peer for s in sent(out, P.FENCED)} == {12, 13}  # its live workers are told to exit
    assert [(s.peer, s.close) for s in sent(out, P.STOP)] == [(2, True)]  # and its agent to stop them
    formed = formed_by_peer(out)
    assert m.formed and m.generation == 1 and sorted(formed) == [10, 11, 14, 15]  # the survivors, in place
    assert {f["world_size"] for f in formed.values()} == {4} and formed[10]["logical_world"] == 6
    assert [a.fields["slots"] for a in out if isinstance(a, Note) and a.kind == "shrink"] == [[2, 3]]
    assert m.snapshot()["benched"] == [2, 3] and m.snapshot()["quarantined"] == {"hostB": False}
    # it does not come back by itself: a worker of it registering again (a new incarnation) is refused
    back = register(m, 32, 2, "hostB", "again2", 20.0)
    assert sent(back, P.FENCED) and "fenced for corruption" in logged(back) and m.benched == [2, 3]
    assert not sent(back, P.GENERATION)
    # a second report naming it (an older generation's, or the same one again) changes nothing
    assert not sent(report(m, 3, "hostB", generation=1, by=11), P.STOP)
    # the operator starts its agent again ('fleet restart --host hostB'): its workers grow the job back
    hello = agent(m, 30, "hostB", (2, 3), 40.0)
    assert "host hostB, fenced for corruption, is back" in logged(hello) and not sent(hello, P.STOP)
    grown = register(m, 42, 2, "hostB", "new2", 41.0)
    assert "worker_2, worker_3 back on hostB: generation 2 grows to 6 of 6 workers" in logged(grown)
    assert "quarantined" not in m.snapshot()


def test_a_fenced_hosts_agent_that_never_got_its_stop_is_stopped_when_it_comes_back() -> None:
    m = job(min_workers=4)
    m.lost(2, "connection closed", 4.0)  # hostB's agent is cut off (its workers still report through the net)
    out = report(m, 2, "hostB")
    assert "shrinking to 4 of 6 workers" in logged(out) and not sent(out, P.STOP)
    assert m.snapshot()["quarantined"] == {"hostB": True}
    restored = job(min_workers=4)
    restored.restore(m.snapshot(), 6.0)  # what a restarted scheduler reads back keeps it out
    assert restored.corrupt.quarantined == {"hostB": True} and restored.benched == [2, 3]
    first = agent(m, 30, "hostB", (2, 3), 8.0)  # the fenced agent itself reconnects: told to stop
    assert [(s.peer, s.close) for s in sent(first, P.STOP)] == [(30, True)] and "refused the agent" in logged(first)
    second = agent(m, 31, "hostB", (2, 3), 50.0)  # one started again after it stopped: the operator's
    assert not sent(second, P.STOP) and "is back" in logged(second)


def test_an_elastic_job_below_min_workers_stops_with_one_line_saying_why_it_could_not_shrink() -> None:
    m = job(min_workers=5)
    out = report(m, 4, "hostC")
    assert Exit(1) in out and not sent(out, P.FORMED)
    failed = [a.text for a in out if isinstance(a, Log) and "failed" in a.text]
    assert failed == ["job job failed: host hostC is fenced: found corrupt twice by the replica check (rank 4 on "
                      "hostC; the second time in steps 13-16), and no spare is free to take over hostC (spares with "
                      "an agent: none); add a host to the inventory's [spares], deploy and train; not shrinking "
                      "instead: 4 workers would be left, below --min-workers 5 (TOOLKIT_MIN_WORKERS)"]


def test_a_free_spare_is_preferred_to_shrinking() -> None:
    m = job(min_workers=4, spares=("s1",))
    agent(m, 7, "s1", (), 1.0, spare=True)
    out = report(m, 2, "hostB")
    assert [(t.peer, t.fields["host"]) for t in sent(out, P.TAKEOVER)] == [(7, "hostB")]
    assert not [a for a in out if isinstance(a, Note) and a.kind == "shrink"] and m.benched == []
    assert "host hostB replaced by spare s1" in logged(out)


def test_a_host_named_again_after_its_rank_was_relaunched_is_fenced_and_the_count_survives_a_restart() -> None:
    """A rank's own count of findings lives in its process: relaunched, it reports `healed` again for the same host.
    The scheduler's count (persisted with its state) makes the second finding fence the host all the same."""
    m = spare_job()
    assert not sent(report(m, 2, "hostB", action="healed"))  # found once: healed in place
    assert not sent(report(m, 0, "nowhere", action="healed"))  # a host the roster does not know is not counted
    assert not sent(report(m, 0, "hostA", action="rolled back"))  # no majority: no one named
    assert m.corrupt.counts == {"hostB/2": 1} and m.snapshot()["corrupt"] == {"hostB/2": 1}
    restarted = Membership("job", 4, 30.0, 60.0, "boot2", "10.0.0.1:8118", {}, 6.0)
    restarted.restore(m.snapshot(), 6.0)  # a scheduler started again reads the count back
    assert restarted.corrupt.counts == {"hostB/2": 1}
    assert not sent(report(m, 3, "hostB", action="healed"))  # another rank of the host, found once: healed too
    out = report(m, 2, "hostB", action="healed")  # rank 2's process, relaunched, counts this as its first finding
    assert [(t.peer, t.fields["host"]) for t in sent(out, P.TAKEOVER)] == [(3, "hostB")]
    assert ("host hostB replaced by spare s1: fenced: found corrupt 2 times by the replica check (rank 2 on hostB; "
            "the last time in steps 13-16)") in logged(out)
    assert not m.corrupt.counts  # replaced for good: nothing left to count
    with pytest.raises(ValueError, match="corrupt: not a map"):
        read_corrupt({"hostB": 0})


def test_a_malformed_report_is_logged_and_changes_nothing() -> None:
    """A report that does not parse (messages.Corruption) or names ranks the job does not have: one line, no count,
    no fencing; the worker is still heard (any message is a sign of life)."""
    m = spare_job()
    for bad in ({"action": "fenced twice"}, {"ranks": [7]}):
        out = m.message(10, {"op": P.CORRUPTION, "generation": 0, "step": 16, "since": 12, "ranks": [2],
                             "hosts": ["hostB"], "action": P.CORRUPT_FENCED, **bad}, 9.0)
        assert not sent(out) and not [a for a in out if isinstance(a, Note)], bad
        assert "worker_0 sent a malformed 'corruption'" in logged(out), logged(out)
        assert m.roster.members[0].last_seen == 9.0
    assert not m.corrupt.counts and m.roster.replaced_by("hostB") is None
