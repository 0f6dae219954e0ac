"""`train --join`: wait for the job to end, printing each change; the evidence when it failed.

Remote state cannot be waited on, so the job is polled every JOIN_POLL_INTERVAL: one cheap command per host
(POLL_SCRIPT: the agent's files, no Python started) over connections kept open between polls (HostPool). An agent
on this machine (a local job) is also waited on: its exit, which ends its host's part of the job, wakes the wait
at once (a pidfd), so --join returns when the job ends, not up to an interval later. The exit status tells a
script what happened: 0 succeeded, 1 (JobFailed) failed, 3 (JobStopped) stopped by its operator, 130 (Interrupted)
stopped watching."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import select
import signal
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from toolkit.contracts import jobrecord
from toolkit.contracts.agentdoc import FINAL_STATES, AgentState, ProcState
from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.output import dash, emit, interrupt_sets, say
from toolkit.launcher.jobhosts.poll import collect_status
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, host_target
from toolkit.launcher.jobhosts.stopjob import stop_one
from toolkit.launcher.jobhosts.streams import RankFilter, streamed
from toolkit.launcher.jobhosts.tables import progress_line
from toolkit.launcher.jobhosts.view import HostStatus, ProcStatus, job_live
from toolkit.launcher.remote import (
    Host,
    HostPool,
    SshSettings,
    check_all,
    run_on_all,
)
from toolkit.printable import clean

FAILURE_TAIL_LINES = 10  # log lines shown for a process that ended badly, when its agent recorded none
JOIN_POLL_INTERVAL = 2.0  # s between status polls of `train --join`: remote state cannot be waited on otherwise
JOIN_GONE_AFTER = 60.0  # s a host may be unreachable, or its agent gone, before --join stops watching it
JOIN_PROGRESS_EVERY = 30.0  # s between the progress lines (step/total, bar, ETA) that --join prints
JOIN_SETTLE = 30.0  # s beyond the grace period that --join waits, after a host failed, for the others to stop
EXIT_JOB_FAILED = 1
EXIT_JOB_STOPPED = 3  # as the agent's own exit status for a stop (toolkit.agent.supervisor.EXIT_STOPPED)
EXIT_INTERRUPTED = 130


class JobFailed(UserError):
    """`train --join` saw the job end badly (or stop being observable); the message holds the evidence.

    Also raised when --join-timeout passes (the job keeps running). Exits 1. The user reads the evidence (which
    process, its exit status and last log lines), fixes the cause and runs `fleet train` again, or looks
    further with `fleet status` and `fleet logs`."""

    exit_code = EXIT_JOB_FAILED


class JobStopped(UserError):
    """`train --join` saw the job stopped by its operator (`fleet stop`) before it ended: no failure, but not a
    success either. Exits 3; `fleet train` (or `fleet run` again) resumes it from its checkpoints."""

    exit_code = EXIT_JOB_STOPPED
    prefix = ""


class Interrupted(UserError):
    """Ctrl-C while `train --join` waited: only the watching stopped, the job keeps running. Exits 130 (as a
    shell does after SIGINT); `fleet status` to look, `fleet stop` to end it."""

    exit_code = EXIT_INTERRUPTED


def join_job(record: JobRecord, ssh: SshSettings, timeout: float | None = None,
             interval: float = JOIN_POLL_INTERVAL, project: Path | None = None,
             stream: RankFilter | None = None) -> None:
    """Wait until the job ends, printing every change of state; return if every worker succeeded, else raise
    JobFailed with the evidence (node, host, exit status, log tail). A host that cannot be asked, or whose
    agent is gone, for JOIN_GONE_AFTER is no longer watched and counts as a failure. After a host failed, the
    others get the grace period and JOIN_SETTLE to stop (the scheduler stops them); what still runs then is
    stopped, so a failed job leaves nothing behind.

    Called by `train` with join. Every poll is bounded per host (STATUS_TIMEOUT, plus the SSH bounds); a failed
    poll only marks that host unreachable for that round. Raises UserError for a non-positive `timeout`,
    JobFailed when the job fails or `timeout` passes, Interrupted on Ctrl-C (main thread only), and ClusterError
    if stopping what still runs after a failure fails on some host. While it waits, the output of the workers
    `stream` chooses is printed as they write it (jobhosts.streams.streamed: `[rank1]: text`)."""
    if timeout is not None and timeout <= 0:
        raise UserError(f"--join-timeout {timeout:g}: give a positive number of seconds")
    begun = time.monotonic()
    deadline = None if timeout is None else begun + timeout
    interrupted = threading.Event()
    watch = _Watch()
    with HostPool() as pool, interrupt_sets(interrupted), streamed(record, ssh, stream):
        while True:
            record = with_grown_hosts(record, project)
            watched = watch.watched(record)
            now = time.monotonic()
            record, polled = collect_status(record, ssh, pool, watched, project)
            watch.take(record, polled, now)
            states = watch.states(record)
            if all(s in FINAL_STATES for s in states.values()):
                break
            if watch.settle_passed(states, now, record.grace):
                record = _stop_the_rest(record, ssh, pool, watch, states, now)
                break
            wait = _wait_before_next_poll(record, interval, timeout, deadline, now)
            agent_pids = [st.agent_pid for st in watch.last.values() if st.alive] if record.local else []
            if _sleep(interrupted, wait, agent_pids):
                raise Interrupted(f"stopped waiting for job {record.job}; it keeps running: 'fleet status' to "
                                  "look, 'fleet stop' to end it")
    _conclude(record, ssh, watch, begun)


class _Watch:
    """What `train --join` knows of the job between polls, and its decisions on it. It asks no host (join_job polls
    and applies its decisions); it prints what changed and when it stops watching a host.

    `last`: each host's latest status; `seen`/`agents`: what was printed (`_report_changes`); `trouble_since`: when
    each host became unreachable or lost its agent; `unwatched`: host -> why it is no longer watched (JOIN_GONE_AFTER
    of trouble); `benched`: the hosts an elastic job goes on without (issue 42: its scheduler formed the world
    without any of their workers), whose loss or stop is not the job's failure; `failed_at`: since when the job has
    been failing (None: it is not)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], tuple[Any, ...]] = {}
        self.agents: dict[str, str] = {}
        self.trouble_since: dict[str, float] = {}
        self.unwatched: dict[str, str] = {}
        self.benched: set[str] = set()
        self.failed_at: float | None = None
        self.last: dict[str, HostStatus] = {}
        self.progress_at = -JOIN_PROGRESS_EVERY  # when the last progress line was printed

    def watched(self, record: JobRecord) -> list[HostRecord]:
        """The hosts to poll: the job's live hosts still watched."""
        return [h for h in record.live_hosts if h.name not in self.unwatched]

    def take(self, record: JobRecord, polled: list[HostStatus], now: float) -> None:
        """Take one poll's statuses (taken at `now`): forget hosts the record says were replaced by a spare, print
        what changed, and stop watching a host after JOIN_GONE_AFTER of being unreachable or without its agent."""
        for name in [n for n in self.last if record.host(n).replaced_by]:
            del self.last[name]
            self.unwatched.pop(name, None)
            self.trouble_since.pop(name, None)
        live = job_live(polled)
        if live is not None:
            self.benched = benched_hosts(record, live)
        for st in polled:
            self.last[st.host] = st
            _report_changes(st, self.seen, self.agents)
            if st.agent == "unreachable" or st.agent == AgentState.GONE:
                since = self.trouble_since.setdefault(st.host, now)
                if now - since >= JOIN_GONE_AFTER:
                    why = (st.error or "unreachable") if st.agent == "unreachable" else "its agent is gone"
                    self.unwatched[st.host] = f"{why} for {now - since:.0f} s"
                    say(f"{st.host}: {self.unwatched[st.host]}: no longer watched")
            else:
                self.trouble_since.pop(st.host, None)
        self.progress(polled, now)

    def progress(self, polled: list[HostStatus], now: float) -> None:
        """Print the job's progress (step/total, a bar, the ETA: tables.progress_line from the scheduler's live.json)
        at most every JOIN_PROGRESS_EVERY s, and only while it steps."""
        live = job_live(polled)
        line = progress_line(live.get("progress")) if live is not None else None
        if line and now - self.progress_at >= JOIN_PROGRESS_EVERY:
            self.progress_at = now
            emit(line)

    def states(self, record: JobRecord) -> dict[str, str]:
        """{host: agent state} of the live hosts still watched."""
        return {h.name: self.last[h.name].agent for h in record.live_hosts if h.name not in self.unwatched}

    def settle_passed(self, states: Mapping[str, str], now: float, grace: float) -> bool:
        """Whether the job has been failing (a host unwatched, failed or stopped) for longer than `grace` plus
        JOIN_SETTLE: then what still runs is to be stopped. A job no longer failing (e.g. the failed host was found
        replaced by a spare: the job goes on) starts the count again."""
        failing = bool(set(self.unwatched) - self.benched) or any(
            s in (AgentState.FAILED, AgentState.STOPPED) for h, s in states.items() if h not in self.benched)
        if not failing:
            self.failed_at = None
        elif self.failed_at is None:
            self.failed_at = now
        return self.failed_at is not None and now - self.failed_at > grace + JOIN_SETTLE


