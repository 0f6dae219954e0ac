"""agent.json's one definition (toolkit.contracts.agentdoc): the agent's writer gives the bytes the dict literals it
replaced gave, the reader gives back what was written, and a hostile file reads as one clear error or bounded fields."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from toolkit.agent import policy
from toolkit.agent.agentlog import AgentLog, iso
from toolkit.agent.slots import Slot
from toolkit.agent.supervisor import Agent
from toolkit.contracts import agentdoc
from toolkit.contracts.agentdoc import (
    AgentDoc,
    AgentState,
    BadDocument,
    ExitRecord,
    Failure,
    LinkState,
    ProcState,
    Takeover,
    judge,
    recorded_groups,
)
from toolkit.contracts.hostspec import HostSpec, ProcSpec, RestartPolicy
from toolkit.procs import ExitStatus


class _Child:
    """What Slot.document reads of a running incarnation."""

    def __init__(self, pid: int) -> None:
        self.pid = self.pgid = pid
        self.start_ticks = 4242


def _old_proc(slot: Slot, policy: RestartPolicy, exits: list[dict], same: dict | None) -> dict[str, Any]:
    """Slot.document as it was before the records (the dict literal, verbatim but for `exits`, given as dicts)."""
    c = slot.child
    return {
        "node_id": slot.spec.node_id, "role": slot.spec.role, "rank": slot.spec.rank,
        "local_rank": slot.spec.local_rank, "state": slot.state,
        "pid": c.pid if c else None, "pgid": c.pgid if c else None, "start_ticks": c.start_ticks if c else None,
        "last_pid": slot.last_pid, "last_start_ticks": slot.last_ticks,
        "started_at": iso(slot.started_wall), "warm": slot.warm if c else None,
        "restarts": max(0, slot.launches - 1), "counted_restarts": slot.counted,
        "max_restarts": policy.max_restarts, "next_start_at": iso(slot.next_start),
        "last_exit": exits[-1] if exits else None, "exits": exits,
        "step": slot.step, "epoch": slot.epoch, "step_at": iso(slot.step_at), "recovery": slot.recovery,
        "cpus": sorted(slot.cpus) if slot.cpus else None,
        "open_files": slot.files.document() if slot.files else None,
        "failed_at": slot.failed_at, "same_failure": same,
        "log_file": slot.spec.log_file, "argv": list(slot.spec.argv),
        "relaunched": slot.relaunched,  # added by issue 41 (the job's restarts of a healthy process, apart)
    }


def _old_agent(a: Agent, failure: dict | None, took: list[dict], procs: list[dict], updated: str) -> dict[str, Any]:
    """Agent.document (with WarmSpare.document) as it was before the records (verbatim but for the time and the
    parts given as dicts)."""
    sp = a.warm.spare
    return {
        "version": 1, "job": a.spec.job, "host": a.spec.host,
        "job_dir": str(a.spec.job_dir), "job_id": a.spec.job_id,
        "agent": {"pid": a.pid, "start_ticks": a.ticks, "started_at": iso(a.started), "python": sys.executable},
        "state": a.state, "reason": a.reason, "exit_code": a.exit_code, "updated_at": updated,
        "scheduler": {"address": f"{a.spec.sched_host}:{a.spec.sched_port}", "link": a.link.state,
                      "since": iso(a.link.since)},
        "warm_spare": {"enabled": a.warm.enabled, "pid": sp.child.pid if sp else None,
                       "ready": bool(sp and sp.ready), "held": bool(sp and sp.held)},
        "bind_core": a.spec.bind_core,
        "spare": a.spec.spare, "took_over": took,
        "processes": procs,
        "failure": failure,
    }


def _agent(tmp_path: Path) -> Agent:
    def proc(node: str, rank: int | None) -> ProcSpec:
        return ProcSpec(node, "worker" if rank is not None else "sched", rank, rank, ("python", "train.py", "--x"),
                        str(tmp_path), str(tmp_path / f"{node}.env"), str(tmp_path / f"{node}.log"))

    spec = HostSpec(job="golden", host="h1", job_dir=tmp_path, sched_host="127.0.0.1", sched_port=29400,
                    token_file=tmp_path / "token", policy=RestartPolicy(max_restarts=2), grace=1.0, bind_core=False,
                    warm_spare=False, processes=(proc("sched", None), proc("worker_0", 0)),
                    standby=(proc("worker_1", 1),), job_id="abc123")
    return Agent(spec, AgentLog(tmp_path / "agent.log", "h1"))


def test_the_writer_gives_the_bytes_of_the_old_dict_literals(tmp_path: Path) -> None:
    """A document with every part set (a running process, a failed one with judged exits and a repeated failure, a
    takeover, the give-up evidence), built by the agent's writer, is byte for byte what the dict literals wrote."""
    a = _agent(tmp_path)
    a.state, a.reason, a.exit_code = AgentState.FAILED, "worker_0 exit code 1 after 2 restarts", 1
    sched, worker = a.processes.slots["sched"], a.processes.slots["worker_0"]
    sched.child, sched.state, sched.launches, sched.started_wall = _Child(999), ProcState.RUNNING, 1, time.time()
    sched.last_pid, sched.last_ticks, sched.cpus = 999, 4242, frozenset({3, 1})
    worker.launches, worker.counted, worker.step, worker.epoch, worker.step_at = 3, 2, 5, 0, time.time()
    worker.recovery, worker.started_wall, worker.last_pid, worker.last_ticks = "in-place", time.time(), 1001, 77
    old_exits = []
    for pid in (1000, 1001):  # the real recording and judging of two failed exits
        worker.started_mono = time.monotonic()
        rec = a.processes.record_exit(worker, ExitStatus(1, None), pid, 5)
        old_exits.append({"code": 1, "signal": None, "pid": pid, "at": rec.at, "ran_for": rec.ran_for, "step": 5,
                          "cause": None, "failure": True})
        worker.judged(policy.GiveUp(2, 5), rec)
    worker.state = ProcState.FAILED
    assert worker.last_exit == worker.exits[-1] and worker.last_exit.failure
    same = policy.repeated_failure(old_exits)
    assert worker.same_failure == same
    old_failure = {"host": "h1", "node_id": "worker_0", "rank": 0, "pid": 1001, "code": 1, "signal": None,
                   "status": "exit code 1", "cause": "exit code 1", "restarts": 2, "log_file": worker.spec.log_file,
                   "log_tail": ["a", "b"], "at": iso(time.time())}
    a.processes.failure = Failure(**{**old_failure, "log_tail": ("a", "b")})
    old_took = [{"host": "h0", "node_ids": ["worker_1"], "seq": 3, "at": iso(time.time())}]
    a.took_over = [Takeover(**{**t, "node_ids": tuple(t["node_ids"])}) for t in old_took]

    doc = a.document()
    old = _old_agent(a, old_failure, old_took, [_old_proc(sched, a.spec.policy, [], None),
                                                _old_proc(worker, a.spec.policy, old_exits, same)], doc.updated_at)
    assert doc.to_json() == json.dumps(old, indent=1) + "\n"
    assert doc.to_dict() == old
    assert AgentDoc.parse(doc.to_json()) == doc  # the reader gives back what the writer wrote
    assert doc.state is AgentState.FAILED and doc.processes[1].state is ProcState.FAILED
    assert doc.scheduler is not None and doc.scheduler.link is LinkState.DOWN
    assert recorded_groups(doc.to_json()) == [("sched", 999, 4242), ("worker_0", 1001, 77)]


