"""The agent's one connection to the scheduler (toolkit.contracts.protocol): hello, then heartbeats and the `exited` and
`gave_up` reports out, `kill`, `stop`, `finished` and (to a spare) `takeover` in. Driven by the supervisor's
selector: never blocks its loop."""

from __future__ import annotations

import errno
import os
import selectors
import socket
import time
from typing import Any, Callable

from toolkit.agent.agentlog import AgentLog
from toolkit.agent.timers import Timer, Timers
from toolkit.contracts import envvars, protocol
from toolkit.contracts import messages as wire
from toolkit.contracts.agentdoc import LinkState
from toolkit.contracts.hostspec import HostSpec
from toolkit.contracts.session import AT_ONCE, Unproven, open_session

LINK_RETRY_INTERVAL = 1.0  # s between attempts to reach the scheduler while it is down
LINK_REJECTED_RETRY = 10.0  # s before trying again after the scheduler rejected us (e.g. a token being re-deployed)
LINK_CONNECT_TIMEOUT = 3.0  # s for one TCP connect and handshake with the scheduler
QUEUE_LIMIT = 1000  # reports held for the scheduler while it is unreachable
HEARTBEAT_INTERVAL = envvars.DEFAULT_AGENT_HEARTBEAT  # s between the agent's heartbeats while the link is up, unless
#                           the scheduler's welcome gives another (`beat`, longer at thousands of ranks): a host cut off
#                           falls silent, and the scheduler finds it lost (a pulled cable closes no connection)


