"""Starting the job on every host at once, all or nothing, after checking what was typed against the job record
and what its previous run left (`start_job`: the body of `train`, and of `run` after its deploy).

Starting a host means running its launch.sh, which starts the host's agent detached and returns (or says the agent
already runs); the agents then start and supervise the processes. So `train` returns once every agent runs, not
when the job is formed; `--join` (jobhosts.follow) waits for the end."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from toolkit.contracts import ckptkey, jobrecord
from toolkit.contracts.agentdoc import AgentState
from toolkit.contracts.jobrecord import JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.deployment import deploy
from toolkit.launcher.jobhosts.follow import Interrupted, join_job
from toolkit.launcher.jobhosts.output import say
from toolkit.launcher.jobhosts.poll import collect_status
from toolkit.launcher.jobhosts.preflight import failure_text, print_report, run_check
from toolkit.launcher.jobhosts.reach import (
    LAUNCH_TIMEOUT,
    STATUS_TIMEOUT,
    fan_out,
    host_target,
    load_record,
    record_ssh,
    record_targets,
    unless_other_job,
)
from toolkit.launcher.jobhosts.rerun import move_checkpoints, project_checkpoints, refuse_size_change, workdir_of
from toolkit.launcher.jobhosts.scripts import ARCHIVE_SCRIPT, LOG_ROTATE_SCRIPT
from toolkit.launcher.jobhosts.stopjob import stop_on_interrupt, stop_one
from toolkit.launcher.jobhosts.streams import RankFilter
from toolkit.launcher.jobhosts.view import HostStatus
from toolkit.launcher.remote import (
    AuthenticationFailed,
    ChangedHostKey,
    ClusterError,
    Host,
    HostResult,
    HostUnreachable,
    PreflightFailed,
    SshSettings,
    UnknownHostKey,
    check_all,
    rich_progress,
    run_on_all,
)
from toolkit.launcher.settings import Request

LOG_RUNS_KEPT = 10  # earlier runs' logs kept on each host (logs/runs/<n>/), the newest


def start_job(request: Request, join: bool = False, join_timeout: float | None = None, fresh: bool = False,
              again: bool = False, check: bool = True, verb: str = "fleet train", deployed: JobRecord | None = None,
              known: list[HostStatus] | None = None, stop_on_ctrl_c: bool = False,
              stream: RankFilter | None = None) -> None:
    """Start the deployed job on every host at once (deploying it first if it never was); all or nothing: if a
    host fails to start, what started elsewhere is stopped. With `join`, wait for the job to end.

    A job whose every host finished successfully is not started again by accident (its workers would resume
    from their final checkpoints and end at once): `fresh` starts it over (its checkpoints and state are moved
    aside, never deleted), `again` runs it once more from where it ended (with more epochs, say).

    Hosts start in parallel with fail_fast (hosts not yet begun when one fails are skipped); each launch.sh is
    bounded by LAUNCH_TIMEOUT. Before the scheduler's host starts, if no agent runs there, it is preflighted
    with the scheduler's two ports (MS_SCHED_PORT, MASTER_PORT): a busy port fails the start, rolled back.
    Hosts whose agent already runs are left as they are (and counted). Raises UserError for --fresh with
    --again, for flags that contradict the record, for a finished job without --fresh/--again, or for --fresh
    while the job runs; on a failed start, UserError with the ClusterError text and what the rollback did; what
    deploy raises when it deploys first; with `join`, what join_job raises.

    With `check` (the default; `--no-check` turns it off), the hosts of a job on hosts (not a local one) are
    checked first, after any deploy (toolkit.launcher.jobhosts.preflight): a problem refuses the start (UserError
    listing them) before anything is started; a host or link that is only slow is a warning. `verb` is the command the
    messages tell the user to type again (`fleet run` passes its own).

    `run` passes what it already has, so that no host is asked twice: `deployed`, the record its deploy returned
    (not read again), and `known`, every live host's status asked before that deploy and judged by
    `refuse_start` then. With `stop_on_ctrl_c` (run), Ctrl-C while joined stops the job (as `fleet stop`,
    jobhosts.stopjob.stop_on_interrupt) and raises StoppedOnInterrupt; without it, Interrupted (the job goes
    on). `stream`: whose output --join prints while it waits (jobhosts.streams.RankFilter)."""
    if fresh and again:
        raise UserError("--fresh and --again both given: start the job over (--fresh) or go on from where it "
                        "ended (--again), not both")
    ref = request.job_ref()
    record = deployed or _deployed_record(request)
    ssh = record_ssh(record, request.core)
    if check and not record.local:
        _check_first(record, ssh, ref.project)
    record.host(record.scheduler_host)  # a record naming a scheduler host it does not list: one line, nothing started
    if known is None:
        _, known = collect_status(record, ssh)
        refuse_start(record, known, ssh, fresh=fresh, again=again, verb=verb)
    if fresh:  # nothing is moved aside before the start's own checks passed (the scheduler's ports)
        _preflight_scheduler(record, ssh, frozenset(h.host for h in known if h.alive))
        _move_aside(record, ssh, known, ref.project)
    try:
        _start_all(record, ssh, frozenset(h.host for h in known if h.alive))
        if join:
            join_job(record, ssh, join_timeout, project=ref.project, stream=stream)
    except (Interrupted, KeyboardInterrupt):  # Ctrl-C while starting (what started is stopped too) or joined
        if not stop_on_ctrl_c:
            raise
        raise stop_on_interrupt(record, ssh) from None


def _start_all(record: JobRecord, ssh: SshSettings, alive: frozenset[str]) -> None:
    """Start every live host at once (`start_host`; `alive`: the hosts whose agent already ran), rolling back what
    started if one fails (`_roll_back` raises), then say how it went."""
    begun = time.monotonic()
    with rich_progress("starting", len(record.live_hosts)) as progress:
        results = run_on_all([host_target(h, record.local) for h in record.live_hosts],
                             functools.partial(start_host, record, alive), ssh, progress=progress, fail_fast=True)
    if any(not r.ok for r in results.values()):
        _roll_back(record, ssh, results)
    started = sum(1 for r in results.values() if r.value)
    already = "" if started == len(results) else f" ({len(results) - started} already running)"
    say(f"job {record.job} started on {len(results)} host(s){already} in {time.monotonic() - begun:.1f} s: "
        f"{record.world_size} worker(s), scheduler on {record.scheduler_host}:{record.sched_port}; "
        "follow it with 'fleet status' and 'fleet logs -f', end it with 'fleet stop'")


def _deployed_record(request: Request) -> JobRecord:
    """The job's record, deploying the job first if it never was or its last deploy did not complete (what deploy
    raises, it raises)."""
    ref = request.job_ref()
    record = None
    name = jobrecord.choose(ref.project, ref.job, ref.default_job)
    if name is not None and jobrecord.exists(ref.project, name):
        record = load_record(ref)
    if record is None or not record.deployed:  # never deployed, or its last deploy did not complete
        record = deploy(request.settings())
    return record


def start_host(record: JobRecord, alive: frozenset[str], host: Host) -> bool:
    """Run the host's launch.sh: True if this call started the agent (False: this job's agent already ran). On the
    scheduler's host without a running agent (`alive`: the hosts whose agent ran when they were asked), preflight
    first with the scheduler's two ports. OtherJob, with nothing started, where the job directory holds another
    project's job (launch.sh --job-id)."""
    h = record.host(host.name)
    port = record.sched_port
    if h.name == record.scheduler_host and h.name not in alive:
        host.preflight(h.python, h.job_dir, ports=(port, port + 1))
    argv = [f"{h.job_dir}/launch.sh"] + (["--job-id", record.job_id] if record.job_id else [])
    if h.name not in alive:  # a new run on this host: new log files (the last run's kept under logs/runs/<n>/)
        argv = ["sh", "-c", LOG_ROTATE_SCRIPT, "sh", h.job_dir, str(LOG_RUNS_KEPT), *argv]
    launch = host.run(argv, timeout=LAUNCH_TIMEOUT)
    return "already running" not in unless_other_job(host.name, launch).check().stdout


