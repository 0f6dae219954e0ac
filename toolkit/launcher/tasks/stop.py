"""`stop` and `restart`: end the job on every host and verify nothing is left; restart one process or one host by
hand.

Both act through what deploy put on each host (stop.sh, recover.sh, launch.sh), so the host's agent does the
signalling: it signals only processes it can prove are the job's (pid and start time), never by name."""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.launcher.jobhosts.output import say
from toolkit.launcher.jobhosts.poll import poll_status
from toolkit.launcher.jobhosts.reach import (
    LAUNCH_TIMEOUT,
    OtherJob,
    host_target,
    load_record,
    record_ssh,
    unless_other_job,
)
from toolkit.launcher.jobhosts.stopjob import stop_job
from toolkit.launcher.remote import (
    Host,
    check_all,
    run_on_all,
)
from toolkit.launcher.settings import JobRef


def stop(ref: JobRef) -> None:
    """Stop the job on every host (SIGTERM, grace, SIGKILL) and verify that no process of it remains
    (toolkit.launcher.jobhosts.stopjob.stop_job, which `run` calls on Ctrl-C too, says how and what it raises)."""
    record = load_record(ref)
    stop_job(record, record_ssh(record, ref.request.core))


# --- restart -----------------------------------------------------------------------------------------------------


def restart(ref: JobRef, node: str | None, host_name: str | None) -> None:
    """Restart one process by hand through its agent, with the same environment (`--node`, what recover.sh
    does on the host), or every process of one host (`--host`; starts the host's agent if it is gone).

    Exactly one of `node` and `host_name` (UserError otherwise, or for a name the job does not have). Each
    recover.sh or launch.sh is bounded by LAUNCH_TIMEOUT; recover.sh starts the agent too if it is gone. Prints
    what the host said; raises ClusterError if the host fails."""
    if (node is None) == (host_name is None):
        raise UserError("restart needs exactly one of --node NODE_ID (e.g. worker_3) or --host HOST")
    record = load_record(ref)
    h = record.host(record.process(node)["host"]) if node is not None else record.host(host_name)  # type: ignore

    def do(host: Host) -> str:
        """recover.sh for the node; for a host, launch.sh if its agent is not alive, else recover.sh per node. Never
        in a job directory that holds another project's job (OtherJob)."""
        doc = poll_status(host, h)["doc"]
        if doc.job_id and record.job_id and doc.job_id != record.job_id:
            raise OtherJob(host.name, f"{h.job_dir} holds another project's job {record.job}: nothing was restarted")
        if node is not None:
            return host.run([f"{h.job_dir}/recover.sh", node], timeout=LAUNCH_TIMEOUT, check=True).stdout.strip()
        if not doc.alive:
            launch = host.run([f"{h.job_dir}/launch.sh", "--job-id", record.job_id] if record.job_id else
                              [f"{h.job_dir}/launch.sh"], timeout=LAUNCH_TIMEOUT)
            return unless_other_job(host.name, launch).check().stdout.strip()
        return "\n".join(host.run([f"{h.job_dir}/recover.sh", n], timeout=LAUNCH_TIMEOUT, check=True).stdout.strip()
                         for n in h.node_ids)

    out = check_all(run_on_all([host_target(h, record.local)], do, record_ssh(record, ref.request.core)))[h.name]
    say(out or f"restarted {node or host_name}")