def _stop_the_rest(record: JobRecord, ssh: SshSettings, pool: HostPool, watch: _Watch, states: Mapping[str, str],
                   now: float) -> JobRecord:
    """Stop the job on the hosts still running after it failed, then poll them once more (into `watch.last`).
    Returns the record as that poll left it; ClusterError if stopping failed on some host."""
    running = [n for n, s in states.items() if s not in FINAL_STATES]
    failed_at = now if watch.failed_at is None else watch.failed_at
    say(f"the job failed but is still running on {', '.join(running)} after {now - failed_at:.0f} s: stopping it "
        "there")
    check_all(run_on_all([host_target(record.host(n), record.local) for n in running],
                         functools.partial(stop_one, record=record, by="fleet --join: the job failed"), ssh))
    record, polled = collect_status(record, ssh, pool, [record.host(n) for n in running])
    watch.last.update({st.host: st for st in polled})
    return record


def _wait_before_next_poll(record: JobRecord, interval: float, timeout: float | None, deadline: float | None,
                           now: float) -> float:
    """Seconds until the next poll: `interval`, cut short by the deadline of --join-timeout; JobFailed once that
    deadline has passed (the job keeps running)."""
    if deadline is None:
        return interval
    if now >= deadline:
        raise JobFailed(f"job {record.job} still runs after --join-timeout {timeout:g} s; it keeps "
                        "running: 'fleet status' to look, 'fleet stop' to end it")
    return min(interval, deadline - now)


