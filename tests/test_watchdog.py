"""The progress watchdog's decision (toolkit.scheduler.watchdog) on a fake clock, its place in the membership (a stuck
rank declared dead, its agent told to dump its stacks and kill it, the rank told nothing), and the worker's parts
it stands on: the p99 step time (toolkit.train.pace), where the training thread waits (toolkit.train.stacks), the
stall shown as one in the live view and the goodput. The jobs themselves: tests/train/test_watchdog_jobs.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from toolkit.agent import policy
from toolkit.contracts import messages as wire
from toolkit.contracts import protocol as P
from toolkit.launcher.jobhosts.tables import live_lines, process_note
from toolkit.launcher.jobhosts.view import ProcStatus
from toolkit.scheduler.actions import CAUSE_STUCK, Note, NoteKind, Send
from toolkit.scheduler.journal import Journal
from toolkit.scheduler.membership import Membership
from toolkit.scheduler.watchdog import Watchdog
from toolkit.train import stacks
from toolkit.train.pace import StepPace
from toolkit.train.runtime import Runtime, WorkerEnv

BEAT = 1.0


def hb(fields: dict[str, Any]) -> wire.Heartbeat:
    """A worker's heartbeat of these wire fields, as the membership hands it to the watchdog (read as a peer's)."""
    return wire.Heartbeat.from_msg({"op": P.HEARTBEAT, **fields})


def beat(w: Watchdog, now: float, steps: dict[int, int | None], waiting: set[int],
         extra: dict[int, dict[str, Any]] | None = None) -> None:
    """A heartbeat of each rank in `steps` at `now` (ranks in `waiting` say they wait in a collective; `extra`: more
    fields by rank)."""
    for rank, step in steps.items():
        w.heard(rank, f"worker_{rank}", step, hb({"waiting": rank in waiting, **(extra or {}).get(rank, {})}), now)


def train(w: Watchdog, until: float, p99: float = 0.05) -> int:
    """Both ranks step every second up to `until` (a step per heartbeat), reporting `p99`; the last step."""
    step = 0
    for t in range(int(until) + 1):
        step += 1
        beat(w, float(t), {0: step, 1: step}, set(), {r: {"step_p99": p99} for r in (0, 1)})
    return step


def test_a_rank_outside_any_collective_while_its_peer_waits_is_named_once_the_floor_passed() -> None:
    w = Watchdog(BEAT)
    step = train(w, 10)  # last step at t=10
    for t in range(11, 16):  # rank 1 sleeps in its own code, rank 0 waits in the step's allreduce from t=11
        beat(w, float(t), {0: step, 1: step}, {0})
        assert w.check(float(t)) == [], t  # waited less than the 5 s floor (10 x 0.05 s is less)
    assert w.due() == 16.0
    beat(w, 16.0, {0: step, 1: step}, {0})
    (stuck,) = w.check(16.0)
    assert (stuck.rank, stuck.node_id, stuck.step, stuck.silent, stuck.waiting) == (1, "worker_1", step, False,
                                                                                    ("worker_0",))
    assert stuck.stalled == 6.0 and stuck.bound == P.STALL_FLOOR
    assert stuck.reason().startswith(f"stuck: no step for 6 s after step {step} (not in any collective) while "
                                     "worker_0 waited for it in a collective (bound 5 s: max(10 x p99 step 0.05 s")
    assert w.check(17.0) == []  # named once: the membership takes it from here


def test_the_bound_scales_with_the_p99_step_time() -> None:
    w = Watchdog(BEAT)
    step = train(w, 10, p99=2.0)  # bound 20 s
    for t in range(11, 31):
        beat(w, float(t), {0: step, 1: step}, {0})
        assert w.check(float(t)) == [], t
    beat(w, 31.0, {0: step, 1: step}, {0})
    assert [s.rank for s in w.check(31.0)] == [1]
    assert P.stall_bound(2.0) == 20.0 and P.stall_bound(None) == P.STALL_FLOOR == P.stall_bound(0.01)


def test_a_rank_silent_while_its_agent_vouches_is_named_a_call_holding_its_gil() -> None:
    w = Watchdog(BEAT)
    step = train(w, 10)
    for t in range(11, 18):  # rank 1 heartbeats no more (its GIL is held); rank 0 waits
        beat(w, float(t), {0: step}, {0})
    assert w.check(16.0, vouched=lambda rank, since: rank != 1) == []  # stopped (SIGSTOP) or cut off: silence's
    # its agent's last word came 1.5 s after its last heartbeat (at 10): it may have been stopped since
    assert w.check(16.0, vouched=lambda rank, since: 11.5 > since) == []
    (stuck,) = w.check(17.0, vouched=lambda rank, since: 12.5 > since)  # a word from a time it should have beaten
    assert stuck.rank == 1 and stuck.silent and stuck.silent_for == 7.0
    assert "sent no heartbeat for 7.0 s though running (a call holding its GIL?)" in stuck.reason()


@pytest.mark.parametrize("case", ["first step", "all wait", "nobody waits", "long phase", "one glimpse outside",
                                  "steps move", "alone", "uneven ends"])
def test_what_must_not_trip_it(case: str) -> None:
    w = Watchdog(BEAT)
    if case == "first step":  # a generation formed; rank 1's first step in it takes 30 s (a compile, a transfer)
        step = train(w, 10)
        w.formed()
        for t in range(11, 41):
            beat(w, float(t), {0: step + 1, 1: step}, {0})  # rank 0 made its first step, rank 1 not yet
    elif case == "alone":
        for t in range(40):
            w.heard(0, "worker_0", t // 20, hb({"waiting": False}), float(t))
    else:
        step = train(w, 10)
        for t in range(11, 41):
            waiting = {"all wait": {0, 1}, "nobody waits": set(), "long phase": {0}, "one glimpse outside": {0, 1},
                       "steps move": {0}, "uneven ends": {0} if t >= 37 else set()}[case]
            # uneven ends: both ranks evaluate for 26 s, rank 0 ends 4 s sooner and waits (less than the bound)
            if case == "one glimpse outside" and t == 40:
                waiting = {0}  # one heartbeat outside: a collective's error being handled, say
            extra = {1: {"long": "checkpoint"}} if case == "long phase" else {}
            if case == "steps move":
                step += t % 4 == 0  # slow (a step in 4 s) but moving: a straggler, no hang
            beat(w, float(t), {0: step, 1: step}, waiting, extra)
    assert w.check(40.0) == []


def test_a_new_generation_waits_for_every_rank_to_step_and_forgets_the_dead() -> None:
    w = Watchdog(BEAT)
    step = train(w, 10)
    w.forget(1)
    w.formed()
    beat(w, 11.0, {0: step, 1: None}, set())  # the replacement, no step yet
    assert w.due() == float("inf")
    beat(w, 12.0, {0: step + 1, 1: step + 1}, set())
    assert w.due() == 17.0


def test_hostile_fields_read_as_absent() -> None:
    w = Watchdog(BEAT)
    w.heard(0, "worker_0", 1, hb({"waiting": "yes", "long": 7, "step_p99": float("nan")}), 0.0)
    r = w.ranks[0]
    assert (r.waiting, r.long, r.p99) == (False, None, None)
    w.heard(0, "worker_0", 1, hb({"waiting": True, "long": "x" * 1000, "step_p99": 1e9}), 1.0)
    assert w.ranks[0].waiting and len(w.ranks[0].long or "") == P.MAX_LONG and w.ranks[0].p99 is None


# --- a script that reports no step: judged by its collectives ---------------------------------------------------


def counted(w: Watchdog, now: float, counts: dict[int, int], waiting: set[int]) -> None:
    """A heartbeat at `now` of each rank in `counts`, which reports no step: its default group's collective count."""
    for rank, count in counts.items():
        w.heard(rank, f"worker_{rank}", None, hb({"waiting": rank in waiting, "collectives": count}), now)