def test_an_exit_not_judged_has_no_failure_key() -> None:
    rec = ExitRecord(code=None, signal="SIGKILL", pid=7, at="t", ran_for=1.5, step=None, cause="declared dead")
    assert rec.to_dict() == {"code": None, "signal": "SIGKILL", "pid": 7, "at": "t", "ran_for": 1.5, "step": None,
                             "cause": "declared dead"}


def test_states_print_as_their_values() -> None:
    assert f"{AgentState.RUNNING}" == str(AgentState.RUNNING) == "running" and f"{ProcState.BACKOFF:>8}" == " backoff"
    assert json.dumps([AgentState.GONE, LinkState.UP]) == '["gone", "up"]'
    assert AgentState.parse("finishing") is AgentState.FINISHING and AgentState.parse("nope") is None
    assert AgentState.parse(["running"]) is None and AgentState.SUCCEEDED in agentdoc.FINAL_STATES
    assert "failed" in agentdoc.FINAL_STATES and {"gone": 1}[AgentState.GONE] == 1  # a value is its member


def test_judge() -> None:
    doc = AgentDoc(version=1, state=AgentState.RUNNING, agent=agentdoc.AgentInfo(10, 5, None, None))
    assert judge(doc, (10, 5)).alive is True and judge(doc, (10, 5)).state is AgentState.RUNNING
    gone = judge(doc, None)
    assert gone.state is AgentState.GONE and gone.alive is False and gone.to_dict()["alive"] is False
    assert judge(doc, (11, 5)).state is AgentState.GONE  # another process holds the pid file
    final = AgentDoc(state=AgentState.STOPPED, agent=agentdoc.AgentInfo(10, 5, None, None))
    assert judge(final, None).state is AgentState.STOPPED
    absent = judge(None, None)
    assert absent.to_dict() == {"state": "absent", "alive": False, "processes": []}
    assert list(agentdoc.replace(absent, version=1, job="j", host="h", job_id="x", job_dir="/d").to_dict()) == [
        "state", "alive", "processes", "version", "job", "host", "job_id", "job_dir"]