def _conclude(record: JobRecord, ssh: SshSettings, watch: _Watch, begun: float) -> None:
    """The end of the wait: say the job succeeded (every live host's agent succeeded, none unwatched: an agent
    succeeds only when each of its processes exited 0), raise JobStopped when its operator stopped it (some host
    `stopped`, none failed), else JobFailed with the evidence, the log tails of the processes that ended badly
    fetched now."""
    hosts = [watch.last[h.name] for h in record.live_hosts if h.name not in watch.benched and h.name in watch.last]
    unwatched = {h: why for h, why in watch.unwatched.items() if h not in watch.benched}
    took = time.monotonic() - begun
    if not unwatched and hosts and all(h.agent == AgentState.SUCCEEDED for h in hosts):
        without = f"; it went on without {', '.join(sorted(watch.benched))} (elastic)" if watch.benched else ""
        say(f"job {record.job} succeeded: every worker exited 0 ({took:.1f} s){without}")
        return
    stopped = [h for h in hosts if h.agent == AgentState.STOPPED]
    if not unwatched and stopped and all(h.agent in (AgentState.SUCCEEDED, AgentState.STOPPED) for h in hosts):
        why = sorted({h.reason for h in stopped if h.reason})
        raise JobStopped(f"job {record.job} stopped after {took:.1f} s ({'; '.join(why) or 'stopped'}): "
                         "'fleet train' resumes it from its checkpoints")
    raise JobFailed(_failure_text(record, hosts, unwatched, took, _failed_tails(record, ssh, hosts)))


