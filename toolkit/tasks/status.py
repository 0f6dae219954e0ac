"""`status`: every process of the job as its host's agent sees it, from the agents' own files, as a table or JSON.

Two ways to ask a host, judged by the same rule (toolkit.agentdoc): `status` runs the agent's own `status` command
(STATUS_SCRIPT); the pollers (`train` before starting, `train --join`, `restart`) read the agent's files with
POLL_SCRIPT, starting no Python. Either way one bounded command per host (STATUS_TIMEOUT); the agent is asked,
never its processes, and a host that cannot be asked becomes a row saying so rather than an exception.

The scheduler host's command also reads the scheduler's live.json (toolkit.rundoc): the generation, each rank's
pace, loss and heartbeat age, the stragglers and the last incident, which the agents cannot know."""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from rich.markup import escape
from rich.table import Table

from toolkit import agentdoc, jobrecord, rundoc
from toolkit.agentdoc import FINAL_STATES, AgentDoc, AgentState, BadDocument, ProcDoc, ProcState, Takeover
from toolkit.errors import UserError
from toolkit.jobrecord import HostRecord, JobRecord
from toolkit.printable import clean
from toolkit.protocol import RECOVERY_IN_PLACE, RECOVERY_RESTART
from toolkit.remote import (
    ClusterError,
    Host,
    HostPool,
    HostResult,
    SshSettings,
    run_on_all,
)
from toolkit.settings import JobRef
from toolkit.tasks.hosts import (
    STATUS_TIMEOUT,
    host_target,
    load_record,
    record_ssh,
)
from toolkit.tasks.output import dash, human_age, say, table_console
from toolkit.tasks.scripts import POLL_SCRIPT, STATUS_SCRIPT, clock_and_logs


@dataclass(frozen=True)
class ProcStatus:
    """One process as its host's agent sees it."""

    host: str
    node_id: str
    role: str  # "sched" or "worker"
    rank: int | None
    pid: int | None
    state: str  # the agent's (running, backoff, restarting, succeeded, failed, stopped), or gone, unreachable
    restarts: int
    step: int | None
    log_age: float | None  # s since its log was last written, by the host's clock
    last_exit: str | None  # "exit code 3", "killed by SIGKILL"
    recovery: str | None = None  # how the worker said it recovers (protocol.RECOVERY_*), once it has
    steps_per_s: float | None = None  # the scheduler's figures (live.json) for this worker, while it reports
    loss: float | None = None
    heartbeat_age: float | None = None  # s since the scheduler last heard from it
    straggler: float | None = None  # named a straggler: its own work per step over the others' median
    repeating: str | None = None  # it keeps failing the same way: how (the agent's policy.repeated_failure)

    @property
    def prefix(self) -> str:
        """`host:role:rank`, what every line of output about this process starts with."""
        return f"{self.host}:{self.role}:{dash(self.rank)}"


@dataclass(frozen=True)
class HostStatus:
    """One host as its agent's files show it: the agent's state and whether it still runs, why it ended, the
    give-up evidence (`failure`: node, rank, pid, status, restarts, log tail), and one ProcStatus per process
    the record places there (`reached` False: the host could not be asked, see `error`)."""

    host: str
    reached: bool
    error: str | None  # why the host could not be asked
    agent: str  # the agent's state (starting, running, finishing, stopping, succeeded, failed, stopped), gone,
    # absent (never started), unreachable
    alive: bool
    agent_pid: int | None
    reason: str | None  # why the agent ended
    failure: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)  # the give-up evidence
    processes: tuple[ProcStatus, ...] = ()
    updated_at: str | None = None  # when the agent last wrote its state (the host's clock)
    live: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)  # the scheduler host's
    # live.json (toolkit.rundoc), if this host runs the scheduler and it could be read
    took_over: tuple[Mapping[str, Any], ...] = field(default=(), hash=False, compare=False)  # a spare's takeovers:
    # {host (the lost one), by (this one), node_ids, seq}, as its agent recorded them
    other_job: str | None = None  # the job directory holds another project's job of this name (where it is from)


def live_path(record: JobRecord) -> tuple[str, str]:
    """The host that runs the scheduler and the path there of its live.json (in MS_RECOVERY_PATH, which the plan
    puts in `<job dir>/recovery`)."""
    name = record.process("sched")["host"]
    return name, posixpath.join(record.host(name).job_dir, "recovery", rundoc.LIVE_FILE)


