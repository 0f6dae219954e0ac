"""How host states look on a terminal: the status table (one row per process, coloured by state), the note that
stands out about a process, and the scheduler's view in a few lines. Shared by `status` and `status --watch`."""

from __future__ import annotations

import textwrap
from typing import Any, Mapping

from rich import box
from rich.markup import escape
from rich.table import Table

from toolkit.contracts.agentdoc import ProcState
from toolkit.contracts.jobrecord import JobRecord
from toolkit.contracts.rundoc import JobStatus
from toolkit.launcher.jobhosts.output import dash, human_age
from toolkit.launcher.jobhosts.view import HostStatus, ProcStatus, job_live, number

# How a process's state stands out in the table (rich styles); states not listed are plain.
STATE_STYLE = {"running": "green", "succeeded": "green", "starting": "cyan", "connecting": "cyan",
               "restarting": "bold yellow", "backoff": "bold yellow", "stopping": "yellow", "failed": "bold red",
               "gone": "bold red", "unreachable": "bold red", "fenced": "bold red", "stopped": "magenta"}


LAGGING_AFTER = 5.0  # s without a heartbeat at the scheduler before a running worker's row says it lags
COMPACT_BELOW = 100  # terminal columns below which the status table takes its compact layout


def status_table(record: JobRecord, hosts: list[HostStatus], title: str | None = None,
                 width: int | None = None) -> Table:
    """One row per process: where it runs, its state as its agent sees it, and the scheduler's figures (step,
    steps/s, loss, heartbeat age; a straggler's factor). Shared by `status` and `status --watch`. Dead,
    restarting, fenced and unreachable states are coloured, and so are lagging workers (heartbeat older than
    LAGGING_AFTER while running) and stragglers. On a terminal `width` columns wide, below COMPACT_BELOW, the
    compact layout (`_compact_table`): nothing is cut to `loc…`."""
    live = job_live(hosts)
    if title is None:
        title = f"job {record.job}: {record.world_size} worker(s) on {len(record.live_hosts)} host(s), " \
                f"scheduler {record.scheduler_host}:{record.sched_port}"
        if live is not None:
            title += f", generation {live.get('generation')}"
    if width is not None and width < COMPACT_BELOW:
        return _compact_table(hosts, title)
    table = Table(title=title)
    right = ("rank", "pid", "restarts", "step", "steps/s", "loss", "heartbeat")
    for column in ("host", "node id", "rank", "pid", "state", "restarts", "step", "steps/s", "loss", "heartbeat",
                   "log age", "note"):
        table.add_column(column, justify="right" if column in right else "left")
    for h in hosts:
        for p in h.processes:
            note, style = process_note(p)
            table.add_row(p.host, p.node_id, dash(p.rank), dash(p.pid), f"[{STATE_STYLE.get(p.state, '')}]"
                          f"{escape(p.state)}" if p.state in STATE_STYLE else escape(p.state),
                          f"{p.restarts} (+{p.relaunched} relaunched)" if p.relaunched else str(p.restarts),
                          dash(p.step), _fixed(p.steps_per_s, 2), _fixed(p.loss, 4),
                          human_age(p.heartbeat_age) if p.heartbeat_age is not None else "-",
                          human_age(p.log_age), f"[{style}]{escape(note)}" if note else "")
    return table


def _state(p: ProcStatus) -> str:
    return f"[{STATE_STYLE[p.state]}]{escape(p.state)}" if p.state in STATE_STYLE else escape(p.state)


