"""The agent's control socket (state/agent.sock): a unix stream socket, mode 0600 (whoever can talk to it can stop
the job), one JSON request line per connection and one JSON reply line (toolkit.contracts.agentdoc.ControlOp). What a
request means is the agent's business (`handle`); this module only keeps the conversations bounded.

Every client is hostile until proved otherwise: at most MAX_CONTROL_CLIENTS connections are open at once (more are
closed unanswered), each has CLIENT_TIMEOUT to send its request (a deadline on the loop's timers, so a silent one
cannot hold a descriptor for ever), a request is read up to MAX_CONTROL_LINE bytes, and one that is not a JSON
object line is answered with an error. An action the agent defers (stop) runs only once the reply has been sent.
Runs on the agent's loop thread, through its selector and timers.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
from pathlib import Path
from typing import Any, Callable

from toolkit.agent.timers import Timer, Timers

CLIENT_TIMEOUT = 5.0  # s for one control-socket conversation, either side
MAX_CONTROL_LINE = 64 << 10  # bytes of one control request; a longer one is answered as not a JSON object line
MAX_CONTROL_CLIENTS = 16  # control connections open at once (the socket is the operator's own: 0600)
LISTEN_BACKLOG = 16
RECV_SIZE = 65536

# A request (the decoded JSON line, of any type) -> (reply, action to run once the reply is sent, or None).
Handler = Callable[[Any], tuple[dict, Callable[[], None] | None]]
NOT_JSON = {"ok": False, "error": "not a JSON object line"}


def request_line(buf: bytes, eof: bool) -> bytes | None:
    """The request in what a client sent so far, once it is complete: its first line when `buf` holds a newline,
    everything when the client closed its side (`eof`) or sent more than MAX_CONTROL_LINE bytes; None while more may
    come. Pure."""
    if eof or b"\n" in buf or len(buf) > MAX_CONTROL_LINE:
        return buf.split(b"\n", 1)[0]
    return None


def answer(line: bytes, handle: Handler) -> tuple[dict | None, Callable[[], None] | None]:
    """(reply, deferred action) for one request line: None and None for an empty line (no answer), NOT_JSON for a
    line that is not JSON or that `handle` cannot take as a request."""
    if not line.strip():
        return None, None
    try:
        return handle(json.loads(line))
    except (ValueError, TypeError, AttributeError, RecursionError):
        return NOT_JSON, None


class _Conn:
    """One accepted connection: what it sent so far and the deadline that closes it."""

    __slots__ = ("sock", "buf", "deadline")

    def __init__(self, sock: socket.socket, deadline: Timer) -> None:
        self.sock, self.buf, self.deadline = sock, b"", deadline


class ControlServer:
    """The listening socket at `path` and its open conversations, on the loop's selector `sel` and `timers`;
    `handle` answers a request (see Handler). `open` makes the socket, `close` removes it. Loop thread only."""

    def __init__(self, path: Path, sel: selectors.BaseSelector, timers: Timers, handle: Handler) -> None:
        self.path, self.sel, self.timers, self.handle = path, sel, timers, handle
        self._sock: socket.socket | None = None
        self._clients: dict[socket.socket, _Conn] = {}

    def open(self) -> None:
        """Bind and listen at `path` (0600, non-blocking) and register with the selector. A stale socket file is
        unlinked first: the caller holds the lock that says no other agent of the job runs. Raises OSError."""
        self.path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)  # whoever can talk to it can stop the job
        self._sock.listen(LISTEN_BACKLOG)
        self._sock.setblocking(False)
        self.sel.register(self._sock, selectors.EVENT_READ, self._on_accept)

    def close(self) -> None:
        """Close the open conversations and the listening socket and unlink its file; safe if `open` never ran or
        failed part way. The selector is the caller's (it may be closed already)."""
        for conn in list(self._clients):
            self._close_conn(conn)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.path.unlink(missing_ok=True)

    def clients(self) -> int:
        """How many conversations are open now."""
        return len(self._clients)

    def _on_accept(self, _mask: int) -> None:
        """Selector callback on the listening socket: accept one connection, without blocking. Beyond
        MAX_CONTROL_CLIENTS open at once it is closed unanswered; when accept fails (e.g. out of descriptors) the
        client stays in the backlog, bounded by its own timeout."""
        try:
            sock, _ = self._sock.accept()
        except OSError:  # nothing there (BlockingIOError) or out of descriptors: its own timeout bounds it
            return
        if len(self._clients) >= MAX_CONTROL_CLIENTS:
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, self.timers.after(CLIENT_TIMEOUT, lambda: self._close_conn(sock)))
        self._clients[sock] = conn
        self.sel.register(sock, selectors.EVENT_READ, lambda _m: self._on_conn(conn))

    def _close_conn(self, sock: socket.socket) -> None:
        """Forget and close a connection; idempotent (the reply path and the deadline may both call it)."""
        conn = self._clients.pop(sock, None)
        if conn is not None:
            conn.deadline.cancel()
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError, RuntimeError):  # RuntimeError: the selector is closed already
            pass
        sock.close()

    def _on_conn(self, conn: _Conn) -> None:
        """Selector callback on a connection: read, and once the request is complete (`request_line`) answer it with
        one JSON line (an empty one gets no answer) and close: one request per connection. Sending the reply blocks
        for at most CLIENT_TIMEOUT. A deferred action runs after the reply, so the client hears `ok` before the agent
        acts (stops)."""
        try:
            data = conn.sock.recv(RECV_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        conn.buf += data
        line = request_line(conn.buf, not data)
        if line is None:
            return
        conn.deadline.cancel()
        reply, after = answer(line, self.handle)
        if reply is not None:
            try:
                conn.sock.settimeout(CLIENT_TIMEOUT)
                conn.sock.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass
        self._close_conn(conn.sock)
        if after is not None:
            after()