def test_a_script_without_steps_is_judged_by_its_collectives_and_the_rank_behind_is_named() -> None:
    w = Watchdog(BEAT)
    for t in range(11):  # DDP's set-up (6 collectives), then 7 allreduces (buckets) a step, a step per heartbeat
        counted(w, float(t), {0: 6 + 7 * t, 1: 6 + 7 * t}, set())
        assert (w.due() == float("inf")) == (t < 3), t  # the first steps: 4 heartbeats with a new count each
    last = 6 + 7 * 10
    for t in range(11, 16):  # rank 1 spins in its own code at 76; rank 0 entered the next step's first allreduce
        counted(w, float(t), {0: last + 1, 1: last}, {0})
        assert w.check(float(t)) == [], t
    counted(w, 16.0, {0: last + 1, 1: last}, {0})
    (stuck,) = w.check(16.0)
    assert (stuck.rank, stuck.collectives, stuck.peers_at, stuck.silent, stuck.step) == (1, last, last + 1, False, None)
    assert stuck.stalled == 5.0 and stuck.bound == P.STALL_FLOOR  # the job's last move: rank 0's, at t=11
    assert stuck.reason().startswith(f"stuck: entered no collective for 5 s after its collective {last} (not in any "
                                     f"collective) while worker_0 waited for it in a collective (theirs: {last + 1}"), \
        stuck.reason()


