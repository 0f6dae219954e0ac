"""The scheduler's server: two listeners on MS_SCHED_HOST, one thread, one selector.

- MS_SCHED_PORT: the control server (toolkit.contracts.protocol), through which workers register and heartbeat and
  agents report exits. What to do about each message is decided by `Membership`; this module only carries messages.
- MASTER_PORT: the job's store (`KVStore`), which process groups bootstrap from.

Every connection is hostile until it proves the job token (toolkit.contracts.protocol's challenge-response, checked here
in `_hello`), and bounded before and after by the connection table (toolkit.scheduler.transport: the pre-authentication
deadline and table, line and output limits, accept batches, a pause of the listeners when the process runs out of
file descriptors). The server owns the loop, the signals, the deadlines, the actions and the persisted state.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import resource
import secrets
import selectors
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

from toolkit import procs
from toolkit.contracts import envvars, protocol
from toolkit.contracts import messages as wire
from toolkit.printable import clean
from toolkit.scheduler import exposition, state
from toolkit.scheduler.actions import Close, DropKeys, Exit, Log, Note, Send
from toolkit.scheduler.admission import Admission, Limits
from toolkit.scheduler.config import Config, ConfigError
from toolkit.scheduler.journal import Journal
from toolkit.scheduler.kvstore import KVStore, bounds
from toolkit.scheduler.membership import Membership
from toolkit.scheduler.metrics import Endpoint, Exchange
from toolkit.scheduler.replay import CLOCK_SKEW, Replays
from toolkit.scheduler.transport import CONTROL, MAX_LOG_TEXT, PREAUTH_TIMEOUT, STORE, Conn, Connections, RateLimited

log = logging.getLogger("toolkit.scheduler")

EXIT_FAILED = 1
LINGER = 2.0  # s to flush the last messages (finished, stop) before exiting
MAX_WAIT = 30.0  # s: longest select() when no deadline is nearer
COMMIT_PERSIST_INTERVAL = 1.0  # s: commits come from every rank at every checkpoint; written at most this often
PERSIST_RETRY = 1.0  # s after a failed write of the state before the next try (a full disk is not retried per pass)


class Server:
    """Serves one job until its Membership says exit (or a signal comes); `serve()` returns the exit code.

    One thread, one selector, non-blocking sockets: the two listeners, every connection, and a socketpair that a
    signal writes to. The server owns the clock, the files and (through its connection table,
    transport.Connections) the sockets; `Membership` and `KVStore` are pure and only return what to do, which the
    server turns into queued bytes, closed connections, log lines and the exit code. `clock` (monotonic seconds) is
    injectable for tests. `boot` is random per start and names this start in every store prefix, so keys of a
    previous scheduler start are never mistaken for this one's."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.cfg = config
        self.clock = clock
        self.wall = wall  # for the hello-first messages' `sent` (replay.Replays)
        self.replays = Replays()
        self.boot = secrets.token_hex(8)
        self.members = Membership(config.job, config.world_size, config.node_timeout, config.topo_timeout,
                                  self.boot, f"{config.host}:{config.port}", config.expected, clock(),
                                  config.host_timeout, config.spares, min_workers=config.min_workers,
                                  logical_world=config.logical_ranks or config.world_size)
        self.kv = KVStore(*bounds(config.world_size),
                          generation_prefix=protocol.generation_prefix(config.job, self.boot))
        self.journal = Journal(config.recovery_path, config.job, config.world_size, 1.0 / config.straggler_factor,
                               clock)
        self.sel = selectors.DefaultSelector()
        self.hosts = len(set(config.expected.values()) | set(config.spares)) or 1
        self.admission = Admission(Limits.for_job(config.world_size, self.hosts, _nofile()), PREAUTH_TIMEOUT)
        self.exit_code: int | None = None
        self.signalled = ""
        self.commits_persist_at = 0.0
        self.persist_retry_at = 0.0  # after a failed write: no new try before this
        path = self._state_path()
        self.state_writer = state.StateWriter(path) if path is not None else None
        self.said = RateLimited(clock)
        self.conns = Connections(self.sel, self.admission, self.said, clock, config.token, self._dispatch,
                                 self._drop, self.kv.forget)
        self._wake_r, self._wake_w = socket.socketpair()
        self.exchange = Exchange(self._wake)
        self.metrics = Endpoint(*config.metrics, self.exchange) if config.metrics is not None else None

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
            doc = state.load(path, self.cfg.job, self.cfg.world_size)
            if doc is not None:
                self._apply(self.members.restore(doc, self.clock()))
        control = self._bind(self.cfg.port, f"{envvars.MS_SCHED_HOST}:{envvars.MS_SCHED_PORT}", "")
        store = self._bind(self.cfg.store_port, envvars.MASTER_PORT, "the store ")
        if self.metrics is not None:
            try:
                self.metrics.start()
            except ConfigError:
                control.close()
                store.close()
                raise
        self.conns.listen(CONTROL, control)
        self.conns.listen(STORE, store)
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
            if self.metrics is not None:
                self.metrics.close()
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

        Each pass: select() until the nearest deadline (`_due`: nothing polls), handle the ready sockets; once that
        deadline has come, do what time brings (`_on_time`); then persist, and flush what was queued. Persisting
        comes before the flush, so a membership change is on disk before that flush writes the messages it caused (a
        socket already waiting to write may take its bytes earlier, during event handling); a state that cannot be
        written is logged and retried at the next pass, and the messages go anyway.

        What the ready sockets made due at once (an urgent ledger write, a lost-host scan after the roster changed)
        is in the next pass's deadline, which is then now: the next select() does not wait. At thousands of ranks
        most passes carry one or two messages; running the timed work on each of them was about an eighth of the
        scheduler's busy time in a profile of the steady state at 4096 ranks."""
        while self.exit_code is None:
            due = self._due()
            for key, mask in self.sel.select(max(0.0, due - self.clock())):
                self._event(key, mask)
            now = self.clock()
            if now >= due:
                self._on_time(now)
            if self.exchange.wanted:
                self.exchange.serve(self._snapshot)
            self._persist()
            self.conns.flush()
        if self.signalled:
            log.info("stopped by %s; state persisted; workers keep training and reconnect to a restarted "
                     "scheduler", self.signalled)

    def _event(self, key: selectors.SelectorKey, mask: int) -> None:
        """One ready selector key: a listener (accept what waits), the wake-up socket (drain it), or a connection
        (read, then write; a connection closed by the read is not written)."""
        if key.data in (CONTROL, STORE):
            self.conns.accept(key.data)
        elif key.data == "wake":
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        else:
            conn: Conn = key.data
            if mask & selectors.EVENT_READ and not conn.closed:
                self.conns.read(conn)
            if mask & selectors.EVENT_WRITE and not conn.closed:
                self.conns.write(conn)

    def _on_time(self, now: float) -> None:
        """What the passing of time brings: expire unauthenticated connections and timed-out store waits, log the
        held summaries, let the membership and the journal act on the time (Membership.tick: heartbeats that
        stopped, a formation too slow; Journal.tick: stragglers, the ledger and live.json), resume paused
        listeners. Each returns at once when nothing of its own is due."""
        self._expire(now)
        self.said.flush(now)
        self._apply(self.members.tick(now))
        self._apply(self.journal.tick())
        self.conns.resume(now)

    def _due(self) -> float:
        """When the loop has timed work next (monotonic): the nearest membership, journal or store deadline,
        pre-authentication deadline, log summary, due commit persist or end of a listener pause, and never more
        than MAX_WAIT from now; now or earlier if one has passed."""
        now = self.clock()
        deadlines = [now + MAX_WAIT, self.members.next_deadline(), self.kv.next_deadline(),
                     self.journal.next_deadline()]
        connections = self.conns.next_deadline()
        if connections is not None:
            deadlines.append(connections)
        if self.members.commits_dirty:
            deadlines.append(self.commits_persist_at)
        if self.members.dirty and self.persist_retry_at:
            deadlines.append(self.persist_retry_at)
        summary = self.said.next_deadline()
        if summary is not None:
            deadlines.append(summary)
        return min(deadlines)

    def _wake(self) -> None:
        """Wake select() from another thread (the metrics listener's: a scrape waits for a snapshot)."""
        try:
            self._wake_w.send(b"m")
        except OSError:
            pass  # full (a wake-up is already pending) or closed (the server ends)

    def _snapshot(self) -> exposition.Snapshot:
        """The figures the metrics endpoint serves, copied on this thread (exposition.take)."""
        return exposition.take(self.journal, self.members.roster, self.members.generation, self.cfg.max_restarts,
                               self.clock(), self.journal.wall())

    def _linger(self) -> None:
        """Give `finished`/`stop` a bounded moment to reach the agents before the sockets close.

        At most LINGER s, and only while some connection still has output: only connections are served (writes,
        or a read that notices an EOF); the listeners accept nothing more."""
        deadline = self.clock() + LINGER
        self._persist()
        self.conns.flush()
        while self.conns.unsent() and self.clock() < deadline:
            for key, mask in self.sel.select(max(0.0, deadline - self.clock())):
                if isinstance(key.data, Conn):
                    if mask & selectors.EVENT_WRITE:
                        self.conns.write(key.data)
                    elif mask & selectors.EVENT_READ:
                        self.conns.read(key.data)

    def _shutdown(self) -> None:
        """Close every connection, the listeners, the selector and the wake-up pair. Connections are closed, not
        dropped: the scheduler's end is not its members' death (nothing is reported to the membership)."""
        self.conns.close_all()
        self.sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _expire(self, now: float) -> None:
        """Drop the connections that did not authenticate by their deadline (Connections.expire), and answer the
        store waits whose timeout passed with error "timeout"."""
        self.conns.expire(now)
        for reply in self.kv.expire(now):
            conn = self.conns.get(reply.peer)
            if conn is not None:
                self.conns.queue(conn, reply.message())

    # -- messages

    def _dispatch(self, conn: Conn, msg: dict[str, Any]) -> None:
        """Route one message: an unauthenticated connection's first message is its hello (`_hello`); on the store
        only `kv` requests are accepted (anything else drops the connection), and their replies may go to other
        connections (waiters a write woke); on the control port every message goes to Membership.message."""
        now = self.clock()
        if not conn.authed:
            self._hello(conn, msg, now)
        elif conn.kind == STORE:
            if msg["op"] != protocol.KV:
                self.conns.drop(conn, f"unexpected {msg['op'][:40]!r} on the store")
                return
            for reply in self.kv.request(conn.id, msg, now):
                target = self.conns.get(reply.peer)
                if target is not None:
                    self.conns.queue(target, reply.message())
        else:
            self._apply(self.members.message(conn.id, msg, now))

    def _hello(self, conn: Conn, msg: dict[str, Any], now: float) -> None:
        """Authenticate a connection's first message and act on it.

        It must be its port's hello (`store_hello` on the store; `register`, `agent_hello` or the operator's
        `replace` on the control port) with a client proof (protocol.check_client, constant-time): over this
        connection's nonce, or hello first, fresh (replay.Replays.judge). A plain `token` field is refused with a
        line saying the peer's toolkit is older. Any refusal is a `reject {retry: false}` carrying no proof (but
        for a clock too far from ours under a proof that checked: the client then trusts the reason and says it),
        and the connection closes once it is written; it is logged rate-limited (one line per kind of refusal per
        LOG_EVERY, then a summary), the claimed name cleaned. Accepted: the connection is authed, its line limit
        rises to P.MAX_LINE (P.MAX_STORE_LINE on the store), and its first reply carries the server's proof: the
        store's `welcome` here; for a worker or an agent, whatever the membership sends it first (`welcome`, or a
        `reject`/`fenced` the client can then trust)."""
        op = msg["op"]
        expected = ((protocol.STORE_HELLO,) if conn.kind == STORE
                    else (protocol.REGISTER, protocol.AGENT_HELLO, protocol.REPLACE))
        subject = protocol.hello_subject(msg)[:80] or "?"  # what the peer claims: cleaned where it is logged
        if op not in expected:
            self.said.warn("rejected:unexpected", f"rejected {conn.addr}: {op[:40]!r} before authenticating")
            self.conns.send(conn, wire.Reject(f"expected {' or '.join(expected)} first"))
            conn.closing = True
            return
        if "token" in msg:
            reason = ("the job token in the clear is refused: this peer's toolkit is older than the scheduler's; "
                      "install the same toolkit on every host")
        elif not protocol.check_client(self.cfg.token, conn.nonce, msg):
            reason = "wrong or missing job token"
        else:
            reason = self.replays.judge(msg, self.wall())
        if reason:
            what = {protocol.REGISTER: f"registration of {subject}", protocol.AGENT_HELLO: "agent hello",
                    protocol.STORE_HELLO: f"store connection of {subject}", protocol.REPLACE: "replace request"}[op]
            host = f" (host {subject})" if op == protocol.AGENT_HELLO else ""
            self.said.warn(f"rejected:{op}:{reason[:20]}", f"rejected {what} from {conn.addr}{host}: {reason}")
            if reason.startswith(CLOCK_SKEW):  # its proof checked: a proven reject, which the client trusts and says
                self.conns.authenticate(conn, str(msg["nonce"]))
            self.conns.send(conn, wire.Reject(reason))
            conn.closing = True
            return
        self.conns.authenticate(conn, str(msg["nonce"]))
        if op == protocol.STORE_HELLO:
            self.conns.send(conn, wire.Welcome())
        elif op == protocol.REGISTER:
            self._apply(self.members.register(conn.id, conn.addr, msg, now))
        elif op == protocol.REPLACE:  # the operator's (fleet replace): answered, then closed
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
                    message = action.message
                    if isinstance(message, wire.Formed):  # the ledger's figures, for the checkpoint interval
                        message = dataclasses.replace(message, **self.journal.history())
                    self.conns.send(conn, message)
                    if action.close:
                        conn.closing = True
            elif isinstance(action, Close):
                conn = self.conns.get(action.peer)
                if conn is not None:
                    self.conns.close(conn)
            elif isinstance(action, Log):  # peers' strings in it (node ids, hosts, log tails) shown, never obeyed
                log.log(action.level, "%s", clean(action.text, MAX_LOG_TEXT))
            elif isinstance(action, Exit):
                if self.exit_code is None:
                    self.exit_code = action.code
            elif isinstance(action, DropKeys):
                self.kv.drop_prefix(action.prefix)
            elif isinstance(action, Note):
                self._apply(self.journal.note(action))

    def _drop(self, conn: Conn, reason: str) -> None:
        """A connection ended, and is closed (Connections.drop): for a member, its death (Membership.lost).

        Reports an authenticated control connection to the membership (for a worker that had not said `done`: its
        death; for an agent: forgotten). The end of a store or an unauthenticated connection means nothing to the
        membership."""
        if conn.authed and conn.kind == CONTROL:
            self._apply(self.members.lost(conn.id, reason, self.clock()))

    # -- persistence

    def _state_path(self) -> Path | None:
        """Where the state is persisted (MS_RECOVERY_PATH/scheduler.json), or None when recovery is off."""
        if not self.cfg.recovery or self.cfg.recovery_path is None:
            return None
        return self.cfg.recovery_path / state.STATE_FILE

    def _persist(self, force: bool = False) -> None:
        """Write the state durably (state.StateWriter: the records that changed, or both files whole) if the
        membership changed (`dirty`), if `force`d (at exit), or if commit progress changed and
        COMMIT_PERSIST_INTERVAL has passed since the last write (commits come from every rank at every checkpoint).
        A failed write is logged as a warning and leaves the flags and the roster's marks set, so that a try comes
        again PERSIST_RETRY s later (a full disk or a lost mount is not retried on every pass, and said at most once
        per LOG_EVERY); the server goes on either way. Nothing is written with recovery off."""
        now = self.clock()
        commits_due = self.members.commits_dirty and now >= self.commits_persist_at
        if self.state_writer is None or not (self.members.dirty or force or commits_due):
            return
        if now < self.persist_retry_at and not force:
            return
        try:
            self.state_writer.save(state.changes(self.members), self.members.snapshot)
        except OSError as e:
            self.said.warn("persist", f"cannot persist the state to {self.state_writer.path}: {e.strerror} (recovery "
                                      f"after a scheduler crash would lose it); trying again every {PERSIST_RETRY:g} s")
            self.persist_retry_at = now + PERSIST_RETRY
            return
        self.persist_retry_at = 0.0
        self.members.dirty = self.members.commits_dirty = False
        self.members.roster.unsaved.clear()
        self.commits_persist_at = now + COMMIT_PERSIST_INTERVAL


def _nofile() -> int:
    """The soft limit of descriptors this process may open."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
