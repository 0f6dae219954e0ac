"""The typed messages (toolkit.contracts.messages): each op's value goes on the wire as the dicts the senders built
before (the same JSON, field for field, nulls included; a heartbeat's fields in the order of its dataclass, where the
dict had the order of the calls that filled it), comes back equal through the receiver's decode, and a malformed one
is one ProtocolError line or, where the receiver reads on (a heartbeat), a field read as absent; the scheduler's Send
refuses anything but a typed message."""

from __future__ import annotations

import json

import pytest

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol as P
from toolkit.scheduler.actions import Send

# each message and the line the senders wrote for it before it was typed
WIRE = [
    (wire.Challenge("n" * 32), {"op": "challenge", "nonce": "n" * 32}),
    (wire.Welcome(rank=1, world_size=4, generation=0, job="j"),
     {"op": "welcome", "rank": 1, "world_size": 4, "generation": 0, "job": "j"}),
    (wire.Welcome(beat=1.5), {"op": "welcome", "beat": 1.5}),
    (wire.Welcome(), {"op": "welcome"}),
    (wire.Welcome(host="hostB", spare="s1", node_ids=("worker_2",)),
     {"op": "welcome", "host": "hostB", "spare": "s1", "node_ids": ["worker_2"]}),
    (wire.Reject("why"), {"op": "reject", "reason": "why", "retry": False}),
    (wire.Reject("held", retry=True), {"op": "reject", "reason": "held", "retry": True}),
    (wire.Fenced("declared dead: x"), {"op": "fenced", "reason": "declared dead: x"}),
    (wire.Stop("failed"), {"op": "stop", "reason": "failed"}),
    (wire.Finished(), {"op": "finished"}),
    (wire.Kill("worker_1", 101, "heartbeat silence"),
     {"op": "kill", "node_id": "worker_1", "pid": 101, "cause": "heartbeat silence"}),
    (wire.Kill("worker_1", 101, "stuck", dump=True),
     {"op": "kill", "node_id": "worker_1", "pid": 101, "cause": "stuck", "dump": True}),
    (wire.TakeOver("hostB", ("worker_2", "worker_3"), 1),
     {"op": "takeover", "host": "hostB", "node_ids": ["worker_2", "worker_3"], "seq": 1}),
    (wire.Generation(3), {"op": "generation", "generation": 3}),
    (wire.Formed(2, "job/boot/gen2/", 1, 3, 4, [[0], [1, 3], [2]], 5, 12.5, 0.75),
     {"op": "formed", "generation": 2, "prefix": "job/boot/gen2/", "rank": 1, "world_size": 3, "logical_world": 4,
      "logical": [[0], [1, 3], [2]], "faults": 5, "uptime": 12.5, "goodput": 0.75}),
    (wire.Register("worker_0", 0, 2, "inc", 1000, "hostA", None, False, P.RECOVERY_IN_PLACE),
     {"op": "register", "node_id": "worker_0", "rank": 0, "world_size": 2, "incarnation": "inc", "pid": 1000,
      "host": "hostA", "generation": None, "rejoin": False, "recovery": "in-place"}),
    (wire.AgentHello("hostA", ("worker_0", "worker_1"), False),
     {"op": "agent_hello", "host": "hostA", "node_ids": ["worker_0", "worker_1"], "spare": False}),
    (wire.StoreHello("worker_1"), {"op": "store_hello", "node_id": "worker_1"}),
    (wire.Replace("hostB", None), {"op": "replace", "node_id": "operator", "host": "hostB", "spare": None}),
    (wire.Heartbeat(step=7, total=100, step_time=0.25, busy=0.2, loss=2.5, ckpt_stall=0.01, ckpts=1, ckpt_bytes=4096,
                    ckpt_every=5, ckpt_why="5 steps: fixed", ckpt_step=5, stride=1, first_step=1, step_p99=0.3,
                    waiting=False, long="checkpoint", ckpt_skipped=0, ckpt_full="", collectives=None, capacity=3),
     {"op": "heartbeat", "step": 7, "total": 100, "step_time": 0.25, "busy": 0.2, "loss": 2.5, "ckpt_stall": 0.01,
      "ckpts": 1, "ckpt_bytes": 4096, "ckpt_every": 5, "ckpt_why": "5 steps: fixed", "ckpt_step": 5, "stride": 1,
      "first_step": 1, "step_p99": 0.3, "waiting": False, "long": "checkpoint", "ckpt_skipped": 0, "ckpt_full": "",
      "capacity": 3}),
    (wire.Heartbeat(step=None, waiting=True, collectives=12),  # a worker before its first step: a step of null
     {"op": "heartbeat", "step": None, "waiting": True, "collectives": 12}),
    (wire.Heartbeat(running={"worker_0": 1000, "worker_1": 1001}),  # an agent's: no step
     {"op": "heartbeat", "running": {"worker_0": 1000, "worker_1": 1001}}),
    (wire.Commit(40), {"op": "commit", "step": 40}),
    (wire.Done(), {"op": "done"}),
    (wire.Recovered(2, 40, "peer", None, 3, 0.25, 1 << 20),
     {"op": "recovered", "generation": 2, "step": 40, "source": "peer", "from_rank": None, "recomputed": 3,
      "seconds": 0.25, "bytes": 1 << 20}),
    (wire.Corruption(3, 16, 12, (2,), ("hostB",), P.CORRUPT_FENCED),
     {"op": "corruption", "generation": 3, "step": 16, "since": 12, "ranks": [2], "hosts": ["hostB"],
      "action": "fenced"}),
    (wire.Corruption(0, 8, None, (0, 1), ("hostA", "hostA"), "rolled back"),  # no good check yet: since null
     {"op": "corruption", "generation": 0, "step": 8, "since": None, "ranks": [0, 1], "hosts": ["hostA", "hostA"],
      "action": "rolled back"}),
    (wire.Exited("worker_1", 1001, None, "SIGKILL", None),
     {"op": "exited", "node_id": "worker_1", "pid": 1001, "code": None, "signal": "SIGKILL", "cause": None}),
    (wire.GaveUp("worker_1", 3, None, "ValueError: bad data", "a\nb"),
     {"op": "gave_up", "node_id": "worker_1", "code": 3, "signal": None, "cause": "ValueError: bad data",
      "log_tail": "a\nb"}),
]