def test_a_rank_not_behind_the_waiting_peers_is_never_blamed() -> None:
    w = Watchdog(BEAT)
    for t in range(11):
        counted(w, float(t), {0: 6 + 7 * t, 1: 6 + 7 * t}, set())
    # rank 1 entered the collective rank 0 waits in (same count) and is seen outside any: not the culprit
    for t in range(11, 40):
        counted(w, float(t), {0: 100, 1: 100}, {0})
        assert w.check(float(t)) == [], t


def test_the_bound_follows_the_observed_intervals_between_collectives() -> None:
    """A healthy slow rank: rank 1 works 8 s at each step while rank 0 waits 7 s for it (past the 5 s floor), never
    blamed; the bound is then 10 x the intervals learned (at their least: 8 s between moves, less a heartbeat), after
    which a rank stuck behind is named."""
    w = Watchdog(BEAT)
    count = 6
    for t in range(0, 64):
        if t % 8 == 0:
            count += 7
        counted(w, float(t), {0: count + (t % 8 > 0), 1: count}, {0} if t % 8 > 0 else set())
        assert w.check(float(t)) == [], t
    assert w.gap_p99 == 7.0 and w.due() == 57 + 70  # rank 0 entered the last step's allreduce at t=57
    for t in range(64, 127):
        counted(w, float(t), {0: count + 1, 1: count}, {0})
        assert w.check(float(t)) == [], t
    counted(w, 127.0, {0: count + 1, 1: count}, {0})
    (stuck,) = w.check(127.0)
    assert stuck.rank == 1 and stuck.bound == 70.0 and "p99 interval 7 s" in stuck.reason(), stuck.reason()


def test_hostile_collective_counts_read_as_absent() -> None:
    w = Watchdog(BEAT)
    for bad in ("7", 7.0, -1, 1 << 70, True, None):
        w.heard(0, "worker_0", None, hb({"collectives": bad}), 0.0)
        assert w.ranks[0].collectives is None and w.ranks[0].moves == 0, bad


def test_the_collective_count_is_read_from_another_thread_while_one_waits(tmp_path: Any) -> None:
    """stacks.collectives on a real gloo group of one: None before it exists, then torch's count of the collectives
    the process entered."""
    import torch
    import torch.distributed as dist

    assert stacks.collectives() is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        before = stacks.collectives()
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
        seen: list[int | None] = []
        reader = threading.Thread(target=lambda: seen.append(stacks.collectives()))
        reader.start()
        reader.join(30)
        assert before is not None and seen == [before + 3]
    finally:
        dist.destroy_process_group()
    assert stacks.collectives() is None


# --- in the membership ---------------------------------------------------------------------------------------