class SchedulerLink:
    """The agent's one connection to the scheduler, driven by the agent's selector. Never blocks the loop: a
    down scheduler means reports wait in a queue (an `exited` per node coalesced to the latest) and a reconnect
    is tried every LINK_RETRY_INTERVAL.

    States: down -> connecting (TCP) -> hello (hello sent first; the server's challenge and proven answer awaited)
    -> up. Nothing the scheduler says is acted on, and no report is sent, before it proved the job token
    (toolkit.contracts.protocol)."""

    def __init__(self, spec: HostSpec, sel: selectors.BaseSelector, timers: Timers, log: AgentLog,
                 on_message: Callable[[wire.Message], None], on_change: Callable[[], None],
                 hello: Callable[[], wire.AgentHello] | None = None,
                 heartbeat: Callable[[], wire.Heartbeat] | None = None) -> None:
        self.spec, self.sel, self.timers, self.log = spec, sel, timers, log
        # what the hello says: the host and the node ids it supervises now (a spare's grow when it takes over)
        self.hello = hello or (lambda: wire.AgentHello(spec.host, tuple(p.node_id for p in spec.processes)))
        self.heartbeat = heartbeat or wire.Heartbeat  # what each heartbeat says: the children it vouches for
        self.on_message, self.on_change = on_message, on_change
        self.sock: socket.socket | None = None
        self.state: LinkState = LinkState.DOWN
        self.since = time.time()
        self.queue: list[tuple[str | None, bytes]] = []  # (node_id of a coalescible exited report, message)
        self.wbuf = bytearray()
        self.lines = protocol.LineBuffer()
        self.retry: Timer | None = None
        self.connect_timer: Timer | None = None
        self.beat_timer: Timer | None = None
        self.beat_interval = HEARTBEAT_INTERVAL  # what the scheduler's last welcome said (`beat`)
        self.nonces: tuple[str, str] | None = None  # (server's, ours) while the hello is unanswered ("": no challenge)
        self.at_once = 0  # reconnects at once in a row after the scheduler closed a hello (`_closed_by_peer`)
        self.token = ""  # read from the token file at each connection (a re-deploy may have replaced it)
        self.closed = False
        self._said_down = False

    def start(self) -> None:
        """Make the first connection attempt; later ones run on timers. Called once, by Agent.run after the first
        launches. Never blocks on the scheduler; resolving its name (getaddrinfo, at every attempt) is the one call
        without a timeout of ours."""
        self._attempt()

    def report(self, message: wire.Message, coalesce: str | None = None) -> None:
        """Queue a report for the scheduler, and send it now if the link is up. Never blocks and never raises for
        network trouble: what the socket does not take at once goes out when it is writable, and while the link is down
        reports wait for the next successful hello.

        With `coalesce` (a node id) a queued report with the same key is replaced: a node's `exited` reports collapse to
        the latest while the scheduler is unreachable. At most QUEUE_LIMIT reports wait; beyond that the oldest is
        dropped. Delivery is at most once: a report already moved to a connection that then drops is not sent again (the
        scheduler also learns of a death when its heartbeats stop)."""
        msg = message.line()
        if coalesce is not None:
            self.queue = [q for q in self.queue if q[0] != coalesce]
        self.queue.append((coalesce, msg))
        if len(self.queue) > QUEUE_LIMIT:
            del self.queue[0]
        if self.state is LinkState.UP:
            self._pump()

    def _set(self, state: LinkState) -> None:
        """Change the link's state, stamp `since`, and tell the agent (agent.json shows the link)."""
        if state != self.state:
            self.state, self.since = state, time.time()
            self.on_change()

    def _attempt(self) -> None:
        """Timer callback: start a non-blocking connect, unless the link is closed or not down. A failure schedules the
        next attempt (`_down`); the connect and the handshake together get LINK_CONNECT_TIMEOUT."""
        self.retry = None
        if self.closed or self.state is not LinkState.DOWN:
            return
        try:
            infos = socket.getaddrinfo(self.spec.sched_host, self.spec.sched_port, type=socket.SOCK_STREAM)
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as e:
            self._down(f"cannot resolve {self.spec.sched_host}: {e}")
            return
        sock.setblocking(False)
        err = sock.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._down(os.strerror(err))
            return
        self.sock = sock
        self.lines = protocol.LineBuffer()
        self.nonces = None
        self._set(LinkState.CONNECTING)
        self.sel.register(sock, selectors.EVENT_WRITE, self._on_event)
        self.connect_timer = self.timers.after(LINK_CONNECT_TIMEOUT, lambda: self._drop("connect timed out"))

    def _on_event(self, mask: int) -> None:
        """Selector callback: complete the connect, read and handle messages, write what is buffered. A socket error,
        EOF or a ProtocolError drops the link (a reconnect follows): nothing the scheduler sends makes it raise."""
        if self.sock is None:
            return
        if self.state is LinkState.CONNECTING and mask & selectors.EVENT_WRITE and self.nonces is None:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._drop(os.strerror(err))
                return
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._hello()  # hello first: read at the scheduler's accept, before a flood can evict it
            return
        if mask & selectors.EVENT_READ:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except ConnectionResetError as e:
                self._closed_by_peer(str(e))
                return
            except OSError as e:
                self._drop(str(e))
                return
            if data == b"":
                self._closed_by_peer("the scheduler closed the connection")
                return
            if data:
                try:
                    messages = self.lines.feed(data)
                    for msg in messages:
                        if not self._handle(msg) or self.sock is None:
                            return
                except protocol.ProtocolError as e:
                    self._drop(f"bad message from the scheduler: {e}")
                    return
        if mask & selectors.EVENT_WRITE and self.sock is not None:
            self._pump()

    def _hello(self) -> None:
        """The TCP connection is up: send the hello at once (protocol.first_hello; the token read anew, a re-deploy
        may have replaced it); the server's challenge and its proven answer follow."""
        try:
            token = self.spec.token_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            self._drop(f"cannot read the job token {self.spec.token_file}: {e}")
            return
        hello, nonce = protocol.first_hello(protocol.AGENT_HELLO, token, time.time(), **self.hello().encode())
        self.nonces = ("", nonce)  # the server's nonce comes with its challenge
        self.token = token
        self.wbuf = bytearray(hello)
        self._set(LinkState.HELLO)
        self._pump()

    def _closed_by_peer(self, why: str) -> None:
        """The scheduler closed (or reset) the connection: during the hello (to make room, under a flood) reconnect
        at once, up to AT_ONCE times in a row; else after the usual LINK_RETRY_INTERVAL."""
        if self.state is LinkState.HELLO and self.at_once < AT_ONCE:
            self.at_once += 1
            self._drop(f"{why} during the hello", 0.0)
            return
        self.at_once = 0
        self._drop(why)

    def _handle(self, msg: dict[str, Any]) -> bool:
        """One message; False once the link was dropped."""
        if self.state is LinkState.HELLO:
            if self.nonces is None:  # a hello is sent with its nonces: this is a bug, not input
                raise RuntimeError("scheduler link in state hello without nonces")
            if not self.nonces[0]:  # the server's challenge: its nonce, which its proof covers
                self.nonces = (protocol.challenge_nonce(msg), self.nonces[1])
                return True
            if not protocol.check_server(self.token, *self.nonces, msg):
                reason = (str(msg.get("reason"))[:300] if msg.get("op") == protocol.REJECT
                          else f"{msg['op'][:40]} unproven")
                self.log("agent", f"the scheduler's answer did not prove the job token ({reason}): a wrong token "
                                  "here, or not this job's scheduler")
                self._drop("unproven answer", LINK_REJECTED_RETRY)
                return False
            answer = wire.decode(msg)
            if not isinstance(answer, wire.Welcome):
                self.log("agent", f"the scheduler rejected this agent: {wire.refusal(answer)[0][:300]}")
                self._drop("rejected", LINK_REJECTED_RETRY)
                return False
            if self.connect_timer:
                self.connect_timer.cancel()
            self.nonces, self.at_once = None, 0
            self.beat_interval = answer.beat or HEARTBEAT_INTERVAL  # none said (an older scheduler): its own
            self._set(LinkState.UP)
            self._said_down = False
            self.log("agent", f"connected to the scheduler at {self.spec.sched_host}:{self.spec.sched_port}")
            self._pump()
            self._beat()
            return self.sock is not None
        if self.state is not LinkState.UP:  # nothing is read before the hello is sent: never acted on
            self._drop(f"{msg['op'][:40]} before the hello")
            return False
        try:
            message = wire.decode(msg)
        except protocol.ProtocolError as e:  # authenticated, so a bug or a version skew: said, not obeyed
            self.log("agent", f"ignored a malformed message from the scheduler: {e}")
            return True
        self.on_message(message)
        return True

    def _pump(self) -> None:
        """Send what the socket takes now, without blocking. Queued reports join the write buffer only once the link is
        up (nothing but the hello goes out before the scheduler proved the token); the selector waits for writability
        only while bytes remain. A send error drops the link."""
        if self.state is LinkState.UP:
            for _, msg in self.queue:
                self.wbuf += msg
            self.queue.clear()
        while self.wbuf:
            try:
                n = self.sock.send(self.wbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._drop(str(e))
                return
            del self.wbuf[:n]
        self.sel.modify(self.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if self.wbuf else 0), self._on_event)

    def _beat(self) -> None:
        """Send a heartbeat now and every `beat_interval` while the link is up (never queued while it is down),
        saying `heartbeat()`: the children running and not stopped, which the scheduler counts as alive even when
        their own heartbeats stop."""
        self.beat_timer = None
        if self.closed or self.state is not LinkState.UP or self.sock is None:
            return
        self.wbuf += self.heartbeat().line()
        self._pump()
        if not self.closed and self.state is LinkState.UP:
            self.beat_timer = self.timers.after(self.beat_interval, self._beat)

    def _drop(self, why: str, retry: float = LINK_RETRY_INTERVAL) -> None:
        """Close the connection, discard its unsent bytes (the hello, or reports already moved out of the queue), and
        schedule a reconnect in `retry` s."""
        for timer in (self.connect_timer, self.beat_timer):
            if timer:
                timer.cancel()
        if self.sock is not None:
            self.sel.unregister(self.sock)
            self.sock.close()
            self.sock = None
        self.wbuf.clear()
        self.nonces = None
        self._down(why, retry)

    def _down(self, why: str, retry: float = LINK_RETRY_INTERVAL) -> None:
        """Mark the link down and schedule the next attempt in `retry` s; no-op once closed. Only the first failure
        since the link was last up is logged."""
        if self.closed:
            return
        if not self._said_down:
            self.log("agent", f"scheduler {self.spec.sched_host}:{self.spec.sched_port} unreachable ({why}); "
                              f"retrying every {retry:g} s, supervision goes on")
            self._said_down = True
        self._set(LinkState.DOWN)
        if not self.closed:
            self.retry = self.timers.after(retry, self._attempt)

    def flush(self, timeout: float) -> bool:
        """At exit: deliver what is queued within `timeout`, connecting if needed; True if nothing is left.

        Blocking: called by Agent._shutdown only, after the loop. Marks the link closed, so no reconnect follows.
        Without a live link it opens a fresh authenticated session (toolkit.contracts.session.open_session: the
        scheduler must prove the token and welcome the agent), then sends everything in one sendall bounded by what is
        left of `timeout`. False on any failure: unreachable, rejected, unproven, timed out."""
        self.closed = True
        if self.retry:
            self.retry.cancel()
        if not self.queue and not (self.state is LinkState.UP and self.wbuf):
            return True
        deadline = time.monotonic() + timeout
        if self.state is not LinkState.UP:
            if self.sock is not None:
                self.sel.unregister(self.sock)
                self.sock.close()
                self.sock = None
            try:
                token = self.spec.token_file.read_text(encoding="utf-8").strip()
                session = open_session((self.spec.sched_host, self.spec.sched_port), token, self.hello(), timeout,
                                       min(timeout, LINK_CONNECT_TIMEOUT))
            except (OSError, protocol.ProtocolError, Unproven):
                return False
            if not isinstance(session.reply, wire.Welcome):
                session.sock.close()
                return False
            self.sock = session.sock
            self.wbuf = bytearray()
        else:
            self.sel.unregister(self.sock)
        for _, msg in self.queue:
            self.wbuf += msg
        self.queue.clear()
        try:
            self.sock.settimeout(max(0.05, deadline - time.monotonic()))
            self.sock.sendall(self.wbuf)
            self.wbuf.clear()
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Close the link for good: no more reconnects, the connection closed, state `closed`; queued reports are
        abandoned. Idempotent. Called when the scheduler announced the end of the job (it exits now) and by
        Agent._shutdown."""
        self.closed = True
        self.state = LinkState.CLOSED
        for timer in (self.retry, self.connect_timer, self.beat_timer):
            if timer:
                timer.cancel()
        if self.sock is not None:
            try:
                self.sel.unregister(self.sock)
            except (KeyError, ValueError):
                pass
            self.sock.close()
            self.sock = None
