"""Reaching the hosts of a job: SSH settings as deploy recorded them (Fabric's flags typed now win), one Target per
host, and a fan-out with a progress line per host.

Only deploy builds SSH settings from flags (`ssh_settings`); every later task reaches the hosts as the job record
says (`record_ssh`, `record_targets`), so `status` or `stop` need no host flags and cannot reach different hosts
than the job runs on. The timeouts below bound the tasks' own remote commands (on top of SshSettings' bounds)."""

from __future__ import annotations

from typing import Any, Callable

from toolkit.contracts import jobrecord
from toolkit.contracts.agentdoc import EXIT_OTHER_JOB
from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.errors import UserError
from toolkit.launcher.remote import (
    CommandResult,
    Host,
    HostResult,
    PreflightFailed,
    SshSettings,
    Target,
    check_all,
    rich_progress,
    run_on_all,
)
from toolkit.launcher.settings import RECORDED_SSH, CoreFlags, JobRef, Settings

LAUNCH_TIMEOUT = 60.0  # s for launch.sh to report the agent up
STOP_TIMEOUT_EXTRA = 30.0  # s beyond the grace period for stop.sh to finish
STATUS_TIMEOUT = 30.0  # s for one host's status or log command


class OtherJob(PreflightFailed):
    """The host's job directory holds another project's job of this name (the agent's EXIT_OTHER_JOB): nothing was
    done there, and that job was left as it is."""


def unless_other_job(host: str, result: CommandResult) -> CommandResult:
    """`result`, unless it is the agent's EXIT_OTHER_JOB (launch.sh or stop.sh --job-id): then OtherJob with the
    agent's line."""
    if result.exit_code == EXIT_OTHER_JOB:
        line = (result.stderr.strip().splitlines() or ["another project's job is there"])[-1]
        raise OtherJob(host, line.removeprefix(f"{host}: "))
    return result


def load_record(ref: JobRef) -> JobRecord:
    """The deployed job a command means, checked against what was typed: a flag that contradicts the record is
    an error (deploy again to change the job), never silently ignored.

    Raises UserError when no job was deployed from the project, the name is ambiguous, the record is unreadable
    or damaged (jobrecord.load), or the typed flags contradict it. Reads local files only."""
    record = jobrecord.load(ref.project, ref.job, ref.default_job)
    recorded = {**record.options, **{k: record.ssh.get(k) for k in RECORDED_SSH}}
    wrong = ref.request.contradictions(record.job, recorded, tuple(h.name for h in record.hosts), record.local)
    if wrong:
        raise UserError("; ".join(wrong) + f": run 'fleet deploy' with the new values to change job {record.job} "
                        "(or leave the flags out: every task reads them from the job record)")
    return record


def ssh_settings(settings: Settings) -> SshSettings:
    """SSH settings from the typed flags (deploy); the other bounds keep SshSettings' defaults. Raises UserError
    for a non-positive timeout or --parallel."""
    return SshSettings(
        known_hosts=settings.known_hosts,
        accept_new_host_keys=settings.accept_new_host_keys,
        ssh_config=settings.core.ssh_config,
        identity_files=settings.core.identities,
        connect_timeout=settings.core.connect_timeout,
        parallel=settings.parallel,
    )


def record_ssh(record: JobRecord, core: CoreFlags | None = None) -> SshSettings:
    """How deploy reached the hosts; Fabric's own flags typed now (-S, -i, -t) take precedence."""
    s = record.ssh
    return SshSettings(
        known_hosts=s["known_hosts"],
        accept_new_host_keys=s["accept_new_host_keys"],
        ssh_config=(core.ssh_config if core and core.ssh_config else None) or s["ssh_config"],
        identity_files=(core.identities if core and core.identities else None) or tuple(s["identities"]),
        connect_timeout=(core.connect_timeout if core and core.connect_timeout else None) or s["connect_timeout"],
        parallel=s["parallel"],
    )


def record_targets(record: JobRecord) -> list[Target]:
    """One Target per host of the job, in the record's order (the order of every table and result)."""
    return [host_target(h, record.local) for h in record.hosts]


def host_target(h: HostRecord, local: bool) -> Target:
    """The Target for one recorded host. A hostname equal to the name (deploy records the name when the inventory
    gave no address) is left to ssh_config, where the name may be an alias."""
    hostname = None if h.hostname == h.name else h.hostname
    return Target(h.name, hostname=hostname, port=h.port, user=h.user, key_file=h.key_file, local=local)


def fan_out(what: str, targets: list[Target], fn: Callable[[Host], Any], ssh: SshSettings,
             line: Callable[[HostResult[Any]], str | None] | None = None) -> dict[str, Any]:
    """run_on_all under a progress bar titled `what` (with `line(result)` printed per host), all or nothing: the
    values by host name, or ClusterError naming every failed host, root cause first."""
    with rich_progress(what, len(targets), line=line) as progress:
        results: dict[str, HostResult[Any]] = run_on_all(targets, fn, ssh, progress=progress)
    return check_all(results)


def result_line(r: HostResult[Any]) -> str | None:
    """A progress line: the host's value as text (nothing if empty); nothing for a failed host, whose error the
    caller says once after the fan-out (ClusterError groups the hosts that failed alike: one fact, one line)."""
    return str(r.value) if r.ok and r.value else None
