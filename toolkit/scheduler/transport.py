"""The scheduler's connection table: what its server (toolkit.scheduler.server) does with sockets, apart from what the
messages mean.

`Connections` accepts on the two listeners, reads lines, queues and writes replies, and closes; it bounds every
connection before and after it authenticates: a first message of at most MAX_PREAUTH_LINE bytes within
PREAUTH_TIMEOUT, a table of such connections sized for the job that makes room for a newcomer by closing another
(toolkit.scheduler.admission: a rate per source, connections beyond it closed first, a hello waiting unread passed
over), lines of at most MAX_LINE (MAX_STORE_LINE on the store), at most MAX_OUTBUF queued for a peer that stopped
reading, at most ACCEPT_BATCH accepts between reads. When
the process runs out of file descriptors, the listeners pause for ACCEPT_PAUSE instead of spinning. Every pass costs
what is ready, pending or due, never a walk over all connections (issue 24). `RateLimited` says each kind of
warning at most once per LOG_EVERY.

What a message means, and what ends a member, is the server's: `Connections` hands each complete line to its
`on_message` and each connection that ends to `on_drop`, and tells `on_closed` the id of every connection it closes.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

from toolkit.contracts import protocol
from toolkit.contracts.messages import Challenge, Message
from toolkit.printable import clean
from toolkit.scheduler.admission import Admission

log = logging.getLogger("toolkit.scheduler")

MAX_OUTBUF = 1 << 20  # bytes queued to one peer that has stopped reading before it is dropped
RECV_SIZE = 1 << 16
PREAUTH_TIMEOUT = 10.0  # s for a new connection to prove the token
ACCEPT_BATCH = 64  # connections accepted per readiness of a listener: the hellos already there are read in between
ACCEPT_PAUSE = 0.5  # s the listeners rest after accept() failed for want of descriptors or memory
LOG_EVERY = 10.0  # s: a repeated warning (refused connections, no descriptors) is logged at most this often
MAX_LOG_TEXT = 4096  # characters of one log line's text (a failed job's reason carries a log tail of 2000)
RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
CONTROL, STORE = "control", "store"


@dataclass(eq=False)
class Conn:
    """One connection. `authed` once its first message proved the token; `prove` until the first reply carried
    the server's own proof.

    `kind` says which listener accepted it (CONTROL or STORE). Until `authed`, the connection must send a hello that
    proves the token before `deadline` (PREAUTH_TIMEOUT after accept) in a line of at most P.MAX_PREAUTH_LINE bytes;
    after, `lines` allows P.MAX_LINE (P.MAX_STORE_LINE on the store). `out` is what is queued for the peer (dropped
    past MAX_OUTBUF). `closing`: a last message (a reject, `fenced`) is being flushed and input is ignored;
    `closed`: the socket is gone and nothing more is queued."""

    id: int
    sock: socket.socket
    addr: str
    ip: str
    kind: str  # CONTROL or STORE
    nonce: str
    deadline: float  # pre-authentication deadline
    lines: protocol.LineBuffer = field(default_factory=lambda: protocol.LineBuffer(protocol.MAX_PREAUTH_LINE))
    out: bytearray = field(default_factory=bytearray)
    client_nonce: str | None = None
    authed: bool = False
    prove: bool = False
    closing: bool = False  # close once `out` is flushed; further input is ignored
    closed: bool = False


class RateLimited:
    """Warnings said at most once per LOG_EVERY per key, the rest summed up: what keeps hostile or broken peers
    (floods of rejected or refused connections, bad lines, a lack of descriptors) from flooding the log.

    The first warning of a key is logged at once; later ones within LOG_EVERY are only counted, and once the window
    is over (`flush`, called by the server's loop at `next_deadline`) one line says how many there were and the
    latest of them. So a flood that lasts costs one line per key per LOG_EVERY; callers use a fixed set of keys
    (never one per address, which a peer could multiply). Texts go through printable.clean at the sink."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.next: dict[str, float] = {}  # when the key may be logged again
        self.held: dict[str, tuple[int, str]] = {}  # key -> (occurrences not logged yet, the latest text)

    def warn(self, key: str, text: str) -> None:
        """Count one occurrence of `key`; log `text` unless `key` was logged less than LOG_EVERY ago (then it is
        held for the summary)."""
        now = self.clock()
        if now >= self.next.get(key, 0.0) and key not in self.held:
            log.warning("%s", clean(text, MAX_LOG_TEXT))
            self.next[key] = now + LOG_EVERY
            return
        count, _ = self.held.get(key, (0, ""))
        self.held[key] = (count + 1, text)

    def flush(self, now: float) -> None:
        """Log the summary of every key whose window is over: how many were held back, and the latest."""
        for key in [k for k in self.held if now >= self.next.get(k, 0.0)]:
            count, latest = self.held.pop(key)
            log.warning("%s", clean(f"{count} more like this in the last {LOG_EVERY:g} s; the latest: {latest}",
                                    MAX_LOG_TEXT))
            self.next[key] = now + LOG_EVERY

    def next_deadline(self) -> float | None:
        """When the next summary is due (None: nothing is held)."""
        return min((self.next.get(k, 0.0) for k in self.held), default=None)


class Connections:
    """The listeners and every connection of one server, on the server's selector (whose keys carry a listener's
    kind or a `Conn`), with `token` for the server's proof.

    Callbacks: `on_message(conn, msg)` for each complete line read (an unauthenticated connection's first one is
    its hello: `authenticate` it or close it); `on_drop(conn, reason)` after a connection that ended (EOF, an
    error, a protocol violation, a peer that stopped reading, no hello in time) was closed; `on_closed(conn_id)`
    for every connection closed, whatever the reason (its pending store wait goes)."""

    def __init__(self, sel: selectors.BaseSelector, admission: Admission, said: RateLimited,
                 clock: Callable[[], float], token: str, on_message: Callable[[Conn, dict[str, Any]], None],
                 on_drop: Callable[[Conn, str], None], on_closed: Callable[[int], None]) -> None:
        self.sel = sel
        self.admission = admission
        self.said = said
        self.clock = clock
        self.token = token
        self.on_message, self.on_drop, self.on_closed = on_message, on_drop, on_closed
        self.conns: dict[int, Conn] = {}
        self.ids = iter(range(1, 1 << 62))
        self.listeners: dict[str, socket.socket] = {}
        self.paused_until = 0.0
        self.pending: set[Conn] = set()

    def listen(self, kind: str, sock: socket.socket) -> None:
        """Serve bound socket `sock` as listener `kind` (CONTROL or STORE)."""
        sock.listen(4096)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ, kind)
        self.listeners[kind] = sock

    def get(self, conn_id: int) -> Conn | None:
        """The open connection `conn_id` (None once it is closed)."""
        return self.conns.get(conn_id)

    def accept(self, kind: str) -> None:
        """Accept what waits on listener `kind` (CONTROL or STORE), at most ACCEPT_BATCH at a time (the listener
        stays readable for the next pass, and the hellos already received are read in between).

        A connection whose whole hello is already there (our clients send it first, toolkit.contracts.protocol) is
        read and judged at once: authenticated, or refused and closed, it never enters the table of connections
        waiting to authenticate, so no flood of connections that prove nothing can compete with it (from any
        source, the worker's own included). Any other is admitted (`_admit`): when that table is full (for its
        source, or in all) another waiting one is closed to make room (admission.Admission; a rate-limited warning
        says so), or, beyond its source's rate, it is refused itself. It is non-blocking with TCP_NODELAY, and must
        prove the token within PREAUTH_TIMEOUT (`expire`). Out of descriptors or memory
        (RESOURCE_ERRORS) the listeners pause (`pause`) instead of spinning on a listener that stays readable; any
        other accept error waits for the next readiness."""
        listener = self.listeners[kind]
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in RESOURCE_ERRORS:
                    self.pause(e)
                return
            ip = str(addr[0])
            now = self.clock()
            conn = Conn(next(self.ids), sock, f"{addr[0]}:{addr[1]}", ip, kind, protocol.new_nonce(),
                        now + PREAUTH_TIMEOUT)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns[conn.id] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)
            self.send(conn, Challenge(conn.nonce))
            if self._hello_waiting(conn.id):  # hello first: read and judged now, before any admission
                self.read(conn)
                if conn.authed or conn.closed or conn.closing:
                    continue
            self._admit(conn, now)

    def _admit(self, conn: Conn, now: float) -> None:
        """Enter `conn`, which has not proved the token yet, in the table of connections waiting to authenticate
        (admission.Admission): close the one it names to make room, or `conn` itself when it is refused."""
        out = self.admission.admit(conn.id, conn.ip, now, self._hello_waiting)
        if out == conn.id:  # beyond its source's rate, and nothing of the kind to close: refused
            self.said.warn("refused", f"refused {conn.addr}: {len(self.admission)} connections are waiting to "
                                      f"authenticate and its source opened more than {self.admission.rate:g} a "
                                      "second")
            self.close(conn)
            return
        victim = self.conns.get(out or 0)
        if victim is not None:
            lim = self.admission.limits
            self.said.warn("evicted", f"closed {victim.addr}, which had not authenticated after "
                                      f"{now - victim.deadline + PREAUTH_TIMEOUT:.1f} s, to make room for "
                                      f"{conn.addr}: {len(self.admission)} connections are waiting to "
                                      f"authenticate (at most {lim.total}, {lim.per_address} from one address)")
            self.close(victim)

    def _hello_waiting(self, conn_id: int) -> bool:
        """Whether connection `conn_id` has a whole line (its hello) waiting unread: it answered while the loop was
        accepting, and is read this pass rather than evicted (a peek; nothing is consumed)."""
        conn = self.conns.get(conn_id)
        if conn is None or conn.closed:
            return False
        try:
            return b"\n" in conn.sock.recv(protocol.MAX_PREAUTH_LINE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return False

    def pause(self, e: OSError) -> None:
        """Out of descriptors (or memory): the connection waits in the kernel's backlog while the listeners rest;
        connections that never authenticate expire meanwhile and free theirs.

        Unregisters both listeners (once; a pause during a pause only extends it) until ACCEPT_PAUSE s from now,
        when `resume` registers them again; warned at most once per LOG_EVERY."""
        self.said.warn("resources", f"cannot accept connections: {e.strerror}; pausing the listeners for "
                                    f"{ACCEPT_PAUSE:g} s")
        if not self.paused_until:
            for sock in self.listeners.values():
                self.sel.unregister(sock)
        self.paused_until = self.clock() + ACCEPT_PAUSE

    def resume(self, now: float) -> None:
        """Register the listeners again once a pause (`pause`) is over."""
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            for kind, sock in self.listeners.items():
                self.sel.register(sock, selectors.EVENT_READ, kind)

    def next_deadline(self) -> float | None:
        """The nearest pre-authentication deadline or end of a listener pause (None: neither)."""
        deadlines = [d for d in (self.admission.next_deadline(), self.paused_until or None) if d is not None]
        return min(deadlines, default=None)

    def expire(self, now: float) -> None:
        """Drop the connections that did not authenticate by their deadline (they hold a descriptor and a
        pre-authentication slot)."""
        for conn in [self.conns[i] for i in self.admission.expired(now) if i in self.conns]:
            self.said.warn("preauth", f"dropped {conn.addr}: it did not authenticate within {PREAUTH_TIMEOUT:g} s")
            self.drop(conn, "did not authenticate")

    def read(self, conn: Conn) -> None:
        """Read what `conn` has (at most RECV_SIZE bytes) and hand each complete line to `on_message`.

        EOF or a socket error drops the connection (for a member: its death). A line over the connection's limit, or
        anything that is not a message (protocol.decode), is a protocol error that drops this one connection, warned
        at most once per LOG_EVERY per address. Input on a closing connection is discarded, and messages after the
        one that closed it are not handed on."""
        try:
            data = conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.drop(conn, f"connection error ({e.strerror})")
            return
        if not data:
            self.drop(conn, "connection closed")
            return
        if conn.closing:
            return
        try:
            messages = conn.lines.feed(data)
        except protocol.ProtocolError as e:
            self.said.warn("protocol", f"dropped {conn.addr}: {e}")
            self.drop(conn, f"protocol error ({e})")
            return
        for msg in messages:
            if conn.closed or conn.closing:
                return
            self.on_message(conn, msg)

    def authenticate(self, conn: Conn, client_nonce: str) -> None:
        """`conn`'s hello proved the token: it leaves the pre-authentication table, its line limit rises to
        P.MAX_LINE (P.MAX_STORE_LINE on the store), and its next message carries the server's proof."""
        conn.authed, conn.prove, conn.client_nonce = True, True, client_nonce
        self.admission.done(conn.id)
        conn.lines.limit = protocol.MAX_STORE_LINE if conn.kind == STORE else protocol.MAX_LINE

    def send(self, conn: Conn, message: Message) -> None:
        """Queue `message` for `conn`. The first one after an accepted hello carries the server's proof
        (HMAC over both nonces), which the client checks before it believes anything the scheduler says."""
        fields = message.encode()
        if conn.prove and conn.client_nonce is not None:  # the first answer to a hello proves we hold the token
            fields["proof"] = protocol.server_proof(self.token, conn.nonce, conn.client_nonce)
            conn.prove = False
        self.queue(conn, protocol.encode(message.OP, **fields))

    def queue(self, conn: Conn, data: bytes) -> None:
        """Append encoded bytes to `conn`'s output for the next flush; nothing is queued to a closed connection."""
        if conn.closed:
            return
        conn.out += data
        self.pending.add(conn)

    def flush(self) -> None:
        """Write what is queued, once per loop pass. A peer with more than MAX_OUTBUF bytes unsent has stopped
        reading and is dropped (for a member, its death) instead of being buffered without bound; what a full
        socket did not take stays pending, with EVENT_WRITE on."""
        pending, self.pending = self.pending, set()
        for conn in pending:
            if conn.closed:
                continue
            if len(conn.out) > MAX_OUTBUF:
                self.drop(conn, "stopped reading its messages")
                continue
            self.write(conn)
            if conn.out and not conn.closed:
                self.pending.add(conn)

    def unsent(self) -> bool:
        """Whether some open connection still has output queued (only the pending ones are looked at)."""
        return any(c.out and not c.closed for c in self.pending)

    def write(self, conn: Conn) -> None:
        """One non-blocking send of `conn.out`. Once it is empty a closing connection is closed and others go back
        to read-only interest; while bytes remain, EVENT_WRITE stays on. A send error drops the connection."""
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.drop(conn, "connection closed while sending")
            return
        del conn.out[:sent]
        if not conn.out:
            if conn.closing:
                self.close(conn)
                return
            self.sel.modify(conn.sock, selectors.EVENT_READ, conn)
        else:
            self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def close(self, conn: Conn) -> None:
        """Close `conn` and forget it (connection table, selector, then `on_closed`); idempotent. Says nothing to
        `on_drop`: `drop` is for an end that means something."""
        if conn.closed:
            return
        conn.closed = True
        self.conns.pop(conn.id, None)
        self.admission.done(conn.id)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        self.on_closed(conn.id)

    def drop(self, conn: Conn, reason: str) -> None:
        """A connection ended (or is ended): close it, then tell `on_drop` why."""
        self.close(conn)
        self.on_drop(conn, reason)

    def close_all(self) -> None:
        """Close every connection and both listeners (the selector stays the server's)."""
        for conn in list(self.conns.values()):
            self.close(conn)
        for sock in self.listeners.values():
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
