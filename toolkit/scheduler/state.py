"""The scheduler's persisted state in MS_RECOVERY_PATH: what a restarted scheduler needs to go on with the job
(Membership.snapshot()), written durably before anything that depends on it is sent, so a scheduler killed with -9
and started again never hands out a generation twice.

Written so that a write costs what changed, not the job's size (the whole document was 722 kB at 4096 ranks and
was rewritten on every change: issue 24). The document is seen as keyed records (`records`): a scalar per field
(SCALARS) and one record per rank's member (`member/<rank>`), rank done (`done/<rank>`), rank's committed step
(`commit/<rank>`), fenced incarnation (`fenced/<incarnation>`) and replacement (`replaced/<number>`);
`committed_step` is derived. Two files:

- STATE_FILE, the base: the whole document with `version` and `epoch` (random, new at each rewrite). Rewritten
  atomically (toolkit.atomicfile, DURABLE) at a scheduler's first write and whenever the journal outgrows it.
- JOURNAL_FILE: a first line `{"version", "epoch"}` naming the base it continues, then one line per write,
  `{"set": {key: record}, "del": [key]}`: the records that changed, appended with one write and one fsync. One line
  per write, so a write is applied whole or not at all. When a line would take the journal past JOURNAL_FLOOR
  bytes and past JOURNAL_RATIO times the base, both files are rewritten instead (the compaction): the bytes
  written stay within twice what changed, and a load reads at most about twice the base.

`load` reads the base, then the journal if its epoch is the base's. Another epoch is a journal the base already
contains (a crash between the two rewrites) or one of a base moved away: it is ignored, and replaced at the next
write. A last line without its newline is a write a crash cut short: never acknowledged, so nothing that depended
on it was sent; it is ignored. Anything else malformed is refused, in one line naming the file and what to do.

`job` and `world_size` never change in a run: `toolkit.launcher.jobhosts.rerun` reads them from the base alone.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from toolkit import atomicfile
from toolkit.atomicfile import Durability
from toolkit.contracts.protocol import finite_json
from toolkit.contracts.rundoc import STATE_FILE, JobStatus
from toolkit.errors import UserError
from toolkit.scheduler import corrupthosts, elastic
from toolkit.scheduler.corrupthosts import CorruptHosts
from toolkit.scheduler.roster import Fact, Roster

JOURNAL_FILE = "scheduler.journal"
VERSION = 2
READABLE = (1, VERSION)  # version 1: the whole document alone (toolkit before the journal), read as a base
SCALARS = ("job", "world_size", "status", "failure", "generation", "formed", "benched", "assignment", "quarantined",
           "corrupt")
OPTIONAL = ("benched", "assignment", "quarantined", "corrupt")  # written only while not empty (issues 42, 44)
MAX_FILE_BYTES = 64 << 20  # per file; the base is 0.65 MB at 4096 ranks, the journal at most about as much
JOURNAL_FLOOR = 64 << 10  # bytes the journal may always grow to before a compaction
JOURNAL_RATIO = 1.0  # ... and the multiple of the base's size


class StateError(UserError):
    """The persisted state cannot be used; the message says which file and what to do."""


def load(path: Path, job: str, world_size: int) -> dict[str, Any] | None:
    """The state of `job` in `path` (the base) and the journal beside it, or None if there is no base yet."""
    data = _read(path)
    if data is None:
        return None
    try:
        base = finite_json(data)
    except (ValueError, RecursionError) as e:
        raise StateError(f"{path}: unreadable scheduler state ({e}); move it away to start the job afresh") from None
    if not isinstance(base, dict) or base.get("version") not in READABLE:
        raise StateError(f"{path}: not a scheduler state of this toolkit (version {VERSION}); move it away to start "
                         "the job afresh")
    journal = path.with_name(JOURNAL_FILE)
    where, them = str(path), "it"
    try:
        recs = records(base)
        if isinstance(base.get("epoch"), str) and _replay(journal, base["epoch"], recs):
            where, them = f"{path} (with {journal.name})", "them"
        doc = document(recs)
        if doc.get("job") == job and doc.get("world_size") == world_size:
            _check(doc)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise StateError(f"{where}: damaged scheduler state ({type(e).__name__}: {str(e)[:200]}); move {them} away "
                         "to start the job afresh") from None
    if doc.get("job") != job or doc.get("world_size") != world_size:
        raise StateError(f"{where} is the state of job {doc.get('job')!r} with {doc.get('world_size')} workers, not "
                         f"of {job!r} with {world_size}: a run cannot change its size; 'fleet train --fresh' starts "
                         "the job over (this state moved aside), or deploy it with its old size again")
    return doc


def records(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The keyed records of a snapshot document (module docstring). TypeError, KeyError or ValueError if it is
    malformed."""
    out = {name: doc[name] for name in SCALARS if name in doc}
    out.update((f"{Fact.MEMBER}/{m['rank']}", m) for m in doc.get("members", []))
    out.update((f"{Fact.DONE}/{rank}", True) for rank in doc.get("done", []))
    out.update((f"{Fact.FENCED}/{incarnation}", True) for incarnation in doc.get("fenced", []))
    out.update((f"{Fact.COMMIT}/{rank}", step) for rank, step in dict(doc.get("commits", {})).items())
    out.update((f"{Fact.REPLACED}/{n}", r) for n, r in enumerate(doc.get("replaced", []), 1))
    return out


