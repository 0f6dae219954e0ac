"""The agent's progress socket (state/progress.sock): a unix datagram socket, mode 0600, where the workers say how
far they got (toolkit.contracts.agentdoc.progress: node_id, step, epoch, recovery). Not to be confused with
toolkit.train.progress and scriptreport (toolkit.train.report), which send a script's own progress to the scheduler.

Every datagram is hostile until parsed: one that is not a JSON object with a string `node_id` is dropped, and a field
of the wrong type is left out (`parse`); at most READS_PER_WAKE datagrams are read per wake-up, so a flood cannot
stall the agent's loop (the rest wait in the socket for the next one). Which node ids exist is the agent's business
(`on_reports`). Runs on the agent's loop thread, through its selector.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from toolkit.contracts import protocol

READS_PER_WAKE = 256  # datagrams read per wake-up of the loop
MAX_DATAGRAM = 4096  # bytes of one datagram read (the rest of a longer one is discarded by the kernel)


@dataclass(frozen=True)
class Report:
    """One worker's progress datagram, its fields checked: `recovery` is one of protocol.RECOVERY_* or None (the
    worker joined its group and says how it recovers), `step` an int or None, `epoch` an int or None."""

    node_id: str
    step: int | None = None
    epoch: int | None = None
    recovery: str | None = None
    done: bool = False  # the worker told the scheduler it finished training (toolkit.train's `done`)


def parse(data: bytes) -> Report | None:
    """The Report in one datagram; None when it is not a JSON object naming a node (a string `node_id`). A `step`
    that is not an int (a bool is not) is left out; so is an `epoch` that is not an int; so is a `recovery` other
    than protocol.RECOVERY_IN_PLACE or RECOVERY_RESTART; `done` counts only as the JSON value true. Pure."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(msg, dict) or not isinstance(msg.get("node_id"), str):
        return None
    step, epoch, recovery = msg.get("step"), msg.get("epoch"), msg.get("recovery")
    return Report(msg["node_id"],
                  step if protocol.is_int(step) else None,
                  epoch if isinstance(epoch, int) else None,
                  recovery if isinstance(recovery, str)
                  and recovery in (protocol.RECOVERY_IN_PLACE, protocol.RECOVERY_RESTART) else None,
                  msg.get("done") is True)


class ProgressInbox:
    """The datagram socket at `path` on the loop's selector `sel`; each wake-up's reports go to `on_reports` (called
    once per wake-up, with the reports in the order they arrived, possibly none). `open` makes the socket, `close`
    removes it. Loop thread only."""

    def __init__(self, path: Path, sel: selectors.BaseSelector,
                 on_reports: Callable[[list[Report]], None]) -> None:
        self.path, self.sel, self.on_reports = path, sel, on_reports
        self._sock: socket.socket | None = None

    def open(self) -> None:
        """Bind at `path` (0600, non-blocking) and register with the selector. A stale socket file is unlinked
        first: the caller holds the lock that says no other agent of the job runs. Raises OSError."""
        self.path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.setblocking(False)
        self.sel.register(self._sock, selectors.EVENT_READ, self._on_readable)

    def close(self) -> None:
        """Close the socket and unlink its file; safe if `open` never ran or failed part way."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.path.unlink(missing_ok=True)

    def owns(self, fileobj: object) -> bool:
        """Whether `fileobj` (a selector key's) is this inbox's socket: the loop reads it before the children's exits
        seen in the same wake-up, since a worker's last datagram (its `done`) was sent before it exited."""
        return self._sock is not None and fileobj is self._sock

    def _on_readable(self, _mask: int) -> None:
        """Selector callback: read up to READS_PER_WAKE datagrams, parse each, and hand the valid ones on."""
        reports = []
        for _ in range(READS_PER_WAKE):  # bounded per wake-up; the rest is read at the next one
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except BlockingIOError:
                break
            report = parse(data)
            if report is not None:
                reports.append(report)
        self.on_reports(reports)
