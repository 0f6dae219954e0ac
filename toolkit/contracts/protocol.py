"""The scheduler's wire contract, shared by the scheduler, the worker runtime, the agent and the store client.

Both sides import the names from here so they cannot drift apart; each op's fields and their validation are one
frozen dataclass of toolkit.contracts.messages. Framing: one JSON object per line, UTF-8, over TCP to
MS_SCHED_HOST:MS_SCHED_PORT (the control server) or MASTER_PORT (the job's store). Every message has an "op". Every
peer treats what it reads as hostile: a line is bounded (`LineBuffer`), and `decode` turns anything that is not a
message (bad UTF-8, bad JSON, numbers past Python's digit limit, nesting past the recursion limit, a JSON value that
is not an object with an "op") into one ProtocolError.

Authentication (both ports): the job token never crosses the network. On connect the server sends
`challenge {nonce}`; the client's first message carries its own `nonce` and `proof` = HMAC-SHA256(token, "client",
server nonce, client nonce, the op, who it claims to be); the server's answer carries `proof` = HMAC(token,
"server", both nonces), which the client checks before it believes anything the server says (a process that took
the scheduler's port while the scheduler restarted learns nothing and can order nothing). A first message with a
plain `token` field, or none of these, is refused.

Hello first (what every client of ours sends): the client does not wait for the challenge. Its hello goes out as soon
as the TCP connection is up, with `sent` (its wall clock, integer ms) and `proof` = HMAC(token, "client", "", client
nonce, op, who, sent): no server nonce. So a worker's hello is usually in the socket when the scheduler accepts it,
and the scheduler authenticates it at once, before a flood of connections that prove nothing (another user on the
worker's own host) can compete with it for the table of connections waiting to authenticate
(toolkit.scheduler.transport). Freshness without the server nonce: the scheduler accepts `sent` within HELLO_SKEW of
its own clock and each client nonce once within that window (toolkit.scheduler.replay); a proven `reject` names a
larger clock difference. The server still sends its challenge, and its proof still covers both nonces.

Worker conversation (one connection per worker process, kept for its whole life; its EOF is a death signal):

    sched  -> challenge {nonce}
    worker -> register {nonce, proof, node_id, rank, world_size, incarnation, pid, host, generation, rejoin,
                        recovery}
    sched  -> welcome {proof, rank, world_size, generation, job}   or reject {reason, retry} / fenced {reason}
    sched  -> formed {generation, prefix, logical_world, logical, faults, uptime, goodput}
                                            every rank of `generation` is registered: build the process group over
                                            PrefixStore(prefix, the job's store); logical_world is the job's L
                                            logical ranks and logical, one ascending list per rank of the
                                            generation (index = rank), the logical ranks each serves
                                            (toolkit.contracts.logical: a worker checks it with parse_formed and
                                            stops rather than train on a bad one; absent: L = world size, rank r
                                            serves r); faults and uptime (s) are the ledger's, for the workers'
                                            checkpoint interval; goodput (0-1, when known) for rank 0's
                                            TensorBoard scalars
    worker -> heartbeat {step, total, step_time, busy, loss, ckpt_stall, ckpts, ckpt_bytes, ckpt_every, ckpt_why,
                         ckpt_step, stride, first_step, step_p99, waiting, long, ckpt_skipped, ckpt_full,
                         collectives}
                                            every TOOLKIT_HEARTBEAT_INTERVAL; any message counts as one; all but
                                            step optional (toolkit.train.pace, messages.Heartbeat; ckpt_step, stride,
                                            first_step: the newest checkpoint a torchrun-style script reported, the
                                            steps between its reports, the first step this process reported:
                                            toolkit.train.scriptreport; step_p99, waiting, long: for the progress
                                            watchdog, the p99 time between steps, whether the training thread
                                            waits in a collective now, a legitimately long phase it is in:
                                            toolkit.train.stacks; ckpt_skipped, ckpt_full: checkpoints
                                            skipped in a row for a full disk and the line saying why, 0 once one
                                            is written: toolkit.train.ckpt.schedule; collectives: the collectives
                                            its default group entered, sent while it reports no step)
    sched  -> generation {generation}       a member died: leave the current process group, wait for `formed`
    worker -> commit {step}                 this rank committed a checkpoint of `step`
    worker -> recovered {generation, step, source, from_rank, recomputed, seconds, bytes}
                                            this rank trains again in `generation` from the state of `step`,
                                            taken from `source` ("peer", "checkpoint" or "initial")
    worker -> corruption {generation, step, since, ranks, hosts, action}
                                            the replica check found `ranks` (on `hosts`) corrupt at `step`, the
                                            last good check at `since`; action: healed, rolled back, fenced or
                                            stopped (toolkit.train.replicas; messages.Corruption). `fenced`:
                                            found corrupt twice, their hosts go to spares or the job stops
    worker -> done {}                       clean finish; the EOF that follows is not a death
    sched  -> stop {reason}                 the job failed; stop training
    sched  -> fenced {reason}               this incarnation was declared dead: exit at once, never write again

Agent conversation: `agent_hello {nonce, proof, host, node_ids}` answered by `welcome {proof, beat}` (`beat`: the
seconds between the agent's heartbeats, longer for a job of thousands of ranks); then the agent reports `exited` and
`gave_up` (with the exit's first `cause`), and heartbeats naming the children it sees running (`running {node_id:
pid}`: alive and not stopped, whatever their own heartbeats say); the scheduler sends `kill` (with its `cause`, and
`dump`: write the process's Python stacks to its log first, STACKS_SIGNAL), `stop` and `finished`
(docs/architecture.md).

Store conversation (MASTER_PORT): `store_hello {nonce, proof, node_id}` answered by `welcome {proof}`; then
`kv {id, cmd, ...}` requests, each answered by `kv_reply {id, ok, ...}` (toolkit/scheduler/kvstore.py has the
commands: set, get, multi_get, add, compare_set, check, wait, delete, num_keys); keys and values travel
base64-encoded. A request line is at most MAX_STORE_LINE; a reply line at most MAX_STORE_REPLY (a multi_get's
values together).

`recovery` says how the worker recovers from a peer's death: "in-place" (it called toolkit.train.init(): it re-forms
the group and goes on) or "restart" (a torchrun-style script under `python -m toolkit.train`: it exits and its
agent relaunches it, to resume from its own checkpoints).

`incarnation` is random per process: it tells a relaunched worker (new incarnation, accepted once the old one is
known dead) from the old process coming back after SIGCONT or a healed partition (old incarnation: fenced).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import signal
from collections.abc import Mapping
from typing import Any, TypeGuard

MAX_LINE = 64 << 10  # bytes of one control message (the longest, gave_up, carries a bounded log tail)
MAX_STORE_LINE = 512 << 10  # bytes of one store message (a value of up to MAX_STORE_VALUE, base64)
MAX_STORE_VALUE = 256 << 10
MAX_STORE_KEYS = 1024  # keys in one store request (wait, check, multi_get)
# bytes of one store reply (a multi_get's values), read once the server proved the token; at most what the scheduler
# queues for one peer (transport.MAX_OUTBUF): a longer multi_get is refused, and the client asks for fewer keys
MAX_STORE_REPLY = 1 << 20
MAX_PREAUTH_LINE = 4 << 10  # bytes of a first message: hellos are small
NONCE_BYTES = 16
HELLO_SKEW = 300.0  # s a hello-first `sent` may differ from the scheduler's clock (hosts' clocks kept by NTP)

# both ways, before anything else
CHALLENGE = "challenge"
# agent -> scheduler
AGENT_HELLO = "agent_hello"
EXITED = "exited"
GAVE_UP = "gave_up"
# scheduler -> agent
KILL = "kill"
STACKS_SIGNAL = signal.SIGUSR1  # a worker writes every thread's Python stack to its log on it (faulthandler, no GIL)
STOP = "stop"
FINISHED = "finished"
TAKEOVER = "takeover"  # to a spare's agent: {host, node_ids}: start these processes, the lost host's
# operator (fleet replace, over SSH on the scheduler's host) -> scheduler: the first message of its connection
REPLACE = "replace"  # {node_id: "operator", host, spare}: answered welcome {host, spare, node_ids} or reject

# worker -> scheduler
REGISTER = "register"
HEARTBEAT = "heartbeat"
COMMIT = "commit"
RECOVERED = "recovered"
CORRUPTION = "corruption"  # {generation, step, since, ranks, hosts, action}: the replica check found one (ledger)
DONE = "done"
# scheduler -> worker (and REJECT to an agent with a wrong token; STOP to workers too)
WELCOME = "welcome"
REJECT = "reject"
FENCED = "fenced"
GENERATION = "generation"
FORMED = "formed"
# store client <-> scheduler
STORE_HELLO = "store_hello"
KV = "kv"
KV_REPLY = "kv_reply"
# A worker's group build, under the generation's key prefix (toolkit.train.runtime._arrive): each rank adds 1 to
# ARRIVED, the last one sets ALL_ARRIVED, every rank waits for it before its backend connects.
ARRIVED, ALL_ARRIVED = "toolkit/arrived", "toolkit/all-arrived"

HELLOS = (REGISTER, AGENT_HELLO, STORE_HELLO, REPLACE)  # the first message of a connection, authenticated

# How a worker recovers from a peer's death (the `recovery` field of `register`).
RECOVERY_IN_PLACE = "in-place"
RECOVERY_RESTART = "restart"

# A fenced worker exits with this code, so its agent (and its log) can tell fencing from a crash.
EXIT_FENCED = 75
# A wrapped torchrun-style script (`python -m toolkit.train SCRIPT`) exits with this code when the job moves to a
# new generation: it cannot re-form in place, so its agent relaunches it and it rejoins with fresh store keys.
EXIT_REJOIN = 76
# A worker found that the job cannot go on correctly (toolkit.train.replicas: forgotten state, a rank corrupt twice):
# its agent gives up at once, with no restart, and the job fails with the worker's one line.
EXIT_FATAL = 77


class ProtocolError(Exception):
    """A peer sent something that is not a message of this protocol."""


def encode(op: str, **fields: Any) -> bytes:
    """One message as its wire line: compact JSON of {"op": op, **fields} and a newline. Nothing is checked here: a
    line past the receiver's limit (MAX_LINE, MAX_STORE_LINE, MAX_PREAUTH_LINE for a hello) gets the sender's
    connection dropped."""
    return json.dumps({"op": op, **fields}, separators=(",", ":")).encode() + b"\n"


def finite_json(data: bytes | str) -> Any:
    """The JSON value of UTF-8 `data`, with finite numbers only: ValueError (UnicodeDecodeError is one) for bad JSON,
    NaN, Infinity or a float beyond a double's range (`1e400`, which Python reads as inf and whose int() would raise
    OverflowError); RecursionError for nesting too deep. The one reader of what another process wrote: the wire's
    lines here, the scheduler's state file and journal (toolkit.scheduler.state)."""
    return _DECODER.decode(data.decode("utf-8") if isinstance(data, bytes) else data)


