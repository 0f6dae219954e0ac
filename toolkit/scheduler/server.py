"""The scheduler's transport: two listeners on MS_SCHED_HOST, one thread, one selector.

- MS_SCHED_PORT: the control server (toolkit.protocol), through which workers register and heartbeat and agents
  report exits. What to do about each message is decided by `Membership`; this module only carries messages.
- MASTER_PORT: the job's store (`KVStore`), which process groups bootstrap from.

Every connection is hostile until it proves the job token (toolkit.protocol's challenge-response), and bounded
before and after: a first message of at most MAX_PREAUTH_LINE bytes within PREAUTH_TIMEOUT, a table of such
connections sized for the job that makes room for a newcomer by closing the oldest (toolkit.scheduler.admission: a
flood never locks a worker out), lines of at most MAX_LINE (MAX_STORE_LINE on the store), at most MAX_OUTBUF queued
for a peer that stopped reading, at most ACCEPT_BATCH accepts between reads. When the process runs out of file
descriptors, the listeners pause for ACCEPT_PAUSE instead of spinning, and say so at most once per LOG_EVERY.
"""

from __future__ import annotations

import errno
import logging
import resource
import secrets
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from toolkit import envvars as E
from toolkit import procs
from toolkit import protocol as P
from toolkit.printable import clean
from toolkit.scheduler import state as S
from toolkit.scheduler.actions import Close, DropKeys, Exit, Log, Note, Send
from toolkit.scheduler.admission import Admission, Limits
from toolkit.scheduler.config import Config, ConfigError
from toolkit.scheduler.journal import Journal
from toolkit.scheduler.kvstore import KVStore, bounds
from toolkit.scheduler.membership import Membership

log = logging.getLogger("toolkit.scheduler")

EXIT_FAILED = 1
LINGER = 2.0  # s to flush the last messages (finished, stop) before exiting
MAX_WAIT = 30.0  # s: longest select() when no deadline is nearer
COMMIT_PERSIST_INTERVAL = 1.0  # s: commits come from every rank at every checkpoint; written at most this often
PERSIST_RETRY = 1.0  # s after a failed write of the state before the next try (a full disk is not retried per pass)
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
    lines: P.LineBuffer = field(default_factory=lambda: P.LineBuffer(P.MAX_PREAUTH_LINE))
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


