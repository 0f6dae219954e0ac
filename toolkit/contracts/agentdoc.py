"""The agent's documents, defined once for the agent that writes them and for `fleet` that reads them (over SSH,
from the files, without starting a Python on the host):

- `state/agent.pid`: "<pid> <start time in clock ticks>" of the running agent (`pid_record`);
- `state/agent.json`: the agent's state, rewritten atomically on every change: `AgentDoc` and its records, written
  by `AgentDoc.to_json` and read by `AgentDoc.parse` (states: `AgentState`, `FINAL_STATES`, `ProcState`,
  `LinkState`); whether its writer still runs is decided by one rule (`judge`);
- `state/agent.sock`: its control socket, one JSON request per line (`ControlOp`) and one reply;
- `state/progress.sock`: the workers' progress datagrams (`progress`);
- `job-id`: which job of which project the job directory holds (`JOB_ID_FILE`, `read_identity`), written once by
  the first deploy (jobhosts.scripts.LAYOUT_SCRIPT) and compared by every later deploy, start and stop.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from toolkit.contracts.protocol import is_int, is_number

JOB_ID_FILE = "job-id"  # in the job directory: "<job id>\n<project it was deployed from>\n"
MAX_IDENTITY = 2048  # bytes of it read: it is two short lines
EXIT_OTHER_JOB = 4  # the agent's `start`/`stop --job-id`: the directory holds another project's job (left alone)


def read_identity(text: str) -> tuple[str, str]:
    """(job id, where it was deployed from) from job-id's text; ("", "") when the text has no id. The second line
    is only shown to people (with its control characters escaped by the caller)."""
    lines = text[:MAX_IDENTITY].split("\n")
    job_id = lines[0].strip()
    return (job_id, lines[1].strip() if len(lines) > 1 else "") if job_id else ("", "")


class ControlOp(str, enum.Enum):
    """Requests on the agent's control socket: `{"op": "status"}` -> the agent.json document; `{"op": "restart",
    "node_id": N}` -> `{"ok", "node_id", "was_pid", "pid"}` or `{"ok": false, "error"}`; `{"op": "stop"}` ->
    `{"ok": true}`, then the agent stops its children and exits."""

    STATUS = "status"
    RESTART = "restart"
    STOP = "stop"


def pid_record(text: str) -> tuple[int, int] | None:
    """(pid, start ticks) from agent.pid's text; None unless both are there. A pid alone is never trusted: pids
    are reused, and a pid file from before a reboot (or written by someone else) would name an unrelated process."""
    try:
        words = text.split()
        pid, ticks = int(words[0]), int(words[1])
    except (IndexError, ValueError):
        return None
    return (pid, ticks) if pid > 1 and ticks >= 0 else None


def stat_matches(record: tuple[int, int], stat_text: str) -> bool:
    """Whether /proc/<pid>/stat's text shows the recorded process alive: no zombie, the recorded start time. Pure:
    `fleet status` reads the file over SSH and decides here, without a Python on the host."""
    fields = stat_text.rsplit(")", 1)[-1].split()
    return len(fields) >= 20 and fields[0] not in ("Z", "X") and fields[19] == str(record[1])


# --- agent.json: the states, the records, the writer (`AgentDoc.to_json`) and the reader (`AgentDoc.parse`)

VERSION = 1  # agent.json's "version"
MAX_ENTRIES = 4096  # processes, takeovers, argv words, log tail lines kept from a document read
MAX_EXITS = 10  # exits kept per process (the agent writes at most that many)
MAX_TEXT = 16384  # characters of any one string kept from a document read
MAX_FLAT = 32  # keys kept of a small free-form entry (open_files, same_failure)


class StateEnum(str, enum.Enum):
    """A state named once; a member prints, formats and serialises as its value (Python 3.10 has no StrEnum, and
    a str-mixin Enum formats as `Cls.MEMBER` in f-strings from 3.11 on)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: Any) -> Any:
        """The member named `value`, or None for anything else (a document read is hostile: never raises)."""
        try:
            return cls(value) if isinstance(value, str) else None
        except ValueError:
            return None


class AgentState(StateEnum):
    """agent.json's `state`; GONE and ABSENT are only `judge`'s (the agent never writes them)."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHING = "finishing"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    GONE = "gone"  # what `status` says of an agent whose process is gone before reaching a final state
    ABSENT = "absent"  # never started here (no agent.json)


FINAL_STATES = frozenset({AgentState.SUCCEEDED, AgentState.FAILED, AgentState.STOPPED})  # exited for good
GONE, ABSENT = AgentState.GONE, AgentState.ABSENT


class ProcState(StateEnum):
    """A process's `state` (the agent's Slot): BACKOFF while a relaunch timer is armed, RESTARTING after the
    operator's restart sent SIGTERM."""

    PENDING = "pending"
    RUNNING = "running"
    BACKOFF = "backoff"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class LinkState(StateEnum):
    """The agent's link to the scheduler (toolkit.agent.link): `scheduler.link`."""

    DOWN = "down"
    CONNECTING = "connecting"
    HELLO = "hello"
    UP = "up"
    CLOSED = "closed"


class BadDocument(ValueError):
    """A document that is not JSON, or not a JSON object: one line saying so."""


def _int(v: Any) -> int | None:
    return v if is_int(v) else None


def _num(v: Any) -> float | None:
    return v if is_number(v) else None


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _text(v: Any) -> str | None:
    return v[:MAX_TEXT] if isinstance(v, str) else None


def _texts(v: Any) -> tuple[str, ...]:
    return tuple(t[:MAX_TEXT] for t in v[:MAX_ENTRIES] if isinstance(t, str)) if isinstance(v, list) else ()


def _flat(v: Any) -> dict[str, Any] | None:
    """A small entry of scalars (open_files, same_failure); nested values are dropped."""
    if not isinstance(v, dict):
        return None
    items = [(k, _text(x) if isinstance(x, str) else x) for k, x in list(v.items())[:MAX_FLAT]]
    return {k[:MAX_TEXT]: x for k, x in items if isinstance(x, (type(None), bool, int, float, str))}


def _plain(v: Any) -> Any:
    """A field's value as JSON has it: a record as its dict, a tuple as a list, a state as its value."""
    if isinstance(v, enum.Enum):
        return v.value
    if hasattr(v, "to_dict"):
        return v.to_dict()
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _dict(record: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(record, f.name)) for f in fields(record)}


@dataclass(frozen=True)
class ExitRecord:
    """One exit of a process (`last_exit`, `exits`): its code or signal (by name), pid, when (ISO), how long it ran
    (s), the step it had reached, its first cause (toolkit.agent.causes; None when the status says it all), and
    `failure` once the restart budget judged it (written only when true)."""

    code: int | None
    signal: str | None
    pid: int | None
    at: str | None
    ran_for: float | None
    step: int | None
    cause: str | None
    failure: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = _dict(self)
        if not self.failure:
            del out["failure"]
        return out

    @classmethod
    def from_obj(cls, raw: Any) -> ExitRecord | None:
        if not isinstance(raw, dict):
            return None
        return cls(_int(raw.get("code")), _text(raw.get("signal")), _int(raw.get("pid")), _text(raw.get("at")),
                   _num(raw.get("ran_for")), _int(raw.get("step")), _text(raw.get("cause")), raw.get("failure") is True)


@dataclass(frozen=True)
class ProcDoc:
    """One process in `processes` (the agent's Slot.document). `pid`, `pgid` and `start_ticks` name the running
    incarnation (None between incarnations), `last_pid` and `last_start_ticks` the latest one, running or not
    (`recorded_groups`). `open_files` is openfiles.Trend.document's, `same_failure` policy.repeated_failure's."""

    node_id: str | None
    role: str | None
    rank: int | None
    local_rank: int | None
    state: ProcState | None
    pid: int | None
    pgid: int | None
    start_ticks: int | None
    last_pid: int | None
    last_start_ticks: int | None
    started_at: str | None
    warm: bool | None
    restarts: int | None
    counted_restarts: int | None
    max_restarts: int | None
    next_start_at: str | None
    last_exit: ExitRecord | None
    exits: tuple[ExitRecord, ...]
    step: int | None
    epoch: int | None
    step_at: str | None
    recovery: str | None
    cpus: tuple[int, ...] | None
    open_files: Mapping[str, Any] | None = field(hash=False)
    failed_at: int | None
    same_failure: Mapping[str, Any] | None = field(hash=False)
    log_file: str | None
    argv: tuple[str, ...]
    relaunched: int | None = None  # of `restarts`: the job's restart of this healthy process (exit 76 or 75)

    def to_dict(self) -> dict[str, Any]:
        return _dict(self)

    @classmethod
    def from_obj(cls, raw: Any) -> ProcDoc | None:
        if not isinstance(raw, dict):
            return None
        g = raw.get
        exits = g("exits")
        cpus = g("cpus")
        return cls(
            _text(g("node_id")), _text(g("role")), _int(g("rank")), _int(g("local_rank")), ProcState.parse(g("state")),
            _int(g("pid")), _int(g("pgid")), _int(g("start_ticks")), _int(g("last_pid")), _int(g("last_start_ticks")),
            _text(g("started_at")), _bool(g("warm")), _int(g("restarts")), _int(g("counted_restarts")),
            _int(g("max_restarts")), _text(g("next_start_at")), ExitRecord.from_obj(g("last_exit")),
            tuple(e for e in map(ExitRecord.from_obj, exits[-MAX_EXITS:] if isinstance(exits, list) else [])
                  if e is not None),
            _int(g("step")), _int(g("epoch")), _text(g("step_at")), _text(g("recovery")),
            tuple(c for c in map(_int, cpus[:MAX_ENTRIES]) if c is not None) if isinstance(cpus, list) else None,
            _flat(g("open_files")), _int(g("failed_at")), _flat(g("same_failure")), _text(g("log_file")),
            _texts(g("argv")), _int(g("relaunched")))


@dataclass(frozen=True)
class Failure:
    """`failure`: the give-up evidence of the process whose restarts ran out (the agent's `_give_up`)."""

    host: str | None
    node_id: str | None
    rank: int | None
    pid: int | None
    code: int | None
    signal: str | None
    status: str | None
    cause: str | None
    restarts: int | None
    log_file: str | None
    log_tail: tuple[str, ...]
    at: str | None

    def to_dict(self) -> dict[str, Any]:
        return _dict(self)

    @classmethod
    def from_obj(cls, raw: Any) -> Failure | None:
        if not isinstance(raw, dict):
            return None
        g = raw.get
        return cls(_text(g("host")), _text(g("node_id")), _int(g("rank")), _int(g("pid")), _int(g("code")),
                   _text(g("signal")), _text(g("status")), _text(g("cause")), _int(g("restarts")),
                   _text(g("log_file")), _texts(g("log_tail")), _text(g("at")))


@dataclass(frozen=True)
class Takeover:
    """One entry of a spare's `took_over`: the lost `host` whose `node_ids` it started, the scheduler's `seq`."""

    host: str
    node_ids: tuple[str, ...]
    seq: int | None  # None: the scheduler gave none (such an entry reads as malformed)
    at: str | None

    def to_dict(self) -> dict[str, Any]:
        return _dict(self)

    @classmethod
    def from_obj(cls, raw: Any) -> Takeover | None:
        """None for a malformed entry (a host, an int seq and a list of node id strings are required)."""
        if not (isinstance(raw, dict) and isinstance(raw.get("host"), str) and _int(raw.get("seq")) is not None
                and isinstance(raw.get("node_ids"), list) and all(isinstance(n, str) for n in raw["node_ids"])):
            return None
        return cls(raw["host"][:MAX_TEXT], _texts(raw["node_ids"]), raw["seq"], _text(raw.get("at")))


@dataclass(frozen=True)
class AgentInfo:
    """`agent`: the agent process itself (its pid and start ticks are agent.pid's), and its interpreter."""

    pid: int | None
    start_ticks: int | None
    started_at: str | None
    python: str | None

    def to_dict(self) -> dict[str, Any]:
        return _dict(self)

    @classmethod
    def from_obj(cls, raw: Any) -> AgentInfo | None:
        if not isinstance(raw, dict):
            return None
        return cls(_int(raw.get("pid")), _int(raw.get("start_ticks")), _text(raw.get("started_at")),
                   _text(raw.get("python")))


@dataclass(frozen=True)
class LinkDoc:
    """`scheduler`: where the scheduler listens, the link's state and since when."""

    address: str | None
    link: LinkState | None
    since: str | None

    def to_dict(self) -> dict[str, Any]:
        return _dict(self)

    @classmethod
    def from_obj(cls, raw: Any) -> LinkDoc | None:
        if not isinstance(raw, dict):
            return None
        return cls(_text(raw.get("address")), LinkState.parse(raw.get("link")), _text(raw.get("since")))


@dataclass(frozen=True)
class WarmSpareDoc:
    """`warm_spare`: whether the agent keeps one, its pid, whether it is ready, and held while a worker starts
    cold."""

    enabled: bool | None
    pid: int | None
    ready: bool | None
    held: bool | None

    def to_dict(self) -> dict[str, Any]:
        return _dict(self)

    @classmethod
    def from_obj(cls, raw: Any) -> WarmSpareDoc | None:
        if not isinstance(raw, dict):
            return None
        return cls(_bool(raw.get("enabled")), _int(raw.get("pid")), _bool(raw.get("ready")), _bool(raw.get("held")))


@dataclass(frozen=True)
class AgentDoc:
    """state/agent.json, also the control socket's `status` reply: written by the agent (`to_json`, in this key
    order), read by `fleet` and the next agent (`parse`). `alive` is never written by the agent: `judge` sets it
    (the agent's `status` command prints it last). A document read is hostile: every field of the wrong type reads
    as None (a bool is never an int), lists and strings are bounded, malformed takeovers are dropped."""

    version: int | None = None
    job: str | None = None
    host: str | None = None
    job_dir: str | None = None
    job_id: str | None = None
    agent: AgentInfo | None = None
    state: AgentState | None = None
    reason: str | None = None
    exit_code: int | None = None
    updated_at: str | None = None
    scheduler: LinkDoc | None = None
    warm_spare: WarmSpareDoc | None = None
    bind_core: bool | None = None
    spare: bool | None = None
    took_over: tuple[Takeover, ...] = ()
    processes: tuple[ProcDoc, ...] = ()
    failure: Failure | None = None
    alive: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """The document as JSON has it. A host without agent.json (`judge`'s ABSENT) keeps the short reply the
        agent's `status` gives for it: state, alive, no processes, and what is known of the job."""
        if self.state is AgentState.ABSENT:
            head = {"state": ABSENT.value, "alive": bool(self.alive), "processes": []}
            known = {k: getattr(self, k) for k in ("version", "job", "host", "job_id", "job_dir")}
            return {**head, **{k: v for k, v in known.items() if v is not None}}
        out = _dict(self)
        if self.alive is None:
            del out["alive"]
        return out

    def to_json(self) -> str:
        """agent.json's text, as the agent writes it."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_obj(cls, raw: Any) -> AgentDoc:
        """The document from parsed JSON (a file's, or the control socket's reply). BadDocument unless an object."""
        if not isinstance(raw, dict):
            raise BadDocument(f"agent.json is not a JSON object but {type(raw).__name__}")
        g = raw.get
        procs, took = g("processes"), g("took_over")
        return cls(
            _int(g("version")), _text(g("job")), _text(g("host")), _text(g("job_dir")), _text(g("job_id")),
            AgentInfo.from_obj(g("agent")), AgentState.parse(g("state")), _text(g("reason")), _int(g("exit_code")),
            _text(g("updated_at")), LinkDoc.from_obj(g("scheduler")), WarmSpareDoc.from_obj(g("warm_spare")),
            _bool(g("bind_core")), _bool(g("spare")),
            tuple(t for t in map(Takeover.from_obj, took[:MAX_ENTRIES] if isinstance(took, list) else []) if t),
            tuple(p for p in map(ProcDoc.from_obj, procs[:MAX_ENTRIES] if isinstance(procs, list) else []) if p),
            Failure.from_obj(g("failure")), _bool(g("alive")))

    @classmethod
    def parse(cls, text: str | bytes) -> AgentDoc:
        """agent.json's text as a document. BadDocument (one line) if it is not a JSON object; never another
        exception, whatever the text (deep nesting, huge numbers, junk)."""
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise BadDocument(f"agent.json is not JSON ({str(e)[:200]})") from None
        return cls.from_obj(raw)


def judge(doc: AgentDoc | None, running: tuple[int, int] | None) -> AgentDoc:
    """agent.json as `status` reports it: with `alive` (its writer is the running agent) and the state GONE when the
    agent died before reaching a final state (ABSENT without a document). Pure: `running` is the caller's finding
    (commands.running_agent on the host, stat_matches over SSH)."""
    if doc is None:
        return AgentDoc(state=AgentState.ABSENT, alive=False)
    alive = running is not None and doc.agent is not None and doc.agent.pid == running[0]
    state = doc.state if alive or doc.state in FINAL_STATES else AgentState.GONE
    return replace(doc, state=state, alive=alive)


def recorded_groups(text: str) -> list[tuple[str, int, int]]:
    """(node_id, pgid, leader start ticks) of every process an agent.json names. An entry without its leader's start
    time is skipped: a group id alone may name someone else's processes by now."""
    try:
        doc = AgentDoc.parse(text)
    except BadDocument:
        return []
    out = []
    for p in doc.processes:
        pgid = p.pgid or p.last_pid  # a session leader's pgid is its pid
        ticks = p.start_ticks if p.pgid else p.last_start_ticks
        if pgid is not None and pgid > 1 and ticks is not None:
            out.append((str(p.node_id), pgid, ticks))
    return out


def progress(node_id: str, step: int | None = None, epoch: int | None = None,
             recovery: str | None = None) -> dict[str, Any]:
    """A progress datagram: how far a worker got, and how it recovers (protocol.RECOVERY_*)."""
    return {"node_id": node_id, "step": step, "epoch": epoch, "recovery": recovery}
