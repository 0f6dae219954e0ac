"""The scheduler's wire contract, shared by the scheduler, the worker runtime and the agent.

Both sides import the names from here so they cannot drift apart. Framing: one JSON object per line, UTF-8,
over TCP to MS_SCHED_HOST:MS_SCHED_PORT. Every message has an "op".

Worker conversation (one connection per worker process, kept for its whole life; its EOF is a death signal):

    worker -> register {token, node_id, rank, world_size, incarnation, pid, host, generation, rejoin, recovery}
    sched  -> welcome {rank, world_size, generation, job}     or reject {reason, retry} / fenced {reason}, then close
    sched  -> formed {generation, prefix}   every rank of `generation` is registered: build the process group over
                                            PrefixStore(prefix, store)
    worker -> heartbeat {step}              every TOOLKIT_HEARTBEAT_INTERVAL; any message counts as one
    sched  -> generation {generation}       a member died: leave the current process group, wait for `formed`
    worker -> commit {step}                 this rank committed a checkpoint of `step`
    worker -> recovered {generation, step, source, from_rank, recomputed, seconds, bytes}
                                            this rank trains again in `generation` from the state of `step`,
                                            taken from `source` ("peer", "checkpoint" or "initial")
    worker -> done {}                       clean finish; the EOF that follows is not a death
    sched  -> stop {reason}                 the job failed; stop training
    sched  -> fenced {reason}               this incarnation was declared dead: exit at once, never write again

`recovery` says how the worker recovers from a peer's death: "in-place" (it called toolkit.train.init(): it re-forms
the group and goes on) or "restart" (a torchrun-style script under `python -m toolkit.train`: it exits and its
agent relaunches it, to resume from its own checkpoints).

`incarnation` is random per process: it tells a relaunched worker (new incarnation, accepted once the old one is
known dead) from the old process coming back after SIGCONT or a healed partition (old incarnation: fenced).
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

# worker -> scheduler
REGISTER = "register"
HEARTBEAT = "heartbeat"
COMMIT = "commit"
RECOVERED = "recovered"
DONE = "done"
# scheduler -> worker (and REJECT to an agent with a wrong token; STOP to workers too)
WELCOME = "welcome"
REJECT = "reject"
FENCED = "fenced"
GENERATION = "generation"
FORMED = "formed"

# How a worker recovers from a peer's death (the `recovery` field of `register`).
RECOVERY_IN_PLACE = "in-place"
RECOVERY_RESTART = "restart"

# A fenced worker exits with this code, so its agent (and its log) can tell fencing from a crash.
EXIT_FENCED = 75
# A wrapped torchrun-style script (`python -m toolkit.train SCRIPT`) exits with this code when the job moves to a
# new generation: it cannot re-form in place, so its agent relaunches it and it rejoins with fresh store keys.
EXIT_REJOIN = 76


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


class LineBuffer:
    """Reassembles messages from the arbitrary chunks a non-blocking socket returns.

    A peer that sends a line longer than MAX_LINE without a newline is cut off instead of growing the buffer
    without bound (a stuck or hostile client must not exhaust the scheduler's memory).
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        messages = []
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            if line.strip():
                messages.append(decode(line))
        if len(self._buf) > MAX_LINE:
            raise ProtocolError(f"line longer than {MAX_LINE} bytes")
        return messages


def store_prefix(job: str, boot: str, generation: int) -> str:
    """Key prefix of one generation's process group in the scheduler's TCPStore.

    `boot` is random per scheduler start: a restarted scheduler serves a new, empty store, and keys of a process
    group that was being built when it died can never be confused with the next attempt's (torchrun's stale-key
    hang, docs in REFERENCE.md).
    """
    return f"{job}/{boot}/gen{generation}/"


def worker_node_id(rank: int) -> str:
    """The stable node id of the worker of `rank` (MS_NODE_ID), as the launch plan names it."""
    return f"worker_{rank}"