def test_the_membership_declares_the_stuck_rank_dead_and_has_its_agent_dump_and_kill_it() -> None:
    m = Membership("job", 2, 3.0, 60.0, "boot", "10.0.0.1:8118", {"worker_0": "hostA", "worker_1": "hostA"}, 0.0)
    m.started(0.0)
    m.agent_hello(50, "a", {"op": P.AGENT_HELLO, "host": "hostA", "node_ids": ["worker_0", "worker_1"]}, 0.0)
    for rank in (0, 1):
        m.register(10 + rank, f"10.0.0.2:{rank}", {"op": P.REGISTER, "node_id": f"worker_{rank}", "rank": rank,
                                                   "world_size": 2, "incarnation": f"i{rank}", "pid": 100 + rank,
                                                   "host": "hostA", "recovery": P.RECOVERY_IN_PLACE}, 0.0)
    assert m.formed
    out: list[Any] = []
    for t in range(1, 20):
        now = float(t)
        m.message(50, {"op": P.HEARTBEAT, "running": {"worker_0": 100, "worker_1": 101}}, now)
        m.message(10, {"op": P.HEARTBEAT, "step": min(t, 5), "waiting": t > 5, "step_p99": 0.1}, now)
        if t <= 5:  # rank 1 stops at step 5, its GIL held: no heartbeat
            m.message(11, {"op": P.HEARTBEAT, "step": t, "step_p99": 0.1}, now)
        if now >= m.next_deadline():
            out = m.tick(now)
        if any(isinstance(a, Send) and a.op == P.KILL for a in out):
            break
    kill = [a for a in out if isinstance(a, Send) and a.op == P.KILL]
    assert kill == [Send(50, wire.Kill("worker_1", 101, CAUSE_STUCK, dump=True))]
    assert kill[0].fields == {"node_id": "worker_1", "pid": 101, "cause": CAUSE_STUCK, "dump": True}  # on the wire
    assert not [a for a in out if isinstance(a, Send) and a.peer == 11]  # told nothing: it dumps, then dies
    assert [a.fields["generation"] for a in out if isinstance(a, Send) and a.op == P.GENERATION] == [1]
    (death,) = [a for a in out if isinstance(a, Note) and a.kind == NoteKind.DEATH]
    # rank 0 waited from t=6 and the 5 s floor passed at t=11: failed at its last step (t=5), 6 s before
    assert death.fields["cause"] == CAUSE_STUCK and death.fields["silent_for"] == 6.0 and now == 11.0
    assert "sent no heartbeat for 6.0 s though running" in death.fields["reason"]


# --- the worker's parts ------------------------------------------------------------------------------------------


def test_the_p99_step_time_is_of_the_intervals_between_reports_and_a_recovery_is_none() -> None:
    pace = StepPace(strided=True)
    assert pace.p99() is None and "step_p99" not in pace.summary()
    t = 0.0
    for step in range(1, 201):
        t += 2.0 if step % 100 == 0 else 0.1  # two slow steps (a checkpoint) in 200
        pace.step(step, t)
    assert pace.p99() == 2.0 and pace.summary()["step_p99"] == 2.0
    pace.restart()
    pace.step(201, t + 60.0)  # the fault and its recovery: no step's time
    pace.step(211, t + 61.0)  # reported every 10th step: the time between reports
    assert max(pace.intervals) == 2.0 and pace.intervals[-1] == 1.0


def fake(path: str) -> Any:
    """A function `wait(event)` whose code lives at `path` (as if it were that library's)."""
    space: dict[str, Any] = {}
    exec(compile("def wait(event):\n    event.wait(60)\n", path, "exec"), space)  # noqa: S102 - our own two lines
    return space["wait"]


