"""Stopping the job on one host through what deploy put there (stop.sh), so that the host's agent does the
signalling: it signals only processes it can prove are the job's (pid and start time), never by name. Shared by
`stop`, train's rollback and --join after a failure."""

from __future__ import annotations

from toolkit.jobhosts.reach import STOP_TIMEOUT_EXTRA, unless_other_job
from toolkit.jobhosts.scripts import STOP_SCRIPT
from toolkit.jobrecord import JobRecord
from toolkit.remote import Host


def stop_one(host: Host, record: JobRecord, by: str = "fleet stop") -> str:
    """Stop the job on one host through its stop.sh (STOP_SCRIPT) and return what it printed. Bounded by the
    grace period plus STOP_TIMEOUT_EXTRA; raises CommandFailed (stop.sh could not verify that nothing is left,
    or timed out), ConnectionLost or HostStalled, and OtherJob where the job directory holds another project's job
    (left running). Used by `stop`, by train's rollback and by --join after a failure; `by` says which (the cause
    the agent records for the processes it stops: "stopped by fleet stop")."""
    h = record.host(host.name)
    result = host.run(["sh", "-c", STOP_SCRIPT, "sh", h.job_dir, h.name, record.job_id, by],
                      timeout=record.grace + STOP_TIMEOUT_EXTRA)
    return unless_other_job(host.name, result).check().stdout.strip()
