"""The scheduler's messages as values: one frozen dataclass per op, with its validation (`from_msg`) and its wire
fields (`encode`), defined once for the scheduler that sends them and the agent and the worker that read them (as
toolkit.contracts.agentdoc does for agent.json). The framing, the authentication and the field checks they use are
toolkit.contracts.protocol's; the wire format is the same as when senders built dicts (a field left None is not sent).

A sender builds a message and sends `msg.line()` (or, in the scheduler, returns `Send(peer, msg)`); a receiver turns
what protocol.LineBuffer gave it into one with `decode` (the one dispatch by op), which raises protocol.ProtocolError
with one line saying what is wrong, and then switches on the type.

Every op is typed: what the scheduler sends (challenge, welcome, reject, fenced, stop, finished, kill, takeover,
generation, formed), the hellos (register, agent_hello, store_hello, replace), and the workers' and agents' reports
(heartbeat, commit, done, recovered, corruption, exited, gave_up). Only the store's `kv` requests and replies are
not (toolkit.scheduler.kvstore reads them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping

from toolkit.contracts import logical, protocol
from toolkit.contracts.protocol import ProtocolError, whole

MAX_REASON = 2000  # characters of a reason (stop, fenced, reject) kept from a message read
MAX_NAME = 256  # characters of a host or node id kept from a message read
MAX_NODE_IDS = 4096  # node ids in one takeover or welcome


def _text(msg: Mapping[str, Any], name: str, limit: int) -> str | None:
    """A string field cut to `limit` characters; None when it is missing or not a string."""
    value = msg.get(name)
    return value[:limit] if isinstance(value, str) else None


def _names(msg: Mapping[str, Any], name: str, what: str) -> tuple[str, ...] | None:
    """A list of node ids (strings of at most MAX_NAME characters, at most MAX_NODE_IDS of them); None when absent;
    ProtocolError naming the message `what` when it is anything else."""
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_NODE_IDS \
            or not all(isinstance(n, str) and len(n) <= MAX_NAME for n in value):
        raise ProtocolError(f"{what} with a malformed {name}: expected a list of at most {MAX_NODE_IDS} names")
    return tuple(value)


def _generation(msg: Mapping[str, Any], op: str) -> int:
    """A message's `generation`: a whole number >= 0; ProtocolError for anything else."""
    generation = whole(msg, "generation")
    if generation is None or generation < 0:
        raise ProtocolError(f"{op} without a generation")
    return generation