def job_live(hosts: list[HostStatus]) -> Mapping[str, Any] | None:
    """The scheduler's live.json as the scheduler host's status read it, or None."""
    return next((h.live for h in hosts if h.live is not None), None)


def status(ref: JobRef, as_json: bool = False) -> None:
    """One table of every process of the job (or JSON); a host that cannot be asked gets a row saying so, and
    the command then ends non-zero after listing the failed hosts.

    The job's layout is the spares' word: a spare whose agent took over a lost host's ranks shows them, and the job
    record is updated to say so (`settle_layout`); a replaced host is no longer asked (it is fenced from the job),
    only named in a note. The table goes to stdout, notes per host (agent gone, never started, failed, stopped,
    replaced) and the recovery mode to stderr. Raises ClusterError (after printing) if any host still part of the job
    could not be asked; UserError from load_record."""
    record = load_record(ref)
    sched, live = live_path(record)
    results = run_on_all([host_target(h, record.local) for h in record.live_hosts],
                         lambda host: _fetch_status(host, record.host(host.name), live if host.name == sched else ""),
                         record_ssh(record, ref.request.core))
    record, hosts = settle_layout(record, results, ref.project)
    results = {name: r for name, r in results.items() if name in {h.host for h in hosts}}
    if as_json:
        print(json.dumps(_status_json(record, hosts), indent=2))
    else:
        _print_status(record, hosts)
    if any(not r.ok for r in results.values()):
        raise ClusterError(results)


def collect_status(record: JobRecord, ssh: SshSettings, pool: HostPool | None = None,
                   hosts: list[HostRecord] | None = None, project: Path | None = None
                   ) -> tuple[JobRecord, list[HostStatus]]:
    """Every host's status from its agent's files (cheap enough to poll; see POLL_SCRIPT), and the record with the
    layout the spares report (`settle_layout`; saved where `project` finds it, if given).

    `hosts` limits it to some of the record's hosts (default: those not replaced); `pool` keeps the connections for
    the next poll. Never raises for a host's failure: that host's status says `unreachable`, with the error. In the
    order of `hosts`, less any found replaced."""
    chosen = list(record.live_hosts) if hosts is None else hosts
    sched, live = live_path(record)
    results = run_on_all([host_target(h, record.local) for h in chosen],
                         lambda host: poll_status(host, record.host(host.name), live if host.name == sched else ""),
                         ssh, pool=pool)
    return settle_layout(record, results, project)


def settle_layout(record: JobRecord, results: Mapping[str, HostResult[dict[str, Any]]],
                  project: Path | None = None) -> tuple[JobRecord, list[HostStatus]]:
    """The record after the takeovers the spares' agents report (JobRecord.with_takeovers), and each host's status
    judged by it; a host found replaced is left out. When the layout changed and `project` is given, the record is
    rewritten (jobrecord.update) so that every later command sees the spare holding the ranks."""
    hosts = host_statuses(record, results)
    takeovers = [t for h in hosts for t in h.took_over]
    new = record.with_takeovers(takeovers)
    if new == record:
        return record, hosts
    if project is not None:
        jobrecord.update(project, new)
        for h in new.hosts:
            if h.replaced_by and record.host(h.name).replaced_by is None:
                say(f"{h.name} was replaced by spare {h.replaced_by}, which runs its ranks now; job record updated")
    return new, [h for h in host_statuses(new, results) if new.host(h.host).replaced_by is None]


def host_statuses(record: JobRecord, results: Mapping[str, HostResult[dict[str, Any]]]) -> list[HostStatus]:
    """Each polled host's HostStatus (in the order of `results`), the scheduler's live figures (read on its host)
    joined into every host's workers."""
    live = next((r.value["live"] for r in results.values() if r.ok and r.value and r.value.get("live")), None)
    return [_host_status(record, name, r, live) for name, r in results.items()]


def _fetch_status(host: Host, h: HostRecord, live_file: str = "") -> dict[str, Any]:
    """{"doc": the agent's status document (an AgentDoc), "live": live.json's document or None, "now", "mtimes"} from
    STATUS_SCRIPT (`python -m toolkit.agent status` on the host; `live_file` only on the scheduler's host). Raises
    what run(check=True) raises, and UserError if the agent's answer is not JSON."""
    out = host.run(["sh", "-c", STATUS_SCRIPT, "sh", h.python, h.job_dir, live_file], timeout=STATUS_TIMEOUT,
                   check=True)
    doc_text, live_text, rest = (out.stdout.split("\x1e\n", 2) + ["", ""])[:3]
    try:
        doc = AgentDoc.parse(doc_text)
    except BadDocument:
        raise UserError(f"{h.name}: the agent's status is not JSON: {doc_text.strip()[:200]}") from None
    return {"doc": doc, "live": rundoc.read_live(live_text), **clock_and_logs(rest)}


