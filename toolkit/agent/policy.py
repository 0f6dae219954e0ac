"""The agent's decisions: what to do when one of its processes exits, and when the scheduler says something. Pure:
the facts come in as values (how long the process ran, whether it had trained, whether the operator asked for the
restart), a reaction comes out, and the supervisor (toolkit.agent.supervisor) applies it, as the scheduler's server
applies its membership's actions.

The restart policy, per process (host.json's max_restarts, backoff_base, backoff_max, restart_refill,
healthy_reset): the first restart is immediate (time to recovery matters), the next ones wait backoff_base * 2^(k-1)
seconds, capped at backoff_max, unless the process had trained since its launch (reported a step or joined its
group: a crash loop never does), which restarts at once; past max_restarts the job fails. The count starts again
only with progress: when the incarnation that failed had got past the step at which the previous failure happened
(restart_refill "progress", the default; a crash at the same step counts however long it took, and a script that
reports no step has every crash counted); "never" as torchrun; "time" after healthy_reset seconds of running. An
exit the scheduler asked for (fenced, or a torchrun-style script leaving a broken generation) and one the operator
asked for are relaunched at once and never counted. Compared with torchrun: its --max-restarts is one budget for the
whole worker group that never refills, every failure restarts every worker, and there is no backoff (a crash loop
ends in ~2 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol
from toolkit.contracts.agentdoc import ProcState
from toolkit.contracts.hostspec import RestartPolicy


@dataclass(frozen=True)
class Exited:
    """What the supervisor knows when one of its processes exits."""

    code: int | None  # None: killed by a signal
    ran_for: float  # s since its launch
    progressed: bool  # it reported a step, or joined its group, since its launch
    counted: int  # restarts counted against max_restarts so far
    manual: bool  # the operator asked for this restart (the exit was expected)
    closing: bool  # the agent is finishing or stopping: nothing is relaunched
    finishing: bool  # ... because the job finished: once nothing runs, the agent is done
    others_running: bool  # another process of this host still runs
    others_succeeded: bool  # every other process of this host has exited 0
    reached: int | None = None  # the last step this incarnation completed (contracts.stepfile); None: none
    failed_at: int | None = None  # the furthest step this count's failures reached (None: none, or no step)
    said_done: bool = False  # this incarnation told the scheduler it finished training


# --- reactions to an exit ---


@dataclass(frozen=True)
class Settle:
    """The process's final state is `state` (the agent is closing, or the process exited after it finished
    training); with `finish`, nothing runs any more and the finishing agent is done. `state` FAILED: a non-zero exit
    after the end, which makes the job failed (its exit status is the truth)."""

    state: ProcState
    finish: bool


@dataclass(frozen=True)
class Relaunch:
    """Start it again after `delay` s (0: now); `counted` is its new count of counted restarts; `failure`: the exit
    was a failure the restart policy judged (its step is the one the next failure is compared with)."""

    why: str
    delay: float
    counted: int
    failure: bool = False
    failed_at: int | None = None  # with `failure`: the furthest step of this count's failures (the next one's mark)


@dataclass(frozen=True)
class Succeeded:
    """It finished; with `all_done`, every process of the host has, and the agent is done."""

    all_done: bool


@dataclass(frozen=True)
class GiveUp:
    """Its restarts are used up: the job has failed."""

    counted: int
    failed_at: int | None = None


# A usage or set-up error: argparse's exit status, toolkit.train's (a missing script or module), the sample's (data or
# checkpoint directory unusable: another user may write it, read-only, no space). Before any step it cannot heal.
EXIT_SETUP = 2


def on_exit(policy: RestartPolicy, e: Exited, how: str) -> Settle | Relaunch | Succeeded | GiveUp:
    """The reaction to one process's exit. Pure. In order: a non-zero exit (a signal included) after the process
    said `done`, or while the agent finishes, settles it `failed` (the job has failed: a worker's exit status is the
    truth, and the scheduler will not take it back); a closing agent only settles the final state; the operator's
    restart relaunches at once, uncounted; exit 0 is success; EXIT_FATAL gives up at once, and so does EXIT_SETUP
    before the process made any progress (retried with backoff, it took 10-19 s to say what the first exit said);
    EXIT_FENCED and EXIT_REJOIN relaunch at once, uncounted; any other exit, a death by signal included, is a
    failure that RestartPolicy.after_failure counts, backs off or gives up on. `how` describes the exit ("exit
    code 3", "killed by SIGKILL") for the reasons given."""
    done_here = e.finishing and not e.others_running
    if e.code != 0 and (e.said_done or e.closing and e.finishing):
        return Settle(ProcState.FAILED, done_here)  # after the end: no restart can undo it, the job has failed
    if e.closing:
        return Settle(ProcState.SUCCEEDED if e.code == 0 else ProcState.STOPPED, done_here)
    if e.manual:
        return Relaunch("restart requested by the operator", 0.0, e.counted)
    if e.code == 0:
        return Succeeded(e.others_succeeded)
    if e.code == protocol.EXIT_FATAL:
        return GiveUp(e.counted)  # the worker found the job cannot go on correctly: a restart would hide it
    if e.code == EXIT_SETUP and not e.progressed:
        return GiveUp(e.counted)  # a usage or set-up error before any step: the same again, whatever the backoff
    if e.code in (protocol.EXIT_FENCED, protocol.EXIT_REJOIN):
        # Not the process's fault: the scheduler fenced a stale incarnation, or a wrapped torchrun-style script
        # left a broken generation. Relaunch at once, outside the crash budget.
        return Relaunch(f"relaunch after {how}", 0.0, e.counted)
    decision = policy.after_failure(e.counted, e.ran_for, e.progressed, e.reached, e.failed_at)
    if decision.give_up:
        return GiveUp(decision.counted, decision.failed_at)
    refilled = f"; the count started again: {decision.refilled}" if decision.refilled else ""
    return Relaunch(f"restart {decision.counted} of {policy.max_restarts} after {how}{refilled}", decision.delay,
                    decision.counted, failure=True, failed_at=decision.failed_at)


REPEATED = 2  # failures in a row at the same step with the same cause that `fleet status` points out


def repeated_failure(exits: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The failures at the end of a process's exit history (agent.json's `exits`: `failure` true for the ones the
    restart policy judged) that happened at the same step the same way (code or signal, and first cause), when there
    are REPEATED or more: {"times", "step", "code", "signal", "cause"}; None otherwise. A step of None (a script that
    reports none) is a step like any other: the same cause again and again is worth saying too. Pure."""
    run: list[Mapping[str, Any]] = []
    for rec in reversed(exits):
        if not rec.get("failure"):
            break
        if run and (rec.get("step"), rec.get("code"), rec.get("signal"), rec.get("cause")) != \
                (run[0].get("step"), run[0].get("code"), run[0].get("signal"), run[0].get("cause")):
            break
        run.append(rec)
    if len(run) < REPEATED:
        return None
    last = run[0]
    return {"times": len(run), "step": last.get("step"), "code": last.get("code"), "signal": last.get("signal"),
            "cause": last.get("cause")}


# --- reactions to the scheduler ---


@dataclass(frozen=True)
class Kill:
    """Fence a process the scheduler declared dead (it may still run, e.g. SIGSTOPped): SIGKILL its group; its
    death is then handled like any other, its first cause the scheduler's `cause` unless it had one of its own."""

    node_id: str
    cause: str = "declared dead"
    dump: bool = False  # write its Python stacks to its log first (protocol.STACKS_SIGNAL): a stuck rank's


@dataclass(frozen=True)
class StopJob:
    """The job failed elsewhere: stop every child and exit non-zero."""

    reason: str


@dataclass(frozen=True)
class FinishJob:
    """Every worker exited 0: cancel pending restarts, let what still runs end (grace), then exit 0."""


@dataclass(frozen=True)
class TakeOver:
    """This spare host takes over the lost `host`'s processes `node_ids`: start them (each for the first time here)."""

    host: str
    node_ids: tuple[str, ...]


@dataclass(frozen=True)
class Ignore:
    """Nothing to do; the supervisor logs `why` (unless it is "already closing")."""

    why: str


def on_scheduler(msg: wire.Message, running: Mapping[str, int], closing: bool,
                 standby: Collection[str] = (), supervised: Collection[str] = ()
                 ) -> Kill | StopJob | FinishJob | TakeOver | Ignore:
    """The reaction to one message from the scheduler (the link has authenticated it, toolkit.contracts.messages
    has read it). Pure. `kill` applies only to a node running here, and only to its running pid when the message
    names one (a kill for an earlier incarnation is ignored); `stop` fails the job here; `finished` ends it, unless
    the agent is already closing; `takeover` (to a spare host's agent) starts the named processes, if every one
    stands by here (`standby`: the node ids of host.json's standby list) and the agent is not closing: those it
    already supervises (`supervised`: a takeover sent again after a reconnect) are left out, and with none left it
    is ignored; anything else is ignored. `running` maps node ids to the pid of their running incarnation."""
    if isinstance(msg, wire.TakeOver):
        host, names = msg.host, msg.node_ids
        unknown = [n for n in names if n not in standby]
        if unknown:
            return Ignore(f"cannot take over {host}: {', '.join(unknown[:5])} not standing by here (host.json "
                          "standby); deploy the job again")
        if closing:
            return Ignore(f"the scheduler asked to take over {host}, but this agent is closing")
        new = tuple(n for n in names if n not in supervised)
        if not new:
            return Ignore(f"already took over {host} ({', '.join(names)})")
        return TakeOver(host, new)
    if isinstance(msg, wire.Kill):
        if msg.node_id not in running or (msg.pid is not None and msg.pid != running[msg.node_id]):
            return Ignore(f"scheduler asked to kill {msg.node_id} pid {msg.pid}: not running here")
        return Kill(msg.node_id, msg.cause or "declared dead", msg.dump)
    if isinstance(msg, wire.Stop):
        return StopJob(msg.reason or "no reason given")
    if isinstance(msg, wire.Finished):
        return Ignore("already closing") if closing else FinishJob()
    return Ignore(f"ignored a {msg.what!r} message from the scheduler")
