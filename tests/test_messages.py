"""The typed messages (toolkit.contracts.messages): each op's value goes on the wire as the dicts the senders built
before (the same JSON, field for field, nulls included), comes back equal through the receiver's decode, and a
malformed one is one ProtocolError line; the scheduler's Send refuses anything but a typed message."""

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
    (wire.Commit(40), {"op": "commit", "step": 40}),
    (wire.Done(), {"op": "done"}),
    (wire.Recovered(2, 40, "peer", None, 3, 0.25, 1 << 20),
     {"op": "recovered", "generation": 2, "step": 40, "source": "peer", "from_rank": None, "recomputed": 3,
      "seconds": 0.25, "bytes": 1 << 20}),
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
                               P.DONE, P.RECOVERED, P.EXITED, P.GAVE_UP}  # left: heartbeat, corruption
    assert {type(m) for m, _ in WIRE} == set(wire.BY_OP.values())
    assert wire.decode({"op": "from the future", "x": 1}) == wire.Unknown("from the future")


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