def poll_status(host: Host, h: HostRecord, live_file: str = "") -> dict[str, Any]:
    """The agent's files, judged as `agent status` judges them (toolkit.agentdoc): no Python started on the host.

    Returns {"doc", "live", "now", "mtimes"} like `_fetch_status`; `doc.alive` is True only if the pid file
    names a live process with the recorded start time that wrote agent.json. An unreadable agent.json counts as
    absent. Raises what run(check=True) raises."""
    out = host.run(["sh", "-c", POLL_SCRIPT, "sh", h.job_dir, live_file], timeout=STATUS_TIMEOUT, check=True).stdout
    pid_text, stat_text, doc_text, live_text, rest = (out.split("\x1e\n", 4) + ["", "", "", ""])[:5]
    try:
        doc = AgentDoc.parse(doc_text) if doc_text.strip() else None
    except BadDocument:
        doc = None  # written atomically, so this is not a half-written file: treat as unknown
    record = agentdoc.pid_record(pid_text)
    running = record if record is not None and agentdoc.stat_matches(record, stat_text) else None
    return {"doc": agentdoc.judge(doc, running),
            "live": rundoc.read_live(live_text), **clock_and_logs(rest)}


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
            state = "restarting"  # relaunched by its agent, not yet back with the scheduler (no heartbeat yet)
        procs.append(_proc(name, p, got, state, now, mtimes, figures))
    return HostStatus(name, True, None, agent, alive, doc.agent.pid if doc.agent else None, doc.reason,
                      doc.failure.to_dict() if doc.failure else None, tuple(procs), doc.updated_at,
                      live=result.value.get("live"), took_over=_takeovers(name, doc.took_over))


OTHER_JOB = "another project's"  # the state of a host (and its processes) whose job directory is not this job's