@dataclass(frozen=True)
class Message:
    """One message of the protocol: `OP` is its op; the dataclass fields are its wire fields, in wire order."""

    OP: ClassVar[str]
    SENT_NULL: ClassVar[tuple[str, ...]] = ()  # fields sent as null when None (the others are left out)

    def encode(self) -> dict[str, Any]:
        """The wire fields (the op not among them): every field that is not None (or is in SENT_NULL), tuples as
        lists."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None or f.name in self.SENT_NULL:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @property
    def what(self) -> str:
        """The op, as a line may name it (an Unknown's: the op it came with)."""
        return self.OP

    def line(self) -> bytes:
        """The message as its wire line (protocol.encode)."""
        return protocol.encode(self.OP, **self.encode())

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Message:
        """The message `msg` (a dict protocol.decode returned, with this op) as a value; ProtocolError with one line
        when a field it needs is missing or malformed. Unknown fields (a newer peer's, the proof) are ignored."""
        raise NotImplementedError


@dataclass(frozen=True)
class Challenge(Message):
    """Both ports, first: the server's `nonce` for this connection (the client's proof covers it)."""

    OP: ClassVar[str] = protocol.CHALLENGE
    nonce: str

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Challenge:
        return cls(protocol.challenge_nonce(msg))


@dataclass(frozen=True)
class Welcome(Message):
    """The scheduler accepted a hello. To a worker: {rank, world_size, generation, job}; to an agent: {beat} (the
    seconds between its heartbeats); to the store client: {}; to `fleet replace`: {host, spare, node_ids}. The
    transport adds the server's proof (protocol.server_proof)."""

    OP: ClassVar[str] = protocol.WELCOME  # read: a beat out of [MIN_BEAT, MAX_BEAT] reads as None
    rank: int | None = None
    world_size: int | None = None
    generation: int | None = None
    job: str | None = None
    beat: float | None = None
    host: str | None = None
    spare: str | None = None
    node_ids: tuple[str, ...] | None = None

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Welcome:
        beat = msg.get("beat")
        generation = None if "generation" not in msg else _generation(msg, cls.OP)
        return cls(whole(msg, "rank"), whole(msg, "world_size"), generation,
                   _text(msg, "job", MAX_NAME),
                   float(beat) if protocol.finite_number(beat) and protocol.MIN_BEAT <= beat <= protocol.MAX_BEAT
                   else None,
                   _text(msg, "host", MAX_NAME), _text(msg, "spare", MAX_NAME), _names(msg, "node_ids", cls.OP))


@dataclass(frozen=True)
class Reject(Message):
    """A hello refused, and why; with `retry`, the same hello may succeed later (a predecessor's connection not yet
    found dead)."""

    OP: ClassVar[str] = protocol.REJECT
    reason: str
    retry: bool = False

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Reject:
        return cls(_text(msg, "reason", MAX_REASON) or "rejected", msg.get("retry") is True)


@dataclass(frozen=True)
class Fenced(Message):
    """To a worker: this incarnation was declared dead; exit at once (protocol.EXIT_FENCED), never write again."""

    OP: ClassVar[str] = protocol.FENCED
    reason: str

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Fenced:
        return cls(_text(msg, "reason", MAX_REASON) or "no reason given")


@dataclass(frozen=True)
class Stop(Message):
    """To workers and agents: the job failed (or this host is out of it), for `reason`; stop. A `stop` without a
    reason reads as reason None (each receiver says what it shows then)."""

    OP: ClassVar[str] = protocol.STOP
    reason: str | None

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Stop:
        reason = msg.get("reason")
        return cls(None if reason is None else str(reason)[:MAX_REASON])


@dataclass(frozen=True)
class Finished(Message):
    """To agents: every rank is done; the job succeeded."""

    OP: ClassVar[str] = protocol.FINISHED

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Finished:
        return cls()


@dataclass(frozen=True)
class Kill(Message):
    """To an agent: SIGKILL the process `node_id` (only its incarnation `pid`, when given), for `cause`; with
    `dump`, have it write its Python stacks first (protocol.STACKS_SIGNAL: a stuck rank's)."""

    OP: ClassVar[str] = protocol.KILL
    node_id: str
    pid: int | None = None
    cause: str | None = None
    dump: bool = False

    def encode(self) -> dict[str, Any]:
        out = super().encode()
        if not self.dump:
            del out["dump"]  # sent only when asked
        return out

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Kill:
        return cls(str(msg.get("node_id"))[:MAX_NAME], whole(msg, "pid"), protocol.cause_field(msg),
                   msg.get("dump") is True)


@dataclass(frozen=True)
class TakeOver(Message):
    """To a spare host's agent: start the lost `host`'s processes `node_ids` here; `seq` orders the takeovers of a
    job (the agent.json record)."""

    OP: ClassVar[str] = protocol.TAKEOVER
    host: str
    node_ids: tuple[str, ...]
    seq: int | None = None

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> TakeOver:
        host = str(msg.get("host"))[:MAX_NAME]
        names = _names(msg, "node_ids", f"takeover of {host}")
        if not names:
            raise ProtocolError(f"takeover of {host} without node ids")
        return cls(host, names, whole(msg, "seq"))


@dataclass(frozen=True)
class Generation(Message):
    """To workers: a member died; leave the current process group and wait for `formed` of `generation`."""

    OP: ClassVar[str] = protocol.GENERATION
    generation: int

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Generation:
        return cls(_generation(msg, cls.OP))


MAX_WORLD = 1 << 20  # ranks a `formed` may say a generation has (a hostile bound)


@dataclass(frozen=True)
class Formed(Message):
    """To workers: every rank of `generation` is registered; build the group under `prefix` in the job's store.
    `rank` and `world_size`: this worker's in the generation (an elastic job's; both or neither); `logical_world`
    and `logical`: the job's L logical ranks and the ones each rank serves, as sent (checked by the worker with
    toolkit.contracts.logical.parse_formed, which stops rather than train on a wrong one); `faults`, `uptime` (s)
    and `goodput` (0-1): the ledger's, added by the scheduler's server (toolkit.scheduler.journal.history)."""

    OP: ClassVar[str] = protocol.FORMED
    generation: int
    prefix: str
    rank: int | None = None
    world_size: int | None = None
    logical_world: Any = None
    logical: Any = None
    faults: int | None = None
    uptime: float | None = None
    goodput: float | None = None

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Formed:
        """Also ProtocolError for a formed without a store prefix, or whose rank is not in its world size; a
        fault count, uptime or goodput out of range reads as None (the worker keeps the last)."""
        generation = _generation(msg, cls.OP)
        prefix = msg.get("prefix")
        if not isinstance(prefix, str):
            raise ProtocolError("formed without a store prefix")
        rank = world = None
        if "world_size" in msg:
            rank, world = whole(msg, "rank"), whole(msg, "world_size")
            if rank is None or world is None or not 0 <= rank < world <= MAX_WORLD:
                raise ProtocolError("formed with a rank that is not in its world size")
        faults, goodput = whole(msg, "faults"), msg.get("goodput")
        return cls(generation, prefix, rank, world, msg.get("logical_world"), msg.get("logical"),
                   faults if faults is not None and faults >= 0 else None, protocol.seconds_field(msg, "uptime"),
                   float(goodput) if protocol.is_number(goodput) and 0 <= goodput <= 1 else None)

    @property
    def shape(self) -> tuple[int, int] | None:
        """(rank, world size) of the worker in this generation, None when the message did not say."""
        return None if self.rank is None or self.world_size is None else (self.rank, self.world_size)


# --- the hellos: the first message of a connection (protocol.first_hello adds nonce, sent and proof)


@dataclass(frozen=True)
class Register(Message):
    """A worker's hello: the process `pid` on `host` (the inventory's name) of rank `rank` of `world_size`, this
    incarnation (random per process), the generation of the group it holds (None: none yet), whether it comes back
    (`rejoin`) and how it recovers (`recovery`: protocol.RECOVERY_IN_PLACE or RECOVERY_RESTART; read: anything else
    is "unknown")."""

    OP: ClassVar[str] = protocol.REGISTER
    SENT_NULL: ClassVar[tuple[str, ...]] = ("generation",)
    node_id: str
    rank: int
    world_size: int | None
    incarnation: str
    pid: int
    host: str
    generation: int | None = None
    rejoin: bool = False
    recovery: str = "unknown"

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Register:
        """ProtocolError unless the node id and host are strings of at most MAX_NAME characters, the incarnation
        one of 1 to 64, rank and pid whole numbers. The world size is the job's to judge (None: not a number)."""
        node_id, rank, inc = msg.get("node_id"), whole(msg, "rank"), msg.get("incarnation")
        pid, host = whole(msg, "pid"), msg.get("host")
        if not (isinstance(node_id, str) and rank is not None and isinstance(inc, str) and 0 < len(inc) <= 64
                and pid is not None and isinstance(host, str) and len(node_id) <= MAX_NAME and len(host) <= MAX_NAME):
            raise ProtocolError("malformed register message")
        recovery = msg.get("recovery")
        return cls(node_id, rank, whole(msg, "world_size"), inc, pid, host, whole(msg, "generation"),
                   msg.get("rejoin") is True,
                   recovery if recovery in (protocol.RECOVERY_IN_PLACE, protocol.RECOVERY_RESTART) else "unknown")


@dataclass(frozen=True)
class AgentHello(Message):
    """An agent's hello: the agent of `host`, supervising `node_ids` now; `spare`: a spare host's agent (the
    scheduler may hand it a lost host's ranks)."""

    OP: ClassVar[str] = protocol.AGENT_HELLO
    host: str
    node_ids: tuple[str, ...]
    spare: bool | None = None

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> AgentHello:
        """ProtocolError unless the host has 1 to MAX_NAME characters and node_ids is a list of at most
        MAX_NODE_IDS; a node id that is not a string of at most MAX_NAME characters is left out."""
        host, node_ids = msg.get("host"), msg.get("node_ids")
        if not isinstance(host, str) or not 0 < len(host) <= MAX_NAME or not isinstance(node_ids, list) \
                or len(node_ids) > MAX_NODE_IDS:
            raise ProtocolError("malformed agent_hello")
        return cls(host, tuple(n for n in node_ids if isinstance(n, str) and len(n) <= MAX_NAME),
                   msg.get("spare") is True)


@dataclass(frozen=True)
class StoreHello(Message):
    """The store client's hello, for the worker `node_id`."""

    OP: ClassVar[str] = protocol.STORE_HELLO
    node_id: str

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> StoreHello:
        node_id = _text(msg, "node_id", MAX_NAME)
        if node_id is None:
            raise ProtocolError("store_hello without a node id")
        return cls(node_id)


@dataclass(frozen=True)
class Replace(Message):
    """The operator's request (fleet replace): let `spare` (None: the first free one) take `host`'s ranks. Read:
    a host that is not a string reads as None (the scheduler refuses it, naming the hosts)."""

    OP: ClassVar[str] = protocol.REPLACE
    host: str | None
    spare: str | None = None
    node_id: str = "operator"  # who the proof covers

    def encode(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host": self.host, "spare": self.spare}  # a spare of None sent as null

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Replace:
        """ProtocolError for a spare that is neither a host name nor null."""
        spare = msg.get("spare")
        if spare is not None and not isinstance(spare, str):
            raise ProtocolError("malformed replace: spare is not a host name")
        return cls(_text(msg, "host", MAX_NAME), spare)


# --- what a connected worker or agent reports


MAX_PACE_SECONDS = 1e7  # s: a step time, busy time or total stall past this is nonsense from a peer
MAX_LOSS = 1e30
MAX_WHY = 400  # characters of a heartbeat's ckpt_why or ckpt_full
MAX_COUNT = 1 << 40  # a heartbeat's count (steps, checkpoints, bytes) past this reads as absent
MAX_COLLECTIVES = 1 << 62  # a heartbeat's `collectives` past this reads as absent
_NUMBER = (int, float)  # the exact types of a JSON number (a bool is neither)


def _pace_seconds(value: Any) -> float | None:
    """A heartbeat's duration: a JSON number from 0 to MAX_PACE_SECONDS as a float, else None. A range check rejects
    NaN, the infinities and an integer past a float's range (10**400: float() of it would raise)."""
    return float(value) if type(value) in _NUMBER and 0 <= value <= MAX_PACE_SECONDS else None


def _count(value: Any) -> int | None:
    """A heartbeat's count: a whole number from 0 below MAX_COUNT (never a bool), else None."""
    return value if type(value) is int and 0 <= value < MAX_COUNT else None


@dataclass(frozen=True)
class Heartbeat(Message):
    """A worker's or an agent's sign of life, every TOOLKIT_HEARTBEAT_INTERVAL (an agent's: its welcome's `beat`);
    the fields are protocol's docstring's. A worker's says its `step` (sent as null before its first) and its pace
    figures (toolkit.train.pace, the Trainer's checkpoint schedule and `capacity`: the logical ranks its memory
    holds), for the progress watchdog whether its training thread is `waiting` in a collective, the `long` phase it
    is in and the `collectives` it entered; an agent's says only `running` {node_id: pid}: its children running and
    not stopped, which the scheduler counts as alive when their own heartbeats stop.

    Read for every heartbeat (thousands a second at thousands of ranks), so written for speed, and never refused: a
    field of the wrong type or out of range reads as absent (None): numbers finite and in range, counts whole and
    non-negative, texts cut short, `running` cut to MAX_NODE_IDS entries and keeping only node ids (strings of at
    most MAX_NAME characters) with whole pids."""

    OP: ClassVar[str] = protocol.HEARTBEAT
    PACE: ClassVar[tuple[str, ...]] = (  # the pace figures: a NoteKind.PACE for the ledger, the stragglers
        "total", "step_time", "busy", "loss", "ckpt_stall", "ckpts", "ckpt_bytes", "ckpt_every", "ckpt_why",
        "ckpt_step", "stride", "first_step", "step_p99", "ckpt_skipped", "ckpt_full")
    step: int | None = None
    total: int | None = None
    step_time: float | None = None
    busy: float | None = None
    loss: float | None = None
    ckpt_stall: float | None = None
    ckpts: int | None = None
    ckpt_bytes: int | None = None
    ckpt_every: int | None = None
    ckpt_why: str | None = None
    ckpt_step: int | None = None
    stride: int | None = None
    first_step: int | None = None
    step_p99: float | None = None
    waiting: bool | None = None
    long: str | None = None
    ckpt_skipped: int | None = None
    ckpt_full: str | None = None
    collectives: int | None = None
    capacity: int | None = None
    running: Mapping[str, int] | None = None

    def encode(self) -> dict[str, Any]:
        out = super().encode()
        if self.running is None and self.step is None:
            out = {"step": None, **out}  # a worker's says it has no step yet
        return out

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Heartbeat:
        get = msg.get
        loss, why, full = get("loss"), get("ckpt_why"), get("ckpt_full")
        waiting, long, count = get("waiting"), get("long"), get("collectives")
        capacity, running = get("capacity"), get("running")
        return cls(
            whole(msg, "step"), _count(get("total")), _pace_seconds(get("step_time")), _pace_seconds(get("busy")),
            float(loss) if type(loss) in _NUMBER and -MAX_LOSS <= loss <= MAX_LOSS else None,
            _pace_seconds(get("ckpt_stall")), _count(get("ckpts")), _count(get("ckpt_bytes")),
            _count(get("ckpt_every")), why[:MAX_WHY] if isinstance(why, str) else None, _count(get("ckpt_step")),
            _count(get("stride")), _count(get("first_step")), _pace_seconds(get("step_p99")),
            waiting if type(waiting) is bool else None,
            long[:protocol.MAX_LONG] if isinstance(long, str) and long else None,
            _count(get("ckpt_skipped")), full[:MAX_WHY] if isinstance(full, str) else None,
            count if type(count) is int and 0 <= count < MAX_COLLECTIVES else None,
            capacity if type(capacity) is int and 1 <= capacity <= logical.MAX_LOGICAL_RANKS else None,
            None if not isinstance(running, dict) else {
                n: pid for n, pid in itertools.islice(running.items(), MAX_NODE_IDS)
                if isinstance(n, str) and len(n) <= MAX_NAME and protocol.is_int(pid)})

    def pace(self) -> dict[str, Any]:
        """The pace figures it carries (PACE, those not None), as the ledger and the stragglers keep them."""
        return {name: value for name in self.PACE if (value := getattr(self, name)) is not None}


@dataclass(frozen=True)
class Commit(Message):
    """A worker's: this rank committed a checkpoint of `step` (read: None when it is not a whole number)."""

    OP: ClassVar[str] = protocol.COMMIT
    step: int | None

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Commit:
        return cls(whole(msg, "step"))


@dataclass(frozen=True)
class Done(Message):
    """A worker's clean finish; the EOF that follows is not a death."""

    OP: ClassVar[str] = protocol.DONE

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Done:
        return cls()


RECOVERY_SOURCES = ("peer", "checkpoint", "initial")


@dataclass(frozen=True)
class Recovered(Message):
    """A worker's: this rank trains again in `generation` from the state of `step`, taken from `source` (one of
    RECOVERY_SOURCES) of rank `from_rank`, `recomputed` steps done again, in `seconds`, `bytes` received. Read: a
    field of the wrong type is None (shown as such in the scheduler's log)."""

    OP: ClassVar[str] = protocol.RECOVERED
    SENT_NULL: ClassVar[tuple[str, ...]] = ("from_rank",)
    generation: int | None
    step: int | None
    source: str | None
    from_rank: int | None
    recomputed: int | None
    seconds: float | None
    bytes: int | None = None

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Recovered:
        source = msg.get("source")
        return cls(whole(msg, "generation"), whole(msg, "step"), source if source in RECOVERY_SOURCES else None,
                   whole(msg, "from_rank"), whole(msg, "recomputed"), protocol.seconds_field(msg, "seconds"),
                   whole(msg, "bytes"))


@dataclass(frozen=True)
class Exited(Message):
    """An agent's: its process `node_id` (pid `pid`) ended with exit `code` or by `signal` (its name; code None),
    its first cause `cause` (the script's error, or the fencing that killed it). Read: ProtocolError without a node
    id; the cause as one bounded line (protocol.cause_field); other fields of the wrong type are None."""

    OP: ClassVar[str] = protocol.EXITED
    SENT_NULL: ClassVar[tuple[str, ...]] = ("code", "signal", "cause")
    node_id: str
    pid: int | None
    code: int | None
    signal: str | None
    cause: str | None = None

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Exited:
        node_id = _text(msg, "node_id", MAX_NAME)
        if node_id is None:
            raise ProtocolError("exited without a node id")
        return cls(node_id, whole(msg, "pid"), whole(msg, "code"), _text(msg, "signal", MAX_NAME),
                   protocol.cause_field(msg))


@dataclass(frozen=True)
class Corruption(Message):
    """A worker's (one rank reports it): the replica check found `ranks` (on `hosts`, as the worker places them)
    corrupt at `step` of `generation`, the last good check at `since` (None: none), and did `action` (one of
    protocol.CORRUPTION_ACTIONS: healed, rolled back, fenced: found corrupt twice, their hosts go; stopped). Read:
    ProtocolError unless step and since are whole and in order, ranks and hosts as many (1 to MAX_WORLD) of whole
    ranks and strings, and the action known; a generation that is not a whole number reads as None; each host as one
    line of at most MAX_NAME characters. Whether the ranks are the job's is the receiver's to judge (`within`)."""

    OP: ClassVar[str] = protocol.CORRUPTION
    SENT_NULL: ClassVar[tuple[str, ...]] = ("generation", "since")
    generation: int | None
    step: int
    since: int | None
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    action: str

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Corruption:
        step, since = whole(msg, "step"), whole(msg, "since")
        ranks, hosts, action = msg.get("ranks"), msg.get("hosts"), msg.get("action")
        if step is None or step < 0 or since is not None and not 0 <= since <= step:
            raise ProtocolError("corruption report with a malformed step or since: expected 0 <= since <= step")
        if action not in protocol.CORRUPTION_ACTIONS:
            raise ProtocolError(f"corruption report with an unknown action: expected one of "
                                f"{', '.join(protocol.CORRUPTION_ACTIONS)}")
        if not (isinstance(ranks, list) and isinstance(hosts, list) and 0 < len(ranks) == len(hosts) <= MAX_WORLD
                and all(type(r) is int and 0 <= r < MAX_WORLD for r in ranks)
                and all(isinstance(h, str) for h in hosts)):
            raise ProtocolError("corruption report with malformed ranks or hosts: expected as many ranks as host "
                                "names, at least one")
        return cls(whole(msg, "generation"), step, since, tuple(ranks),
                   tuple(protocol.one_line(h)[:MAX_NAME] for h in hosts), action)

    def within(self, world_size: int) -> bool:
        """Whether its ranks are ranks of a job of `world_size` (and no more of them than the job has)."""
        return len(self.ranks) <= world_size and max(self.ranks) < world_size


MAX_LOG_TAIL = 16 << 10  # characters of a gave_up's log tail read (its end: the last lines count)


def _tail(value: Any) -> str:
    """A log tail: its last MAX_LOG_TAIL characters if it is a string, else ""."""
    return value[-MAX_LOG_TAIL:] if isinstance(value, str) else ""


@dataclass(frozen=True)
class GaveUp(Message):
    """An agent's: its process `node_id` failed past its max restarts (exit `code` or `signal`, first `cause`), and
    the tail of its log: the job fails. Read: a node id that is not a string is "?", other fields of the wrong type
    are None (the tail "")."""

    OP: ClassVar[str] = protocol.GAVE_UP
    SENT_NULL: ClassVar[tuple[str, ...]] = ("code", "signal", "cause")
    node_id: str
    code: int | None
    signal: str | None
    cause: str | None
    log_tail: str = ""

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> GaveUp:
        return cls(_text(msg, "node_id", MAX_NAME) or "?", whole(msg, "code"), _text(msg, "signal", MAX_NAME),
                   protocol.cause_field(msg), _tail(msg.get("log_tail")))


# the one dispatch by op; an op of another direction or version reads as Unknown
BY_OP: dict[str, type[Message]] = {cls.OP: cls for cls in (
    Challenge, Welcome, Reject, Fenced, Stop, Finished, Kill, TakeOver, Generation, Formed,
    Register, AgentHello, StoreHello, Replace, Heartbeat, Commit, Done, Recovered, Corruption, Exited, GaveUp)}


@dataclass(frozen=True)
class Unknown(Message):
    """A message whose op this version does not read (its receiver ignores it, saying so)."""

    OP: ClassVar[str] = ""
    op: str

    @property
    def what(self) -> str:
        return self.op

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Unknown:
        return cls(str(msg.get("op"))[:40])


def decode(msg: Mapping[str, Any]) -> Message:
    """The typed message of a dict protocol.decode returned (it has a str op); ProtocolError with one line when it
    is malformed; Unknown for an op not typed here."""
    cls = BY_OP.get(msg["op"])
    return Unknown.from_msg(msg) if cls is None else cls.from_msg(msg)


def refusal(answer: Message) -> tuple[str, bool]:
    """(why, whether to retry) of an answer to a hello that is not a welcome: a reject's reason and retry, a fenced's
    reason (no retry), or the op of anything else."""
    if isinstance(answer, Reject):
        return answer.reason, answer.retry
    if isinstance(answer, Fenced):
        return answer.reason, False
    return f"answered {answer.what!r} instead of a welcome", False
