"""The wire contract: framing round-trips, reassembly from arbitrary chunks, and refusal of what is not a message."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol as P

fields = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda k: k != "op"),
    st.one_of(st.none(), st.integers(), st.text(max_size=20), st.booleans(), st.lists(st.integers(), max_size=3)),
    max_size=5,
)


@given(op=st.sampled_from([P.REGISTER, P.WELCOME, P.EXITED, P.KILL, P.FORMED]), body=fields,
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_messages_survive_any_chunking(op: str, body: dict, cuts: list[int]) -> None:
    wire = P.encode(op, **body) + P.encode(P.HEARTBEAT, step=7)
    buf = P.LineBuffer()
    got = []
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    for a, b in zip(points[:-1], points[1:], strict=True):
        got += buf.feed(wire[a:b])
    assert got == [{"op": op, **body}, {"op": P.HEARTBEAT, "step": 7}]


def test_one_message_is_one_line() -> None:
    wire = P.encode(P.REJECT, reason="line\nbreak", retry=False)
    assert wire.count(b"\n") == 1 and wire.endswith(b"\n")
    assert P.decode(wire.strip()) == {"op": P.REJECT, "reason": "line\nbreak", "retry": False}


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b'{"no_op": 1}', b'{"op": 3}', b"\xff\xfe"])
def test_garbage_is_a_protocol_error(line: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode(line)


def test_an_endless_line_is_cut_off_not_buffered() -> None:
    buf = P.LineBuffer()
    with pytest.raises(P.ProtocolError, match="longer than"):
        buf.feed(b"x" * (P.MAX_LINE + 1))


def test_blank_lines_are_ignored() -> None:
    assert P.LineBuffer().feed(b"\n\n" + P.encode(P.DONE) + b"\n") == [{"op": P.DONE}]


def test_store_prefixes_never_repeat_across_generations_or_scheduler_starts() -> None:
    prefixes = {P.store_prefix("job", boot, gen) for boot in ("a1", "b2") for gen in range(3)}
    assert len(prefixes) == 6
    assert all(p.startswith("job/") and p.endswith("/") for p in prefixes)


def test_agent_contract_names_are_kept() -> None:
    # the agent engineer's side depends on these exact strings (docs/architecture.md)
    assert (P.AGENT_HELLO, P.EXITED, P.GAVE_UP, P.KILL, P.STOP, P.FINISHED) == (
        "agent_hello", "exited", "gave_up", "kill", "stop", "finished")
    assert P.worker_node_id(3) == "worker_3"


# --- hostile input ----------------------------------------------------------------------------------------------


@given(st.binary(max_size=2048))
def test_any_bytes_are_messages_or_one_protocol_error(data: bytes) -> None:
    try:
        for msg in P.LineBuffer().feed(data + b"\n"):
            assert isinstance(msg, dict) and isinstance(msg["op"], str)
    except P.ProtocolError:
        pass


@pytest.mark.parametrize("line", [
    b'{"op": "register", "rank": ' + b"9" * 5000 + b"}",  # past Python's int-digit limit (ValueError)
    b"[" * 200_000,  # past the recursion limit (RecursionError)
    b'{"op": "register", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"op": "register", "rank": 1e999999}',  # an infinite number
    b'{"op": "register", "rank": NaN}',
])
def test_lines_that_broke_the_scheduler_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode(line)


def test_a_line_over_the_limit_is_refused_even_with_its_newline() -> None:
    buf = P.LineBuffer(limit=100)
    with pytest.raises(P.ProtocolError, match="longer than 100"):
        buf.feed(b"x" * 101 + b"\n")


def test_the_handshake_proves_the_token_both_ways_and_never_carries_it() -> None:
    server_nonce = P.new_nonce()
    hello, client_nonce = P.hello(P.REGISTER, "the-token", server_nonce, node_id="worker_1", rank=1)
    msg = P.decode(hello.strip())
    assert b"the-token" not in hello and "token" not in msg
    assert P.check_client("the-token", server_nonce, msg)
    assert not P.check_client("another-token", server_nonce, msg)
    assert not P.check_client("the-token", P.new_nonce(), msg)  # replayed on another connection
    assert not P.check_client("the-token", server_nonce, {**msg, "node_id": "worker_0"})  # claims someone else
    assert not P.check_client("the-token", server_nonce, {**msg, "token": "the-token"})  # the plain form
    answer = {"op": P.WELCOME, "proof": P.server_proof("the-token", server_nonce, client_nonce)}
    assert P.check_server("the-token", server_nonce, client_nonce, answer)
    assert not P.check_server("another-token", server_nonce, client_nonce, answer)
    assert not P.check_server("the-token", server_nonce, client_nonce, {"op": P.WELCOME})


def test_fields_of_the_wrong_type_are_not_numbers() -> None:
    assert P.whole({"rank": True}, "rank") is None and P.whole({"rank": "1"}, "rank") is None
    assert P.whole({"rank": 3}, "rank") == 3 and P.whole({}, "rank", 7) == 7


@pytest.mark.parametrize("beat", [None, "2", True, 0.0, -1.0, 0.01, 61.0, float("nan"), float("inf"), 10**400])
def test_a_welcome_without_a_sane_beat_leaves_the_agents_own(beat: Any) -> None:
    assert P.beat_interval({"op": P.WELCOME} if beat is None else {"op": P.WELCOME, "beat": beat}, 1.0) == 1.0


def test_a_welcomes_beat_is_taken() -> None:
    assert P.beat_interval({"op": P.WELCOME, "beat": 2}, 1.0) == 2.0 and P.beat_interval({"beat": 0.5}, 1.0) == 0.5


def test_an_integer_past_a_floats_range_is_a_number_out_of_range_not_a_crash() -> None:
    # JSON allows 10**400 (Python reads up to 4300 digits); math.isfinite and float() of it raise OverflowError,
    # which in the scheduler's loop would have ended the scheduler on one worker's heartbeat.
    huge = P.decode(b'{"op":"heartbeat","step":1,"loss":1' + b"0" * 400 + b',"busy":-1' + b"0" * 400
                    + b',"step_time":0.5,"seconds":1' + b"0" * 400 + b"}")
    assert wire.Heartbeat.from_msg(huge).pace() == {"step_time": 0.5}
    assert P.seconds_field(huge, "seconds") is None and P.seconds_field(huge, "step_time") == 0.5
    assert P.finite_number(huge["loss"]) and not P.finite_number(float("nan")) and not P.finite_number(True)


def test_the_heartbeat_says_checkpoints_skipped_for_a_full_disk_and_why_bounded() -> None:
    got = wire.Heartbeat.from_msg({"ckpt_skipped": 3, "ckpt_full": "x" * 1000}).pace()
    assert got == {"ckpt_skipped": 3, "ckpt_full": "x" * wire.MAX_WHY}
    assert wire.Heartbeat.from_msg({"ckpt_skipped": -1, "ckpt_full": 5}).pace() == {}
    assert wire.Heartbeat.from_msg({"ckpt_skipped": True}).pace() == {}