def _live_rank(live: Mapping[str, Any] | None, p: Mapping[str, Any]) -> Mapping[str, Any]:
    """The scheduler's figures for the worker `p` (live.json's entry for its rank, if that is this node), or {}."""
    if live is None or p["rank"] is None:
        return {}
    entry = (live.get("ranks") or {}).get(str(p["rank"]))
    return entry if isinstance(entry, dict) and entry.get("node_id") == p["node_id"] else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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
            f"killed by {last.signal}" if last.signal else f"exit code {last.code}")
    steps = [v for v in (got.step if got else None, figures.get("step"))
             if isinstance(v, int) and not isinstance(v, bool)]
    score = _number(figures.get("score"))
    straggler = round(1 / score, 2) if figures.get("straggler") is True and score else None
    return ProcStatus(
        host=host,
        node_id=p["node_id"],
        role="worker" if p["rank"] is not None else "sched",
        rank=p["rank"],
        pid=got.pid if got and state not in ("gone", "unreachable") else None,
        state=state,
        restarts=(got.restarts or 0) if got else 0,
        step=max(steps) if steps else None,
        log_age=age,
        last_exit=how,
        recovery=got.recovery if got and got.recovery in (RECOVERY_IN_PLACE, RECOVERY_RESTART) else None,
        steps_per_s=_number(figures.get("steps_per_s")),
        loss=_number(figures.get("loss")),
        heartbeat_age=_number(figures.get("heartbeat_age")) if state == "running" else None,
        straggler=straggler,
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


# What each recovery mode means, and why a job runs in it: status says it in one line.
RECOVERY_WHY = {
    RECOVERY_IN_PLACE: "in place: the script uses toolkit.train, so after a fault the survivors re-form the group "
                       "and the replacement takes the state from a peer",
    RECOVERY_RESTART: "restart: the script initialises torch.distributed itself (a torchrun-style script), so a "
                      "fault relaunches every worker, which resume from the script's own checkpoints",
}


def recovery_mode(processes: list[ProcStatus], forced: bool = False) -> dict[str, str] | None:
    """The job's recovery mode as its workers reported it ({"mode", "why"}), None before any did."""
    modes = {p.recovery for p in processes if p.role == "worker" and p.recovery}
    if not modes:
        return None
    mode = RECOVERY_RESTART if RECOVERY_RESTART in modes else RECOVERY_IN_PLACE
    why = RECOVERY_WHY[mode]
    if forced and mode == RECOVERY_RESTART:
        why = "restart: --torchrun-script asks for it: a fault relaunches every worker"
    elif len(modes) > 1:
        why += " (some workers use toolkit.train, some do not: the job restarts as a whole)"
    return {"mode": mode, "why": why}


def _status_json(record: JobRecord, hosts: list[HostStatus]) -> dict[str, Any]:
    """`status --json`: the job, its scheduler, world size and recovery mode, the scheduler's live document (None
    until it wrote one), the hosts (without their processes) and every process, flat."""
    return {
        "job": record.job,
        "scheduler": {"host": record.scheduler_host, "port": record.sched_port},
        "world_size": record.world_size,
        "recovery": recovery_mode([p for h in hosts for p in h.processes], bool(record.options.get("torchrun_script"))),
        "live": job_live(hosts),
        "hosts": [{k: v for k, v in asdict(h).items() if k not in ("processes", "live", "took_over")} for h in hosts],
        "replaced": {h.name: h.replaced_by for h in record.hosts if h.replaced_by},
        "spares": [h.name for h in record.hosts if h.spare and not h.node_ids and not h.replaced_by],
        "processes": [asdict(p) for h in hosts for p in h.processes],
    }


# How a process's state stands out in the table (rich styles); states not listed are plain.
STATE_STYLE = {"running": "green", "succeeded": "green", "starting": "cyan", "connecting": "cyan",
               "restarting": "bold yellow", "backoff": "bold yellow", "stopping": "yellow", "failed": "bold red",
               "gone": "bold red", "unreachable": "bold red", "fenced": "bold red", "stopped": "magenta"}
LAGGING_AFTER = 5.0  # s without a heartbeat at the scheduler before a running worker's row says it lags


def status_table(record: JobRecord, hosts: list[HostStatus], title: str | None = None) -> Table:
    """One row per process: where it runs, its state as its agent sees it, and the scheduler's figures (step,
    steps/s, loss, heartbeat age; a straggler's factor). Shared by `status` and `status --watch`. Dead,
    restarting, fenced and unreachable states are coloured, and so are lagging workers (heartbeat older than
    LAGGING_AFTER while running) and stragglers."""
    live = job_live(hosts)
    if title is None:
        title = f"job {record.job}: {record.world_size} worker(s) on {len(record.live_hosts)} host(s), " \
                f"scheduler {record.scheduler_host}:{record.sched_port}"
        if live is not None:
            title += f", generation {live.get('generation')}"
    table = Table(title=title)
    right = ("rank", "pid", "restarts", "step", "steps/s", "loss", "heartbeat")
    for column in ("host", "node id", "rank", "pid", "state", "restarts", "step", "steps/s", "loss", "heartbeat",
                   "log age", "note"):
        table.add_column(column, justify="right" if column in right else "left")
    for h in hosts:
        for p in h.processes:
            note, style = process_note(p)
            table.add_row(p.host, p.node_id, dash(p.rank), dash(p.pid), f"[{STATE_STYLE.get(p.state, '')}]"
                          f"{escape(p.state)}" if p.state in STATE_STYLE else escape(p.state), str(p.restarts),
                          dash(p.step), _fixed(p.steps_per_s, 2), _fixed(p.loss, 4),
                          human_age(p.heartbeat_age) if p.heartbeat_age is not None else "-",
                          human_age(p.log_age), f"[{style}]{escape(note)}" if note else "")
    return table


def process_note(p: ProcStatus) -> tuple[str, str]:
    """What stands out about a process (a straggler and by how much, a lagging heartbeat, its last bad exit) and
    the style to show it in; ("", "") for nothing."""
    if p.straggler is not None:
        return f"straggler: {p.straggler:.2f}x the others' own work per step", "bold magenta"
    if p.state == "running" and p.heartbeat_age is not None and p.heartbeat_age > LAGGING_AFTER:
        return f"lagging: no heartbeat for {p.heartbeat_age:.0f} s", "bold yellow"
    if p.last_exit and p.last_exit != "exit code 0":
        return f"last exit: {p.last_exit}", "red" if p.state != "running" else "yellow"
    return "", ""


def _fixed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _print_status(record: JobRecord, hosts: list[HostStatus]) -> None:
    """The table on stdout (one row per process, unreachable ones included), then notes, the stragglers, the last
    incident and the recovery mode on stderr."""
    table_console().print(status_table(record, hosts))
    for h in hosts:
        note = _host_note(h)
        if note:
            say(note)
        for p in h.processes:
            if p.repeating:
                say(f"{p.prefix} ({p.node_id}): {p.repeating}")
    for line in live_lines(job_live(hosts)):
        say(line)
    for h in record.hosts:
        if h.replaced_by:
            say(f"{h.name}: replaced by spare {h.replaced_by}, which runs its ranks; the scheduler refuses its agent "
                "and workers (fenced)")
        elif h.spare and not h.node_ids:
            say(f"{h.name}: spare, standing by (it takes over a lost host's ranks)")
    mode = recovery_mode([p for h in hosts for p in h.processes], bool(record.options.get("torchrun_script")))
    if mode is not None:
        say(f"recovery: {mode['why']}")


def live_lines(live: Mapping[str, Any] | None) -> list[str]:
    """The scheduler's view in a few lines: each straggler (host, rank, by how much), the last incident (cause,
    processes, step, time to recover, steps recomputed) and the goodput so far. Empty without a live document."""
    if live is None:
        return []
    lines = [f"straggler: {s.get('node_id')} (rank {s.get('rank')}) on {s.get('host')}: its own work per step "
             f"takes {s.get('factor')}x the median of the others" for s in live.get("stragglers") or []
             if isinstance(s, dict)]
    inc = live.get("last_incident")
    if isinstance(inc, dict):
        recomputed = "" if inc.get("recomputed") is None else f", {inc['recomputed']} step(s) recomputed"
        procs, where = (", ".join(map(str, inc.get(k) or [])) for k in ("processes", "hosts"))
        at = f" at step {inc['step']}" if isinstance(inc.get("step"), int) else ""
        lines.append(f"last incident (#{inc.get('number')} of {live.get('incidents')}): {inc.get('cause')}: "
                     f"{procs} on {where}{at}; {recovery_text(inc, live)}{recomputed}")
    goodput = live.get("goodput")
    if isinstance(goodput, dict) and _number(goodput.get("goodput")) is not None:
        wall = human_age(_number(goodput.get("wall")))
        head = "goodput" if live.get("status") in ("finished", "failed") else "goodput so far"
        if goodput.get("basis") == "formations":
            lines.append(f"{head}: at most {100 * goodput['goodput']:.1f}% of {wall} (the script reports no steps: "
                         "toolkit.train.report(step, loss=...) makes it exact)")
        else:
            lines.append(f"{head}: {100 * goodput['goodput']:.1f}% of {wall}")
    return lines


def recovery_text(inc: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    """How an incident of live.json stands: recovered (every rank trains again) in how long; else whether its group
    formed again, and for a script that reports no steps that nothing more can be known; an incident the job ended
    without recovering from says so rather than "not recovered yet"."""
    took, formed = _number(inc.get("time_to_recover")), _number(inc.get("formed_in"))
    ended = live.get("status") in ("finished", "failed")
    if took is not None:
        return f"recovered in {took:.2f} s"
    if formed is not None and not live.get("reports_steps"):
        return (f"its group formed again {formed:.2f} s after the failure (the script reports no steps: when it "
                "trained again is not known)")
    if formed is not None:
        return f"its group formed again in {formed:.2f} s" + ("" if ended else ", not training again yet")
    return f"not recovered: the job {live.get('status')} first" if ended else "not recovered yet"


def _host_note(h: HostStatus) -> str | None:
    """What to tell the user about a host whose agent is gone, absent, failed or stopped (with what to do), or
    None; an unreachable host is left to the ClusterError that follows."""
    if not h.reached:
        return None  # listed by the error that follows
    if h.other_job is not None:
        return (f"{h.host}: {h.other_job} holds another project's job of this name"
                f"{' (running)' if h.alive else ''}, not this one: its processes are not shown, and no command of "
                "this project acts on it; deploy this job under another --job name (or --workdir)")
    if h.agent == "gone":
        return (f"{h.host}: the agent is gone (it stopped without finishing the job): its processes show as gone; "
                f"'fleet restart --host {h.host}' starts it again")
    if h.agent == "absent":
        return f"{h.host}: the job was never started here; 'fleet train' starts it"
    if h.agent == "failed":
        return f"{h.host}: failed: {h.reason or 'no reason recorded'}"
    if h.agent == "stopped":
        return f"{h.host}: stopped ({h.reason or 'by the operator'})"
    return None
