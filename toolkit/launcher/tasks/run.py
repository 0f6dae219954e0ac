"""`run`: deploy, train and wait in one, the way torchrun and mpirun are typed (`fleet run --nproc-per-node
2 train.py --lr 0.1`), and stop on Ctrl-C as they do.

The recorded job is the default: in a project with a deployed job, what was not typed is taken from its record
(hosts, size, port, options), so `fleet run train.py` runs it again as it was; only the flags typed change it, as
they may between two torchrun commands. What `train` refuses (a finished job without --fresh or --again, a run of
another size, a job that still runs) `run` refuses before it deploys anything. Each host is asked for its status
once: before the deploy, and that answer is what the start goes on (`start_job`'s `known`)."""

from __future__ import annotations

from toolkit.contracts import jobrecord
from toolkit.contracts.jobrecord import JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.deployment import deploy, launch_plan, recorded_inventory
from toolkit.launcher.jobhosts.launch import refuse_start, start_job
from toolkit.launcher.jobhosts.poll import collect_status
from toolkit.launcher.jobhosts.reach import record_ssh
from toolkit.launcher.jobhosts.streams import RankFilter
from toolkit.launcher.jobhosts.view import HostStatus
from toolkit.launcher.settings import Recorded, Request

VERB = "fleet run"


def run(request: Request, join_timeout: float | None = None, fresh: bool = False, again: bool = False,
        check: bool = True, detach: bool = False, stream: RankFilter | None = None) -> None:
    """Deploy the job (the recorded one, with what was typed over it), start it and wait for its end
    (toolkit.launcher.jobhosts.launch.start_job with join, as `train --join` does); Ctrl-C stops the job with last words
    (a second one at once); `detach` returns once it started, leaving it running; `stream`: whose output is shown
    while it waits (jobhosts.streams.RankFilter).

    Refused before anything is deployed (UserError, saying what to type): a job of that name that still runs on
    some host, and what `refuse_start` refuses (a finished job, another size, another project's job). Raises what
    deploy and start_job raise (UserError; JobFailed, exit 1, when the job fails; StoppedOnInterrupt, exit 130,
    on Ctrl-C)."""
    if fresh and again:
        raise UserError("--fresh and --again both given: start the job over (--fresh) or go on from where it "
                        "ended (--again), not both")
    ref = request.job_ref()
    try:
        name = jobrecord.choose(ref.project, ref.job, ref.default_job)
    except UserError:  # several jobs there, none named: run deploys the one named after the project, as before
        name = ref.default_job
    old = jobrecord.load(ref.project, name) if name is not None and jobrecord.exists(ref.project, name) else None
    if old is not None:
        request = request.with_recorded(Recorded(old.options, None if old.local else recorded_inventory(old)))
    settings = request.settings()
    known = None
    if old is not None and old.job == settings.options.job:
        known = _refuse_before_deploy(old, request, launch_plan(settings).world_size, fresh, again)
    record = deploy(settings)
    if old is not None and known is not None and not _same_hosts(old, record):
        known = None  # other hosts or job directories: start_job asks the new ones
    start_job(request, join=not detach, join_timeout=join_timeout, fresh=fresh, again=again, check=check, verb=VERB,
              deployed=record, known=known, stop_on_ctrl_c=True, stream=stream)


def _refuse_before_deploy(old: JobRecord, request: Request, world_size: int, fresh: bool,
                          again: bool) -> list[HostStatus]:
    """Ask every host of the recorded job for its status (once) and refuse what cannot start: a job that still
    runs, and what `refuse_start` refuses, with the size this run asks for. Returns the statuses."""
    ssh = record_ssh(old, request.core)
    _, hosts = collect_status(old, ssh)
    alive = [h.host for h in hosts if h.alive]
    if alive:
        raise UserError(f"job {old.job} already runs on {', '.join(alive)}: 'fleet train --join' waits for it, "
                        "'fleet stop' ends it; or give this run another --job name")
    refuse_start(old, hosts, ssh, fresh=fresh, again=again, verb=VERB, world_size=world_size)
    return hosts


def _same_hosts(old: JobRecord, new: JobRecord) -> bool:
    """Whether `new` lives where `old` did (the same hosts and job directories): then their statuses still hold."""
    return [(h.name, h.job_dir) for h in old.live_hosts] == [(h.name, h.job_dir) for h in new.live_hosts]
