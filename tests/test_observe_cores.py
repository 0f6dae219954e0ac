"""The pure cores of the operator's view, driven with fake clocks: a rank's pace, the straggler verdicts, the
checkpoint interval, and the watch's view of hosts that answer, fall silent and end."""

from __future__ import annotations

import math
import warnings

import pytest

from toolkit.contracts import messages as wire
from toolkit.contracts.agentdoc import AgentDoc
from toolkit.launcher.jobhosts.tables import live_lines
from toolkit.launcher.remote import HostResult
from toolkit.launcher.tasks.watch import SILENT_MIN, Answer, job_outcome, watch_view
from toolkit.scheduler.stragglers import EVAL_INTERVAL, PERSIST, Cleared, Named, Stragglers
from toolkit.testing.records import two_host_record
from toolkit.train.ckpt.interval import DEFAULT_PRIOR_MTBF, IntervalChooser, choose
from toolkit.train.pace import SAMPLE_INTERVAL, WINDOW, StepPace

# -- pace


def test_pace_takes_medians_of_consecutive_steps_only() -> None:
    pace = StepPace()
    t = 0.0
    for step in range(1, 11):
        t += 0.5 if step != 5 else 9.0  # one slow step: the median ignores it
        pace.step(step, t, busy=0.2)
    pace.step(40, t + 100.0, busy=50.0)  # a recovery in between: not a step of 100 s
    out = pace.summary()
    assert out["step_time"] == 0.5 and out["busy"] == 0.2


def test_a_strided_pace_takes_steps_reported_every_kth_as_k_steps() -> None:
    """toolkit.train.report from a script that reports every 10th step: 10 steps in 5 s are 0.5 s each; no own-work
    time across a stride; a step back (a restart) starts the timing again."""
    pace = StepPace(strided=True)
    for k in range(1, 6):
        pace.step(10 * k, 5.0 * k, busy=0.1)
    pace.step(7, 100.0)
    pace.step(8, 100.5)
    assert pace.summary()["step_time"] == 0.5 and "busy" not in pace.summary()
    assert "step_time" not in _stepped(StepPace(), [(10, 5.0), (20, 10.0)]).summary()  # the Trainer's: consecutive


def _stepped(pace: StepPace, steps: list[tuple[int, float]]) -> StepPace:
    for step, t in steps:
        pace.step(step, t)
    return pace


def test_pace_keeps_a_window_and_samples_the_loss_at_most_once_a_second() -> None:
    pace = StepPace()
    for step in range(1, WINDOW + 20):
        pace.step(step, step * (1.0 if step < 20 else 2.0), busy=1.0 if step < 20 else 1.5)
    assert pace.summary()["step_time"] == 2.0 and pace.summary()["busy"] == 1.5  # the old steps left the window
    assert pace.wants_loss(0.0)
    pace.sample_loss(0.75, 0.0)
    assert not pace.wants_loss(SAMPLE_INTERVAL / 2) and pace.wants_loss(SAMPLE_INTERVAL)
    pace.sample_loss(float("nan"), SAMPLE_INTERVAL)
    assert "loss" not in pace.summary()  # a diverged loss is missing, never NaN in a document
    pace.checkpoint(0.25)
    pace.checkpoint(0.5)
    assert (pace.summary()["ckpt_stall"], pace.summary()["ckpts"]) == (0.75, 2)


def test_a_loss_with_its_graph_is_read_without_a_warning() -> None:
    """trainer.report(loss) hands over the loss as the step computed it (requires_grad): reading it must not print
    torch's UserWarning in every worker's log."""
    import torch
    loss = torch.tensor(0.25, requires_grad=True) * 2
    pace = StepPace()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pace.sample_loss(loss, 0.0)
    assert pace.summary()["loss"] == 0.5


def test_hostile_pace_fields_are_dropped() -> None:
    got = wire.Heartbeat.from_msg({"step_time": float("inf"), "busy": -1, "loss": "x", "ckpts": 2.5, "ckpt_every": 7,
                                   "ckpt_stall": 0.1, "ckpt_why": "y" * 10_000, "ckpt_step": -3}).pace()
    assert set(got) == {"ckpt_every", "ckpt_stall", "ckpt_why"} and len(got["ckpt_why"]) <= wire.MAX_WHY
    assert wire.Heartbeat.from_msg({"ckpt_step": 40, "stride": 10}).pace() == {"ckpt_step": 40, "stride": 10}


# -- stragglers


def _beat(s: Stragglers, rank: int, busy: float, now: float) -> None:
    s.observe({"rank": rank, "node_id": f"worker_{rank}", "host": f"h{rank // 2}", "pid": 100 + rank, "step": 1,
               "busy": busy, "step_time": 1.0}, now)


def _run(s: Stragglers, busies: dict[int, float], evaluations: int, start: float = 0.0) -> tuple[list, float]:
    events, now = [], start
    for _ in range(evaluations):
        for rank, busy in busies.items():
            _beat(s, rank, busy, now)
        events += s.evaluate(now)
        now += EVAL_INTERVAL
    return events, now