def document(recs: Mapping[str, Any]) -> dict[str, Any]:
    """The snapshot document of keyed records: the inverse of `records`, in Membership.snapshot()'s order (ranks
    and replacements by number, incarnations by name). ValueError or TypeError if a key is not a record's."""
    facts: dict[Fact, list[tuple[str, Any]]] = {fact: [] for fact in Fact}
    for key, value in recs.items():
        kind, slash, name = key.partition("/")
        if slash:
            facts[Fact(kind)].append((name, value))
        elif key not in SCALARS:
            raise ValueError(f"unknown record {key[:64]!r}")
    for fact in (Fact.DONE, Fact.FENCED):
        if any(value is not True for _, value in facts[fact]):
            raise ValueError(f"a {fact} record that is not true")
    commits = sorted((_number(name), step) for name, step in facts[Fact.COMMIT])
    return {**{name: recs[name] for name in SCALARS if name in recs},
            "members": [m for _, m in sorted(facts[Fact.MEMBER], key=lambda item: _number(item[0]))],
            "done": sorted(_number(name) for name, _ in facts[Fact.DONE]),
            "fenced": sorted(name for name, _ in facts[Fact.FENCED]),
            "commits": {str(rank): step for rank, step in commits},
            "committed_step": min(step for _, step in commits) if len(commits) == recs.get("world_size") else None,
            "replaced": [r for _, r in sorted(facts[Fact.REPLACED], key=lambda item: _number(item[0]))]}


class Persisted(Protocol):
    """What `changes` reads of the scheduler's membership: its roster, its corruption findings (`quarantined` and
    `corrupt` of SCALARS), and each other of SCALARS as an attribute (a Protocol, because this module sits below
    toolkit.scheduler.membership, which imports it)."""

    roster: Roster
    corrupt: CorruptHosts


def changes(m: Persisted) -> dict[str, Any]:
    """The records that may differ from those last written: every scalar, and the record of each fact the roster
    marked changed (`Roster.unsaved`); None for a record that is gone. O(what was marked), not O(N)."""
    roster = m.roster
    out: dict[str, Any] = {name: getattr(m, name) for name in SCALARS if name not in ("quarantined", "corrupt")}
    out.update(quarantined=m.corrupt.quarantined, corrupt=m.corrupt.counts)
    for name in OPTIONAL:  # absent from the snapshot while empty: a job that never shrank writes what it did
        out[name] = (dict(out[name]) if isinstance(out[name], dict) else out[name]) or None  # a copy: the
        # membership updates its map in place, and the writer compares with what it wrote
    replacements: list[dict[str, Any]] | None = None
    for fact, name in roster.unsaved:
        value: Any = None
        if fact is Fact.MEMBER:
            member = roster.members.get(int(name))
            value = member.to_json() if member is not None else None
        elif fact is Fact.COMMIT:
            value = roster.commits.get(int(name))
        elif fact is Fact.DONE:
            value = True if name in roster.done else None
        elif fact is Fact.FENCED:
            value = True if name in roster.fenced else None
        else:
            replacements = replacements if replacements is not None else roster.replacements()
            value = replacements[int(name) - 1] if 0 < int(name) <= len(replacements) else None
        out[f"{fact}/{name}"] = value
    return out