def _compact_table(hosts: list[HostStatus], title: str) -> Table:
    """The status table for a narrow terminal: no borders, one space between columns, short headings, the rank
    left to the node id (worker_<rank>) and the log age out; the note folds onto more lines instead of being
    cut. About 70 columns before the note."""
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False,
                  show_edge=False, title_justify="left")
    for column, justify in (("host", "left"), ("node", "left"), ("pid", "right"), ("state", "left"),
                            ("rst", "right"), ("step", "right"), ("st/s", "right"), ("loss", "right"),
                            ("hb", "right")):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    table.add_column("note", overflow="fold")
    for h in hosts:
        for p in h.processes:
            note, style = process_note(p)
            table.add_row(p.host, p.node_id, dash(p.pid), _state(p), str(p.restarts), dash(p.step),
                          _fixed(p.steps_per_s, 1), _fixed(p.loss, 3),
                          human_age(p.heartbeat_age) if p.heartbeat_age is not None else "-",
                          f"[{style}]{escape(note)}" if note else "")
    return table


def process_note(p: ProcStatus) -> tuple[str, str]:
    """What stands out about a process (a straggler and by how much, a lagging heartbeat, its last bad exit) and
    the style to show it in; ("", "") for nothing."""
    if p.no_step_for is not None:
        return f"no step for {p.no_step_for:.0f} s", "bold red"
    if p.straggler is not None:
        return f"straggler: {p.straggler:.2f}x the others' own work per step", "bold magenta"
    if p.state == ProcState.RUNNING and p.heartbeat_age is not None and p.heartbeat_age > LAGGING_AFTER:
        return f"lagging: no heartbeat for {p.heartbeat_age:.0f} s", "bold yellow"
    if p.last_exit and p.last_exit != "exit code 0":
        return f"last exit: {p.last_exit}", "red" if p.state != ProcState.RUNNING else "yellow"
    return "", ""


def _fixed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def recovery_lines(why: str, width: int) -> list[str]:
    """The `recovery:` note under the status table, wrapped on words to `width` columns (a terminal's; elsewhere
    table_console's own width keeps it one line for a pipe), its continuation lines indented."""
    return textwrap.wrap(f"recovery: {why}", width=width, subsequent_indent="  ", break_on_hyphens=False)


def live_lines(live: Mapping[str, Any] | None) -> list[str]:
    """The scheduler's view in a few lines: each straggler (host, rank, by how much), each rank skipping checkpoints
    for a full disk (how many, why), the last incident (cause, processes, step, time to recover, steps recomputed)
    and the goodput so far. Empty without a live document."""
    if live is None:
        return []
    lines = elastic_lines(live.get("elastic"))
    lines += [f"straggler: {s.get('node_id')} (rank {s.get('rank')}) on {s.get('host')}: its own work per step "
             f"takes {s.get('factor')}x the median of the others" for s in live.get("stragglers") or []
             if isinstance(s, dict)]
    lines += [f"checkpoints skipped: {e.get('node_id')} (rank {e.get('rank')}) on {e.get('host')}: "
              f"{e.get('skipped')} in a row, the disk is full: {e.get('why')} (training goes on from the older "
              "copies; the next checkpoint tries again)" for e in live.get("skipping_checkpoints") or []
              if isinstance(e, dict)]
    stalled = number(live.get("stalled_for"))
    if stalled is not None:
        lines.append(f"stalled: no step for {stalled:.0f} s (the progress watchdog names a rank that stopped while "
                     "its peers wait for it; docs/porting.md)")
    inc = live.get("last_incident")
    if isinstance(inc, dict):
        recomputed = "" if inc.get("recomputed") is None else f", {inc['recomputed']} step(s) recomputed"
        procs, where = (", ".join(map(str, inc.get(k) or [])) for k in ("processes", "hosts"))
        at = f" at step {inc['step']}" if isinstance(inc.get("step"), int) else ""
        relaunched = ", ".join(map(str, inc.get("relaunched") or []))
        also = f" ({relaunched} relaunched with it: restart recovery)" if relaunched else ""
        lines.append(f"last incident (#{inc.get('number')} of {live.get('incidents')}): {inc.get('cause')}: "
                     f"{procs} on {where}{at}{also}; {recovery_text(inc, live)}{recomputed}")
    line = progress_line(live.get("progress"))
    if line:
        lines.append(line)
    goodput = live.get("goodput")
    if isinstance(goodput, dict) and number(goodput.get("goodput")) is not None:
        wall = human_age(number(goodput.get("wall")))
        head = "goodput" if live.get("status") in (JobStatus.FINISHED, JobStatus.FAILED) else "goodput so far"
        if goodput.get("basis") == "formations":
            lines.append(f"{head}: at most {100 * goodput['goodput']:.1f}% of {wall} (the script reports no steps: "
                         "toolkit.train.report(step, loss=...) makes it exact)")
        else:
            lines.append(f"{head}: {100 * goodput['goodput']:.1f}% of {wall}")
    return lines


