"""The agent's decisions (toolkit.agent.policy), driven directly: what it does when a process exits, and when the
scheduler speaks. The supervisor applying them is tested with real processes in test_agent.py."""

from __future__ import annotations

import dataclasses

from toolkit import protocol as P
from toolkit.agent import policy
from toolkit.agent.policy import FinishJob, GiveUp, Ignore, Kill, Relaunch, Settle, StopJob, Succeeded
from toolkit.hostspec import RestartPolicy

RULES = RestartPolicy(max_restarts=3, backoff_base=1.0, backoff_max=30.0, healthy_reset=300.0)
CRASH = policy.Exited(code=1, ran_for=2.0, progressed=False, counted=0, manual=False, closing=False,
                      finishing=False, others_running=True, others_succeeded=False)


def exit_(**kw: object) -> policy.Exited:
    return dataclasses.replace(CRASH, **kw)


def test_a_crash_loop_backs_off_then_gives_up() -> None:
    delays, counted = [], 0
    for _ in range(3):
        r = policy.on_exit(RULES, exit_(counted=counted), "exit code 1")
        assert isinstance(r, Relaunch)
        delays.append(r.delay)
        counted = r.counted
    assert delays == [0.0, 1.0, 2.0] and r.why == "restart 3 of 3 after exit code 1"
    assert policy.on_exit(RULES, exit_(counted=3), "exit code 1") == GiveUp(3)


def test_a_process_that_trained_restarts_at_once_a_long_healthy_run_refills_the_budget() -> None:
    assert policy.on_exit(RULES, exit_(counted=2, progressed=True), "killed by SIGKILL") == Relaunch(
        "restart 3 of 3 after killed by SIGKILL", 0.0, 3)
    assert policy.on_exit(RULES, exit_(counted=3, ran_for=301.0), "killed by SIGKILL") == Relaunch(
        "restart 1 of 3 after killed by SIGKILL", 0.0, 1)


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


def test_success_and_closing() -> None:
    assert policy.on_exit(RULES, exit_(code=0), "exit code 0") == Succeeded(False)
    assert policy.on_exit(RULES, exit_(code=0, others_succeeded=True), "exit code 0") == Succeeded(True)
    assert policy.on_exit(RULES, exit_(closing=True), "killed by SIGTERM") == Settle("stopped", False)
    assert policy.on_exit(RULES, exit_(code=0, closing=True, finishing=True, others_running=False),
                          "exit code 0") == Settle("succeeded", True)


def test_the_schedulers_messages() -> None:
    running = {"worker_0": 100}
    assert policy.on_scheduler({"op": P.KILL, "node_id": "worker_0", "pid": 100}, running, False) == Kill("worker_0")
    assert isinstance(policy.on_scheduler({"op": P.KILL, "node_id": "worker_0", "pid": 99}, running, False), Ignore)
    assert isinstance(policy.on_scheduler({"op": P.KILL, "node_id": "worker_9"}, running, False), Ignore)
    assert policy.on_scheduler({"op": P.STOP, "reason": "x failed"}, running, False) == StopJob("x failed")
    assert policy.on_scheduler({"op": P.FINISHED}, running, False) == FinishJob()
    assert isinstance(policy.on_scheduler({"op": P.FINISHED}, running, True), Ignore)
    assert isinstance(policy.on_scheduler({"op": "nonsense"}, running, False), Ignore)


def test_a_spare_takes_over_what_stands_by_here_once() -> None:
    standby = ["worker_2", "worker_3"]
    msg = {"op": P.TAKEOVER, "host": "hostB", "node_ids": ["worker_2", "worker_3"], "seq": 1}
    assert policy.on_scheduler(msg, {}, False, standby) == policy.TakeOver("hostB", ("worker_2", "worker_3"))
    again = policy.on_scheduler(msg, {"worker_2": 5}, False, standby, ["worker_2", "worker_3"])  # sent again
    assert isinstance(again, Ignore) and again.why == "already took over hostB (worker_2, worker_3)"
    other = policy.on_scheduler({**msg, "node_ids": ["worker_9"]}, {}, False, standby)
    assert isinstance(other, Ignore) and "worker_9 not standing by here" in other.why
    assert isinstance(policy.on_scheduler(msg, {}, True, standby), Ignore)  # closing: nothing starts
    assert isinstance(policy.on_scheduler({**msg, "node_ids": "worker_2"}, {}, False, standby), Ignore)


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
