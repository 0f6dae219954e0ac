"""`grow`: a host the operator names joins a degraded elastic job (`fleet grow --host X[:SLOTS]`, issue 42 item 3).

An elastic job that lost a host and shrank (its survivors serve the lost host's logical ranks) benches that host's
slots. `grow` gives the job a new host for them, as a spare of the inventory's [spares] would be, but named now: X
is deployed to (only X: the lost host may be gone), checked against the scheduler's host by the pre-flight check
(`fleet check`'s facts and health), added to the job record as a spare, and its agent started. Its agent says hello
as a spare; the scheduler's scan hands it the benched host's slots (toolkit.scheduler.membership `_take_over`), and
its workers join at the next step boundary, taking the state from a peer. A job that is not degraded is refused:
its world is its logical ranks' count, and every one of them has its own worker."""

from __future__ import annotations

import dataclasses
import functools

from toolkit.contracts import jobrecord
from toolkit.contracts.jobrecord import JobRecord
from toolkit.errors import UserError
from toolkit.launcher.inventory import Host, Inventory, split_host_item
from toolkit.launcher.jobhosts.deployment import deploy_host, recorded_inventory
from toolkit.launcher.jobhosts.follow import benched_hosts
from toolkit.launcher.jobhosts.launch import start_host
from toolkit.launcher.jobhosts.output import say
from toolkit.launcher.jobhosts.poll import collect_status
from toolkit.launcher.jobhosts.preflight import failure_text, print_report, run_check
from toolkit.launcher.jobhosts.reach import host_target, load_record, record_ssh
from toolkit.launcher.jobhosts.view import job_live
from toolkit.launcher.remote import ClusterError, SshSettings, run_on_all
from toolkit.launcher.settings import Recorded, Request


def grow(request: Request, spec: str | None) -> None:
    """Deploy, check and start host `spec` (`[user@]host[:slots]`) as the job's spare for its benched host (the
    first, in the record's order), whose slots it takes at the next step boundary. Prints what it did.

    Raises UserError, one line, for a missing or malformed --host, a job on this machine, a host already in the job,
    a job that is not degraded (nothing to grow into), SLOTS other than the benched host's, or the check's problems
    (then X holds the job's files but runs nothing and the record does not name it); ClusterError if X or the
    scheduler's host cannot be reached. Every remote call is bounded (as deploy, check and train bound them)."""
    ref = request.job_ref()
    if not spec:
        raise UserError("grow needs --host HOST[:SLOTS]: the new host that takes the slots of the host a degraded "
                        "elastic job goes on without")
    user, name, slots = split_host_item(spec.strip(), f"--host {spec}")
    record = load_record(ref)
    if record.local:
        raise UserError(f"job {record.job} runs on this machine: there is no host to grow it with; deploy it on "
                        "hosts (--hosts, --hostfile or --inventory) to use 'fleet grow'")
    _refuse_known(record, name)
    ssh = record_ssh(record, request.core)
    lost = _benched_host(record, ssh)
    need = sum(1 for n in record.host(lost).node_ids if n != "sched")
    if slots is not None and slots != need:
        raise UserError(f"--host {spec}: {name} would take the {need} slot(s) of {lost}, the host the job goes on "
                        f"without; give {name}:{need} (or no :SLOTS)")
    defined = _defined(request, name) or Host(name=name)
    host = dataclasses.replace(defined, slots=need, user=user or defined.user)
    settings = request.with_recorded(Recorded(record.options, _with_spare(recorded_inventory(record), host))).settings()
    new = deploy_host(settings, name)
    grown = dataclasses.replace(record, hosts=record.hosts + (new,))
    checked = dataclasses.replace(grown, hosts=(grown.host(grown.scheduler_host), new))
    report = run_check(checked, ssh, ref.project)
    print_report(checked, report)
    if report.problems:
        raise UserError(failure_text(report.problems) + f"\n{name} was not added to job {record.job}: fix the "
                        f"above and run 'fleet grow --host {spec}' again")
    jobrecord.update(ref.project, grown)
    results = run_on_all([host_target(new, False)], functools.partial(start_host, grown, frozenset()), ssh)
    if not results[name].ok:
        raise ClusterError(results)
    say(f"{name} joined job {record.job} as a spare: it takes {lost}'s {need} slot(s) "
        f"({', '.join(n for n in record.host(lost).node_ids if n != 'sched')}) and the state from a peer at the next "
        "step boundary; 'fleet status' shows the job grow back")


def _defined(request: Request, name: str) -> Host | None:
    """`name` as the project's inventory defines it (how to reach it, its workdir and python), if it does: a host
    listed there outside [workers] and [spares] is one the operator keeps at hand to grow a job with."""
    try:
        return request.settings().inventory.host(name)
    except UserError:  # no inventory configured, or it has no such host: the job's defaults (--workdir, --python)
        return None


def _refuse_known(record: JobRecord, name: str) -> None:
    """UserError if `name` is already one of the job's hosts (by name or address), saying what to type instead."""
    for h in record.hosts:
        if name not in (h.name, h.hostname):
            continue
        if h.replaced_by:
            raise UserError(f"{name} was replaced by {h.replaced_by} in job {record.job} and is fenced from it: it "
                            "may not rejoin; grow with another host")
        if h.spare and not h.node_ids:
            raise UserError(f"{name} is already a spare of job {record.job}: the scheduler gives it a lost host's "
                            "slots by itself ('fleet replace --host LOST --with " + name + "' does it now)")
        raise UserError(f"{name} is already a host of job {record.job}: 'fleet restart --host {h.name}' starts its "
                        "agent again if it is down; grow with a host the job does not have")


def _benched_host(record: JobRecord, ssh: SshSettings) -> str:
    """The host whose slots a new host takes: the first the elastic job goes on without (its scheduler's live.json,
    read on the scheduler's host). UserError if the job runs nothing there or is not degraded."""
    _, hosts = collect_status(record, ssh, hosts=[record.host(record.scheduler_host)])
    sched = hosts[0] if hosts else None
    if sched is None or not sched.alive:
        said = (sched.error or sched.reason) if sched is not None else None
        why = f" ({said})" if said else ""
        raise UserError(f"job {record.job} does not run on its scheduler's host {record.scheduler_host}{why}: only "
                        "a running job grows; 'fleet status' says how it stands")
    benched = benched_hosts(record, job_live(hosts) or {})
    if not benched:
        raise UserError(f"job {record.job} is not degraded: each of its {record.world_size} logical ranks has its own "
                        "worker, and the job's world is its logical ranks' count, so there is nothing to grow "
                        "into; to keep a host in reserve, add it to the inventory's [spares] and deploy")
    return next(h.name for h in record.hosts if h.name in benched)


def _with_spare(inventory: Inventory, host: Host) -> Inventory:
    """`inventory` with `host` added as a spare (last)."""
    return dataclasses.replace(inventory, hosts=inventory.hosts + (host,), spares=inventory.spares + (host.name,))
