"""Stopping the job through what deploy put on each host (stop.sh), so that the host's agent does the signalling: it
signals only processes it can prove are the job's (pid and start time), never by name. Shared by `stop`, `run`'s
Ctrl-C, train's rollback and --join after a failure: one stop, whoever asks for it."""

from __future__ import annotations

import threading

from toolkit.contracts.jobrecord import JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.output import interrupt_sets, say
from toolkit.launcher.jobhosts.reach import STOP_TIMEOUT_EXTRA, OtherJob, record_targets, result_line, unless_other_job
from toolkit.launcher.jobhosts.scripts import STOP_SCRIPT
from toolkit.launcher.remote import ClusterError, Host, SshSettings, check_all, rich_progress, run_on_all

STOP_WAIT_MARGIN = 30.0  # s beyond stop_job's own bound that run's Ctrl-C waits for it (connecting, the fan-out)
EXIT_STOPPED = 130  # `run` stopped the job on Ctrl-C: as a shell reports a command ended by SIGINT


class StoppedOnInterrupt(UserError):
    """Ctrl-C during `fleet run`: the job was stopped (with last words, as `fleet stop`), or with a second Ctrl-C
    at once. Exits EXIT_STOPPED."""

    exit_code = EXIT_STOPPED


def stop_one(host: Host, record: JobRecord, by: str = "fleet stop", now: bool = False) -> str:
    """Stop the job on one host through its stop.sh (STOP_SCRIPT) and return what it printed. Bounded by the
    grace period plus STOP_TIMEOUT_EXTRA; `now`: no grace (the agent is killed at once, and what it leaves: the
    second Ctrl-C of `run`). Raises CommandFailed (stop.sh could not verify that nothing is left, or timed out),
    ConnectionLost or HostStalled, and OtherJob where the job directory holds another project's job (left
    running). Used by `stop`, `run`, train's rollback and --join after a failure; `by` says which (the cause the
    agent records for the processes it stops: "stopped by fleet stop")."""
    h = record.host(host.name)
    result = host.run(["sh", "-c", STOP_SCRIPT, "sh", h.job_dir, h.name, record.job_id or "", by,
                       *(["--timeout", "0"] if now else [])],
                      timeout=(0 if now else record.grace) + STOP_TIMEOUT_EXTRA)
    return unless_other_job(host.name, result).check().stdout.strip()


def stop_job(record: JobRecord, ssh: SshSettings, now: bool = False, by: str = "fleet stop") -> None:
    """`fleet stop`: stop the job on every host (SIGTERM, grace, SIGKILL; `now`: SIGKILL at once) and verify that
    no process of it remains.

    Every host in parallel, each bounded as `stop_one`; a host where nothing was deployed counts as stopped. Raises
    UserError listing the hosts that failed (root cause first) and saying the job may still run there: run `fleet
    stop` again once they answer. Repeating it is harmless. A host replaced by a spare is stopped too if it answers
    (a healed partition may have left processes there); if it does not, that is only said: the scheduler fences it
    from the job anyway."""
    with rich_progress("stopping", len(record.hosts), line=result_line) as progress:
        results = run_on_all(record_targets(record), lambda host: stop_one(host, record, by, now), ssh,
                             progress=progress)
    for name in [n for n, r in results.items() if isinstance(r.exception, OtherJob)]:
        say(f"{results.pop(name).error}; nothing of this job runs there")
    for name in [n for n, r in results.items() if not r.ok and record.host(n).replaced_by]:
        say(f"{name} (replaced by {record.host(name).replaced_by}) could not be stopped: {results.pop(name).error}; "
            "it is fenced from the job")
    try:
        check_all(results)
    except ClusterError as e:
        raise UserError(f"{e}\nthe job may still run there: run 'fleet stop' again once the host answers") from None
    say(f"job {record.job} stopped on {len(results)} host(s); each verified that no process of the job is left")


def stop_on_interrupt(record: JobRecord, ssh: SshSettings) -> StoppedOnInterrupt:
    """What `run` does on Ctrl-C: stop the job as `fleet stop` does (stop_job: SIGTERM, so a toolkit.train script
    saves its last words, the grace period, SIGKILL), while a second Ctrl-C stops it at once (stop_job with
    `now`). The stop runs on its own thread so that the main thread can take the second Ctrl-C as an event (the
    handler only sets it) instead of an exception in the middle of a fan-out. Returns the error `run` raises:
    StoppedOnInterrupt saying how it ended; what stop_job raised, it raises."""
    say(f"Ctrl-C: stopping job {record.job} (SIGTERM, last words, up to {record.grace:g} s of grace); Ctrl-C again "
        "stops it at once")
    wake, again = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def stop_gently() -> None:
        try:
            stop_job(record, ssh, by="Ctrl-C of fleet run")
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, raised there
            failure.append(e)
        finally:
            wake.set()

    worker = threading.Thread(target=stop_gently, name="stop", daemon=True)
    with interrupt_sets(again, wake):
        worker.start()
        if not wake.wait(record.grace + STOP_TIMEOUT_EXTRA + STOP_WAIT_MARGIN):  # stop_job is bounded by less
            raise UserError(f"stopping job {record.job} did not end in time: the job may still run; run 'fleet stop' "
                            "again")
        if again.is_set() and worker.is_alive():
            say(f"Ctrl-C again: stopping job {record.job} at once (SIGKILL)")
            stop_job(record, ssh, now=True, by="Ctrl-C of fleet run")
            return StoppedOnInterrupt(f"job {record.job} killed (second Ctrl-C): no process of it is left; its last "
                                      "checkpoint is the one saved before")
    if failure:
        raise failure[0]
    return StoppedOnInterrupt(f"job {record.job} stopped (Ctrl-C): its workers had SIGTERM and the grace period to "
                              "save last words; 'fleet train' resumes it")
