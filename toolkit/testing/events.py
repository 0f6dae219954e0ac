"""The datagrams that test workers send ("I started", with pid, group, rank and environment) to the process that
waits for them: how a test learns that a process started without polling."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Callable

EVENT_WAIT = 30.0  # s for one event to arrive


class Events:
    """A unix datagram socket at `path`; every event received is kept in `seen`. Waiting for an event that does
    not arrive within its timeout (EVENT_WAIT by default) raises TimeoutError."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.seen: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []

    def next(self, timeout: float = EVENT_WAIT) -> dict[str, Any]:
        """The next event (after those already matched away by `match`)."""
        if self.pending:
            return self.pending.pop(0)
        self.sock.settimeout(timeout)
        event = json.loads(self.sock.recv(65536))
        self.seen.append(event)
        return event

    def match(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = EVENT_WAIT) -> dict[str, Any]:
        """The first event, received or still to come, that `predicate` accepts; the others stay pending."""
        for event in self.pending:
            if predicate(event):
                self.pending.remove(event)
                return event
        self.sock.settimeout(timeout)
        while True:
            event = json.loads(self.sock.recv(65536))
            self.seen.append(event)
            if predicate(event):
                return event
            self.pending.append(event)

    def drain(self) -> list[dict[str, Any]]:
        """Every event received so far (the senders are gone)."""
        self.sock.setblocking(False)
        try:
            while True:
                self.seen.append(json.loads(self.sock.recv(65536)))
        except BlockingIOError:
            pass
        return self.seen

    def started(self, n: int) -> dict[str, dict[str, Any]]:
        """The next `n` start events by node id (MS_NODE_ID)."""
        out = {}
        for _ in range(n):
            event = self.next()
            out[event["env"]["MS_NODE_ID"]] = event
        return out

    def close(self) -> None:
        """Close the socket; the socket file at `path` is not removed."""
        self.sock.close()
