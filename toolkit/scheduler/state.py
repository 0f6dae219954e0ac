"""The scheduler's persisted state, `<MS_RECOVERY_PATH>/scheduler.json`: what a restarted scheduler needs to go on
with the job (Membership.snapshot()), written durably before anything that depends on it is sent, so a scheduler
killed with -9 and started again never hands out a generation twice."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any, Mapping

from toolkit import atomicfile
from toolkit.atomicfile import Durability
from toolkit.errors import UserError

STATE_FILE = "scheduler.json"
VERSION = 1


class JobStatus(str, enum.Enum):
    """The job's state in the document (`status`); a member prints, formats and serializes as its value."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # the ledger's outcome when its operator stopped the scheduler

    __str__ = str.__str__
    __format__ = str.__format__


class StateError(UserError):
    """The persisted state cannot be used; the message says which file and what to do."""


def load(path: Path, job: str, world_size: int) -> dict[str, Any] | None:
    """The state of `job` in `path`, or None if there is none yet."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise StateError(f"{path}: unreadable scheduler state ({e}); move it away to start the job afresh") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise StateError(f"{path}: not a scheduler state of this toolkit (version {VERSION}); move it away to start "
                         "the job afresh")
    if doc.get("job") != job or doc.get("world_size") != world_size:
        raise StateError(f"{path} is the state of job {doc.get('job')!r} with {doc.get('world_size')} workers, not of "
                         f"{job!r} with {world_size}: a run cannot change its size; 'fleet train --fresh' starts the "
                         "job over (this state moved aside), or deploy it with its old size again")
    try:
        _check(doc)
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"{path}: damaged scheduler state ({type(e).__name__}: {e}); move it away to start the "
                         "job afresh") from None
    return doc


def save(path: Path, snapshot: Mapping[str, Any]) -> None:
    """Replace `path` with `snapshot` (and the format VERSION), atomically and durably (the file and its directory
    fsynced, mode 0600), creating the directory 0700 if needed. OSError if it cannot; the server logs it and retries."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomicfile.write(path, json.dumps({"version": VERSION, **snapshot}, indent=1), durability=Durability.DURABLE)


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
    [int(r) for r in doc.get("done", [])]
    {int(r): int(s) for r, s in dict(doc.get("commits", {})).items()}
    for m in doc.get("members", []):
        int(m["rank"]), int(m["pid"]), str(m["node_id"]), str(m["incarnation"]), str(m["host"]), str(m["addr"])