class Server:
    """Serves one job until its Membership says exit (or a signal comes); `serve()` returns the exit code.

    One thread, one selector, non-blocking sockets: the two listeners, every connection, and a socketpair that a
    signal writes to. The server owns the clock, the sockets and the files; `Membership` and `KVStore` are pure and
    only return what to do, which the server turns into queued bytes, closed connections, log lines and the exit
    code. `clock` (monotonic seconds) is injectable for tests. `boot` is random per start and names this start in
    every store prefix, so keys of a previous scheduler start are never mistaken for this one's."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = config
        self.clock = clock
        self.boot = secrets.token_hex(8)
        self.members = Membership(config.job, config.world_size, config.node_timeout, config.topo_timeout,
                                  self.boot, f"{config.host}:{config.port}", config.expected, clock(),
                                  config.host_timeout, config.spares)
        self.kv = KVStore(*bounds(config.world_size), generation_prefix=P.generation_prefix(config.job, self.boot))
        self.journal = Journal(config.recovery_path, config.job, config.world_size, 1.0 / config.straggler_factor,
                               clock)
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, Conn] = {}
        self.ids = iter(range(1, 1 << 62))
        self.listeners: dict[str, socket.socket] = {}
        self.paused_until = 0.0
        self.hosts = len(set(config.expected.values()) | set(config.spares)) or 1
        self.admission = Admission(Limits.for_job(config.world_size, self.hosts, _nofile()), PREAUTH_TIMEOUT)
        self.pending: set[Conn] = set()
        self.exit_code: int | None = None
        self.signalled = ""
        self.commits_persist_at = 0.0
        self.persist_retry_at = 0.0  # after a failed write: no new try before this
        path = self._state_path()
        self.state = S.StateWriter(path) if path is not None else None
        self.said = RateLimited(clock)
        self._wake_r, self._wake_w = socket.socketpair()

    # -- life cycle

    def serve(self) -> int:
        """Run the job: restore the persisted state (recovery on), bind both listeners on cfg.host, serve until an
        `Exit` action or SIGTERM/SIGINT, give the last messages up to LINGER s to leave, then persist the state and
        close everything.

        Returns the exit code: the Membership's (0 finished, 1 failed, 3 formation timeout), 128+signal, or
        EXIT_FAILED if none was set. Raises StateError (an unusable state file) or ConfigError (a busy port, an
        address not this host's) before anything is served; `toolkit.scheduler.main` turns both into exit code 2.
        Heartbeat and formation deadlines count from when the listeners are up (Membership.started)."""
        self._raise_nofile()
        self._apply(self.journal.restore())  # first: the membership's restore notes go into the ledger read back
        path = self._state_path()
        if path is not None:
            doc = S.load(path, self.cfg.job, self.cfg.world_size)
            if doc is not None:
                self._apply(self.members.restore(doc, self.clock()))
        self.listeners[CONTROL] = self._bind(self.cfg.port, f"{E.MS_SCHED_HOST}:{E.MS_SCHED_PORT}", "")
        self.listeners[STORE] = self._bind(self.cfg.store_port, E.MASTER_PORT, "the store ")
        for kind, sock in self.listeners.items():
            sock.listen(4096)
            sock.setblocking(False)
            self.sel.register(sock, selectors.EVENT_READ, kind)
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._install_signals()
        self.members.started(self.clock())  # deadlines count from when peers can reach us
        log.info("job %s: control server on %s:%d, store on %s:%d; waiting for %d workers (MS_TOPO_TIMEOUT %g s, "
                 "MS_NODE_TIMEOUT %g s, recovery %s)", self.cfg.job, self.cfg.host, self.cfg.port, self.cfg.host,
                 self.cfg.store_port, self.cfg.world_size, self.cfg.topo_timeout, self.cfg.node_timeout,
                 "on" if self.cfg.recovery else "off")
        try:
            self._loop()
            self._linger()
        finally:
            if self.signalled:
                self.journal.stopped(f"the scheduler was stopped by {self.signalled}")
            self._persist(force=True)
            self.journal.close()
            self._shutdown()
        return self.exit_code if self.exit_code is not None else EXIT_FAILED

    def _raise_nofile(self) -> None:
        """Raise the soft descriptor limit to the hard one (every member holds two connections, and the table of
        connections waiting to authenticate is sized from what is left: admission.Limits), and say in one line if
        even that is too low for the job's size."""
        _, nofile = procs.raise_open_files()
        self.admission.limits = Limits.for_job(self.cfg.world_size, self.hosts, nofile)
        needed = Limits.fds_needed(self.cfg.world_size, self.hosts)
        if nofile < needed:
            log.warning("the descriptor limit (RLIMIT_NOFILE %d) is below the %d a job of %d workers needs: raise "
                        "the hard limit (ulimit -Hn, limits.conf) on %s", nofile, needed, self.cfg.world_size,
                        self.cfg.host)

    def _bind(self, port: int, what: str, store: str) -> socket.socket:
        """A TCP socket bound (not yet listening) to cfg.host:`port`, IPv6 if the host is an IPv6 literal.

        SO_REUSEADDR lets a restarted scheduler bind while its old connections linger in TIME_WAIT; a port another
        process listens on is still refused. A failure is a ConfigError naming the address and its variable
        (`what`); `store` ("the store " or "") says which listener it was."""
        family = socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.cfg.host, port))
        except OSError as e:
            sock.close()
            why = "address already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise ConfigError(f"cannot serve {store}on {self.cfg.host}:{port} ({what}): {why}; is another job using "
                              "the port, or is the address not this host's?") from None
        return sock

    def _install_signals(self) -> None:
        """SIGTERM and SIGINT end the loop with exit code 128+signal (the first signal's). Workers are told
        nothing: their connections close, and they keep training and reconnect to a restarted scheduler."""

        def on_signal(signum: int, _frame: Any) -> None:
            """Record the first signal and wake select() through the socketpair (the self-pipe trick); the loop
            does the rest outside the handler."""
            if self.exit_code is None:
                self.exit_code = 128 + signum
                self.signalled = signal.Signals(signum).name
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _loop(self) -> None:
        """The event loop, until `exit_code` is set (an Exit action or a signal).

        Each pass: select() until the nearest deadline (`_timeout`: nothing polls), handle the ready sockets, expire
        unauthenticated connections and timed-out store waits, let the membership act on the time
        (Membership.tick), resume paused listeners, persist, and flush what was queued. Persisting comes before the
        flush, so a membership change is on disk before that flush writes the messages it caused (a socket already
        waiting to write may take its bytes earlier, during event handling); a state that cannot be written is
        logged and retried at the next pass, and the messages go anyway."""
        while self.exit_code is None:
            for key, mask in self.sel.select(self._timeout(self.clock())):
                self._event(key, mask)
            now = self.clock()
            self._expire(now)
            self.said.flush(now)
            self._apply(self.members.tick(now))
            self._apply(self.journal.tick())
            self._resume_listeners(now)
            self._persist()
            self._flush()
        if self.signalled:
            log.info("stopped by %s; state persisted; workers keep training and reconnect to a restarted "
                     "scheduler", self.signalled)

    def _event(self, key: selectors.SelectorKey, mask: int) -> None:
        """One ready selector key: a listener (accept what waits), the wake-up socket (drain it), or a connection
        (read, then write; a connection closed by the read is not written)."""
        if key.data in (CONTROL, STORE):
            self._accept(key.data)
        elif key.data == "wake":
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        else:
            conn: Conn = key.data
            if mask & selectors.EVENT_READ and not conn.closed:
                self._read(conn)
            if mask & selectors.EVENT_WRITE and not conn.closed:
                self._write(conn)

    def _timeout(self, now: float) -> float:
        """Seconds select() may sleep: until the nearest membership or store deadline, pre-authentication deadline,
        due commit persist or end of a listener pause, and never more than MAX_WAIT; 0 if one has passed."""
        deadlines = [now + MAX_WAIT, self.members.next_deadline(), self.kv.next_deadline(),
                     self.journal.next_deadline()]
        waiting = self.admission.next_deadline()
        if waiting is not None:
            deadlines.append(waiting)
        if self.members.commits_dirty:
            deadlines.append(self.commits_persist_at)
        if self.members.dirty and self.persist_retry_at:
            deadlines.append(self.persist_retry_at)
        if self.paused_until:
            deadlines.append(self.paused_until)
        summary = self.said.next_deadline()
        if summary is not None:
            deadlines.append(summary)
        return max(0.0, min(deadlines) - now)

    def _linger(self) -> None:
        """Give `finished`/`stop` a bounded moment to reach the agents before the sockets close.

        At most LINGER s, and only while some connection still has output: only connections are served (writes,
        or a read that notices an EOF); the listeners accept nothing more."""
        deadline = self.clock() + LINGER
        self._persist()
        self._flush()
        while any(c.out and not c.closed for c in self.pending) and self.clock() < deadline:
            for key, mask in self.sel.select(max(0.0, deadline - self.clock())):
                if isinstance(key.data, Conn):
                    if mask & selectors.EVENT_WRITE:
                        self._write(key.data)
                    elif mask & selectors.EVENT_READ:
                        self._read(key.data)

    def _shutdown(self) -> None:
        """Close every connection, the listeners, the selector and the wake-up pair. Connections are closed, not
        dropped: the scheduler's end is not its members' death (nothing is reported to the membership)."""
        for conn in list(self.conns.values()):
            self._close(conn)
        for sock in self.listeners.values():
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self.sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- connections

    def _accept(self, kind: str) -> None:
        """Accept what waits on listener `kind` (CONTROL or STORE), at most ACCEPT_BATCH at a time (the listener
        stays readable for the next pass, and the hellos already received are read in between).

        Admission is bounded before a byte is read, and never by refusing the newcomer: when the table of connections
        waiting to authenticate is full (for its address, or in all) the oldest one waiting is closed to make room
        (admission.Admission; a rate-limited warning says so). An admitted connection is non-blocking with
        TCP_NODELAY, and must prove the token within PREAUTH_TIMEOUT (`_expire`). Out of descriptors or memory
        (RESOURCE_ERRORS) the listeners pause (`_pause_listeners`) instead of spinning on a listener that stays
        readable; any other accept error waits for the next readiness."""
        listener = self.listeners[kind]
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in RESOURCE_ERRORS:
                    self._pause_listeners(e)
                return
            ip = str(addr[0])
            now = self.clock()
            conn = Conn(next(self.ids), sock, f"{addr[0]}:{addr[1]}", ip, kind, P.new_nonce(), now + PREAUTH_TIMEOUT)
            victim = self.conns.get(self.admission.admit(conn.id, ip, now) or 0)
            if victim is not None:
                lim = self.admission.limits
                self.said.warn("evicted", f"closed {victim.addr}, which had not authenticated after "
                                          f"{now - victim.deadline + PREAUTH_TIMEOUT:.1f} s, to make room for "
                                          f"{conn.addr}: {len(self.admission)} connections are waiting to "
                                          f"authenticate (at most {lim.total}, {lim.per_address} from one address)")
                self._close(victim)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns[conn.id] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)
            self._send(conn, P.CHALLENGE, nonce=conn.nonce)

    def _pause_listeners(self, e: OSError) -> None:
        """Out of descriptors (or memory): the connection waits in the kernel's backlog while the listeners rest;
        connections that never authenticate expire meanwhile and free theirs.

        Unregisters both listeners (once; a pause during a pause only extends it) until ACCEPT_PAUSE s from now,
        when `_resume_listeners` registers them again; warned at most once per LOG_EVERY."""
        self.said.warn("resources", f"cannot accept connections: {e.strerror}; pausing the listeners for "
                                    f"{ACCEPT_PAUSE:g} s")
        if not self.paused_until:
            for sock in self.listeners.values():
                self.sel.unregister(sock)
        self.paused_until = self.clock() + ACCEPT_PAUSE

    def _resume_listeners(self, now: float) -> None:
        """Register the listeners again once a pause (`_pause_listeners`) is over."""
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            for kind, sock in self.listeners.items():
                self.sel.register(sock, selectors.EVENT_READ, kind)

    def _expire(self, now: float) -> None:
        """Drop the connections that did not authenticate by their deadline (they hold a descriptor and a
        pre-authentication slot), and answer the store waits whose timeout passed with error "timeout"."""
        for conn in [self.conns[i] for i in self.admission.expired(now) if i in self.conns]:
            self.said.warn("preauth", f"dropped {conn.addr}: it did not authenticate within {PREAUTH_TIMEOUT:g} s")
            self._drop(conn, "did not authenticate")
        for reply in self.kv.expire(now):
            conn = self.conns.get(reply.peer)
            if conn is not None:
                self._queue(conn, reply.message())

    def _read(self, conn: Conn) -> None:
        """Read what `conn` has (at most RECV_SIZE bytes) and dispatch each complete line.

        EOF or a socket error drops the connection (for a member: its death). A line over the connection's limit, or
        anything that is not a message (protocol.decode), is a protocol error that drops this one connection, warned
        at most once per LOG_EVERY per address. Input on a closing connection is discarded, and messages after the
        one that closed it are not dispatched."""
        try:
            data = conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"connection error ({e.strerror})")
            return
        if not data:
            self._drop(conn, "connection closed")
            return
        if conn.closing:
            return
        try:
            messages = conn.lines.feed(data)
        except P.ProtocolError as e:
            self.said.warn("protocol", f"dropped {conn.addr}: {e}")
            self._drop(conn, f"protocol error ({e})")
            return
        for msg in messages:
            if conn.closed or conn.closing:
                return
            self._dispatch(conn, msg)

    def _dispatch(self, conn: Conn, msg: dict[str, Any]) -> None:
        """Route one message: an unauthenticated connection's first message is its hello (`_hello`); on the store
        only `kv` requests are accepted (anything else drops the connection), and their replies may go to other
        connections (waiters a write woke); on the control port every message goes to Membership.message."""
        now = self.clock()
        if not conn.authed:
            self._hello(conn, msg, now)
        elif conn.kind == STORE:
            if msg["op"] != P.KV:
                self._drop(conn, f"unexpected {msg['op'][:40]!r} on the store")
                return
            for reply in self.kv.request(conn.id, msg, now):
                target = self.conns.get(reply.peer)
                if target is not None:
                    self._queue(target, reply.message())
        else:
            self._apply(self.members.message(conn.id, msg, now))

    def _hello(self, conn: Conn, msg: dict[str, Any], now: float) -> None:
        """Authenticate a connection's first message and act on it.

        It must be its port's hello (`store_hello` on the store; `register`, `agent_hello` or the operator's
        `replace` on the control port)
        with a client proof over this connection's nonce (protocol.check_client, constant-time). A plain `token`
        field is refused with a line saying the peer's toolkit is older. Any refusal is a `reject {retry: false}`
        carrying no proof, and the connection closes once it is written; it is logged rate-limited (one line per
        kind of refusal per LOG_EVERY, then a summary), the claimed name cleaned. Accepted: the connection is
        authed, its line limit rises to P.MAX_LINE (P.MAX_STORE_LINE on the store), and its first reply carries the
        server's proof: the store's `welcome` here; for a worker or an agent, whatever the membership sends it first
        (`welcome`, or a `reject`/`fenced` the client can then trust)."""
        op = msg["op"]
        expected = (P.STORE_HELLO,) if conn.kind == STORE else (P.REGISTER, P.AGENT_HELLO, P.REPLACE)
        subject = P.hello_subject(msg)[:80] or "?"  # what the peer claims: cleaned where it is logged
        if op not in expected:
            self.said.warn("rejected:unexpected", f"rejected {conn.addr}: {op[:40]!r} before authenticating")
            self._send(conn, P.REJECT, reason=f"expected {' or '.join(expected)} first", retry=False)
            conn.closing = True
            return
        if "token" in msg:
            reason = ("the job token in the clear is refused: this peer's toolkit is older than the scheduler's; "
                      "install the same toolkit on every host")
        elif not P.check_client(self.cfg.token, conn.nonce, msg):
            reason = "wrong or missing job token"
        else:
            reason = ""
        if reason:
            what = {P.REGISTER: f"registration of {subject}", P.AGENT_HELLO: "agent hello",
                    P.STORE_HELLO: f"store connection of {subject}", P.REPLACE: "replace request"}[op]
            host = f" (host {subject})" if op == P.AGENT_HELLO else ""
            self.said.warn(f"rejected:{op}:{reason[:20]}", f"rejected {what} from {conn.addr}{host}: {reason}")
            self._send(conn, P.REJECT, reason=reason, retry=False)
            conn.closing = True
            return
        conn.authed, conn.prove, conn.client_nonce = True, True, str(msg["nonce"])
        self.admission.done(conn.id)
        conn.lines.limit = P.MAX_STORE_LINE if conn.kind == STORE else P.MAX_LINE
        if op == P.STORE_HELLO:
            self._send(conn, P.WELCOME)
        elif op == P.REGISTER:
            self._apply(self.members.register(conn.id, conn.addr, msg, now))
        elif op == P.REPLACE:  # the operator's (fleet replace): answered, then closed
            self._apply(self.members.replace(conn.id, msg, now))
        else:
            self._apply(self.members.agent_hello(conn.id, conn.addr, msg, now))

    # -- applying the membership's actions

    def _apply(self, actions: list[Any]) -> None:
        """Carry out the membership's actions in order: Send queues a message (then closes after it, with `close`),
        Close closes now, Log logs, Exit sets the exit code (the first one wins), DropKeys deletes a left
        generation's store keys. A Send or Close for a connection that is already gone is skipped."""
        for action in actions:
            if isinstance(action, Send):
                conn = self.conns.get(action.peer)
                if conn is not None:
                    extra = self.journal.history() if action.op == P.FORMED else {}  # for the checkpoint interval
                    self._send(conn, action.op, **action.fields, **extra)
                    if action.close:
                        conn.closing = True
            elif isinstance(action, Close):
                conn = self.conns.get(action.peer)
                if conn is not None:
                    self._close(conn)
            elif isinstance(action, Log):  # peers' strings in it (node ids, hosts, log tails) shown, never obeyed
                log.log(action.level, "%s", clean(action.text, MAX_LOG_TEXT))
            elif isinstance(action, Exit):
                if self.exit_code is None:
                    self.exit_code = action.code
            elif isinstance(action, DropKeys):
                self.kv.drop_prefix(action.prefix)
            elif isinstance(action, Note):
                self._apply(self.journal.note(action))

    def _send(self, conn: Conn, op: str, **fields: Any) -> None:
        """Queue message `op` for `conn`. The first one after an accepted hello carries the server's proof
        (HMAC over both nonces), which the client checks before it believes anything the scheduler says."""
        if conn.prove and conn.client_nonce is not None:  # the first answer to a hello proves we hold the token
            fields = {**fields, "proof": P.server_proof(self.cfg.token, conn.nonce, conn.client_nonce)}
            conn.prove = False
        self._queue(conn, P.encode(op, **fields))

    def _queue(self, conn: Conn, data: bytes) -> None:
        """Append encoded bytes to `conn`'s output for the next flush; nothing is queued to a closed connection."""
        if conn.closed:
            return
        conn.out += data
        self.pending.add(conn)

    def _flush(self) -> None:
        """Write what is queued, once per loop pass. A peer with more than MAX_OUTBUF bytes unsent has stopped
        reading and is dropped (for a member, its death) instead of being buffered without bound; what a full
        socket did not take stays pending, with EVENT_WRITE on."""
        pending, self.pending = self.pending, set()
        for conn in pending:
            if conn.closed:
                continue
            if len(conn.out) > MAX_OUTBUF:
                self._drop(conn, "stopped reading its messages")
                continue
            self._write(conn)
            if conn.out and not conn.closed:
                self.pending.add(conn)

    def _write(self, conn: Conn) -> None:
        """One non-blocking send of `conn.out`. Once it is empty a closing connection is closed and others go back
        to read-only interest; while bytes remain, EVENT_WRITE stays on. A send error drops the connection."""
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn, "connection closed while sending")
            return
        del conn.out[:sent]
        if not conn.out:
            if conn.closing:
                self._close(conn)
                return
            self.sel.modify(conn.sock, selectors.EVENT_READ, conn)
        else:
            self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _close(self, conn: Conn) -> None:
        """Close `conn` and forget it (connection table, selector, its pending store wait); idempotent. Tells the
        membership nothing: `_drop` is for an end that means something."""
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
        self.kv.forget(conn.id)

    def _drop(self, conn: Conn, reason: str) -> None:
        """A connection ended (or is ended): for a member, its death (Membership.lost).

        Closes it, then reports an authenticated control connection to the membership (for a worker that had not
        said `done`: its death; for an agent: forgotten). The end of a store or an unauthenticated connection
        means nothing to the membership."""
        self._close(conn)
        if conn.authed and conn.kind == CONTROL:
            self._apply(self.members.lost(conn.id, reason, self.clock()))

    # -- persistence

    def _state_path(self) -> Path | None:
        """Where the state is persisted (MS_RECOVERY_PATH/scheduler.json), or None when recovery is off."""
        if not self.cfg.recovery or self.cfg.recovery_path is None:
            return None
        return self.cfg.recovery_path / S.STATE_FILE

    def _persist(self, force: bool = False) -> None:
        """Write the state durably (state.StateWriter: the records that changed, or both files whole) if the
        membership changed (`dirty`), if `force`d (at exit), or if commit progress changed and
        COMMIT_PERSIST_INTERVAL has passed since the last write (commits come from every rank at every checkpoint).
        A failed write is logged as a warning and leaves the flags and the roster's marks set, so that a try comes
        again PERSIST_RETRY s later (a full disk or a lost mount is not retried on every pass, and said at most once
        per LOG_EVERY); the server goes on either way. Nothing is written with recovery off."""
        now = self.clock()
        commits_due = self.members.commits_dirty and now >= self.commits_persist_at
        if self.state is None or not (self.members.dirty or force or commits_due):
            return
        if now < self.persist_retry_at and not force:
            return
        try:
            self.state.save(S.changes(self.members), self.members.snapshot)
        except OSError as e:
            self.said.warn("persist", f"cannot persist the state to {self.state.path}: {e.strerror} (recovery after "
                                      f"a scheduler crash would lose it); trying again every {PERSIST_RETRY:g} s")
            self.persist_retry_at = now + PERSIST_RETRY
            return
        self.persist_retry_at = 0.0
        self.members.dirty = self.members.commits_dirty = False
        self.members.roster.unsaved.clear()
        self.commits_persist_at = now + COMMIT_PERSIST_INTERVAL


def _nofile() -> int:
    """The soft limit of descriptors this process may open."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
