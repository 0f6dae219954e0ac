"""Reading the job's hosts: one bounded command per host (STATUS_TIMEOUT) that reads the agent's files with
POLL_SCRIPT, starting no Python there, judged by the rule `agent status` uses (toolkit.contracts.agentdoc). A host that
cannot be asked becomes a status saying so, never an exception; the spares' takeovers settle the job's layout
(`settle_layout`). Used by `train` before starting, `train --join`, `run`, `restart` and `status --watch`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from toolkit.contracts import agentdoc, jobrecord, rundoc
from toolkit.contracts.agentdoc import AgentDoc, BadDocument
from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.launcher.jobhosts.judge import host_statuses
from toolkit.launcher.jobhosts.output import say
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, host_target
from toolkit.launcher.jobhosts.scripts import POLL_SCRIPT, clock_and_logs
from toolkit.launcher.jobhosts.view import HostStatus, live_path
from toolkit.launcher.remote import (
    Host,
    HostPool,
    HostResult,
    SshSettings,
    run_on_all,
)


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


def poll_status(host: Host, h: HostRecord, live_file: str = "") -> dict[str, Any]:
    """The agent's files, judged as `agent status` judges them (toolkit.contracts.agentdoc): no Python started on the
    host.

    Returns {"doc", "live", "now", "mtimes"} as `status` reads them (tasks.status); `doc.alive` is True only if the
    pid file names a live process with the recorded start time that wrote agent.json. An unreadable agent.json
    counts as absent. Raises what run(check=True) raises."""
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