def _preflight_scheduler(record: JobRecord, ssh: SshSettings, alive: frozenset[str]) -> None:
    """The scheduler host's preflight with its two ports (as `start_host` runs it), unless its agent runs (`alive`):
    ClusterError (a UserError naming the host and the busy port) before anything was moved or started."""
    h = record.host(record.scheduler_host)
    if h.name in alive:
        return
    port = record.sched_port
    check_all(run_on_all([host_target(h, record.local)],
                         lambda host: host.preflight(h.python, h.job_dir, ports=(port, port + 1)), ssh))


def _check_first(record: JobRecord, ssh: SshSettings, project: Path) -> None:
    """`train`'s check: the table and UserError on a problem (nothing has been started); slow hosts are warned of."""
    report = run_check(record, ssh, project)
    refuse = [p for p in report.problems if not p.slow]
    if refuse:
        print_report(record, report)
        raise UserError(failure_text(report.problems) + "\nnothing was started; fix these (or pass --no-check to "
                        "start anyway)")
    for p in report.problems:
        say(f"warning: {p.line()}")
    say(f"checked {len(record.hosts)} host(s): they agree" + (" (some are slow, see the warnings)"
                                                              if report.problems else ""))


@dataclass(frozen=True)
class Finished:
    """A run that ended with every host's agent succeeded: the job is done."""

    step: int | None  # the last step any worker reported
    at: str | None  # when the last agent recorded it (its own clock)


def finished_run(hosts: list[HostStatus]) -> Finished | None:
    """The job's previous run, if every host reached says it succeeded (None while anything runs, or ended
    otherwise: a stopped or failed run is resumed by the next `train`)."""
    if not hosts or not all(h.reached and h.agent == AgentState.SUCCEEDED for h in hosts):
        return None
    steps = [p.step for h in hosts for p in h.processes if p.role == "worker" and p.step is not None]
    stamps = [h.updated_at for h in hosts if h.updated_at]
    return Finished(max(steps) if steps else None, max(stamps) if stamps else None)