@pytest.mark.parametrize("message, line", WIRE, ids=lambda v: type(v).__name__ if isinstance(v, wire.Message) else "")
def test_each_message_goes_on_the_wire_as_before_and_comes_back_equal(message: wire.Message, line: dict) -> None:
    data = message.line()
    assert data == json.dumps(line, separators=(",", ":")).encode() + b"\n"  # byte for byte, in the same order
    read = wire.decode(P.decode(data.rstrip(b"\n")))
    assert read == message


def test_every_op_the_scheduler_sends_or_a_hello_is_typed_and_dispatched_in_one_place() -> None:
    assert set(wire.BY_OP) == {P.CHALLENGE, P.WELCOME, P.REJECT, P.FENCED, P.STOP, P.FINISHED, P.KILL, P.TAKEOVER,
                               P.GENERATION, P.FORMED, P.REGISTER, P.AGENT_HELLO, P.STORE_HELLO, P.REPLACE, P.COMMIT,
                               P.DONE, P.RECOVERED, P.EXITED, P.GAVE_UP, P.HEARTBEAT, P.CORRUPTION}
    assert {type(m) for m, _ in WIRE} == set(wire.BY_OP.values())
    assert wire.decode({"op": "from the future", "x": 1}) == wire.Unknown("from the future")


CORRUPTION = {"op": P.CORRUPTION, "generation": 0, "step": 16, "since": 12, "ranks": [2], "hosts": ["h2"],
              "action": "healed"}


@pytest.mark.parametrize("msg, error", [
    ({"op": P.GENERATION, "generation": True}, "generation without a generation"),
    ({"op": P.FORMED, "generation": 1}, "formed without a store prefix"),
    ({"op": P.FORMED, "generation": 1, "prefix": "p", "rank": 2, "world_size": 2}, "rank that is not in its world"),
    ({"op": P.WELCOME, "generation": -1}, "welcome without a generation"),
    ({"op": P.TAKEOVER, "host": "hostB", "node_ids": []}, "takeover of hostB without node ids"),
    ({"op": P.TAKEOVER, "host": "hostB", "node_ids": [7]}, "takeover of hostB with a malformed node_ids"),
    ({"op": P.CHALLENGE, "nonce": "short"}, "expected a challenge first"),
    ({"op": P.REGISTER, "node_id": "worker_2", "rank": "2"}, "malformed register message"),
    ({"op": P.AGENT_HELLO, "host": "", "node_ids": []}, "malformed agent_hello"),
    ({"op": P.REPLACE, "host": "hostB", "spare": 5}, "malformed replace: spare is not a host name"),
    ({"op": P.EXITED, "node_id": 7, "pid": 1}, "exited without a node id"),
    *[({**CORRUPTION, **bad}, error) for bad, error in [
        ({"step": -1}, "malformed step or since"), ({"step": "16"}, "malformed step or since"),
        ({"since": 17}, "malformed step or since"), ({"action": "ignored"}, "unknown action"),
        ({"ranks": [True]}, "malformed ranks or hosts"), ({"ranks": [-1]}, "malformed ranks or hosts"),
        ({"hosts": []}, "malformed ranks or hosts"), ({"hosts": [7]}, "malformed ranks or hosts"),
        ({"ranks": [0] * (wire.MAX_WORLD + 1), "hosts": ["h"] * (wire.MAX_WORLD + 1)}, "malformed ranks or hosts")]],
])
def test_a_malformed_message_is_one_protocol_error_line(msg: dict, error: str) -> None:
    with pytest.raises(P.ProtocolError, match=error) as caught:
        wire.decode(msg)
    assert "\n" not in str(caught.value)