def with_grown_hosts(record: JobRecord, project: Path | None) -> JobRecord:
    """`record` with the hosts `fleet grow` added to the job's record on disk since (issue 42): a host that joins
    the job while --join waits is watched too, and its takeover of a lost host's ranks settles that host as
    replaced. Unchanged without `project`, or if the record there cannot be read or is another job's."""
    if project is None:
        return record
    try:
        disk = jobrecord.load(project, record.job)
    except (UserError, OSError, ValueError):
        return record
    known = {h.name for h in record.hosts}
    new = tuple(h for h in disk.hosts if h.name not in known)
    if not new or disk.job_id != record.job_id:
        return record
    say(f"{', '.join(h.name for h in new)} joined job {record.job} ('fleet grow'): watched from now on")
    return dataclasses.replace(record, hosts=record.hosts + new)


def benched_hosts(record: JobRecord, live: Mapping[str, Any]) -> set[str]:
    """The live hosts none of whose workers is in the world the scheduler formed last (live.json's `elastic`: which
    worker serves which logical ranks, present only when not the plain way): those an elastic job goes on without.
    The document comes from a host: anything not of the expected shape means no host is benched."""
    elastic = live.get("elastic")
    serving = elastic.get("logical") if isinstance(elastic, Mapping) else None
    if not isinstance(serving, Mapping) or not serving:
        return set()
    return {h.name for h in record.live_hosts if h.node_ids and not any(n in serving for n in h.node_ids)}


def _sleep(interrupted: threading.Event, seconds: float, agent_pids: list[int | None]) -> bool:
    """Wait `seconds`, or less when Ctrl-C comes (then True) or one of `agent_pids` (agents on this machine) exits:
    the OS says so (the agent's pidfd, and the signal wakeup fd for Ctrl-C), nothing is polled. A plain timed wait
    off the main thread (only it receives signals) or without an agent to wait on."""
    fds = []
    for pid in agent_pids:
        with contextlib.suppress(OSError, TypeError):  # gone already (its exit is in the next poll), or unknown
            fds.append(os.pidfd_open(pid))  # type: ignore[arg-type]
    if not fds or threading.current_thread() is not threading.main_thread():
        for fd in fds:
            os.close(fd)
        return interrupted.wait(seconds)
    woken, wake = os.pipe()
    try:
        os.set_blocking(wake, False)
        previous = signal.set_wakeup_fd(wake)
        try:
            if not interrupted.is_set():
                select.select([woken, *fds], [], [], seconds)
        finally:
            signal.set_wakeup_fd(previous)
    finally:
        for fd in (woken, wake, *fds):
            os.close(fd)
    return interrupted.is_set()


def _failed_tails(record: JobRecord, ssh: SshSettings, hosts: list[HostStatus]) -> dict[str, list[str]]:
    """The last log lines of every process that ended badly on a host that recorded no give-up evidence of its
    own (a scheduler that stopped the job, a process stopped with an error status), best effort."""
    wanted: dict[str, list[ProcStatus]] = {}
    for h in hosts:
        if h.reached and not h.failure:
            bad = [p for p in h.processes if p.last_exit and p.last_exit != "exit code 0"
                   and p.state not in (ProcState.RUNNING, ProcState.SUCCEEDED)]
            if bad:
                wanted[h.host] = bad
    if not wanted:
        return {}

    def tails(host: Host) -> dict[str, list[str]]:
        """node_id -> last lines of its log (empty if it cannot be read), each read bounded by STATUS_TIMEOUT."""
        h = record.host(host.name)
        out = {}
        for p in wanted[host.name]:
            log = f"{h.job_dir}/{record.process(p.node_id)['log']}"
            result = host.run(["tail", "-n", str(FAILURE_TAIL_LINES), "--", log], timeout=STATUS_TIMEOUT)
            out[p.node_id] = result.stdout.splitlines() if result.ok else []
        return out

    results = run_on_all([host_target(record.host(n), record.local) for n in wanted], tails, ssh)
    return {node: lines for r in results.values() if r.ok and r.value for node, lines in r.value.items()}


