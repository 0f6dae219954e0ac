"""Why a process ended, as the job reports it: the first cause, not the last act.

A failed worker often ends in more than one way at once: its script raised, then the scheduler, seeing the
connection close, had it killed; or a SIGSTOPped worker was killed by its agent for the scheduler. What the user
must read is the cause that came first, in this order:

1. the script's own: the message of its error file (TORCHELASTIC_ERROR_FILE, torch's `@record` format, written by
   the script's `@record` or by toolkit.train.wrapper for an exception), else for a set-up error (exit code 2) the
   line it said last, else its exit code;
2. a signal from outside (SIGSEGV, a `kill -9`): the signal;
3. the kernel's OOM killer: a SIGKILL while the memory cgroup's `oom_kill` count rose (toolkit.memcgroup), named
   with the cgroup and its limit;
4. fencing: a signal the agent sent because the scheduler declared the process dead, named by the scheduler's cause
   (heartbeat silence, ...).

Pure but for `read_error_file` (one bounded read of a file the worker wrote, treated as hostile input); `last_word`
takes lines the caller read.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

from toolkit.contracts import protocol
from toolkit.procs import ExitStatus

MAX_ERROR_FILE = 256 << 10  # bytes read of an error file (a traceback is in it); the rest is ignored


def error_file(errors_dir: Path, node_id: str, launch: int) -> Path:
    """Where incarnation `launch` (0 for the first start) of `node_id` may write its error file: one per incarnation,
    so that a file left by an earlier one is never read as a later one's."""
    return errors_dir / f"{node_id}.{launch}.json"


def read_error_file(path: Path) -> str | None:
    """The message of the error file at `path` (torch's ErrorHandler format: {"message": {"message": "Type: text",
    "extraInfo": {...}}}, or {"message": "text"}), first line only (protocol.one_line); None when there
    is none, or it is not a regular file (a link is not followed), too short to be one, or not in that format."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            data = f.read(MAX_ERROR_FILE)
    except OSError:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    message = doc.get("message") if isinstance(doc, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    return protocol.one_line(message)


LAST_WORD_LINES = 3  # lines read from the end of a log for a set-up error's last word (blank ones skipped)


def last_word(tail: list[str]) -> str | None:
    """What a process said last (the last non-blank of its log's last lines `tail`), as one line: the cause of a
    set-up error (exit code 2), which scripts say in one line before they exit (argparse's `error: ...`, the
    Trainer's refusal of its checkpoint directory) without an error file; None for nothing said."""
    said = [line for line in tail if line.strip()]
    return protocol.one_line(said[-1]) if said else None


def oom_verdict(before: int | None, after: int | None, cgroup: str, limit: int | None) -> str | None:
    """The kernel's word that it killed for want of memory: the memory cgroup's `oom_kill` count rose from `before`
    to `after` (None: unknown), as one line naming the cgroup and its `limit` (None: none); None if it did not."""
    if before is None or after is None or after <= before:
        return None
    where = f"memory cgroup {cgroup}" + (f", limit {limit >> 20} MB" if limit is not None else "")
    return f"killed by the kernel's OOM killer ({where}: oom_kill {before} -> {after})"


def first_cause(status: ExitStatus, message: str | None, fenced: str | None, oom: str | None = None) -> str | None:
    """The first cause of an exit with `status`, as one line, or None when the status says it all (an exit code,
    or a signal from outside) or the exit is no failure (0, EXIT_FENCED, EXIT_REJOIN). `message`: the error file's
    (the script's own word, first whatever ended the process afterwards); `fenced`: the scheduler's cause when the
    agent signalled the process to fence it (it counts only when a signal ended it: a process that exited on its
    own first gave its own status); `oom`: `oom_verdict` since the last exit, which counts for a SIGKILL."""
    if status.ok or status.code in (protocol.EXIT_FENCED, protocol.EXIT_REJOIN):
        return None
    if message:
        return f"{message} ({status.describe()})"
    if oom and status.signal == signal.SIGKILL:
        return f"{oom} ({status.describe()})"
    if fenced and status.signal is not None:
        return f"{fenced}: fenced by the scheduler ({status.describe()})"
    return None


RESTARTED_BY_OPERATOR = "restarted by fleet restart --node"  # the operator's restart (recover.sh), as an exit's cause


def operator_cause(status: ExitStatus, operator: str | None) -> str | None:
    """The cause of an exit the agent brought about for its operator (`operator`: "stopped by fleet stop",
    RESTARTED_BY_OPERATOR), with its status; None for a clean exit or without one. It comes before the script's
    own error: what a stop does to a process (its DataLoader workers killed, a collective broken) is no fault of
    it."""
    if status.ok or not operator:
        return None
    return f"{operator} ({status.describe()})"


def describe(status: ExitStatus, cause: str | None) -> str:
    """How a process ended, for logs and reports: its first cause when there is one, else "exit code N" or "killed
    by SIGNAME"."""
    return cause or status.describe()
