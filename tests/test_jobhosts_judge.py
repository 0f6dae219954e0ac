"""How `fleet` judges each host from what it read there (toolkit.launcher.jobhosts.judge): pure, so every rule is
checked here on documents as the agent writes them (toolkit.contracts.agentdoc), without a host."""

from __future__ import annotations

from typing import Any

from toolkit.contracts.agentdoc import AgentDoc, judge
from toolkit.launcher.jobhosts.judge import host_statuses
from toolkit.launcher.jobhosts.view import OTHER_JOB
from toolkit.launcher.remote import HostResult
from toolkit.testing.records import two_host_record


def _read(host: str, doc: dict[str, Any] | None, running: tuple[int, int] | None = None,
          live: dict | None = None) -> HostResult:
    """What the poll gives for a host: agent.json (None: there is none) judged against the running agent."""
    judged = judge(AgentDoc.from_obj(doc) if doc is not None else None, running)
    return HostResult(host, True, value={"doc": judged, "live": live, "now": 100.0,
                                         "mtimes": {"worker_0.log": 90.0}})


def _doc(state: str, procs: dict[str, dict], **more: Any) -> dict[str, Any]:
    return {"version": 1, "state": state, "agent": {"pid": 50, "start_ticks": 7},
            "processes": [{"node_id": n, **p} for n, p in procs.items()], **more}


def test_unreachable_gone_and_never_started() -> None:
    results = {"a": HostResult("a", False, error="a: connection refused"),
               "b": _read("b", _doc("running", {"worker_1": {"state": "running", "pid": 9}}))}  # agent not running
    a, b = host_statuses(two_host_record(), results)
    assert (a.agent, a.reached, a.error) == ("unreachable", False, "a: connection refused")
    assert [p.state for p in a.processes] == ["unreachable", "unreachable"]
    assert (b.agent, b.alive) == ("gone", False)
    assert [(p.state, p.pid) for p in b.processes] == [("gone", None)]  # no pid shown for a gone agent's process
    (absent,) = host_statuses(two_host_record(), {"b": _read("b", None)})
    assert absent.agent == "absent" and absent.processes[0].state == "not started"
    (final,) = host_statuses(two_host_record(), {"b": _read("b", _doc("stopped", {"worker_1": {"state": "stopped"}}))})
    assert (final.agent, final.processes[0].state) == ("stopped", "stopped")


def test_the_scheduler_figures_join_the_agent_view() -> None:
    live = {"ranks": {"0": {"node_id": "worker_0", "pid": 10, "step": 7, "score": 0.5, "straggler": True,
                            "steps_per_s": 2.0, "heartbeat_age": 0.5},
                      "1": {"node_id": "worker_1", "pid": 21, "step": 3}}}
    a_doc = _doc("running", {"sched": {"state": "running", "pid": 9},
                             "worker_0": {"state": "running", "pid": 10, "step": 6, "recovery": "in-place"}})
    b_doc = _doc("running", {"worker_1": {"state": "running", "pid": 22, "restarts": 1, "step": 4,
                                          "last_exit": {"code": None, "signal": "SIGKILL", "cause": None}}})
    rows = {p.node_id: p for h in host_statuses(two_host_record(), {"a": _read("a", a_doc, (50, 7), live),
                                                            "b": _read("b", b_doc, (50, 7))})
            for p in h.processes}
    w0, w1 = rows["worker_0"], rows["worker_1"]
    assert (w0.step, w0.straggler, w0.steps_per_s, w0.recovery, w0.log_age) == (7, 2.0, 2.0, "in-place", 10.0)
    assert (w1.state, w1.step, w1.last_exit) == ("restarting", 4, "killed by SIGKILL")  # a new pid, not back yet


def test_takeovers_failure_and_another_project() -> None:
    took = [{"host": "a", "node_ids": ["worker_0"], "seq": 2, "at": "t"}, {"host": "a", "node_ids": [0], "seq": 3},
            {"host": "a", "node_ids": ["worker_0"]}]
    failure = {"host": "b", "node_id": "worker_1", "rank": 1, "log_tail": ["boom"], "restarts": 3}
    (b,) = host_statuses(two_host_record(), {"b": _read("b", _doc("failed", {}, took_over=took, failure=failure,
                                                           reason="gave up"), (50, 7))})
    assert b.took_over == ({"host": "a", "by": "b", "node_ids": ["worker_0"], "seq": 2},)  # malformed ones dropped
    assert b.failure is not None and b.failure["log_tail"] == ["boom"] and b.failure["cause"] is None
    assert (b.agent, b.reason, b.agent_pid) == ("failed", "gave up", 50)
    (other,) = host_statuses(two_host_record("mine"), {"b": _read("b", _doc("running", {}, job_id="theirs",
                                                                     job_dir="/w/b/job"), (50, 7))})
    assert (other.agent, other.other_job, [p.state for p in other.processes]) == (OTHER_JOB, "/w/b/job", [OTHER_JOB])


def test_join_does_not_count_a_host_an_elastic_job_goes_on_without_as_its_failure() -> None:
    """Issue 42: a host lost for hours (unreachable) or fenced (its agent stopped) while an elastic job trains on
    without it must neither stop the survivors (`--join` stops a failing job after the grace) nor make a job whose
    every served worker exited 0 a failure; without the scheduler's word, the same host is the job's failure."""
    from toolkit.launcher.jobhosts.follow import JOIN_GONE_AFTER, _Watch, benched_hosts
    from toolkit.launcher.jobhosts.view import HostStatus

    record = two_host_record()
    shrunk = {"elastic": {"workers": 1, "world_size": 2, "logical_world": 2, "logical": {"worker_0": [0, 1]}}}
    assert benched_hosts(record, shrunk) == {"b"}
    for hostile in ({}, {"elastic": None}, {"elastic": {"logical": ["worker_0"]}}, {"elastic": "x"}):
        assert benched_hosts(record, hostile) == set()

    def poll(live: dict[str, Any] | None, b_agent: str) -> list[HostStatus]:
        return [HostStatus("a", True, None, "running", True, 1, None, live=live),
                HostStatus("b", b_agent != "unreachable", None, b_agent, False, 1, None)]

    for live, failing in ((shrunk, False), ({"elastic": None}, True)):
        watch = _Watch()
        watch.take(record, poll(live, "unreachable"), 0.0)
        watch.take(record, poll(live, "unreachable"), JOIN_GONE_AFTER + 1)
        assert "b" in watch.unwatched
        states = watch.states(record)
        watch.settle_passed(states, JOIN_GONE_AFTER + 1, 0.0)
        assert watch.settle_passed(states, JOIN_GONE_AFTER + 1000, 0.0) is failing
    watch = _Watch()
    watch.take(record, poll(shrunk, "stopped"), 0.0)
    assert watch.settle_passed(watch.states(record), 1000.0, 0.0) is False
