"""`status`: every process of the job as its host's agent sees it, from the agents' own files, as a table or JSON.

Two ways to ask a host, judged by the same rule (toolkit.contracts.agentdoc): `status` runs the agent's own `status`
command (STATUS_SCRIPT); the pollers (toolkit.launcher.jobhosts.poll: `train` before starting, `train --join`,
`restart`) read the agent's files with POLL_SCRIPT, starting no Python. Either way one bounded command per host
(STATUS_TIMEOUT); the agent is asked, never its processes, and a host that cannot be asked becomes a row saying so
rather than an exception (toolkit.launcher.jobhosts.judge).

The scheduler host's command also reads the scheduler's live.json (toolkit.contracts.rundoc): the generation, each
rank's pace, loss and heartbeat age, the stragglers and the last incident, which the agents cannot know."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from toolkit.contracts import rundoc
from toolkit.contracts.agentdoc import AgentDoc, AgentState, BadDocument
from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.output import say, table_console
from toolkit.launcher.jobhosts.poll import settle_layout
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, host_target, load_record, record_ssh
from toolkit.launcher.jobhosts.scripts import STATUS_SCRIPT, clock_and_logs
from toolkit.launcher.jobhosts.tables import live_lines, recovery_lines, status_table
from toolkit.launcher.jobhosts.view import HostStatus, job_live, live_path, recovery_mode
from toolkit.launcher.remote import ClusterError, Host, run_on_all
from toolkit.launcher.settings import JobRef


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


def _status_json(record: JobRecord, hosts: list[HostStatus]) -> dict[str, Any]:
    """`status --json`: the job, its scheduler, world size and recovery mode, the scheduler's live document (None
    until it wrote one), the hosts (without their processes) and every process, flat."""
    return {
        "job": record.job,
        "scheduler": {"host": record.scheduler_host, "port": record.sched_port},
        "world_size": record.world_size,
        "recovery": recovery_mode([p for h in hosts for p in h.processes], bool(record.options.get("torchrun_script"))),
        "live": job_live(hosts),
        "elastic": (job_live(hosts) or {}).get("elastic"),  # a shrunk job's world (issue 42); None: the plain one
        "hosts": [{k: v for k, v in asdict(h).items() if k not in ("processes", "live", "took_over")} for h in hosts],
        "replaced": {h.name: h.replaced_by for h in record.hosts if h.replaced_by},
        "spares": [h.name for h in record.hosts if h.spare and not h.node_ids and not h.replaced_by],
        "processes": [asdict(p) for h in hosts for p in h.processes],
    }


def _print_status(record: JobRecord, hosts: list[HostStatus]) -> None:
    """The table on stdout (one row per process, unreachable ones included), then notes, the stragglers, the last
    incident and the recovery mode on stderr."""
    console = table_console()
    console.print(status_table(record, hosts, width=console.width))
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
        for line in recovery_lines(mode["why"], console.width):
            say(line)


def _host_note(h: HostStatus) -> str | None:
    """What to tell the user about a host whose agent is gone, absent, failed or stopped (with what to do), or
    None; an unreachable host is left to the ClusterError that follows."""
    if not h.reached:
        return None  # listed by the error that follows
    if h.other_job is not None:
        return (f"{h.host}: {h.other_job} holds another project's job of this name"
                f"{' (running)' if h.alive else ''}, not this one: its processes are not shown, and no command of "
                "this project acts on it; deploy this job under another --job name (or --workdir)")
    if h.agent == AgentState.GONE:
        return (f"{h.host}: the agent is gone (it stopped without finishing the job): its processes show as gone; "
                f"'fleet restart --host {h.host}' starts it again")
    if h.agent == AgentState.ABSENT:
        return f"{h.host}: the job was never started here; 'fleet train' starts it"
    if h.agent == AgentState.FAILED:
        return f"{h.host}: failed: {h.reason or 'no reason recorded'}"
    if h.agent == AgentState.STOPPED:
        return f"{h.host}: stopped ({h.reason or 'by the operator'})"
    return None
