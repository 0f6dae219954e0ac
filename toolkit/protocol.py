"""The scheduler's wire contract, shared by the scheduler, the worker runtime and the agent.

Both sides import the names from here so they cannot drift apart. Framing: one JSON object per line, UTF-8,
over TCP to MS_SCHED_HOST:MS_SCHED_PORT. Every message has an "op".
"""

from __future__ import annotations

import json
from typing import Any

MAX_LINE = 1 << 20

# agent -> scheduler
AGENT_HELLO = "agent_hello"
EXITED = "exited"
GAVE_UP = "gave_up"
# scheduler -> agent
KILL = "kill"
STOP = "stop"
FINISHED = "finished"


class ProtocolError(Exception):
    """A peer sent something that is not a message of this protocol."""


def encode(op: str, **fields: Any) -> bytes:
    return json.dumps({"op": op, **fields}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes exceeds {MAX_LINE}")
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"not a JSON line: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("message without an 'op'")
    return msg
