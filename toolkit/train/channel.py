"""The worker's one control connection to the scheduler: registration, heartbeats, reconnects, and the
scheduler's pushes, applied to the worker's view of its job.

Why a thread of its own: generation changes must be noticed while the training thread is busy (torch releases the
GIL inside collectives and store waits), so a background thread owns the reading side and the heartbeats. It decides
nothing itself: each message goes through the pure core (toolkit.train.jobview), and the channel applies what comes
back: it swaps the new JobView in under its Condition and wakes the training thread's waits, then trips the group's
fence, writes the log lines, or ends the process. If the scheduler goes away the thread keeps reconnecting and
training goes on; a scheduler that says `fenced` ends this process on the spot, before it can write anything into
the new generation.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import threading
import time
from typing import Any, Protocol

from toolkit.contracts import envvars, protocol
from toolkit.contracts import messages as wire
from toolkit.contracts.session import AT_ONCE, Unproven, evicted, open_session
from toolkit.train import jobview, stacks
from toolkit.train.faults import JobStopped, RegistrationError, Rejected
from toolkit.train.fence import Fence
from toolkit.train.jobview import DONE_WAIT
from toolkit.train.log import say

CONNECT_RETRY = 0.25  # s between attempts to reach a scheduler that is not (yet) up
CONNECT_TIMEOUT = 2.0  # s for the TCP connect itself (a partitioned scheduler host never answers the SYN)
SEND_TIMEOUT = 2.0  # s a send may block on a scheduler that stopped reading before the connection is dropped
HANDSHAKE_WAIT = 10.0  # s to wait for the answer to `register`: giving up on an accepted registration closes a
# connection the scheduler already counts as this worker's, and that close would read as our death


class ChannelConfig(Protocol):
    """What the channel reads of the worker's settings (toolkit.train.runtime.WorkerEnv has it all)."""

    @property
    def node_id(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def sched_host(self) -> str: ...
    @property
    def sched_port(self) -> int: ...
    @property
    def token(self) -> str: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def node_timeout(self) -> float: ...
    @property
    def topo_timeout(self) -> float: ...


class Channel:
    """The worker's one control connection: registration, heartbeats, and the scheduler's pushes.

    A background thread owns the reading side and the heartbeats, so generation changes are noticed while the
    training thread is busy (torch releases the GIL inside collectives and store waits). If the scheduler goes
    away the thread keeps reconnecting and training goes on; a scheduler that says `fenced` ends this process on
    the spot, before it can write anything into the new generation.
    """

    def __init__(self, cfg: ChannelConfig, exit_on_new_generation: bool = False, fence: Fence | None = None) -> None:
        self.cfg = cfg
        self.fence = fence  # tripped when a newer generation is announced: the blocked collective returns
        self.recovery = protocol.RECOVERY_RESTART if exit_on_new_generation else protocol.RECOVERY_IN_PLACE
        self.incarnation = secrets.token_hex(8)
        self.cond = threading.Condition()
        # what the scheduler said and the generation held: replaced whole under `cond` (by the control thread,
        # and by `adopt`), so one read of it, with or without the lock, is one consistent view
        self.view = jobview.JobView(restart_only=exit_on_new_generation, world_size=cfg.world_size)
        self.step: int | None = None
        # a torchrun-style script's (toolkit.train.wrapper): while it reports no step, its heartbeats carry the
        # collectives its default group entered, which the progress watchdog then judges it by
        self.count_collectives = False
        self.beat: dict[str, Any] = {}  # the latest StepPace.summary() (and checkpoint interval): sent with heartbeats
        self.long: str | None = None  # a legitimately long phase the training thread is in (the watchdog waits)
        self.training_thread = threading.get_ident()  # the thread whose waits each heartbeat samples (stacks)
        self.sock: socket.socket | None = None
        self.lines = protocol.LineBuffer()
        self.send_lock = threading.Lock()
        self.closing = threading.Event()
        self.finishing = False  # `done` sent: read until the scheduler closes, send nothing more
        self.thread: threading.Thread | None = None

    # -- registration (main thread first, then the background thread on reconnects)

    def register(self, rejoin: bool, timeout: float) -> None:
        """One registration over a new authenticated connection, the whole exchange bounded by `timeout` s; on
        `welcome` the connection becomes the channel's and the messages that came with it are handled. Raises
        Rejected (the scheduler's reason, and whether to retry), or OSError, ProtocolError or Unproven when the
        scheduler cannot be reached or proven; a `fenced` answer ends the process with EXIT_FENCED."""
        hello = wire.Register(self.cfg.node_id, self.cfg.rank, self.cfg.world_size, self.incarnation, os.getpid(),
                              os.environ.get(envvars.TOOLKIT_HOST) or socket.gethostname(),  # the inventory's: fencing
                              self.view.held, rejoin, self.recovery)
        session = open_session((self.cfg.sched_host, self.cfg.sched_port), self.cfg.token, hello, timeout,
                               CONNECT_TIMEOUT)
        reply = session.reply
        if not isinstance(reply, wire.Welcome):
            session.sock.close()
            if isinstance(reply, wire.Fenced):
                self._apply([jobview.fenced(reply.reason)])
            reason, retry = wire.refusal(reply)
            raise Rejected(reason[:jobview.MAX_FENCED_REASON], retry)
        session.sock.settimeout(SEND_TIMEOUT)
        with self.send_lock:
            self.sock, self.lines = session.sock, session.lines
        self._take(reply)
        for later in session.queued:
            self._handle(later)

    def join(self, deadline: float) -> None:
        """First registration: retry while the scheduler is not up yet (it starts alongside the workers) and
        while our node id is still held by a predecessor the scheduler has not yet found dead."""
        rejected_since: float | None = None
        at_once = 0
        while True:
            now = time.monotonic()
            try:
                self.register(rejoin=False, timeout=self._handshake_wait())
                return
            except Rejected as r:
                rejected_since = rejected_since if rejected_since is not None else now
                patience = 2 * self.cfg.node_timeout + self.cfg.heartbeat_interval
                if not r.retry or now - rejected_since > patience or now > deadline:
                    raise RegistrationError(f"{self.cfg.node_id}: the scheduler at {self.cfg.sched_host}:"
                                            f"{self.cfg.sched_port} rejected it: {r.reason}") from None
            except (OSError, protocol.ProtocolError, Unproven) as e:
                if now > deadline:
                    raise RegistrationError(
                        f"{self.cfg.node_id}: cannot reach the scheduler at {self.cfg.sched_host}:"
                        f"{self.cfg.sched_port} within {envvars.MS_TOPO_TIMEOUT}={self.cfg.topo_timeout:g} s ({e}); "
                        f"is it running, and is {envvars.MS_SCHED_HOST} this job's scheduler host?") from None
                if evicted(e) and at_once < AT_ONCE:
                    at_once += 1  # closed to make room (a flood): again at once, the hello is read at accept
                    continue
            at_once = 0
            if self.closing.wait(CONNECT_RETRY):
                raise RegistrationError(f"{self.cfg.node_id}: closed while registering")

    def _handshake_wait(self) -> float:
        return max(HANDSHAKE_WAIT, 2 * self.cfg.node_timeout)

    def start(self) -> None:
        """Start the control thread (reading, heartbeats, reconnects), once `join` has registered."""
        self.thread = threading.Thread(target=self._run, name="toolkit-control", daemon=True)
        self.thread.start()

    # -- the background thread

    def _run(self) -> None:
        """The control thread: handle the scheduler's messages, heartbeat when jobview.next_wake says, and rejoin
        when the connection drops (a refusal decided by jobview.on_refused). Ends on `close`, once the scheduler
        closes after `done`, or when a refusal is final."""
        next_beat = wait_until = time.monotonic()
        refused_since: float | None = None
        at_once = 0
        while not self.closing.is_set():
            sock = self.sock
            if sock is None:
                try:
                    self.register(rejoin=True, timeout=self._handshake_wait())
                except Rejected as r:
                    now = time.monotonic()
                    refused_since = now if refused_since is None else refused_since
                    decision = jobview.on_refused(refused_since, now, r.retry, r.reason, self.cfg.node_timeout)
                    if isinstance(decision, jobview.Stop):
                        self._stop(decision.reason)
                        return
                    if isinstance(decision, jobview.ExitProcess):
                        self._apply([decision])
                except (OSError, protocol.ProtocolError, Unproven) as e:
                    if evicted(e) and at_once < AT_ONCE:
                        at_once += 1  # closed to make room (a flood): again at once, the hello is read at accept
                        continue
                else:
                    with self.cond:
                        self.cond.notify_all()
                    say(self.cfg.node_id, f"reconnected to the scheduler (generation {self.view.announced})")
                    refused_since, next_beat = None, time.monotonic()
                    wait_until, at_once = next_beat, 0
                    continue
                at_once = 0
                self.closing.wait(CONNECT_RETRY)
                continue
            try:
                if _readable(sock, max(0.0, wait_until - time.monotonic())):
                    self._read(sock)
                wake = jobview.next_wake(time.monotonic(), next_beat, self.finishing, self.cfg.heartbeat_interval)
                next_beat, wait_until = wake.next_beat, wake.wait_until
                if wake.beat:
                    waiting, busy = stacks.sample(self.training_thread)
                    long = self.long or busy
                    count = stacks.collectives() if self.count_collectives and self.step is None else None
                    self.send(wire.Heartbeat(step=self.step, **self.beat, waiting=waiting, long=long or None,
                                             collectives=count), strict=True)
            except (OSError, ValueError, protocol.ProtocolError) as e:
                if self.closing.is_set() or self.finishing:
                    return
                say(self.cfg.node_id, f"lost the scheduler ({e}); training goes on, reconnecting")
                self._drop(sock)

    def _read(self, sock: socket.socket) -> None:
        """What the scheduler sent, each message handled at the time it is (its `formed` dates the history)."""
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed by the scheduler")
        for msg in self.lines.feed(data):
            self._handle(msg)

    # -- the view and the effects

    def adopt(self, generation: int) -> bool:
        """This process now holds a group of `generation` (the one it names when it rejoins; restart recovery exits
        when the job moves past it). Returns whether the job has already moved past it."""
        with self.cond:
            self.view, moved = jobview.adopt(self.view, generation)
        return moved

    def _handle(self, msg: dict[str, Any]) -> None:
        """One message of the (authenticated) scheduler as read (wire.decode): a malformed one is a ProtocolError,
        which drops the connection like any broken one (the reader reconnects)."""
        self._take(wire.decode(msg))

    def _take(self, message: wire.Message) -> None:
        """One message of the scheduler: the core decides (jobview.on_message, at the time it is handled), the new
        view is swapped in and the waiters woken, then the effects run in order (`fenced` ends the process with the
        view untouched)."""
        with self.cond:
            view, effects = jobview.on_message(self.view, message, time.monotonic())
            if view is not self.view:
                self.view = view
                self.cond.notify_all()
        self._apply(effects)

    def _apply(self, effects: list[jobview.Effect]) -> None:
        """Apply the core's effects in their order, on whichever thread handled the message (the main thread while
        `join` registers, the control thread after)."""
        for effect in effects:
            if isinstance(effect, jobview.TripFence):
                cut = self.fence.overtaken(effect.generation) if self.fence is not None else 0
                if cut:
                    say(self.cfg.node_id, f"generation {effect.generation} announced: abandoned the group of "
                                          f"generation {self.fence.generation} ({cut} connection(s) shut down)")
            elif isinstance(effect, jobview.Say):
                say(self.cfg.node_id, effect.text)
            else:
                say(self.cfg.node_id, effect.why)  # flushed: nothing is lost to the exit
                os._exit(effect.code)

    def _stop(self, reason: str) -> None:
        """The job ended for this worker (a final refusal): the waits raise JobStopped with `reason`."""
        with self.cond:
            self.view = jobview.stopped(self.view, reason)
            self.cond.notify_all()

    def _drop(self, sock: socket.socket) -> None:
        with self.send_lock:
            if self.sock is sock:
                self.sock = None
        sock.close()

    # -- used by the training thread

    def send(self, message: wire.Message, strict: bool = False) -> bool:
        """Best effort: while the scheduler is away, messages are dropped (heartbeats resume on reconnect); with
        `strict`, a failed send raises its OSError (the control thread's heartbeat: it reconnects)."""
        line = message.line()
        with self.send_lock:
            sock = self.sock
            if sock is None:
                return False
            try:
                sock.sendall(line)
                return True
            except OSError:
                if strict:
                    raise
                with contextlib.suppress(OSError):  # a half-sent line: let the reader thread reconnect
                    sock.shutdown(socket.SHUT_RDWR)
                return False

    def wait_formed(self, current: int | None, deadline: float) -> tuple[int, str]:
        """Block until the scheduler has formed the newest generation (every rank registered), bounded."""
        with self.cond:
            while True:
                if self.view.stop_reason is not None:
                    raise JobStopped(self.view.stop_reason)
                f = jobview.formed_for(self.view, current)
                if f is not None:
                    return f
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JobStopped(
                        f"{self.cfg.node_id}: generation {self.view.announced} did not form within "
                        f"{envvars.MS_TOPO_TIMEOUT}={self.cfg.topo_timeout:g} s; see the scheduler's log for the "
                        "missing workers")
                self.cond.wait(left)

    def wait_change(self, current: int | None, bound: float) -> int | None:
        """After a collective failed: did the job move on? Waits up to `bound` for the scheduler's word."""
        deadline = time.monotonic() + bound
        with self.cond:
            while True:
                if self.view.stop_reason is not None:
                    raise JobStopped(self.view.stop_reason)
                new = jobview.changed_from(self.view, current)
                if new is not None:
                    return new
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def done(self) -> bool:
        """Say `done`, then wait (bounded) for the scheduler to close: proof it read the message before our exit
        (closing first could reset the connection and lose it). If the scheduler is down right now (restarting),
        wait a bounded time for the reconnect: a `done` that never arrives would look like a death. Returns whether
        `done` was sent."""
        deadline = time.monotonic() + DONE_WAIT + 2 * self.cfg.node_timeout
        with self.cond:
            while self.sock is None and self.view.stop_reason is None and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
        with self.send_lock:
            sock = self.sock
            if sock is not None:
                try:
                    sock.sendall(wire.Done().line())
                    sock.shutdown(socket.SHUT_WR)
                    self.finishing = True
                except OSError:
                    pass
        if not self.finishing:
            say(self.cfg.node_id, "could not tell the scheduler this worker finished (it is unreachable)")
        elif self.thread is not None:
            self.thread.join(DONE_WAIT)
        self.close()
        return self.finishing

    def close(self) -> None:
        """Stop the control thread (bounded join) and close the connection; without a `done` first, the scheduler
        takes the close as this worker's death."""
        self.closing.set()
        with self.send_lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(max(1.0, self.cfg.heartbeat_interval) + 1.0)


def _readable(sock: socket.socket, timeout: float) -> bool:
    """poll(), not select(): a training process may hold more than FD_SETSIZE (1024) descriptors."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout * 1000))
