"""The wire contract: framing round-trips, reassembly from arbitrary chunks, and refusal of what is not a message."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from toolkit import protocol as P

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
    for a, b in zip(points, points[1:]):
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
