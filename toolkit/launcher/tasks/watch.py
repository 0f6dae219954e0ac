"""`status --watch`: the status table refreshed in place until the job ends, or one JSON object per refresh.

One poller thread per host asks its host every interval (POLL_SCRIPT: the agent's files, and on the scheduler's
host its live.json; one bounded command, over a connection kept open), so a host that stops answering delays
nobody: its row says since when it has not answered, and the others keep updating. The view is rebuilt from the
latest answers at every refresh by `watch_view` (pure: answers and a clock in, rows and an outcome out).

The watch ends when every host's agent has ended (the job's outcome: exit 0 if every worker succeeded, 3 if its
operator stopped it, 1 if it failed: as `fleet run` and `train --join` say), or on Ctrl-C (exit 130; the job keeps
running). Watching never changes the job."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from toolkit.contracts.agentdoc import FINAL_STATES, AgentState
from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.follow import Interrupted, JobFailed, JobStopped
from toolkit.launcher.jobhosts.output import human_age, interrupt_sets, table_console
from toolkit.launcher.jobhosts.poll import poll_status, settle_layout
from toolkit.launcher.jobhosts.reach import host_target, load_record, record_ssh
from toolkit.launcher.jobhosts.tables import live_lines, status_table
from toolkit.launcher.jobhosts.view import HostStatus, live_path, recovery_mode
from toolkit.launcher.remote import HostPool, HostResult, SshSettings, run_on_all
from toolkit.launcher.settings import JobRef

WATCH_INTERVAL = 2.0  # s between refreshes (and between each host's polls) unless --interval says otherwise
MIN_INTERVAL = 0.2  # s: the shortest --interval (each refresh asks every host)
SILENT_AFTER = 3  # intervals without an answer (and at least SILENT_MIN s) before a host's row says unreachable
SILENT_MIN = 5.0  # s


@dataclass
class Answer:
    """A host's latest poll: its result, when it was asked and when it last answered (monotonic)."""

    result: HostResult[dict[str, Any]] | None = None
    asked_at: float | None = None
    answered_at: float | None = None
    last_good: HostResult[dict[str, Any]] | None = None


@dataclass(frozen=True)
class View:
    """One refresh: every host's status, the scheduler's live document (None if unread), the job's outcome
    (None while it runs: succeeded, failed or stopped) and when (monotonic) it was built."""

    hosts: list[HostStatus]
    live: Mapping[str, Any] | None
    outcome: AgentState | None
    at: float


def watch_view(record: JobRecord, answers: Mapping[str, Answer], now: float, interval: float) -> View:
    """The view from each host's latest answer. A host that has not answered for SILENT_AFTER intervals (at least
    SILENT_MIN s), or whose last poll failed, is unreachable, with since when and why; the job has an outcome once
    every host answered with an agent in a final state (all succeeded: succeeded; any failed: failed; else
    stopped)."""
    silent = max(SILENT_AFTER * interval, SILENT_MIN)
    results: dict[str, HostResult[dict[str, Any]]] = {}
    connecting = set()
    for h in record.live_hosts:
        a = answers.get(h.name) or Answer()
        if a.result is not None and a.result.ok and a.answered_at is not None and now - a.answered_at <= silent:
            results[h.name] = a.result
            continue
        since = a.answered_at if a.answered_at is not None else a.asked_at
        why = a.result.error if a.result is not None and not a.result.ok else None
        if why is None and a.answered_at is None and (since is None or now - since <= silent):
            connecting.add(h.name)  # its first poll is under way: not unreachable yet
        elif why is None and since is not None:
            why = f"{h.name}: no answer for {human_age(now - since)}"
        results[h.name] = HostResult(h.name, False, error=why or f"{h.name}: connecting")
    _, settled = settle_layout(record, results)  # a spare that took over a lost host's ranks shows them
    hosts = [_connecting(h) if h.host in connecting else h for h in settled]
    live = next((h.live for h in hosts if h.live is not None), None)
    if live is None:  # the scheduler's host is silent: its last figures, marked by their age, beat none
        sched = answers.get(live_path(record)[0])
        if sched is not None and sched.last_good is not None and sched.last_good.value is not None:
            live = sched.last_good.value.get("live")
    return View(hosts, live, job_outcome(hosts), now)