def _report_changes(st: HostStatus, seen: dict[tuple[str, str], tuple[Any, ...]], agents: dict[str, str]) -> None:
    """Print (timestamped, on stdout) what changed on one host since the last poll: the agent's new state unless
    it is starting or running (with its reason once final; for an unreachable host, the error), and each process
    whose state, pid or restart count changed. `seen` and `agents` hold the last poll's view and are updated."""
    if agents.get(st.host) != st.agent:
        agents[st.host] = st.agent
        if st.agent not in (AgentState.RUNNING, AgentState.STARTING):
            why = f" ({st.reason})" if st.reason and st.agent in FINAL_STATES else ""
            emit(f"{st.host}: agent {st.agent}{why}" if st.agent != "unreachable" else f"{st.error}")
    for p in st.processes:
        key = (p.state, p.pid, p.restarts, p.relaunched)
        if seen.get((p.host, p.node_id)) == key:
            continue
        seen[(p.host, p.node_id)] = key
        parts = [p.state]
        if p.pid is not None:
            parts.append(f"pid {p.pid}")
        if p.restarts:
            parts.append(f"{p.restarts} restart(s)")
        if p.relaunched:
            parts.append(f"relaunched {p.relaunched} time(s) with the job's restart")
        if p.last_exit and p.last_exit != "exit code 0":
            parts.append(f"last exit: {p.last_exit}")
        emit(f"{p.prefix} {', '.join(parts)}")


def _failure_text(record: JobRecord, hosts: list[HostStatus], unwatched: Mapping[str, str], took: float,
                  tails: Mapping[str, list[str]]) -> str:
    """JobFailed's message: how long the job ran; for each host whose agent gave up, the process, its first cause
    (else its exit status), restarts and the log tail the agent recorded; then each host no longer watched and why;
    then every other host that did not succeed, with the log tails fetched by `_failed_tails`."""
    lines = [f"job {record.job} failed after {took:.1f} s"]
    causes = [h for h in hosts if h.failure]
    for h in causes:
        f = h.failure or {}
        role = "sched" if f.get("rank") is None else "worker"
        prefix = f"{h.host}:{role}:{dash(f.get('rank'))}"
        lines.append(f"{f.get('node_id')} on {h.host} (rank {dash(f.get('rank'))}, pid {dash(f.get('pid'))}): "
                     f"{clean(f.get('cause') or f.get('status'), 600)} after {f.get('restarts', 0)} restart(s); "
                     f"last lines of {f.get('log_file')}:")
        lines += [f"  {prefix} | {clean(line, None, tabs=True)}" for line in f.get("log_tail") or []]
    for h in hosts:
        if h.host in unwatched:
            lines.append(f"{h.host}: {unwatched[h.host]}")
        elif not h.failure and h.agent != AgentState.SUCCEEDED:
            lines.append(f"{h.host}: {h.agent}" + (f": {h.reason}" if h.reason else ""))
            for p in h.processes:
                if p.node_id in tails:
                    lines.append(f"  {p.node_id} on {h.host} ({p.state}, last exit: {p.last_exit}); last lines:")
                    lines += [f"    {p.prefix} | {clean(line, None, tabs=True)}" for line in tails[p.node_id]]
    return "\n".join(lines)