@pytest.mark.parametrize("text", ["", "nul", "[]", '"running"', "3", "[" * 100_000 + "]" * 100_000,
                                  '{"a": ' + "1" * 5000 + "}", b"\xff\xfe{", "{" * 50_000])
def test_not_a_document_is_one_clear_error(text: str | bytes) -> None:
    with pytest.raises(BadDocument) as err:
        AgentDoc.parse(text)
    assert "\n" not in str(err.value) and str(err.value).startswith("agent.json is not")
    assert recorded_groups(text if isinstance(text, str) else "") == []


def test_hostile_fields_read_as_none_and_stay_bounded() -> None:
    junk = {
        "version": True, "job": ["x"], "state": "pwned", "agent": {"pid": True, "start_ticks": "7"},
        "exit_code": 1.5, "updated_at": "x" * 10**6, "scheduler": "up", "warm_spare": {"enabled": 1},
        "took_over": [{"host": "h0", "node_ids": ["w"], "seq": 1}, {"host": "h0", "node_ids": [1], "seq": 2},
                      {"host": "h0", "node_ids": ["w"], "seq": True}, "junk"] + [{}] * 10_000,
        "processes": [{"node_id": "w", "pid": False, "state": "running", "exits": [{"code": 1}] * 1000,
                       "argv": ["a"] * 10**5, "cpus": [1, "2", True], "same_failure": {"times": 3, "x": {"y": 1}},
                       "last_exit": [1]}] + [{"node_id": "w"}] * 10**4 + [3, None],
        "failure": {"log_tail": ["l"] * 10**5 + [None], "rank": False},
    }
    doc = AgentDoc.parse(json.dumps(junk))
    assert (doc.version, doc.job, doc.state, doc.exit_code, doc.scheduler) == (None, None, None, None, None)
    assert doc.agent == agentdoc.AgentInfo(None, None, None, None) and doc.warm_spare.enabled is None
    assert len(doc.updated_at) == agentdoc.MAX_TEXT
    assert [t.seq for t in doc.took_over] == [1]  # malformed takeovers are dropped
    assert len(doc.processes) == agentdoc.MAX_ENTRIES
    p = doc.processes[0]
    assert p.pid is None and p.state is ProcState.RUNNING and len(p.exits) == agentdoc.MAX_EXITS
    assert len(p.argv) == agentdoc.MAX_ENTRIES and p.cpus == (1,) and p.same_failure == {"times": 3}
    assert all(q.node_id == "w" and q.exits == () for q in doc.processes[1:])
    assert p.last_exit is None
    assert len(doc.failure.log_tail) == agentdoc.MAX_ENTRIES and doc.failure.rank is None
    assert recorded_groups(json.dumps(junk)) == []  # no pgid with its start ticks anywhere