def _connecting(h: HostStatus) -> HostStatus:
    """A host whose first answer has not come yet, shown as such rather than as unreachable."""
    return replace(h, agent="connecting", processes=tuple(replace(p, state="connecting") for p in h.processes))


def job_outcome(hosts: list[HostStatus]) -> AgentState | None:
    """succeeded, failed or stopped once every host answered with an agent in a final state; else None."""
    states = [h.agent for h in hosts]
    if not states or any(s not in FINAL_STATES for s in states):
        return None
    if all(s == AgentState.SUCCEEDED for s in states):
        return AgentState.SUCCEEDED
    return AgentState.FAILED if AgentState.FAILED in states else AgentState.STOPPED


def view_json(record: JobRecord, view: View) -> dict[str, Any]:
    """One line of `--watch --json`: the job, its outcome so far, the live document and every process."""
    return {"job": record.job, "outcome": view.outcome, "live": view.live,
            "recovery": recovery_mode([p for h in view.hosts for p in h.processes],
                                      bool(record.options.get("torchrun_script"))),
            "hosts": [{k: v for k, v in asdict(h).items() if k not in ("processes", "live", "failure")}
                      for h in view.hosts],
            "processes": [asdict(p) for h in view.hosts for p in h.processes]}


def render(record: JobRecord, view: View, interval: float, width: int | None = None) -> Group:
    """The table (compact on a terminal `width` columns wide, see tables.status_table) and, under it, each
    unreachable host, the stragglers, the last incident and the goodput."""
    live = view.live
    title = f"job {record.job}: {record.world_size} worker(s) on {len(record.live_hosts)} host(s)"
    if live is not None:
        title += f", generation {live.get('generation')}" + ("" if live.get("formed") else " (forming)")
    title += f" · every {interval:g} s · {time.strftime('%H:%M:%S')}"
    lines = [Text(f"{h.host}: unreachable: {h.error}", style="bold red") for h in view.hosts
             if not h.reached and h.agent != "connecting"]
    lines += [Text(line) for line in live_lines(live)]
    if view.outcome is not None:
        lines.append(Text(f"job {record.job} {view.outcome}", style="bold green" if view.outcome is AgentState.SUCCEEDED
                          else "bold red"))
    return Group(status_table(record, view.hosts, title, width), *lines)


class Pollers:
    """One thread per host, each polling its host every `interval` until `stop` is set; `answers()` is a copy of
    the latest answers. Each poll is bounded (STATUS_TIMEOUT and the SSH bounds), so the threads end within one
    bound of `stop`."""

    def __init__(self, record: JobRecord, ssh: SshSettings, interval: float, stop: threading.Event) -> None:
        self.record, self.ssh, self.interval, self.stop = record, ssh, interval, stop
        self.sched, self.live_file = live_path(record)
        self.lock = threading.Condition()  # notified at each answer
        self._answers = {h.name: Answer() for h in record.live_hosts}
        self.pool = HostPool()
        self.threads = [threading.Thread(target=self._poll, args=(h,), name=f"watch {h.name}", daemon=True)
                        for h in record.live_hosts]

    def start(self) -> None:
        """Start every poller."""
        for t in self.threads:
            t.start()

    def answers(self) -> dict[str, Answer]:
        """The latest answer of every host (a copy)."""
        with self.lock:
            return {name: Answer(a.result, a.asked_at, a.answered_at, a.last_good) for name, a in self._answers.items()}

    def first_answers(self, timeout: float) -> None:
        """Wait until every host answered (or failed) once, or `timeout` s."""
        with self.lock:
            self.lock.wait_for(lambda: all(a.result is not None for a in self._answers.values()), timeout)

    def close(self) -> None:
        """Stop the pollers, wait for each (its poll is bounded) and close the connections."""
        self.stop.set()
        for t in self.threads:
            t.join()
        self.pool.close()

    def _poll(self, h: HostRecord) -> None:
        live_file = self.live_file if h.name == self.sched else ""
        while not self.stop.is_set():
            asked = time.monotonic()
            with self.lock:
                self._answers[h.name].asked_at = asked
            result = run_on_all([host_target(h, self.record.local)], lambda host: poll_status(host, h, live_file),
                                self.ssh, pool=self.pool)[h.name]
            with self.lock:
                a = self._answers[h.name]
                a.result = result
                if result.ok:
                    a.answered_at, a.last_good = time.monotonic(), result
                self.lock.notify_all()
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - asked)))