def decode(line: bytes) -> dict[str, Any]:
    """One message from one line; any other input is a ProtocolError, never another exception."""
    try:
        msg = finite_json(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: bad JSON, too many digits
        raise ProtocolError(f"not a JSON line: {type(e).__name__}: {str(e)[:100]}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("message without an 'op'")
    return msg


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number of this format")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:64]} is out of range: not a finite number")
    return value


# made once: json.loads with hooks builds a decoder per call, a tenth of a message's cost at thousands a second
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


class LineBuffer:
    """Reassembles messages from the arbitrary chunks a non-blocking socket returns.

    A peer that sends a line longer than `limit` (with or without its newline) is cut off instead of growing the
    buffer without bound: a stuck or hostile client must not exhaust the receiver's memory."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self.limit = limit

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add a chunk; return the messages of the lines it completed (blank lines skipped), in order.

        ProtocolError for a line over `limit` (complete, or still growing past it) or a line that is not a message
        (`decode`); the messages of the same chunk are lost with it, and the caller drops the connection."""
        self._buf += data
        messages = []
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                break
            if end > self.limit:
                raise ProtocolError(f"line longer than {self.limit} bytes")
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            if line.strip():
                messages.append(decode(line))
        if len(self._buf) > self.limit:
            raise ProtocolError(f"line longer than {self.limit} bytes")
        return messages


# --- authentication ------------------------------------------------------------------------------------------


def new_nonce() -> str:
    """A fresh random nonce (NONCE_BYTES bytes from `secrets`, hex): the server's per connection, the client's per
    hello."""
    return secrets.token_hex(NONCE_BYTES)


def proof(token: str, side: str, server_nonce: str, client_nonce: str, *claims: str) -> str:
    """HMAC-SHA256 with the job token over who speaks (`side`: "client" or "server"), both nonces and what the
    speaker claims (op and identity): it proves knowledge of the token without revealing it, for this connection
    only."""
    text = "\0".join(("toolkit-v1", side, server_nonce, client_nonce, *claims))
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def client_proof(token: str, server_nonce: str, client_nonce: str, op: str, who: str) -> str:
    """The client's proof in its hello: covers the op and who it claims to be (node id, or host for an agent)."""
    return proof(token, "client", server_nonce, client_nonce, op, who)


def server_proof(token: str, server_nonce: str, client_nonce: str) -> str:
    """The server's proof in its first answer to a hello (welcome, reject or fenced)."""
    return proof(token, "server", server_nonce, client_nonce)


def hello_subject(msg: Mapping[str, Any]) -> str:
    """Who a first message claims to be (part of what its proof covers)."""
    field = "host" if msg.get("op") == AGENT_HELLO else "node_id"
    value = msg.get(field)
    return value if isinstance(value, str) else ""


def hello_sent(msg: Mapping[str, Any]) -> int | None:
    """A hello-first message's `sent` (the client's wall clock, ms), None for a hello that answers a challenge; a
    `sent` that is not a whole number (a bool, a float, text) is -1, which no proof covers and no window accepts."""
    if "sent" not in msg:
        return None
    sent = msg["sent"]
    return sent if is_int(sent) else -1


def check_client(token: str, server_nonce: str, msg: dict[str, Any]) -> bool:
    """Whether a first message proves the token (constant-time); a plain `token` field never does. A hello-first
    message (`sent`) is checked without the server nonce; its freshness is the server's to judge (module docstring)."""
    nonce, given = msg.get("nonce"), msg.get("proof")
    if "token" in msg or not isinstance(nonce, str) or not isinstance(given, str) or not 16 <= len(nonce) <= 128:
        return False
    sent = hello_sent(msg)
    if sent is None:
        want = client_proof(token, server_nonce, nonce, str(msg["op"]), hello_subject(msg))
    elif sent < 0:
        return False
    else:
        want = proof(token, "client", "", nonce, str(msg["op"]), hello_subject(msg), str(sent))
    return hmac.compare_digest(want.encode(), given.encode())


def check_server(token: str, server_nonce: str, client_nonce: str, msg: dict[str, Any]) -> bool:
    """Whether the server's answer to our hello proves the token for this connection (constant-time). A client
    believes nothing, not even a reject or fenced, that fails this."""
    given = msg.get("proof")
    return isinstance(given, str) and hmac.compare_digest(
        server_proof(token, server_nonce, client_nonce).encode(), given.encode())


def hello(op: str, token: str, server_nonce: str, **fields: Any) -> tuple[bytes, str]:
    """The authenticated first message `op` (who: fields["node_id"] or fields["host"]) and the client nonce its
    answer's proof must cover."""
    nonce = new_nonce()
    who = fields.get("host" if op == AGENT_HELLO else "node_id", "")
    return encode(op, nonce=nonce, proof=client_proof(token, server_nonce, nonce, op, str(who)), **fields), nonce


def first_hello(op: str, token: str, wall: float, **fields: Any) -> tuple[bytes, str]:
    """The hello-first message `op` (module docstring), sent before the challenge is read, at wall-clock time `wall`
    (s; time.time()), and the client nonce the server's proof must cover."""
    nonce = new_nonce()
    who = str(fields.get("host" if op == AGENT_HELLO else "node_id", ""))
    sent = int(wall * 1000)
    return encode(op, nonce=nonce, sent=sent, proof=proof(token, "client", "", nonce, op, who, str(sent)),
                  **fields), nonce


def challenge_nonce(msg: Mapping[str, Any]) -> str:
    """The server nonce of a `challenge`; ProtocolError for anything else."""
    nonce = msg.get("nonce")
    if msg.get("op") != CHALLENGE or not isinstance(nonce, str) or not 16 <= len(nonce) <= 128:
        raise ProtocolError(f"expected a challenge first, got {str(msg.get('op'))[:40]!r}")
    return nonce


# --- fields --------------------------------------------------------------------------------------------------


def is_int(value: object) -> TypeGuard[int]:
    """An int and not a bool: JSON's and YAML's `true` reads as a bool, which Python counts as an int (True == 1).
    The one such check of every document and message the processes read."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float and not a bool (see is_int); NaN and infinities included: finite_number excludes them."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def whole(msg: Mapping[str, Any], name: str, default: int | None = None) -> int | None:
    """An integer field (never a bool), or `default` when it is missing or of another type."""
    value = msg.get(name)
    return value if is_int(value) else default


def finite_number(value: Any) -> bool:
    """A JSON number (int or float, never a bool) that is finite. An int always is (math.isfinite would raise
    OverflowError for one past a float's range, which JSON allows)."""
    return type(value) is int or isinstance(value, float) and math.isfinite(value)


MAX_SECONDS = 1e9  # s: a duration or age past this (31 years) is nonsense from a peer


def seconds_field(msg: Mapping[str, Any], name: str) -> float | None:
    """A duration field as a float: a finite number from 0 to MAX_SECONDS, else None (a huge JSON integer
    included: float() of it would raise)."""
    value = msg.get(name)
    return float(value) if finite_number(value) and 0 <= value <= MAX_SECONDS else None


MIN_BEAT, MAX_BEAT = 0.05, 60.0  # s: an agent's heartbeat interval (`welcome {beat}`) outside is ignored


def beat_interval(msg: Mapping[str, Any], default: float) -> float:
    """The heartbeat interval an agent's `welcome` gives (`beat`), or `default` when it gives none or one out of
    [MIN_BEAT, MAX_BEAT] (a scheduler of an older version says nothing; the agent then keeps its own)."""
    value = msg.get("beat")
    return float(value) if finite_number(value) and MIN_BEAT <= value <= MAX_BEAT else default


# The progress watchdog (toolkit.scheduler.watchdog): a rank that has not entered the collective its peers wait in
# is stuck once the job has made no step for stall_bound(p99) seconds, p99 being the job's observed 99th percentile
# of the time between two steps. Part of the contract: a worker whose collective failed waits that long (and the
# word's usual wait) for the scheduler to name the stuck peer before it counts the failure as its own.
STALL_FACTOR = 10.0  # k: a stall of k x the p99 step time (nvidia-resiliency-ext learns 5x the longest interval)
STALL_FLOOR = 5.0  # s: never sooner (a step time of milliseconds must not make a GC pause or a page-in a hang)
MAX_LONG = 80  # characters of a heartbeat's `long` (the legitimately long phase a rank is in, e.g. "checkpoint")


def stall_bound(p99: float | None) -> float:
    """Seconds without a step after which a rank outside the collective its peers wait in is stuck: max(STALL_FACTOR
    x `p99`, STALL_FLOOR); `p99` None (no step time known yet) gives the floor."""
    return max(STALL_FACTOR * p99, STALL_FLOOR) if p99 is not None and p99 > 0 else STALL_FLOOR


MAX_CAUSE = 300  # characters of a failure's cause (`exited`, `gave_up`, `kill`): one line


def one_line(text: str) -> str:
    """`text`'s first non-empty line, stripped, without control characters, cut to MAX_CAUSE characters: how a
    cause (an exception's message, a reason) travels and is shown."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    line = "".join(c for c in line if c.isprintable())
    return line if len(line) <= MAX_CAUSE else line[:MAX_CAUSE - 3] + "..."


def cause_field(msg: Mapping[str, Any]) -> str | None:
    """A message's `cause` (the first cause of an exit, or why a kill was asked) as one bounded line; None when it is
    missing, empty or not a string."""
    cause = msg.get("cause")
    return (one_line(cause) or None) if isinstance(cause, str) else None


CORRUPT_FENCED = "fenced"  # a corruption report's action: the ranks were found corrupt twice (their hosts go)
CORRUPTION_ACTIONS = ("healed", "rolled back", CORRUPT_FENCED, "stopped")


def store_prefix(job: str, boot: str, generation: int) -> str:
    """Key prefix of one generation's process group in the job's store.

    `boot` is random per scheduler start: a restarted scheduler serves a new, empty store, and keys of a process
    group that was being built when it died can never be confused with the next attempt's (torchrun's stale-key
    hang, docs in REFERENCE.md)."""
    return f"{job}/{boot}/gen{generation}/"


def generation_prefix(job: str, boot: str) -> str:
    """What every store prefix of this scheduler start begins with."""
    return f"{job}/{boot}/gen"


def worker_node_id(rank: int) -> str:
    """The stable node id of the worker of `rank` (MS_NODE_ID), as the launch plan names it."""
    return f"worker_{rank}"
