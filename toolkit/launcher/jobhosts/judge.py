"""How each host stands, judged from what was read there: its agent's document (toolkit.contracts.agentdoc.AgentDoc, as
`agent status` or the poll script gave it) and the scheduler's live.json. Pure: the reading is
toolkit.launcher.jobhosts.poll's (and `status`'s); processes follow the job record, not the document."""

from __future__ import annotations

from typing import Any, Mapping

from toolkit.contracts import protocol
from toolkit.contracts.agentdoc import FINAL_STATES, AgentDoc, AgentState, ProcDoc, ProcState, Takeover
from toolkit.contracts.jobrecord import JobRecord
from toolkit.contracts.protocol import RECOVERY_IN_PLACE, RECOVERY_RESTART
from toolkit.launcher.jobhosts.view import OTHER_JOB, HostStatus, ProcStatus, number
from toolkit.launcher.remote import HostResult
from toolkit.printable import clean


def host_statuses(record: JobRecord, results: Mapping[str, HostResult[dict[str, Any]]]) -> list[HostStatus]:
    """Each polled host's HostStatus (in the order of `results`), the scheduler's live figures (read on its host)
    joined into every host's workers."""
    live = next((r.value["live"] for r in results.values() if r.ok and r.value and r.value.get("live")), None)
    return [_host_status(record, name, r, live) for name, r in results.items()]


def _host_status(record: JobRecord, name: str, result: HostResult[dict[str, Any]],
                 live: Mapping[str, Any] | None = None) -> HostStatus:
    """A host's HostStatus from its fan-out result and the scheduler's live document. Processes follow the record,
    not the document: one the agent does not mention shows as "not started" (no agent ever ran) or "unknown";
    with the agent gone, every process not in a final state shows as "gone"."""
    expected = [p for p in record.processes if p["host"] == name]
    if not result.ok or result.value is None:
        procs = tuple(_proc(name, p, None, "unreachable", None, {}) for p in expected)
        return HostStatus(name, False, result.error, "unreachable", False, None, None, None, procs)
    doc: AgentDoc = result.value["doc"]
    now, mtimes = result.value["now"], result.value["mtimes"]
    if doc.job_id and record.job_id and doc.job_id != record.job_id:  # not this job: show none of it
        procs = tuple(_proc(name, p, None, OTHER_JOB, None, {}) for p in expected)
        return HostStatus(name, True, None, OTHER_JOB, bool(doc.alive), None, None, None, procs,
                          other_job=clean(doc.job_dir or "its job directory", 400))
    agent = str(doc.state or AgentState.ABSENT)
    alive = bool(doc.alive)
    seen = {p.node_id: p for p in doc.processes}
    procs = []
    for p in expected:
        got = seen.get(p["node_id"])
        state = str(got.state if got and got.state else ("not started" if agent == AgentState.ABSENT else "unknown"))
        if agent == AgentState.GONE and state not in FINAL_STATES:
            state = AgentState.GONE.value
        figures = _live_rank(live, p)
        if (state == ProcState.RUNNING and got and (got.restarts or 0) > 0 and live is not None and live.get("ranks")
                and figures.get("pid") != got.pid):
            # relaunched by its agent, not yet back with the scheduler (no heartbeat yet)
            state = ProcState.RESTARTING.value
        procs.append(_proc(name, p, got, state, now, mtimes, figures))
    return HostStatus(name, True, None, agent, alive, doc.agent.pid if doc.agent else None, doc.reason,
                      doc.failure.to_dict() if doc.failure else None, tuple(procs), doc.updated_at,
                      live=result.value.get("live"), took_over=_takeovers(name, doc.took_over))


def _live_rank(live: Mapping[str, Any] | None, p: Mapping[str, Any]) -> Mapping[str, Any]:
    """The scheduler's figures for the worker `p` (live.json's entry for its rank, if that is this node), or {}."""
    if live is None or p["rank"] is None:
        return {}
    entry = (live.get("ranks") or {}).get(str(p["rank"]))
    return entry if isinstance(entry, dict) and entry.get("node_id") == p["node_id"] else {}


def _takeovers(name: str, took: tuple[Takeover, ...]) -> tuple[dict[str, Any], ...]:
    """A spare agent's `took_over` list as {host, by: `name`, node_ids, seq} (AgentDoc.parse dropped the malformed
    entries)."""
    return tuple({"host": t.host, "by": name, "node_ids": list(t.node_ids), "seq": t.seq} for t in took)


def _proc(host: str, p: Mapping[str, Any], got: ProcDoc | None, state: str, now: float | None,
          mtimes: Mapping[str, float], figures: Mapping[str, Any] | None = None) -> ProcStatus:
    """One process's ProcStatus: the recorded identity `p`, what the agent says of it (`got`), its log's age
    by the host's clock (None without a clock or a log), and the scheduler's `figures` for it (live.json). A pid
    is shown only while the host can be asked and the agent is not gone; an unknown recovery mode is dropped; the
    step is the later of the agent's and the scheduler's."""
    figures = figures or {}
    log_name = p["log"].rsplit("/", 1)[-1]
    age = None
    if now is not None and log_name in mtimes:
        age = max(0.0, now - mtimes[log_name])
    last = got.last_exit if got else None
    how = None
    if last is not None:  # its first cause when the agent found one (the script's error, the fencing)
        how = clean(last.cause, 400) if last.cause is not None else (
            f"killed by {last.signal}" if last.signal else
            f"left for the job's restart (exit code {last.code})" if last.code == protocol.EXIT_REJOIN else
            f"exit code {last.code}")
    relaunched = max(0, got.relaunched or 0) if got else 0
    steps = [v for v in (got.step if got else None, figures.get("step"))
             if protocol.is_int(v)]
    score = number(figures.get("score"))
    straggler = round(1 / score, 2) if figures.get("straggler") is True and score else None
    return ProcStatus(
        host=host,
        node_id=p["node_id"],
        role="worker" if p["rank"] is not None else "sched",
        rank=p["rank"],
        pid=got.pid if got and state not in (AgentState.GONE, "unreachable") else None,
        state=state,
        restarts=max(0, (got.restarts or 0) - relaunched) if got else 0,
        relaunched=relaunched,
        step=max(steps) if steps else None,
        log_age=age,
        last_exit=how,
        recovery=got.recovery if got and got.recovery in (RECOVERY_IN_PLACE, RECOVERY_RESTART) else None,
        steps_per_s=number(figures.get("steps_per_s")),
        loss=number(figures.get("loss")),
        heartbeat_age=number(figures.get("heartbeat_age")) if state == ProcState.RUNNING else None,
        straggler=straggler,
        no_step_for=number(figures.get("no_step_for")) if state == ProcState.RUNNING else None,
        repeating=_repeating(got.same_failure if got else None),
    )


def _repeating(same: Any) -> str | None:
    """The agent's `same_failure` ({times, step, code, signal, cause}: a process failing again and again the same
    way) as words, or None."""
    if not isinstance(same, dict) or not isinstance(same.get("times"), int):
        return None
    how = clean(same["cause"], 400) if isinstance(same.get("cause"), str) else (
        f"killed by {clean(same['signal'], 40)}" if same.get("signal") else f"exit code {same.get('code')}")
    step = same.get("step")
    where = f"at step {step}" if isinstance(step, int) else "before reporting any step"
    return f"failed {same['times']} times in a row {where}, each time with {how}: it does not get past it"