class StateWriter:
    """Writes the state to `path` (the base) and the journal beside it (module docstring). Keeps the records the
    files hold (`written`), so that a write appends only the records that differ from them."""

    def __init__(self, path: Path) -> None:
        self.path, self.journal = path, path.with_name(JOURNAL_FILE)
        self.written: dict[str, Any] | None = None  # None: nothing written yet, or a write failed: rewrite both
        self.base_bytes = self.journal_bytes = 0

    def save(self, changed: Mapping[str, Any], snapshot: Callable[[], Mapping[str, Any]]) -> None:
        """Make the files hold the state: append the records of `changed` (`changes`) that differ from those
        written, in one line with one fsync, or nothing if none does; or rewrite both files from `snapshot()` when
        this writer has written nothing yet (a restored or fresh start: the journal found is replaced), when its
        last write failed (a part of it may be on disk), or when the line would take the journal past its bound.
        OSError if it cannot; the server logs it and tries again."""
        if self.written is not None:
            delta = {key: value for key, value in changed.items() if self.written.get(key) != value}
            if not delta:
                return
            line = json.dumps({"set": {k: v for k, v in delta.items() if v is not None},
                               "del": [k for k, v in delta.items() if v is None]}, separators=(",", ":")) + "\n"
            if self.journal_bytes + len(line) <= max(JOURNAL_FLOOR, JOURNAL_RATIO * self.base_bytes):
                self._append(line.encode(), delta)
                return
        self._rewrite(snapshot())

    def _append(self, line: bytes, delta: Mapping[str, Any]) -> None:
        """Append `line` to the journal (which the last rewrite created: never created here) and fsync it."""
        written, self.written = self.written or {}, None  # until it is on disk: a failure leaves a rewrite to do
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        for key, value in delta.items():
            if value is None:
                written.pop(key, None)
            else:
                written[key] = value
        self.written, self.journal_bytes = written, self.journal_bytes + len(line)

    def _rewrite(self, doc: Mapping[str, Any]) -> None:
        """Replace the base with `doc` under a new epoch, then the journal with its first line, each atomically and
        durably (mode 0600; the directory created 0700 if needed). A crash between the two leaves a journal of
        another epoch, which `load` ignores."""
        self.written = None
        epoch = secrets.token_hex(8)
        base = json.dumps({"version": VERSION, "epoch": epoch, **doc}, separators=(",", ":")).encode()
        head = json.dumps({"version": VERSION, "epoch": epoch}).encode() + b"\n"
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomicfile.write(self.path, base, durability=Durability.DURABLE)
        atomicfile.write(self.journal, head, durability=Durability.DURABLE)
        self.written, self.base_bytes, self.journal_bytes = records(doc), len(base), len(head)


def _read(path: Path) -> bytes | None:
    """The bytes of `path`, None if there is no such file; StateError if it cannot be read or is larger than
    MAX_FILE_BYTES."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateError(f"{path}: unreadable scheduler state ({e.strerror}); move it away to start the job "
                         "afresh") from None
    if len(data) > MAX_FILE_BYTES:
        raise StateError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB, not a scheduler state of this toolkit; "
                         "move it away to start the job afresh")
    return data


def _replay(journal: Path, epoch: str, recs: dict[str, Any]) -> bool:
    """Apply the journal's lines to `recs` if it continues the base of `epoch`; whether it did. A last line
    without its newline is ignored (a write cut short); any other malformed line is a StateError naming it."""
    data = _read(journal)
    lines = data.split(b"\n")[:-1] if data is not None else []  # [-1]: after the last newline, a cut write or ""
    if not lines:
        return False
    for number, line in enumerate(lines, 1):
        try:
            entry = finite_json(line)
            if number == 1:
                if not (isinstance(entry, dict) and entry.get("version") == VERSION
                        and isinstance(entry.get("epoch"), str)):
                    raise ValueError(f"not a journal's first line of version {VERSION}")
                if entry["epoch"] != epoch:
                    return False  # the base holds all of it, or it belonged to another base
                continue
            sets, drops = entry["set"], entry["del"]
            if not isinstance(sets, dict) or not isinstance(drops, list) or not all(isinstance(k, str) for k in drops):
                raise ValueError("not a change of records")
            for key in drops:
                recs.pop(key, None)
            recs.update(sets)
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            raise StateError(f"{journal}: line {number} is damaged ({type(e).__name__}: {str(e)[:200]}); move it "
                             f"and {STATE_FILE} away to start the job afresh") from None
    return True


def _number(name: str) -> int:
    """A record's rank or replacement number, written as the writer writes it: decimal digits without a leading
    zero (ValueError otherwise: `commit/0001` would otherwise stand for rank 1 beside `commit/1`)."""
    if not (name.isascii() and name.isdigit() and str(int(name)) == name):
        raise ValueError(f"not a number as the writer writes it: {name[:64]!r}")
    return int(name)


def _check(doc: Mapping[str, Any]) -> None:
    """Every field a restore reads has the type it expects (a damaged file must not become a traceback)."""
    for r in doc.get("replaced", []):
        if not (isinstance(r["host"], str) and isinstance(r["by"], str)
                and all(isinstance(n, str) for n in r["node_ids"])):
            raise ValueError(f"replaced: {str(r)[:80]}")
    if doc.get("status") != JobStatus.RUNNING:
        return
    int(doc["generation"])
    bool(doc["formed"])
    elastic.read_benched(doc.get("benched"), int(doc["world_size"]))
    corrupthosts.read_quarantined(doc.get("quarantined"))
    corrupthosts.read_corrupt(doc.get("corrupt"))
    if doc.get("assignment") is not None:  # its L is the job's: checked as a partition of what it names
        elastic.read_assignment(doc["assignment"], int(doc["world_size"]),
                                sum(len(e[1]) for e in doc["assignment"] if isinstance(e, list) and len(e) == 2
                                    and isinstance(e[1], list)))
    [int(r) for r in doc.get("done", [])]
    {int(r): int(s) for r, s in dict(doc.get("commits", {})).items()}
    for m in doc.get("members", []):
        int(m["rank"]), int(m["pid"]), str(m["node_id"]), str(m["incarnation"]), str(m["host"]), str(m["addr"])