def test_a_rank_persistently_slower_is_named_with_its_host_and_factor_then_cleared() -> None:
    s = Stragglers(threshold=1 / 1.5)
    events, now = _run(s, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}, PERSIST - 1)
    assert events == []  # not yet: it must persist
    events, now = _run(s, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}, 1, now)
    assert events == [Named(3, "worker_3", "h1", 0.2, 0.1, 2.0)]
    assert s.scores[3] == pytest.approx(0.5) and s.scores[0] == pytest.approx(1.0)
    events, now = _run(s, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}, PERSIST, now)
    assert events == [Cleared(3, "worker_3", "h1")]


def test_an_even_run_and_a_jittery_one_name_nobody() -> None:
    s = Stragglers(threshold=1 / 1.5)
    events, now = _run(s, {r: 0.1 for r in range(4)}, 20)
    jitter = [{0: 0.1, 1: 0.2, 2: 0.1, 3: 0.1}, {0: 0.1, 1: 0.1, 2: 0.2, 3: 0.1}]  # slow by turns, never for long
    for i in range(20):
        more, now = _run(s, jitter[i % 2], 1, now)
        events += more
    assert events == [] and not s.flagged


def test_in_a_world_of_two_the_slow_rank_is_compared_with_the_other_and_stale_or_dead_ranks_are_not() -> None:
    s = Stragglers(threshold=1 / 1.5)
    events, now = _run(s, {0: 0.1, 1: 0.3}, PERSIST)
    assert [e.rank for e in events] == [1]  # the median of all would be 0.2: 0.3 / 0.2 = 1.5, not named
    assert s.forget(1) == [Cleared(1, "worker_1", "h0")]  # died: its verdict goes with it
    events, _ = _run(s, {0: 0.1}, PERSIST, now + 100)
    assert events == [] and s.scores == {}  # alone, or beside stale figures: nobody to compare with


def test_the_threshold_is_validated() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        Stragglers(threshold=1.5)


# -- the checkpoint interval


def test_young_interval_grows_with_the_stall_and_shrinks_with_the_failure_rate() -> None:
    base = choose(stall=1.0, step_time=0.5, faults=0, uptime=0.0)
    assert base.steps == round(math.sqrt(2 * 1.0 * DEFAULT_PRIOR_MTBF) / 0.5) and "no fault yet" in base.why
    slower = choose(stall=4.0, step_time=0.5, faults=0, uptime=0.0)
    assert slower.steps == pytest.approx(2 * base.steps, abs=1)  # sqrt: 4x the stall, 2x the interval
    faulty = choose(stall=1.0, step_time=0.5, faults=9, uptime=3600.0)
    mtbf = (DEFAULT_PRIOR_MTBF + 3600.0) / 10
    assert faulty.steps == round(math.sqrt(2 * mtbf) / 0.5) < base.steps and "9 fault(s)" in faulty.why


def test_the_interval_stays_within_the_bounds_and_says_so() -> None:
    low = choose(stall=0.0001, step_time=10.0, faults=100, uptime=10.0, bounds=(20, 500))
    assert low.steps == 20 and "lower bound" in low.why
    high = choose(stall=100.0, step_time=0.001, faults=0, uptime=0.0, bounds=(20, 500))
    assert high.steps == 500 and "upper bound" in high.why
    assert choose(None, 0.5, 0, 0.0, bounds=(20, 500)).steps == 20  # nothing measured yet: measure early


def test_the_chooser_follows_measured_stalls_and_faults() -> None:
    c = IntervalChooser(bounds=(1, 1_000_000), prior_mtbf=10_000.0)
    assert c.update(0.1).steps == 1  # no stall measured
    c.stalled(0.5)
    first = c.update(0.1).steps
    for _ in range(20):
        c.stalled(5.0)  # checkpoints got slower: the moving average follows
    assert c.update(0.1).steps > first
    before = c.current.steps
    c.history(faults=5, uptime=600.0)
    assert c.update(0.1).steps < before
    with pytest.raises(ValueError, match="ckpt_bounds"):
        IntervalChooser(bounds=(0, 10))
    with pytest.raises(ValueError, match="prior_mtbf"):
        IntervalChooser(prior_mtbf=float("nan"))


# -- the watch's view


def _answer(host: str, agent: str, procs: dict[str, dict], at: float, live: dict | None = None) -> Answer:
    doc = AgentDoc.from_obj({"state": agent, "alive": agent == "running",
                             "processes": [{"node_id": n, **p} for n, p in procs.items()]})
    result = HostResult(host, True, value={"doc": doc, "live": live, "now": at, "mtimes": {}})
    return Answer(result, at, at, result)


LIVE = {"version": 1, "generation": 1, "formed": True,
        "ranks": {"0": {"node_id": "worker_0", "pid": 10, "step": 7, "steps_per_s": 2.0, "loss": 0.5,
                        "heartbeat_age": 0.4, "score": 0.5, "straggler": True}},
        "stragglers": [{"rank": 0, "node_id": "worker_0", "host": "a", "factor": 2.0}]}


