"""`replace`: a spare host takes over a host's ranks now, by the operator's word (`fleet replace --host X [--with Y]`),
as the scheduler does by itself for a host it finds lost.

The decision is the scheduler's (toolkit.scheduler.membership: which spare is free, whether the host can be
replaced); this task only carries the request to it: over SSH to the scheduler's host, where `python -m toolkit.agent
replace` opens an authenticated connection with the job token from the job directory (the token never leaves the
hosts). The job record learns the new layout from the spare's agent at the next `status` or `train --join` poll."""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.launcher.jobhosts.output import say
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, host_target, load_record, record_ssh
from toolkit.launcher.remote import ClusterError, Host, run_on_all
from toolkit.launcher.settings import JobRef


def replace(ref: JobRef, host_name: str | None, spare: str | None) -> None:
    """Ask the scheduler to hand `host_name`'s ranks to `spare` (default: the first free spare with a connected agent)
    and fence `host_name`. Prints what moved where.

    Raises UserError, one line, for a missing --host, a host or spare the job record does not have, a --with host
    that is not a spare, a host already replaced, or the scheduler's refusal (its reason: the job ended, no free spare,
    the scheduler's own host...); ClusterError if the scheduler's host cannot be reached. One bounded command on the
    scheduler's host (STATUS_TIMEOUT)."""
    if not host_name:
        raise UserError("replace needs --host HOST: the host whose ranks a spare takes over (--with SPARE picks the "
                        "spare)")
    record = load_record(ref)
    lost = record.host(host_name)
    if lost.replaced_by:
        raise UserError(f"{host_name} was already replaced by {lost.replaced_by}")
    spares = [h.name for h in record.hosts if h.spare and not h.node_ids and not h.replaced_by]
    if spare is not None and not record.host(spare).spare:
        raise UserError(f"--with {spare}: not a spare of job {record.job} (the inventory's [spares]); its free spares: "
                        f"{', '.join(spares) or 'none'}")
    sched = record.host(record.scheduler_host)
    argv = [sched.python, "-m", "toolkit.agent", "replace", "--job-dir", sched.job_dir, host_name]
    argv += ["--with", spare] if spare else []

    def ask(host: Host) -> tuple[int | None, str]:
        """The replace command's exit code and what it said."""
        result = host.run(argv, timeout=STATUS_TIMEOUT)
        if result.exit_code not in (0, 1):
            result.check()  # raises the matching RemoteError: lost connection, timeout, bad command
        return result.exit_code, (result.stdout + result.stderr).strip()

    results = run_on_all([host_target(sched, record.local)], ask, record_ssh(record, ref.request.core))
    r = results[sched.name]
    if not r.ok or r.value is None:
        raise ClusterError(results)
    code, said = r.value
    if code != 0:
        raise UserError(said.removeprefix(f"{sched.name}: ") or f"the scheduler refused to replace {host_name}")
    say(f"{said}; 'fleet status' shows the new layout")
