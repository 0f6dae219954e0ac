"""The worker's decisions about its job (toolkit.train.jobview), driven directly with a fake clock: what each word of
the scheduler does to the view and which effects follow in which order, what a refused reconnect means, when the
heartbeats go, and that no message, however malformed, does anything but a ProtocolError. The channel that applies
these effects over a real connection is covered by tests/train/test_runtime.py and tests/test_listeners.py."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol as P
from toolkit.train import jobview as J
from toolkit.train.jobview import ExitProcess, JobView, Retry, Say, Stop, TripFence

NOW = 1000.0  # the fake monotonic clock's reading


def msg(op: str, **fields: object) -> dict:
    return {"op": op, **fields}


def on(view: JobView, message: dict, now: float) -> tuple[JobView, list]:
    """jobview.on_message of a message as the channel reads it (toolkit.contracts.messages.decode first)."""
    return J.on_message(view, wire.decode(message), now)


def test_welcome_generation_and_formed_set_the_announced_generation() -> None:
    view, effects = on(JobView(), msg(P.WELCOME, generation=0), NOW)
    assert view.announced == 0 and view.formed is None and view.history is None
    assert effects == [TripFence(0)]  # nothing held yet: the fence (if armed by a build) decides
    view, _ = on(view, msg(P.FORMED, generation=0, prefix="g0/", faults=0, uptime=3.5), NOW + 1)
    assert (view.announced, view.formed, view.history) == (0, (0, "g0/"), (0, 3.5, NOW + 1))
    view = J.adopt(view, 0)[0]
    view, effects = on(view, msg(P.GENERATION, generation=1), NOW + 2)
    assert view.announced == 1 and view.formed == (0, "g0/")  # announced, not formed yet
    assert effects == [TripFence(1), Say("the job moved to generation 1")]


def test_the_history_timestamp_is_the_time_its_message_was_handled() -> None:
    view, _ = on(JobView(), msg(P.FORMED, generation=2, prefix="p", faults=4, uptime=100), NOW)
    view, _ = on(view, msg(P.FORMED, generation=3, prefix="q", faults=5, uptime=160), NOW + 7.25)
    assert view.history == (5, 160.0, NOW + 7.25)


@pytest.mark.parametrize("faults, uptime", [(1, -1.0), (1, math.inf), (1, math.nan), (-1, 5.0), (1, "5"),
                                            (None, 5.0), (True, 5.0), (1, True)])
def test_insane_ledger_figures_leave_the_history_as_it_was(faults: object, uptime: object) -> None:
    before = JobView(announced=1, formed=(1, "p"), history=(2, 50.0, NOW))
    fields = {k: v for k, v in (("faults", faults), ("uptime", uptime)) if v is not None}
    view, _ = on(before, msg(P.FORMED, generation=2, prefix="q", **fields), NOW + 1)
    assert view.formed == (2, "q") and view.history == (2, 50.0, NOW)


def test_a_newer_generation_trips_the_fence_and_the_held_one_does_not() -> None:
    held = JobView(announced=3, formed=(3, "p"), held=3)
    assert on(held, msg(P.WELCOME, generation=3), NOW)[1] == []
    assert on(held, msg(P.FORMED, generation=3, prefix="p"), NOW)[1] == []
    assert on(held, msg(P.GENERATION, generation=4), NOW)[1][0] == TripFence(4)


def test_stop_keeps_the_reason_and_says_it() -> None:
    view, effects = on(JobView(announced=1, held=1), msg(P.STOP, reason="node 2 gave up"), NOW)
    assert view.stop_reason == "node 2 gave up" and view.announced == 1
    assert effects == [Say("the scheduler stopped the job: node 2 gave up")]
    view, _ = on(JobView(), msg(P.STOP, reason="x" * 5000), NOW)
    assert view.stop_reason == "x" * J.MAX_REASON
    assert on(JobView(), msg(P.STOP), NOW)[0].stop_reason == "stopped by the scheduler"


def test_fenced_exits_first_and_changes_nothing() -> None:
    before = JobView(announced=2, formed=(2, "p"), held=2)
    for fields in ({"reason": "a newer incarnation registered"}, {"generation": "junk"}, {}):
        view, effects = on(before, msg(P.FENCED, **fields), NOW)
        assert view is before  # the training thread is not woken into a generation it no longer belongs to
        assert len(effects) == 1 and effects[0].code == P.EXIT_FENCED == 75
        assert effects[0].why.startswith("fenced by the scheduler: ") and "exiting with code 75" in effects[0].why
    long = on(before, msg(P.FENCED, reason="r" * 5000), NOW)[1][0]
    assert "r" * J.MAX_FENCED_REASON + ";" in long.why


def test_restart_recovery_exits_rejoin_after_the_view_and_the_fence() -> None:
    held = JobView(announced=1, formed=(1, "p"), held=1, restart_only=True)
    view, effects = on(held, msg(P.GENERATION, generation=2), NOW)
    assert view.announced == 2  # swapped in (and the waiters woken) before the effects run
    assert [type(e) for e in effects] == [TripFence, ExitProcess]
    assert effects[0] == TripFence(2) and effects[1].code == P.EXIT_REJOIN == 76
    assert "the job moved to generation 2; this script cannot re-form in place" in effects[1].why
    # nothing held yet (before the script's group was built), or the same generation: no exit
    assert on(JobView(restart_only=True), msg(P.GENERATION, generation=2), NOW)[1] == [
        TripFence(2), Say("the job moved to generation 2")]
    assert on(held, msg(P.FORMED, generation=1, prefix="p"), NOW)[1] == []


def test_in_place_recovery_never_exits_on_a_new_generation() -> None:
    held = JobView(announced=1, formed=(1, "p"), held=1)
    for m in (msg(P.GENERATION, generation=2), msg(P.FORMED, generation=5, prefix="q"), msg(P.STOP, reason="r")):
        _, effects = on(held, m, NOW)
        assert not any(isinstance(e, ExitProcess) for e in effects)


@pytest.mark.parametrize("bad, error", [
    (msg(P.WELCOME), "welcome without a generation"),
    (msg(P.GENERATION, generation=-1), "generation without a generation"),
    (msg(P.GENERATION, generation=True), "generation without a generation"),
    (msg(P.FORMED, generation=1.0, prefix="p"), "formed without a generation"),
    (msg(P.FORMED, generation=1), "formed without a store prefix"),
    (msg(P.FORMED, generation=1, prefix=7), "formed without a store prefix"),
])
def test_malformed_messages_are_protocol_errors(bad: dict, error: str) -> None:
    with pytest.raises(P.ProtocolError, match=error):
        on(JobView(announced=1, held=1), bad, NOW)


def test_an_unknown_op_changes_nothing() -> None:
    before = JobView(announced=1, held=1)
    assert on(before, msg("other", generation=9), NOW) == (before, [])


def test_garbage_from_an_authenticated_peer_is_a_protocol_error_or_a_well_formed_view() -> None:
    """Whatever a message holds, the core either raises ProtocolError (the connection is dropped and retried) or
    returns a view of well-formed values: never another exception that would end the control thread."""
    rng = random.Random(3)
    values = [None, True, -1, 2**80, "x", [], {}, 1.5, math.inf]
    view = JobView()
    for i in range(300):
        m = msg(rng.choice([P.WELCOME, P.GENERATION, P.FORMED, P.STOP, "other"]))
        for name in ("generation", "prefix", "reason", "faults", "uptime"):
            if rng.random() < 0.7:
                m[name] = rng.choice(values)
        try:
            view, effects = on(view, m, NOW + i)
        except P.ProtocolError:
            continue
        assert all(isinstance(e, (TripFence, Say)) for e in effects)
    json.dumps(dataclasses.asdict(view))  # whatever got through is well-formed
    assert view.formed is None or (isinstance(view.formed[0], int) and isinstance(view.formed[1], str))
    assert view.announced is None or (type(view.announced) is int and view.announced >= 0)


def test_a_refused_reconnect_retries_stops_or_ends_as_fenced() -> None:
    stop = J.on_refused(NOW, NOW, False, "job finished", 10.0)
    assert stop == Stop("the scheduler refused this worker back: job finished")
    assert J.stopped(JobView(announced=1), stop.reason) == JobView(announced=1, stop_reason=stop.reason)
    assert J.on_refused(NOW, NOW + 20.0, True, "node id held", 10.0) == Retry()  # up to 2 node timeouts
    out = J.on_refused(NOW, NOW + 20.5, True, "node id held", 10.0)
    assert isinstance(out, ExitProcess) and out.code == P.EXIT_FENCED
    assert out.why == "fenced by the scheduler: replaced while disconnected: node id held; exiting with code 75"


def test_heartbeats_go_every_interval_and_none_while_finishing() -> None:
    first = J.next_wake(NOW, NOW, False, 2.0)  # just (re)connected: beat at once
    assert first == (True, NOW + 2.0, NOW + 2.0)
    assert J.next_wake(NOW + 0.5, first.next_beat, False, 2.0) == (False, NOW + 2.0, NOW + 2.0)  # a message came
    assert J.next_wake(NOW + 2.3, first.next_beat, False, 2.0) == (True, NOW + 4.3, NOW + 4.3)  # late: from now on
    assert J.next_wake(NOW + 9.0, NOW, True, 2.0) == (False, NOW, NOW + 9.0 + J.DONE_WAIT)


def test_the_waits_questions() -> None:
    view = JobView(announced=2, formed=(1, "p"), held=1)
    assert J.formed_for(view, 1) is None  # generation 2 announced, not formed yet
    formed = JobView(announced=2, formed=(2, "q"), held=1)
    assert J.formed_for(formed, 1) == (2, "q") and J.formed_for(formed, 2) is None
    assert J.changed_from(view, 1) == 2 and J.changed_from(view, 2) is None and J.changed_from(JobView(), 0) is None


def test_adopt_says_whether_the_job_already_moved_past() -> None:
    view, moved = J.adopt(JobView(announced=3, formed=(3, "p")), 3)
    assert (view.held, moved) == (3, False)
    view, moved = J.adopt(JobView(announced=4, formed=(3, "p")), 3)
    assert (view.held, moved) == (3, True)


def test_the_core_is_pure() -> None:
    """No torch (seconds of import for every unit test), no socket, no clock, no thread: only values in and out."""
    tree = ast.parse(Path(J.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {m.split(".")[0] for m in imported} <= {"__future__", "dataclasses", "typing", "toolkit"}, imported
    # names and framing, the typed messages, and the pure check of a formed message's assignment of logical ranks
    assert {m for m in imported if m.startswith("toolkit")} == {
        "toolkit.contracts.protocol", "toolkit.contracts.messages", "toolkit.contracts.logical.parse_formed"}


def test_formed_may_renumber_this_process_in_an_elastic_job_and_a_hostile_shape_is_refused() -> None:
    """Issue 42: `formed` says this process's rank and the generation's world size when the job shrank or grew; a
    rank outside the world size drops the connection (ProtocolError), a formed without them keeps the shape."""
    view, _ = on(JobView(), {"op": P.FORMED, "generation": 1, "prefix": "p/", "rank": 1, "world_size": 4},
                           0.0)
    assert view.shape == (1, 4)
    view, _ = on(view, {"op": P.FORMED, "generation": 2, "prefix": "p/"}, 0.0)
    assert view.shape == (1, 4) and view.formed == (2, "p/")
    for bad in ({"rank": 4, "world_size": 4}, {"rank": -1, "world_size": 2}, {"rank": "0", "world_size": 2},
                {"rank": 0, "world_size": 1 << 40}):
        with pytest.raises(P.ProtocolError, match="rank"):
            on(view, {"op": P.FORMED, "generation": 3, "prefix": "p/", **bad}, 0.0)


def test_formed_carries_the_assignment_of_logical_ranks_and_without_it_each_rank_serves_its_own() -> None:
    view, _ = on(JobView(world_size=2), msg(P.FORMED, generation=1, prefix="p", logical_world=5,
                                                      logical=[[0, 2, 4], [1, 3]]), NOW)
    assert view.logical == (1, 5, ((0, 2, 4), (1, 3))) and view.formed == (1, "p")
    view, _ = on(JobView(world_size=3), msg(P.FORMED, generation=0, prefix="p"), NOW)
    assert view.logical == (0, 3, ((0,), (1,), (2,)))


@pytest.mark.parametrize("fields", [
    {"logical_world": 4, "logical": [[0, 1], [2, 2]]},  # a logical rank twice, one missing
    {"logical_world": 4, "logical": [[0, 1, 2, 3], []]},  # a rank serving none
    {"logical_world": 4, "logical": [[0, 1], [2, 3], []]},  # not one part per rank
    {"logical_world": 3, "logical": [[0, 1], [2, 3]]},  # outside range(L)
    {"logical_world": "4", "logical": [[0, 1], [2, 3]]},
    {"logical_world": 10**9, "logical": [[0], [1]]},
    {"logical_world": 2, "logical": [[0], [True]]},
    {"logical_world": 2, "logical": {"0": [0], "1": [1]}},
    {"logical": [[0], [1]]},  # half of it
    {"logical_world": 2},
])
def test_a_formed_with_a_bad_assignment_stops_the_worker_with_one_line_and_changes_nothing(fields: dict) -> None:
    before = JobView(announced=1, formed=(0, "p"), held=0, world_size=2, logical=(0, 2, ((0,), (1,))))
    view, effects = on(before, msg(P.FORMED, generation=1, prefix="q", **fields), NOW)
    assert view is before
    (effect,) = effects
    assert isinstance(effect, ExitProcess) and effect.code == P.EXIT_FATAL and "\n" not in effect.why
    assert effect.why.startswith("the scheduler's formed message of generation 1 is wrong: ")