def test_the_view_joins_the_scheduler_figures_and_marks_a_relaunched_worker_restarting() -> None:
    answers = {"a": _answer("a", "running", {"sched": {"state": "running", "pid": 9},
                                             "worker_0": {"state": "running", "pid": 10, "step": 6}}, 100.0, LIVE),
               "b": _answer("b", "running", {"worker_1": {"state": "running", "pid": 22, "restarts": 1}}, 100.0)}
    view = watch_view(two_host_record(), answers, 100.5, 0.5)
    rows = {p.node_id: p for h in view.hosts for p in h.processes}
    assert (rows["worker_0"].step, rows["worker_0"].loss, rows["worker_0"].straggler) == (7, 0.5, 2.0)
    assert rows["worker_1"].state == "restarting"  # relaunched, not back with the scheduler yet
    assert view.outcome is None and view.live is LIVE


def test_a_silent_host_is_unreachable_and_the_others_stay() -> None:
    answers = {"a": _answer("a", "running", {"worker_0": {"state": "running", "pid": 10}}, 200.0, LIVE),
               "b": _answer("b", "running", {"worker_1": {"state": "running", "pid": 22}}, 100.0)}
    view = watch_view(two_host_record(), answers, 200.0 + 0.1, 0.5)
    b = next(h for h in view.hosts if h.host == "b")
    assert not b.reached and "no answer for" in (b.error or "") and b.processes[0].state == "unreachable"
    assert next(h for h in view.hosts if h.host == "a").reached
    assert watch_view(two_host_record(), answers, 100.0 + SILENT_MIN - 1, 0.5).hosts[1].reached  # not silent long yet


def test_the_job_ends_when_every_agent_has() -> None:
    ended = {"a": _answer("a", "succeeded", {}, 1.0), "b": _answer("b", "succeeded", {}, 1.0)}
    assert watch_view(two_host_record(), ended, 1.0, 0.5).outcome == "succeeded"
    ended["b"] = _answer("b", "failed", {}, 1.0)
    assert watch_view(two_host_record(), ended, 1.0, 0.5).outcome == "failed"
    ended["b"] = Answer(HostResult("b", False, error="b: connection refused"), 1.0, None)
    assert watch_view(two_host_record(), ended, 1.0, 0.5).outcome is None  # a host not heard from has not ended
    assert job_outcome([]) is None


def test_a_host_not_heard_from_yet_is_connecting_not_unreachable() -> None:
    answers = {"a": Answer(None, 10.0, None), "b": Answer(None, None, None)}
    view = watch_view(two_host_record(), answers, 10.5, 0.5)
    assert [h.agent for h in view.hosts] == ["connecting", "connecting"]
    assert {p.state for h in view.hosts for p in h.processes} == {"connecting"}
    late = watch_view(two_host_record(), answers, 10.0 + SILENT_MIN + 1, 0.5)
    assert late.hosts[0].agent == "unreachable" and "no answer for" in (late.hosts[0].error or "")


def test_the_last_incident_and_the_goodput_say_what_is_known() -> None:
    """status's lines under the table (status and --watch alike): a finished run's incident is never "not recovered
    yet"; a script that reports no steps says what cannot be known; an upper-bound goodput says so."""
    inc = {"number": 1, "cause": "signal SIGKILL", "step": None, "processes": ["worker_1"], "hosts": ["b"],
           "time_to_recover": None, "recomputed": None, "formed_in": 3.5}
    gp = {"wall": 60.0, "goodput": 0.8, "basis": "formations"}
    live = {"status": "finished", "incidents": 1, "last_incident": inc, "reports_steps": False, "goodput": gp}
    incident, goodput = live_lines(live)
    assert incident == ("last incident (#1 of 1): signal SIGKILL: worker_1 on b; its group formed again 3.50 s after "
                        "the failure (the script reports no steps: when it trained again is not known)")
    assert goodput.startswith("goodput: at most 80.0% of") and "toolkit.train.report" in goodput
    stepped = {**live, "reports_steps": True, "goodput": {**gp, "basis": "steps"},
               "last_incident": {**inc, "step": 120, "time_to_recover": 4.25, "recomputed": 20}}
    incident, goodput = live_lines(stepped)
    assert incident.endswith("worker_1 on b at step 120; recovered in 4.25 s, 20 step(s) recomputed")
    assert goodput.startswith("goodput: 80.0% of")
    assert live_lines({**stepped, "status": "running"})[1].startswith("goodput so far: 80.0% of")
    running = {**stepped, "status": "running", "last_incident": {**inc, "formed_in": None}}
    assert live_lines(running)[0].endswith("; not recovered yet")
    assert live_lines({**running, "status": "failed"})[0].endswith("; not recovered: the job failed first")
    assert live_lines({**running, "last_incident": inc})[0].endswith(
        "; its group formed again in 3.50 s, not training again yet")