def test_the_training_thread_is_seen_waiting_only_inside_a_collective_place_and_saving_as_long() -> None:
    done = threading.Event()
    targets = [fake("/venv/site-packages/torch/distributed/c10d.py"), lambda event: event.wait(60),
               fake("/venv/site-packages/torch/serialization.py")]
    started = [threading.Event() for _ in targets]
    threads = [threading.Thread(target=lambda f=f, s=s: (s.set(), f(done))) for f, s in zip(targets, started,
                                                                                            strict=True)]
    for t, s in zip(threads, started, strict=True):
        t.start()
        assert s.wait(30)
    try:
        assert [stacks.sample(t.ident) for t in threads] == [(True, None), (False, None),
                                                             (False, "a torch.save or torch.load")]
        assert stacks.sample(-1) == (False, None)  # a thread that is gone
    finally:
        done.set()
        for t in threads:
            t.join(30)


# --- shown as a stall ---------------------------------------------------------------------------------------------


def test_a_stall_shows_as_one_in_the_live_view_and_is_not_productive() -> None:
    clock = [0.0]
    journal = Journal(None, "job", 2, 0.75, clock=lambda: clock[0], wall=lambda: 1000.0 + clock[0])
    journal.note(Note(NoteKind.FORMED, {"generation": 0, "seconds": 0.1, "recovery": [P.RECOVERY_RESTART]}))
    for t in range(0, 60):
        clock[0] = float(t)
        for rank in (0, 1):
            journal.note(Note(NoteKind.PACE, {"rank": rank, "node_id": f"worker_{rank}", "host": "h", "pid": 1,
                                              "step": min(t, 20), "step_time": 0.1, "step_p99": 0.2}))
    live = journal.live(59.0, 1059.0)
    assert live["stalled_for"] == 39.0
    assert live["ranks"]["0"]["steps_per_s"] == 0.0 and live["ranks"]["1"]["no_step_for"] == 39.0
    assert live["goodput"]["stalled"] == 39.0 and live["goodput"]["productive"] <= 20.0
    assert "stalled: no step for 39 s" in "\n".join(live_lines(live))
    proc = ProcStatus("h", "worker_1", "worker", 1, 1, "running", 0, 20, 1.0, None, no_step_for=39.0)
    assert process_note(proc)[0] == "no step for 39 s"
    clock[0] = 60.0
    journal.note(Note(NoteKind.PACE, {"rank": 0, "node_id": "worker_0", "host": "h", "pid": 1, "step": 21,
                                      "step_time": 0.1, "step_p99": 0.2}))
    live = journal.live(60.0, 1060.0)
    assert live["stalled_for"] is None and live["ranks"]["0"]["steps_per_s"] == 10.0
    assert "stalled" not in live["goodput"]


def test_the_agent_dumps_only_when_told_so_in_so_many_words() -> None:
    running = {"worker_1": 101}
    for dump, expected in ((True, True), ("yes", False), (None, False)):
        msg = {"op": P.KILL, "node_id": "worker_1", "pid": 101, "cause": CAUSE_STUCK,
               **({} if dump is None else {"dump": dump})}
        assert policy.on_scheduler(wire.decode(msg), running, False, [], ["worker_1"]) == \
            policy.Kill("worker_1", CAUSE_STUCK, expected)


class WordChannel:
    """The Runtime's side of the control channel that `changed_by` uses: records how long it was asked to wait."""

    def __init__(self) -> None:
        self.bounds: list[float] = []

    def wait_change(self, current: int | None, bound: float) -> int | None:
        self.bounds.append(bound)
        return 1


def test_a_survivor_whose_collective_timed_out_waits_the_watchdogs_bound_for_the_word() -> None:
    cfg = WorkerEnv.from_env({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "RANK_ID": "0", "MS_NODE_TIMEOUT": "6"})
    rt = Runtime(cfg, "gloo", 30.0)
    channel = WordChannel()
    rt._channel = channel  # type: ignore[assignment]  # the point: what changed_by waits, no scheduler needed
    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv")
    assert rt.changed_by(timed_out) is not None
    for step in range(1, 40):
        rt.pace.step(step, step * 2.0)  # 2 s steps: the watchdog's bound is 20 s
    assert rt.changed_by(timed_out) is not None
    assert channel.bounds == [cfg.word_wait + P.STALL_FLOOR, cfg.word_wait + 20.0] and cfg.word_wait == 9.0