def refuse_start(record: JobRecord, hosts: list[HostStatus], ssh: SshSettings, fresh: bool, again: bool,
                 verb: str = "fleet train", world_size: int | None = None) -> None:
    """Refuse to start job `record` on what its previous run left (`hosts`: its hosts' statuses), nothing started
    and nothing moved: another project's job in its directories; a running job with `fresh`; a finished job
    without `fresh` or `again` (see `start_job`); a run of another size than the previous one (jobhosts.rerun;
    `world_size`: the size it will have, default the record's) unless `fresh`. UserError saying what to type
    (`verb`: the command to type again)."""
    other = [h for h in hosts if h.other_job is not None]
    if other:
        running = " (running)" if any(h.alive for h in other) else ""
        raise UserError(f"job {record.job}: {', '.join(f'{h.host}:{h.other_job}' for h in other)} holds another "
                        f"project's job of this name{running}: nothing was started, and that job was left as it is; "
                        "deploy this one under another --job name (or --workdir)")
    alive = [h.host for h in hosts if h.alive]
    if alive:
        if fresh:
            raise UserError(f"job {record.job} is running on {', '.join(alive)}: stop it first ('fleet stop'), "
                            f"then '{verb} --fresh' starts it over")
        refuse_size_change(record, ssh, verb, running=True, world_size=world_size)
        return
    done = finished_run(hosts)
    if done is not None and not (fresh or again):
        step = f" at step {done.step}" if done.step is not None else ""
        when = f" ({done.at})" if done.at else ""
        raise UserError(f"job {record.job} already finished{step}{when}: nothing to train. '{verb} --fresh' "
                        "trains it again from the start (its checkpoints and state are moved aside, not deleted), "
                        f"'{verb} --again' goes on from its final checkpoints (e.g. with more epochs), or "
                        "deploy it under another --job name")
    if not fresh:
        refuse_size_change(record, ssh, verb, world_size=world_size)


def _move_aside(record: JobRecord, ssh: SshSettings, hosts: list[HostStatus], project: Path) -> None:
    """`--fresh`: move the previous run aside on every host, so that the new run starts from step 0 and no status
    shows the old run's processes: its checkpoints, state, and the checkpoints its scripts wrote in their project
    (`project`: where a local job runs; jobhosts.rerun says which; `hosts`: their statuses, for when each last
    ran)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    written = project_checkpoints(record, ssh, project, {h.host: h.updated_at for h in hosts})
    key_id = ckptkey.key_id(ckptkey.job_key(jobrecord.token(project, record.job)))  # its checkpoints' key

    def archive(host: Host) -> str:
        """Move this host's previous run aside (ARCHIVE_SCRIPT, move_checkpoints); returns its "moved ..." lines."""
        h = record.host(host.name)
        files = written.get(host.name, [])  # first, all or nothing: if it fails, nothing of the host was moved
        from_project = move_checkpoints(host, h, workdir_of(h, record.local, project), files, stamp)
        moved = host.run(["sh", "-c", ARCHIVE_SCRIPT, "sh", h.job_dir, h.ckpt_dir or f"{h.job_dir}/ckpt", stamp,
                          key_id], timeout=STATUS_TIMEOUT, check=True).stdout.strip()
        return "\n".join(filter(None, [moved, from_project]))

    moved = fan_out("moving the previous run aside", record_targets(record), archive, ssh)
    for name, text in moved.items():
        for line in text.splitlines():
            say(f"{name}: {line}")


def _roll_back(record: JobRecord, ssh: SshSettings, results: Mapping[str, HostResult[bool]]) -> None:
    """Stop the job where this train started it (or may have), then raise the start failure.

    "May have": a host that failed after connecting (a launch.sh that timed out, a lost connection) may run
    an agent; only hosts that failed before anything could run there (unreachable, login or host key refused,
    preflight failed), were skipped, or whose agent already ran before this train are left alone. Always raises
    UserError: the start failure (root cause first), then per host whether stopping worked, and `fleet stop` for
    the hosts where it did not."""
    never = (HostUnreachable, AuthenticationFailed, UnknownHostKey, ChangedHostKey, PreflightFailed)
    started = [record.host(n) for n, r in results.items()
               if (r.ok and r.value) or (not r.ok and not r.skipped and not isinstance(r.exception, never))]
    error = ClusterError(results)
    lines = [str(error)]
    if started:
        stopped = run_on_all([host_target(h, record.local) for h in started],
                             lambda host: stop_one(host, record, "fleet train: its start failed"), ssh)
        ok = [n for n, r in stopped.items() if r.ok]
        bad = [r for r in stopped.values() if not r.ok]
        if ok:
            lines.append(f"stopped the job again on {', '.join(ok)}: no process of it is left there")
        lines += [f"could not stop it on {r.error}; run 'fleet stop' once the host is back" for r in bad]
    else:
        lines.append("nothing was started")
    raise UserError("\n".join(lines))