def test_what_is_read_is_bounded_and_hostile_values_read_as_absent() -> None:
    stop = wire.decode({"op": P.STOP, "reason": "x" * 5000})
    assert isinstance(stop, wire.Stop) and stop.reason == "x" * wire.MAX_REASON
    assert wire.decode({"op": P.KILL, "node_id": "w", "pid": True, "dump": "yes"}) == wire.Kill("w")
    formed = wire.decode({"op": P.FORMED, "generation": 0, "prefix": "p", "faults": -1, "uptime": -3, "goodput": 2})
    assert isinstance(formed, wire.Formed) and (formed.faults, formed.uptime, formed.goodput) == (None, None, None)
    assert wire.decode({"op": P.WELCOME, "beat": 1e9}) == wire.Welcome()  # out of [MIN_BEAT, MAX_BEAT]
    hello = wire.decode({"op": P.AGENT_HELLO, "host": "h", "node_ids": ["w0", 5, "x" * 300]})
    assert hello == wire.AgentHello("h", ("w0",), False)
    gave_up = wire.decode({"op": P.GAVE_UP, "node_id": 7, "code": "x", "signal": [], "log_tail": "z" * 99999})
    assert gave_up == wire.GaveUp("?", None, None, None, "z" * wire.MAX_LOG_TAIL)
    assert wire.decode({"op": P.RECOVERED, "source": "elsewhere", "seconds": -1}) == \
        wire.Recovered(None, None, None, None, None, None)


def test_a_send_carries_a_typed_message_only() -> None:
    send = Send(3, wire.Stop("r"), close=True)
    assert (send.op, send.fields) == (P.STOP, {"reason": "r"})
    with pytest.raises(TypeError, match="typed message"):
        Send(3, P.STOP, {"reason": "r"})  # type: ignore[arg-type]  # the old form: said at once, never sent


def test_a_heartbeats_hostile_fields_read_as_absent_and_its_pace_is_what_is_left() -> None:
    """Never refused (a worker's heartbeat is its sign of life): each field of the wrong type or out of range is
    None, texts are cut, an agent's `running` keeps only node ids with whole pids; `pace` is what the ledger gets."""
    hostile = {"op": P.HEARTBEAT, "step": True, "total": -1, "step_time": float("inf"), "busy": 1e8, "loss": "x",
               "ckpt_stall": -0.5, "ckpts": 2.5, "ckpt_bytes": 1 << 41, "ckpt_every": "5", "ckpt_why": "w" * 1000,
               "ckpt_step": None, "stride": [], "first_step": {}, "step_p99": float("nan"), "waiting": "yes",
               "long": "", "ckpt_skipped": False, "ckpt_full": 5, "collectives": 1 << 70, "capacity": 0,
               "running": {"worker_0": 1000, "worker_1": "1001", "worker_2": True, "x" * 300: 5}}
    beat = wire.decode(hostile)
    assert beat == wire.Heartbeat(ckpt_why="w" * wire.MAX_WHY, running={"worker_0": 1000})
    assert beat.pace() == {"ckpt_why": "w" * wire.MAX_WHY}
    assert wire.decode({"op": P.HEARTBEAT, "long": "z" * 500, "loss": -3, "capacity": 10 ** 9}) == \
        wire.Heartbeat(long="z" * P.MAX_LONG, loss=-3.0)
    assert wire.decode({"op": P.HEARTBEAT, "running": ["worker_0"]}).running is None  # type: ignore[union-attr]
    many = {f"worker_{i}": i for i in range(wire.MAX_NODE_IDS + 10)}
    assert len(wire.decode({"op": P.HEARTBEAT, "running": many}).running or {}) == wire.MAX_NODE_IDS  # type: ignore


def test_a_corruption_report_is_read_as_one_line_per_host_and_judged_against_the_world() -> None:
    report = wire.decode({**CORRUPTION, "generation": "0", "hosts": ["h2\nEVIL" + "h" * 400]})
    assert isinstance(report, wire.Corruption)
    assert report.generation is None and report.hosts == ("h2",)  # a generation not whole reads as absent
    long = wire.decode({**CORRUPTION, "hosts": ["x" * 400]})
    assert isinstance(long, wire.Corruption) and long.hosts == ("x" * wire.MAX_NAME,)
    assert report.within(4) and not report.within(2)  # rank 2 of a job of 2 ranks: not the job's
    five = wire.Corruption(0, 16, 12, (0, 1, 2, 3, 0), ("h",) * 5, "healed")
    assert not five.within(4)  # more ranks named than the job has
