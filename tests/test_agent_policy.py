"""The agent's decisions (toolkit.agent.policy), driven directly: what it does when a process exits, and when the
scheduler speaks. The supervisor applying them is tested with real processes in test_agent.py."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.agent import policy
from toolkit.agent.policy import FinishJob, GiveUp, Ignore, Kill, Relaunch, Settle, StopJob, Succeeded
from toolkit.contracts import messages as wire
from toolkit.contracts import protocol as P
from toolkit.contracts.hostspec import RestartPolicy

RULES = RestartPolicy(max_restarts=3, backoff_base=1.0, backoff_max=30.0, healthy_reset=300.0)
CRASH = policy.Exited(code=1, ran_for=2.0, progressed=False, counted=0, manual=False, closing=False,
                      finishing=False, others_running=True, others_succeeded=False)


def exit_(**kw: object) -> policy.Exited:
    return dataclasses.replace(CRASH, **kw)


def test_a_crash_loop_backs_off_then_gives_up() -> None:
    delays, counted = [], 0
    for _ in range(3):
        r = policy.on_exit(RULES, exit_(counted=counted), "exit code 1")
        assert isinstance(r, Relaunch) and r.failure
        delays.append(r.delay)
        counted = r.counted
    assert delays == [0.0, 1.0, 2.0] and r.why == "restart 3 of 3 after exit code 1"
    assert policy.on_exit(RULES, exit_(counted=3), "exit code 1") == GiveUp(3, None)


def test_a_process_that_trained_restarts_at_once_and_progress_past_its_last_failure_refills_the_budget() -> None:
    assert policy.on_exit(RULES, exit_(counted=2, progressed=True), "killed by SIGKILL") == Relaunch(
        "restart 3 of 3 after killed by SIGKILL", 0.0, 3, failure=True)
    forgiven = policy.on_exit(RULES, exit_(counted=3, progressed=True, reached=41, failed_at=40), "killed by SIGKILL")
    assert forgiven == Relaunch("restart 1 of 3 after killed by SIGKILL; the count started again: it got to step 41, "
                                "past step 40 where it failed before", 0.0, 1, failure=True, failed_at=41)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def run_incarnations(rules: RestartPolicy, lives: list[tuple[float, int | None]]) -> list[str]:
    """Feed on_exit one incarnation after another, as the supervisor does: each lives `seconds` on a fake clock and
    dies (exit code 1) having reached `step` (None: it reported none); the mark the decision carries is kept.
    Returns what each death led to: "restart N" or "give up"."""
    clock, counted, failed_at, out = FakeClock(), 0, None, []
    for seconds, step in lives:
        started = clock.now
        ran = clock.advance(seconds) - started
        r = policy.on_exit(rules, exit_(ran_for=ran, progressed=step is not None, counted=counted, reached=step,
                                        failed_at=failed_at), "exit code 1")
        if isinstance(r, GiveUp):
            out.append("give up")
            break
        assert isinstance(r, Relaunch) and r.failure
        counted, failed_at = r.counted, r.failed_at
        out.append(f"restart {r.counted}")
    return out


def test_a_late_crash_loop_at_the_same_step_gives_up_at_the_budget_however_long_each_run() -> None:
    """A script that resumes from its checkpoint and fails at the same step: each run longer than healthy_reset
    (300 s) once refilled the budget every time; now the same step again counts."""
    assert run_incarnations(RULES, [(3600.0, 120)] * 10) == ["restart 1", "restart 2", "restart 3", "give up"]


def test_getting_past_the_step_of_the_last_failure_starts_the_count_again() -> None:
    lives = [(5.0, 100), (5.0, 100), (5.0, 150), (5.0, 150), (5.0, 150), (5.0, 150)]
    assert run_incarnations(RULES, lives) == ["restart 1", "restart 2", "restart 1", "restart 2", "restart 3",
                                              "give up"]
    behind = [(5.0, 100), (5.0, 90), (5.0, 100), (5.0, 95)]  # back and forth below step 100: never past it
    assert run_incarnations(RULES, behind) == ["restart 1", "restart 2", "restart 3", "give up"]


def test_a_script_that_reports_no_step_has_every_crash_counted_as_under_torchrun() -> None:
    assert run_incarnations(RULES, [(86400.0, None)] * 5) == ["restart 1", "restart 2", "restart 3", "give up"]


def test_the_refill_rules_never_and_time() -> None:
    never = dataclasses.replace(RULES, refill="never")
    assert run_incarnations(never, [(5.0, s) for s in (10, 20, 30, 40, 50)]) == [
        "restart 1", "restart 2", "restart 3", "give up"]
    timed = dataclasses.replace(RULES, refill="time", healthy_reset=60.0)
    assert run_incarnations(timed, [(5.0, 10), (61.0, 10), (5.0, 10), (5.0, 10), (5.0, 10)]) == [
        "restart 1", "restart 1", "restart 2", "restart 3", "give up"]


def test_a_rank_that_keeps_failing_the_same_way_is_pointed_out() -> None:
    def exits(*records: tuple[int | None, int | None, str | None, bool]) -> list[dict]:
        return [{"step": s, "code": c, "signal": sig, "failure": f} for s, c, sig, f in records]

    assert policy.repeated_failure(exits((120, 1, None, True))) is None
    assert policy.repeated_failure(exits((90, 1, None, True), (120, 1, None, True), (120, 1, None, True))) == {
        "times": 2, "step": 120, "code": 1, "signal": None, "cause": None}
    boom = [{"step": 120, "code": 1, "signal": None, "failure": True, "cause": f"ValueError: {n} (exit code 1)"}
            for n in ("a", "b")]
    assert policy.repeated_failure(boom) is None  # the same code, not the same first cause
    assert policy.repeated_failure(exits((120, None, "SIGSEGV", True), (120, 1, None, True))) is None  # two ways
    assert policy.repeated_failure(exits((120, 1, None, True), (120, 75, None, False))) is None  # then fenced
    assert policy.repeated_failure(exits((None, 2, None, True), (None, 2, None, True), (None, 2, None, True)))[
        "times"] == 3


def test_exits_the_scheduler_or_the_operator_asked_for_are_not_counted() -> None:
    for code in (P.EXIT_FENCED, P.EXIT_REJOIN):
        r = policy.on_exit(RULES, exit_(code=code, counted=3), f"exit code {code}")
        assert r == Relaunch(f"relaunch after exit code {code}", 0.0, 3)
    assert policy.on_exit(RULES, exit_(manual=True, counted=3), "killed by SIGTERM") == Relaunch(
        "restart requested by the operator", 0.0, 3)


def test_a_worker_that_says_the_job_cannot_go_on_fails_it_at_once() -> None:
    """EXIT_FATAL (the Trainer's divergence check): no restart, whatever the budget left; the operator's restart and a
    closing agent still take precedence."""
    assert policy.on_exit(RULES, exit_(code=P.EXIT_FATAL, counted=0, progressed=True), "exit code 77") == GiveUp(0)
    assert policy.on_exit(RULES, exit_(code=P.EXIT_FATAL, closing=True), "exit code 77") == Settle("stopped", False)


def test_a_set_up_error_before_any_step_fails_at_once() -> None:
    """Exit 2 (a usage or set-up error: an unusable checkpoint directory, a missing module) before any progress is
    given up on at once, not retried with backoff; after progress it is a failure like any other."""
    assert policy.on_exit(RULES, exit_(code=policy.EXIT_SETUP), "exit code 2") == GiveUp(0)
    after = policy.on_exit(RULES, exit_(code=policy.EXIT_SETUP, progressed=True), "exit code 2")
    assert isinstance(after, Relaunch) and after.counted == 1


def test_success_and_closing() -> None:
    assert policy.on_exit(RULES, exit_(code=0), "exit code 0") == Succeeded(False)
    assert policy.on_exit(RULES, exit_(code=0, others_succeeded=True), "exit code 0") == Succeeded(True)
    assert policy.on_exit(RULES, exit_(closing=True), "killed by SIGTERM") == Settle("stopped", False)
    assert policy.on_exit(RULES, exit_(code=0, closing=True, finishing=True, others_running=False),
                          "exit code 0") == Settle("succeeded", True)


def test_a_nonzero_exit_after_the_end_fails_the_job_and_is_not_restarted() -> None:
    """Issue 41: a worker that said `done` and then exits 1 (or is killed) is not restarted (its rank finished) but
    settled `failed`; so is any non-zero exit while the agent finishes. A stopping agent's exits stay `stopped`."""
    assert policy.on_exit(RULES, exit_(said_done=True), "exit code 1") == Settle("failed", False)
    assert policy.on_exit(RULES, exit_(code=None, said_done=True, manual=True), "killed by SIGKILL") == \
        Settle("failed", False)
    assert policy.on_exit(RULES, exit_(closing=True, finishing=True, others_running=False), "exit code 1") == \
        Settle("failed", True)
    assert policy.on_exit(RULES, exit_(code=0, said_done=True, others_succeeded=True), "exit code 0") == \
        Succeeded(True)
    assert policy.on_exit(RULES, exit_(closing=True), "exit code 143") == Settle("stopped", False)


def test_the_schedulers_messages() -> None:
    running = {"worker_0": 100}

    def said(msg: dict, closing: bool = False) -> object:
        return policy.on_scheduler(wire.decode(msg), running, closing)

    assert said({"op": P.KILL, "node_id": "worker_0", "pid": 100}) == Kill("worker_0")
    assert isinstance(said({"op": P.KILL, "node_id": "worker_0", "pid": 99}), Ignore)
    assert isinstance(said({"op": P.KILL, "node_id": "worker_9"}), Ignore)
    assert said({"op": P.STOP, "reason": "x failed"}) == StopJob("x failed")
    assert said({"op": P.STOP}) == StopJob("no reason given")
    assert said({"op": P.FINISHED}) == FinishJob()
    assert isinstance(said({"op": P.FINISHED}, closing=True), Ignore)
    assert isinstance(said({"op": "nonsense"}), Ignore)


def test_a_spare_takes_over_what_stands_by_here_once() -> None:
    standby = ["worker_2", "worker_3"]
    msg = {"op": P.TAKEOVER, "host": "hostB", "node_ids": ["worker_2", "worker_3"], "seq": 1}
    takeover = wire.decode(msg)
    assert policy.on_scheduler(takeover, {}, False, standby) == policy.TakeOver("hostB", ("worker_2", "worker_3"))
    again = policy.on_scheduler(takeover, {"worker_2": 5}, False, standby, ["worker_2", "worker_3"])  # sent again
    assert isinstance(again, Ignore) and again.why == "already took over hostB (worker_2, worker_3)"
    other = policy.on_scheduler(wire.decode({**msg, "node_ids": ["worker_9"]}), {}, False, standby)
    assert isinstance(other, Ignore) and "worker_9 not standing by here" in other.why
    assert isinstance(policy.on_scheduler(takeover, {}, True, standby), Ignore)  # closing: nothing starts
    with pytest.raises(P.ProtocolError, match="takeover of hostB with a malformed node_ids"):
        wire.decode({**msg, "node_ids": "worker_2"})  # the agent's link logs it and reads on


def test_the_warm_spare_imports_only_while_no_worker_starts_cold() -> None:
    """toolkit.agent.warmspare with a fake clock: a spare that is not ready is held while a worker started cold has
    not progressed, at most HOLD_MAX after that worker's launch (the latest launch counts); a ready one never is."""
    from toolkit.agent.warmspare import HOLD_MAX, SparePlan, spare_plan

    assert spare_plan(False, [], 100.0) == SparePlan(True)
    assert spare_plan(False, [100.0], 100.0) == SparePlan(False, 100.0 + HOLD_MAX)
    assert spare_plan(False, [90.0, 100.0], 120.0) == SparePlan(False, 100.0 + HOLD_MAX)  # the later launch holds
    assert spare_plan(False, [90.0, 100.0], 90.0 + HOLD_MAX + 1) == SparePlan(False, 100.0 + HOLD_MAX)
    assert spare_plan(False, [100.0], 100.0 + HOLD_MAX) == SparePlan(True)  # the bound: it goes on
    assert spare_plan(True, [100.0], 101.0) == SparePlan(True)  # ready: idle, nothing to hold