MAX_SERVING_SHOWN = 16  # processes whose logical ranks are listed on status' line (then "...")


def elastic_lines(elastic: Any) -> list[str]:
    """A shrunk job (issue 42): `degraded: 4 of 6 workers, serving 6 logical ranks`, then which process serves
    which logical ranks. Nothing for the plain world (or a malformed document: live.json is read, not trusted)."""
    if not isinstance(elastic, dict) or not all(isinstance(elastic.get(k), int)
                                                for k in ("workers", "world_size", "logical_world")):
        return []
    lines = []
    if elastic["workers"] < elastic["world_size"]:
        lines.append(f"degraded: {elastic['workers']} of {elastic['world_size']} workers, serving "
                     f"{elastic['logical_world']} logical ranks")
    serving = elastic.get("logical")
    if isinstance(serving, dict) and serving:
        parts = [f"{node} {','.join(map(str, lrs))}" for node, lrs in list(serving.items())[:MAX_SERVING_SHOWN]
                 if isinstance(node, str) and isinstance(lrs, list)]
        more = "; ..." if len(serving) > MAX_SERVING_SHOWN else ""
        lines.append("logical ranks: " + "; ".join(parts) + more)
    return lines


BAR_WIDTH = 20  # characters of the progress bar


def progress_line(progress: Any) -> str | None:
    """`progress: step 120/1000 [##------------------] 12.0%, ETA 3m at 4.40 steps/s` from live.json's
    `progress`: without a total (the script did not say) the step and rate only; None before any step."""
    if not isinstance(progress, dict):
        return None
    step, total, rate = progress.get("step"), progress.get("total"), number(progress.get("steps_per_s"))
    if not isinstance(step, int):
        return None
    at = f" at {rate:.2f} steps/s" if rate else ""
    if not isinstance(total, int) or total <= 0:
        return f"progress: step {step} (total not known: the Trainer reports it, or report(step, total=N)){at}"
    done = min(1.0, step / total)
    filled = round(done * BAR_WIDTH)
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    if step >= total:
        eta = ", done"
    elif rate:
        eta = f", ETA {human_age((total - step) / rate)}"
    else:
        eta = ", ETA not known yet"
    return f"progress: step {step}/{total} [{bar}] {100 * done:.1f}%{eta}{at}"


def recovery_text(inc: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    """How an incident of live.json stands: recovered (every rank trains again) in how long; else whether its group
    formed again, and for a script that reports no steps that nothing more can be known; an incident the job ended
    without recovering from says so rather than "not recovered yet"."""
    took, formed = number(inc.get("time_to_recover")), number(inc.get("formed_in"))
    ended = live.get("status") in (JobStatus.FINISHED, JobStatus.FAILED)
    if took is not None:
        return f"recovered in {took:.2f} s"
    if formed is not None and not live.get("reports_steps"):
        return (f"its group formed again {formed:.2f} s after the failure (the script reports no steps: when it "
                "trained again is not known)")
    if formed is not None:
        return f"its group formed again in {formed:.2f} s" + ("" if ended else ", not training again yet")
    return f"not recovered: the job {live.get('status')} first" if ended else "not recovered yet"