def watch(ref: JobRef, interval: float = WATCH_INTERVAL, as_json: bool = False,
          console: Console | None = None) -> None:
    """Show the job live until it ends (see the module docstring). `console` is where the view goes (a terminal's
    by default; tests pass a recording one); `as_json` prints one JSON object per refresh on stdout instead.

    Returns when every worker succeeded; raises JobStopped (exit 3) when its operator stopped it (`fleet stop`),
    JobFailed (exit 1) when it failed, Interrupted
    (exit 130) on Ctrl-C, UserError for an interval below MIN_INTERVAL."""
    if not interval >= MIN_INTERVAL:
        raise UserError(f"--interval {interval:g}: give at least {MIN_INTERVAL:g} seconds (each refresh asks every "
                        "host)")
    record = load_record(ref)
    return watch_record(record, record_ssh(record, ref.request.core), interval, as_json, console)


def watch_record(record: JobRecord, ssh: SshSettings, interval: float = WATCH_INTERVAL, as_json: bool = False,
                 console: Console | None = None, stop: threading.Event | None = None) -> None:
    """`watch` for a loaded record. `stop` ends the watch as Ctrl-C does (set by SIGINT in the main thread;
    callers in other threads set it themselves)."""
    stop = stop or threading.Event()
    pollers = Pollers(record, ssh, interval, threading.Event())  # stopped by close(), after `stop` or the end
    view = None
    out = console or table_console()
    with interrupt_sets(stop):
        pollers.start()
        try:
            if as_json:
                while view is None or view.outcome is None:
                    view = _next(record, pollers, interval, stop, view)
                    print(json.dumps(view_json(record, view)), flush=True)
            else:
                with Live(console=out, auto_refresh=False, transient=False) as live:
                    while view is None or view.outcome is None:
                        view = _next(record, pollers, interval, stop, view)
                        live.update(render(record, view, interval, out.width), refresh=True)
        finally:
            pollers.close()
    if view.outcome is AgentState.STOPPED:
        why = sorted({h.reason for h in view.hosts if h.agent == AgentState.STOPPED and h.reason})
        raise JobStopped(f"job {record.job} stopped ({'; '.join(why) or 'stopped'}): 'fleet train' resumes it from "
                         "its checkpoints")
    if view.outcome is not AgentState.SUCCEEDED:
        raise JobFailed(f"job {record.job} {view.outcome}: 'fleet status' and 'fleet logs' show why")


def _next(record: JobRecord, pollers: Pollers, interval: float, stop: threading.Event, last: View | None) -> View:
    """The next view: at once for the first (after every host's first answer, or one interval), then one interval
    after the last. Raises Interrupted when `stop` is set."""
    if last is None:
        pollers.first_answers(interval)
    else:
        stop.wait(max(0.0, interval - (time.monotonic() - last.at)))
    if stop.is_set():
        raise Interrupted(f"stopped watching job {record.job}; it keeps running: 'fleet stop' to end it")
    return watch_view(record, pollers.answers(), time.monotonic(), interval)
