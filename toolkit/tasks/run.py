"""`run`: deploy, train and wait in one command, the way torchrun and mpirun are typed (`fleet run --nproc-per-node
2 train.py --lr 0.1`). Each `run` deploys what was typed, so the flags and the script's arguments may change from
one run to the next, as they may between two torchrun commands; what `train` refuses (a finished job without
--fresh or --again, a run of another size) `run` refuses the same way."""

from __future__ import annotations

from toolkit import jobrecord
from toolkit.errors import UserError
from toolkit.jobhosts.deployment import deploy
from toolkit.jobhosts.launch import refuse_finished, start_job
from toolkit.jobhosts.poll import collect_status
from toolkit.jobhosts.reach import record_ssh
from toolkit.settings import Request


def run(request: Request, join_timeout: float | None = None, fresh: bool = False, again: bool = False,
        check: bool = True) -> None:
    """Deploy the job as typed, start it and wait for its end (toolkit.jobhosts.launch.start_job with join, as
    `train --join` does).

    A job of that name that still runs on some host is not deployed over: UserError naming the hosts and what to
    type (wait for it, stop it, or run under another --job), nor is one that finished without --fresh or --again
    (its deployed arguments stay those of its run). Raises what deploy and start_job raise (UserError, and
    JobFailed, exit 1, when the job fails)."""
    settings = request.settings()
    job = settings.options.job
    if jobrecord.exists(settings.project, job):
        record = jobrecord.load(settings.project, job)
        _, hosts = collect_status(record, record_ssh(record, request.core))
        alive = [h.host for h in hosts if h.alive]
        if alive:
            raise UserError(f"job {job} already runs on {', '.join(alive)}: 'fleet train --join' waits for it, "
                            "'fleet stop' ends it; or give this run another --job name")
        if not any(h.other_job for h in hosts):  # (another project's job there: start_job says so, in its words)
            refuse_finished(job, hosts, fresh, again, "fleet run")  # before deploy: nothing of it is changed
    deploy(settings)
    start_job(request, join=True, join_timeout=join_timeout, fresh=fresh, again=again, check=check, verb="fleet run")
