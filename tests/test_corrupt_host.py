"""A host the replica check found corrupt twice (issue 44): the scheduler's decision on the `corruption` report whose
action is `fenced` (toolkit.scheduler.membership.fence_corrupt, spares.fenced_host_spare), driven with a fake clock.
Its ranks go to a free spare as `fleet replace` would send them; with none free, or on the scheduler's own host, the
job stops with one line naming the host. The flow on real hosts is tests/e2e/test_corruption_on_hosts.py."""

from __future__ import annotations

from typing import Any

from test_membership import logged, sent, spare_job

from toolkit.contracts import protocol as P
from toolkit.scheduler.membership import Exit, Membership, Note


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
            "host to the inventory's [spares], deploy and train") in logged(out)
    assert {s.peer for s in sent(out, P.STOP)} >= {1, 2, 10, 11, 12, 13}
    m = spare_job()
    out = report(m, 1, "hostA")
    assert Exit(1) in out and "host hostA is fenced" in logged(out)
    assert "host hostA runs the scheduler: it cannot be replaced while the job runs" in logged(out)
