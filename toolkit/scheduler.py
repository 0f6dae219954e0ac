"""`python -m toolkit.scheduler`: the job's one scheduler (started where MS_ROLE=MS_SCHED).

It serves two things on MS_SCHED_HOST:
- at MS_SCHED_PORT, the control server (toolkit.protocol: JSON lines over TCP) through which workers register and
  heartbeat and agents report exits; it owns membership, ranks and the generation;
- at MASTER_PORT (= MS_SCHED_PORT + 1), a torch.distributed TCPStore (libuv) that process groups bootstrap from,
  one key prefix per generation.

One thread runs every connection through a selector, so hundreds of workers cost no threads and every state change
happens in one place, in order. State changes are persisted (MS_ENABLE_RECOVERY=1) before anything that depends on
them is sent, so a scheduler killed with -9 and started again never hands out a generation twice.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from toolkit import envvars as E
from toolkit import protocol as P
from toolkit.errors import UserError

log = logging.getLogger("toolkit.scheduler")

EXIT_OK = 0
EXIT_FAILED = 1  # a node gave up: the job failed
EXIT_CONFIG = 2  # bad environment, port in use: nothing was started
EXIT_FORMATION = 3  # MS_TOPO_TIMEOUT passed before every worker registered
EXIT_TERMINATED = 128 + signal.SIGTERM

# Optional: a JSON file {node_id: host} so the formation-timeout message can say where a missing worker was
# expected (the renderer writes it; without it the hosts the agents announced are used).
TOOLKIT_EXPECTED = E.TOOLKIT_EXPECTED
STATE_FILE = "scheduler.json"
STATE_VERSION = 1
LINGER = 2.0  # s to flush the last messages (finished, stop) before exiting
MAX_WAIT = 30.0  # s: longest select() when no deadline is nearer
COMMIT_PERSIST_INTERVAL = 1.0  # s: commits come from every rank at every checkpoint; written at most this often
MAX_OUTBUF = 1 << 20  # bytes queued to one peer that has stopped reading before it is dropped
RECV_SIZE = 1 << 16


class ConfigError(UserError):
    """The scheduler's environment is incomplete or wrong; nothing was started."""


@dataclass(frozen=True)
class Config:
    """Everything the scheduler reads from its environment, validated once."""

    job: str
    host: str
    port: int
    store_port: int
    world_size: int
    topo_timeout: float
    node_timeout: float
    recovery: bool
    recovery_path: Path | None
    token: str = field(repr=False)
    expected: Mapping[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Config":
        role = env.get(E.MS_ROLE, E.ROLE_SCHED)
        if role != E.ROLE_SCHED:
            raise ConfigError(f"{E.MS_ROLE}={role}: the scheduler runs where {E.MS_ROLE}={E.ROLE_SCHED}")
        port = _int(env, E.MS_SCHED_PORT, 8118)
        store_port = _int(env, E.MASTER_PORT, port + 1)
        for name, value in ((E.MS_SCHED_PORT, port), (E.MASTER_PORT, store_port)):
            if not 1 <= value <= 65535:
                raise ConfigError(f"{name}={value}: not a TCP port (1-65535)")
        if store_port == port:
            raise ConfigError(f"{E.MASTER_PORT}={store_port} equals {E.MS_SCHED_PORT}: the store needs its own port")
        if E.MS_WORKER_NUM not in env:
            raise ConfigError(f"{E.MS_WORKER_NUM} is not set: give the total number of workers")
        world = _int(env, E.MS_WORKER_NUM, 0)
        if world < 1:
            raise ConfigError(f"{E.MS_WORKER_NUM}={world}: a job needs at least 1 worker")
        topo = _float(env, E.MS_TOPO_TIMEOUT, 600.0)
        node = _float(env, E.MS_NODE_TIMEOUT, 6.0)
        if topo <= 0 or node <= 0:
            raise ConfigError(f"{E.MS_TOPO_TIMEOUT} and {E.MS_NODE_TIMEOUT} must be positive seconds")
        recovery = env.get(E.MS_ENABLE_RECOVERY, "0").strip().lower() in ("1", "true", "yes", "on")
        rpath = env.get(E.MS_RECOVERY_PATH)
        if recovery and not rpath:
            raise ConfigError(f"{E.MS_ENABLE_RECOVERY}=1 needs {E.MS_RECOVERY_PATH}: the directory for the state")
        token_file = env.get(E.TOOLKIT_TOKEN_FILE)
        if not token_file:
            raise ConfigError(f"{E.TOOLKIT_TOKEN_FILE} is not set: workers register with the job token in that file")
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"{E.TOOLKIT_TOKEN_FILE}={token_file}: cannot read the job token ({e.strerror})") from None
        if not token:
            raise ConfigError(f"{E.TOOLKIT_TOKEN_FILE}={token_file}: the token file is empty; render the job again")
        return cls(
            job=env.get(E.TOOLKIT_JOB) or "job",
            host=env.get(E.MS_SCHED_HOST) or "127.0.0.1",
            port=port,
            store_port=store_port,
            world_size=world,
            topo_timeout=topo,
            node_timeout=node,
            recovery=recovery,
            recovery_path=Path(rpath) if rpath else None,
            token=token,
            expected=MappingProxyType(_expected_hosts(env.get(TOOLKIT_EXPECTED))),
        )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a whole number") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number of seconds") from None


def _expected_hosts(path: str | None) -> dict[str, str]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{TOOLKIT_EXPECTED}={path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ConfigError(f"{TOOLKIT_EXPECTED}={path}: expected a JSON object mapping node ids to host names")
    return data


def rank_of(node_id: str) -> int | None:
    """The rank in a worker node id (`worker_<rank>`), None for anything else (`sched`)."""
    prefix = P.worker_node_id(0)[:-1]
    if node_id.startswith(prefix) and node_id[len(prefix):].isdigit():
        return int(node_id[len(prefix):])
    return None


class Conn:
    """One peer connection: a worker, an agent, or not yet authenticated."""

    __slots__ = ("sock", "addr", "lines", "out", "role", "rank", "agent_host", "closing", "closed")

    def __init__(self, sock: socket.socket, addr: str) -> None:
        self.sock = sock
        self.addr = addr
        self.lines = P.LineBuffer()
        self.out = bytearray()
        self.role: str | None = None  # "worker", "agent", "finished" (a worker that said done)
        self.rank: int | None = None
        self.agent_host: str | None = None
        self.closing = False  # close once `out` is flushed; further input is ignored
        self.closed = False


@dataclass
class Member:
    """The live incarnation that holds a rank. Mutable: it is the scheduler's bookkeeping, not a message."""

    rank: int
    node_id: str
    incarnation: str
    pid: int
    host: str
    addr: str
    last_seen: float
    conn: Conn | None = None
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node_id": self.node_id, "incarnation": self.incarnation, "pid": self.pid,
                "host": self.host, "addr": self.addr}


class Scheduler:
    """Membership, generations and the store of one job. `serve()` returns the process exit code."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = config
        self.clock = clock
        self.boot = secrets.token_hex(4)
        self.sel = selectors.DefaultSelector()
        self.members: dict[int, Member] = {}
        self.done: set[int] = set()
        self.fenced: set[str] = set()
        self.commits: dict[int, int] = {}
        self.generation = 0
        self.formed = False
        self.status = "running"  # running | finished | failed
        self.failure = ""
        self.ever_registered = False
        self.ever_formed = False
        self.unmanaged = False
        self.signalled = ""
        self.hb_check_at = float("inf")  # no member's heartbeat can expire before this
        self.started = clock()
        self.gather_since: float | None = self.started
        self.agents: dict[str, Conn] = {}
        self.node_host: dict[str, str] = dict(config.expected)
        self.dirty = False
        self.commits_dirty = False  # only commits changed: persisted within COMMIT_PERSIST_INTERVAL
        self.commits_persist_at = 0.0
        self.pending: set[Conn] = set()
        self.exit_code: int | None = None
        self.listener: socket.socket | None = None
        self.store: Any = None
        self._wake_r, self._wake_w = socket.socketpair()

    # ---------------------------------------------------------------- lifecycle

    def serve(self) -> int:
        self._restore()
        self._bind()  # first: a port conflict is reported before the slow store start
        self._start_store()
        self._listen()  # only now: a worker that reaches us must get an answer, not wait in a queue
        self._install_signals()
        now = self.clock()  # deadlines count from when peers can reach us, not from the slow import of torch
        self.started = now
        if self.gather_since is not None:
            self.gather_since = now
        for member in self.members.values():
            member.last_seen = now
        self.hb_check_at = now + self.cfg.node_timeout if self.members else float("inf")
        log.info(
            "job %s: control server on %s:%d, store on %s:%d; waiting for %d workers (MS_TOPO_TIMEOUT %g s, "
            "MS_NODE_TIMEOUT %g s, recovery %s)", self.cfg.job, self.cfg.host, self.cfg.port, self.cfg.host,
            self.cfg.store_port, self.cfg.world_size, self.cfg.topo_timeout, self.cfg.node_timeout,
            "on" if self.cfg.recovery else "off")
        try:
            self._loop()
            self._linger()
        finally:
            self._persist(force=True)
            self._shutdown()
        return self.exit_code if self.exit_code is not None else EXIT_FAILED

    def _bind(self) -> None:
        family = socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.cfg.host, self.cfg.port))
        except OSError as e:
            sock.close()
            raise ConfigError(
                f"cannot serve on {self.cfg.host}:{self.cfg.port} ({E.MS_SCHED_HOST}:{E.MS_SCHED_PORT}): "
                f"{e.strerror}; is another job using the port, or is the address not this host's?") from None
        self.listener = sock

    def _listen(self) -> None:
        assert self.listener is not None
        self.listener.listen(4096)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, "listener")
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    def _start_store(self) -> None:
        import torch.distributed as dist  # slow to import: only the serving process pays for it

        try:
            self.store = dist.TCPStore(
                self.cfg.host, self.cfg.store_port, None, is_master=True, wait_for_workers=False,
                timeout=timedelta(seconds=max(30.0, self.cfg.topo_timeout)), use_libuv=True)
        except Exception as e:  # torch raises DistNetworkError/RuntimeError with a long text
            text = str(e)
            why = "address already in use" if "EADDRINUSE" in text or "already in use" in text else (
                text.strip().splitlines()[0] if text.strip() else type(e).__name__)
            raise ConfigError(
                f"cannot serve the store on {self.cfg.host}:{self.cfg.store_port} ({E.MASTER_PORT}): {why}; "
                "is another job using the port?") from None

    def _install_signals(self) -> None:
        def on_signal(signum: int, _frame: Any) -> None:
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
        while self.exit_code is None:
            timeout = self._next_deadline(self.clock())
            for key, mask in self.sel.select(timeout):
                if key.data == "listener":
                    self._accept()
                elif key.data == "wake":
                    self._drain_wake()
                else:
                    conn: Conn = key.data
                    if mask & selectors.EVENT_READ and not conn.closed:
                        self._read(conn)
                    if mask & selectors.EVENT_WRITE and not conn.closed:
                        self._write(conn)
            self._check_deadlines(self.clock())
            self._persist()
            self._flush()
        if self.signalled:
            log.info("stopped by %s; state persisted; workers keep training and reconnect to a restarted "
                     "scheduler", self.signalled)

    def _linger(self) -> None:
        """Give `finished`/`stop` a bounded moment to reach the agents before the sockets close."""
        deadline = self.clock() + LINGER
        self._persist()
        self._flush()
        while any(c.out and not c.closed for c in self.pending) and self.clock() < deadline:
            for key, mask in self.sel.select(max(0.0, deadline - self.clock())):
                if isinstance(key.data, Conn) and mask & selectors.EVENT_WRITE:
                    self._write(key.data)
                elif isinstance(key.data, Conn) and mask & selectors.EVENT_READ:
                    self._read(key.data)
                elif key.data == "wake":
                    self._drain_wake()

    def _shutdown(self) -> None:
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, Conn):
                self._close(key.data)
        if self.listener is not None:
            self.sel.unregister(self.listener)
            self.listener.close()
        self.sel.close()
        self._wake_r.close()
        self._wake_w.close()
        self.store = None

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    # ---------------------------------------------------------------- connections

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: keep serving the peers we have
                log.warning("cannot accept a connection: %s", e.strerror)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Conn(sock, f"{addr[0]}:{addr[1]}")
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(conn, f"connection error ({e.strerror})")
            return
        if not data:
            self._lost(conn, "connection closed")
            return
        if conn.closing:
            return
        try:
            messages = conn.lines.feed(data)
        except P.ProtocolError as e:
            log.warning("dropped %s: %s", conn.addr, e)
            self._lost(conn, f"protocol error ({e})")
            return
        for msg in messages:
            if conn.closed or conn.closing:
                return
            self._dispatch(conn, msg)

    def _write(self, conn: Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._lost(conn, "connection closed while sending")
            return
        del conn.out[:sent]
        if not conn.out:
            if conn.closing:
                self._close(conn)
                return
            self.sel.modify(conn.sock, selectors.EVENT_READ, conn)
        else:
            self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _send(self, conn: Conn | None, op: str, **fields: Any) -> None:
        if conn is None or conn.closed:
            return
        conn.out += P.encode(op, **fields)
        self.pending.add(conn)

    def _send_and_close(self, conn: Conn, op: str, **fields: Any) -> None:
        self._send(conn, op, **fields)
        conn.closing = True

    def _flush(self) -> None:
        pending, self.pending = self.pending, set()
        for conn in pending:
            if conn.closed:
                continue
            if len(conn.out) > MAX_OUTBUF:
                self._lost(conn, "stopped reading its messages")
                continue
            self._write(conn)
            if conn.out and not conn.closed:
                self.pending.add(conn)

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _lost(self, conn: Conn, reason: str) -> None:
        """A connection ended. For a worker that had not said `done`, this is its death: the kernel closes the
        socket of a process that exits, so this is as immediate as the agent's `exited` report."""
        self._close(conn)
        if conn.role == "worker" and conn.rank is not None:
            member = self.members.get(conn.rank)
            if member is not None and member.conn is conn:
                self._death(member, reason, kill=True)
        elif conn.role == "agent" and conn.agent_host is not None:
            if self.agents.get(conn.agent_host) is conn:
                del self.agents[conn.agent_host]
                log.info("agent of %s disconnected (%s)", conn.agent_host, reason)

    # ---------------------------------------------------------------- messages

    def _dispatch(self, conn: Conn, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if conn.role is None:
            if op == P.REGISTER:
                self._register(conn, msg)
            elif op == P.AGENT_HELLO:
                self._agent_hello(conn, msg)
            else:
                log.warning("rejected %s: %r before registering", conn.addr, op)
                self._send_and_close(conn, P.REJECT, reason="register first", retry=False)
            return
        if conn.role == "worker":
            member = self.members.get(conn.rank) if conn.rank is not None else None
            if member is None or member.conn is not conn:
                return
            member.last_seen = self.clock()
            if op == P.HEARTBEAT:
                step = msg.get("step")
                member.step = step if isinstance(step, int) else member.step
            elif op == P.COMMIT:
                self._commit(member, msg)
            elif op == P.RECOVERED:
                self._recovered(member, msg)
            elif op == P.DONE:
                self._worker_done(conn, member)
            else:
                log.warning("%s sent unknown op %r (ignored)", member.node_id, op)
        elif conn.role == "agent":
            if op == P.EXITED:
                self._exited(conn, msg)
            elif op == P.GAVE_UP:
                self._gave_up(conn, msg)
            elif op == P.HEARTBEAT:
                pass
            else:
                log.warning("agent of %s sent unknown op %r (ignored)", conn.agent_host, op)

    def _token_ok(self, msg: dict[str, Any]) -> bool:
        given = msg.get("token")
        return isinstance(given, str) and hmac.compare_digest(given.encode(), self.cfg.token.encode())

    def _register(self, conn: Conn, msg: dict[str, Any]) -> None:
        node_id = msg.get("node_id")
        shown = node_id if isinstance(node_id, str) else "?"
        if not self._token_ok(msg):
            log.warning("rejected registration of %s from %s: wrong or missing job token", shown, conn.addr)
            self._send_and_close(conn, P.REJECT, reason="wrong or missing job token", retry=False)
            return
        rank, inc, pid, host = msg.get("rank"), msg.get("incarnation"), msg.get("pid"), msg.get("host")
        if not (isinstance(node_id, str) and isinstance(rank, int) and isinstance(inc, str) and inc
                and isinstance(pid, int) and isinstance(host, str)):
            log.warning("rejected malformed registration from %s", conn.addr)
            self._send_and_close(conn, P.REJECT, reason="malformed register message", retry=False)
            return
        world = msg.get("world_size")
        if world != self.cfg.world_size or not 0 <= rank < self.cfg.world_size:
            reason = (f"{node_id} claims rank {rank} of {world} workers, but the job has "
                      f"{self.cfg.world_size} ({E.MS_WORKER_NUM}); render the job again")
            log.warning("rejected %s from %s: %s", node_id, conn.addr, reason)
            self._send_and_close(conn, P.REJECT, reason=reason, retry=False)
            return
        where = f"pid {pid} on {host}, {conn.addr}"
        if inc in self.fenced:
            log.warning("fenced %s (%s): that incarnation was declared dead; told it to exit", node_id, where)
            self._send_and_close(conn, P.FENCED, reason=f"{node_id} (pid {pid}) was declared dead; a replacement "
                                 "takes its place")
            return
        if self.status != "running":
            self._send_and_close(conn, P.REJECT, reason=f"the job has {self.status}", retry=False)
            return
        if rank in self.done:
            self._send_and_close(conn, P.REJECT, reason=f"{node_id} already finished", retry=False)
            return
        now = self.clock()
        current = self.members.get(rank)
        if current is not None and current.incarnation != inc:
            age = now - current.last_seen
            reason = (f"{node_id} is held by a live process (pid {current.pid} on {current.host}, "
                      f"{current.addr}, heard from {age:.1f} s ago)")
            log.warning("rejected %s from %s: %s", node_id, where, reason)
            self._send_and_close(conn, P.REJECT, reason=reason, retry=True)
            return
        conn.role, conn.rank = "worker", rank
        self.ever_registered = True
        if current is not None:
            old = current.conn
            current.conn, current.addr, current.last_seen = conn, conn.addr, now
            if old is not None and old is not conn:
                old.role = None
                self._close(old)
            log.info("%s reconnected (%s), generation %d", node_id, where, self.generation)
        else:
            self.members[rank] = Member(rank, node_id, inc, pid, host, conn.addr, now, conn)
            self.hb_check_at = min(self.hb_check_at, now + self.cfg.node_timeout)
            self.node_host.setdefault(node_id, host)
            recovery = msg.get("recovery") if msg.get("recovery") in (P.RECOVERY_IN_PLACE, P.RECOVERY_RESTART) \
                else "unknown"
            log.info("registered %s (%s, %s recovery): %d of %d", node_id, where, recovery, len(self.members),
                     self.cfg.world_size)
            self.dirty = True
        self._send(conn, P.WELCOME, rank=rank, world_size=self.cfg.world_size, generation=self.generation,
                   job=self.cfg.job)
        if self.formed:
            self._send(conn, P.FORMED, generation=self.generation, prefix=self._prefix())
        else:
            self._maybe_form()

    def _agent_hello(self, conn: Conn, msg: dict[str, Any]) -> None:
        host = msg.get("host")
        if not self._token_ok(msg):
            log.warning("rejected agent hello from %s (host %s): wrong or missing job token", conn.addr, host)
            self._send_and_close(conn, P.REJECT, reason="wrong or missing job token", retry=False)
            return
        node_ids = msg.get("node_ids")
        if not isinstance(host, str) or not isinstance(node_ids, list):
            self._send_and_close(conn, P.REJECT, reason="malformed agent_hello", retry=False)
            return
        conn.role, conn.agent_host = "agent", host
        old = self.agents.get(host)
        if old is not None and old is not conn:
            old.role = None
            self._close(old)
        self.agents[host] = conn
        for node_id in node_ids:
            if isinstance(node_id, str):
                self.node_host[node_id] = host
        log.info("agent of %s connected from %s, supervising %s", host, conn.addr,
                 ", ".join(n for n in node_ids if isinstance(n, str)) or "nothing")
        if self.status == "finished":
            self._send(conn, P.FINISHED)
        elif self.status == "failed":
            self._send(conn, P.STOP, reason=self.failure)

    def _exited(self, conn: Conn, msg: dict[str, Any]) -> None:
        node_id, pid, code, sig = msg.get("node_id"), msg.get("pid"), msg.get("code"), msg.get("signal")
        if not isinstance(node_id, str):
            return
        rank = rank_of(node_id)
        if rank is None or rank >= self.cfg.world_size:
            log.info("agent of %s: %s (pid %s) exited with %s", conn.agent_host, node_id, pid, _how(code, sig))
            return
        member = self.members.get(rank)
        if code == 0 and sig is None:
            log.info("%s (pid %s on %s) exited 0", node_id, pid, conn.agent_host)
            if member is not None and member.pid == pid:
                self._retire(member)
            self._mark_done(rank)
            return
        if member is not None and member.pid == pid:
            self._death(member, f"its agent on {conn.agent_host} saw it exit with {_how(code, sig)}", kill=False)
        else:
            log.info("%s (pid %s on %s) exited with %s", node_id, pid, conn.agent_host, _how(code, sig))

    def _gave_up(self, conn: Conn, msg: dict[str, Any]) -> None:
        node_id = msg.get("node_id", "?")
        tail = msg.get("log_tail") or ""
        last = " | ".join(line for line in str(tail).strip().splitlines()[-5:])
        reason = (f"{node_id} on {conn.agent_host} failed after its last allowed restart "
                  f"({_how(msg.get('code'), msg.get('signal'))})" + (f"; last log lines: {last}" if last else ""))
        self._fail(reason, EXIT_FAILED)

    def _commit(self, member: Member, msg: dict[str, Any]) -> None:
        step = msg.get("step")
        if isinstance(step, int) and step > self.commits.get(member.rank, -1):
            self.commits[member.rank] = step
            self.commits_dirty = True

    def _recovered(self, member: Member, msg: dict[str, Any]) -> None:
        step, source, recomputed = msg.get("step"), msg.get("source"), msg.get("recomputed")
        origin = {"peer": f"rank {msg.get('from_rank')}'s memory", "checkpoint":
                  f"the checkpoint of rank {msg.get('from_rank')}", "initial": "the initial state"}.get(
                      str(source), str(source))
        log.info("%s trains again in generation %s from step %s, taken from %s in %s s; %s step(s) recomputed",
                 member.node_id, msg.get("generation"), step, origin, msg.get("seconds"), recomputed)

    def _worker_done(self, conn: Conn, member: Member) -> None:
        log.info("%s finished (pid %s on %s)", member.node_id, member.pid, member.host)
        self._retire(member)
        conn.role = "finished"
        self._mark_done(member.rank)

    def _retire(self, member: Member) -> None:
        """A member that ended cleanly leaves without a generation change: nothing to recover from."""
        if self.members.get(member.rank) is member:
            del self.members[member.rank]
            self.dirty = True

    def _mark_done(self, rank: int) -> None:
        if rank not in self.done:
            self.done.add(rank)
            self.dirty = True
        if len(self.done) == self.cfg.world_size and self.status == "running":
            self.status = "finished"
            log.info("all %d workers finished: job %s done", self.cfg.world_size, self.cfg.job)
            for agent in self.agents.values():
                self._send(agent, P.FINISHED)
            self.exit_code = EXIT_OK

    # ---------------------------------------------------------------- membership and generations

    def _prefix(self) -> str:
        return P.store_prefix(self.cfg.job, self.boot, self.generation)

    def _maybe_form(self) -> None:
        if self.formed or self.status != "running":
            return
        present = sum(1 for m in self.members.values() if m.conn is not None)
        if present < self.cfg.world_size:
            return
        self.formed = True
        self.ever_formed = True
        self.dirty = True
        since = self.gather_since if self.gather_since is not None else self.started
        self.gather_since = None
        log.info("generation %d formed: %d workers in %.3f s; store prefix %s", self.generation,
                 self.cfg.world_size, self.clock() - since, self._prefix())
        for member in self.members.values():
            self._send(member.conn, P.FORMED, generation=self.generation, prefix=self._prefix())

    def _death(self, member: Member, reason: str, kill: bool) -> None:
        """Declare `member` dead: fence its incarnation, have its agent kill it if it may still exist, and, if the
        job was formed, move everyone to a new generation."""
        if self.members.get(member.rank) is not member:
            return
        del self.members[member.rank]
        self.fenced.add(member.incarnation)
        self.dirty = True
        if member.conn is not None and not member.conn.closed:
            member.conn.role = None
            self._send_and_close(member.conn, P.FENCED, reason=f"declared dead: {reason}")
        agent = self.agents.get(self.node_host.get(member.node_id, ""))
        if kill and agent is not None:
            self._send(agent, P.KILL, node_id=member.node_id, pid=member.pid)
        if self.status != "running":
            return
        if self.formed:
            self.generation += 1
            self.formed = False
            self.gather_since = self.clock()
            log.warning("%s (pid %d on %s) is dead: %s; generation %d begins, waiting for its replacement",
                        member.node_id, member.pid, member.host, reason, self.generation)
            for other in self.members.values():
                self._send(other.conn, P.GENERATION, generation=self.generation)
        else:
            log.warning("%s (pid %d on %s) is dead: %s; generation %d still gathering", member.node_id,
                        member.pid, member.host, reason, self.generation)

    def _fail(self, reason: str, code: int) -> None:
        if self.status != "running":
            return
        self.status = "failed"
        self.failure = reason
        self.dirty = True
        log.error("job %s failed: %s", self.cfg.job, reason)
        for agent in self.agents.values():
            self._send(agent, P.STOP, reason=reason)
        for member in self.members.values():
            self._send(member.conn, P.STOP, reason=reason)
        self.exit_code = code

    def _next_deadline(self, now: float) -> float:
        deadlines = [now + MAX_WAIT]
        if self.gather_since is not None and not self.unmanaged:
            deadlines.append(self.gather_since + self.cfg.topo_timeout)
        if self.members:
            deadlines.append(self.hb_check_at)
        if self.commits_dirty:
            deadlines.append(self.commits_persist_at)
        return max(0.0, min(deadlines) - now)

    def _check_deadlines(self, now: float) -> None:
        if self.status != "running":
            return
        if now >= self.hb_check_at:
            # Heartbeats only move last_seen later, so the earliest expiry found here is a safe bound for the
            # next scan: with hundreds of members, most loop turns skip the scan.
            for member in list(self.members.values()):
                silent = now - member.last_seen
                if silent >= self.cfg.node_timeout:
                    what = "did not reconnect" if member.conn is None else "sent no heartbeat"
                    self._death(member, f"{what} for {silent:.1f} s "
                                f"({E.MS_NODE_TIMEOUT}={self.cfg.node_timeout:g})", kill=True)
            self.hb_check_at = min((m.last_seen + self.cfg.node_timeout for m in self.members.values()),
                                   default=float("inf"))
        if self.gather_since is not None and not self.unmanaged and now >= self.gather_since + self.cfg.topo_timeout:
            self._formation_timeout(now)

    def _formation_timeout(self, now: float) -> None:
        missing = [r for r in range(self.cfg.world_size)
                   if r not in self.done and (r not in self.members or self.members[r].conn is None)]
        attested = [r for r in missing if self.node_host.get(P.worker_node_id(r)) in self.agents]
        if not self.ever_registered and missing and len(attested) == len(missing):
            self.unmanaged = True
            self.gather_since = None
            log.warning("no worker registered within %s=%g s, but every one runs under its agent: treating them "
                        "as scripts without toolkit.train (the store still serves them; no heartbeats or "
                        "generations)", E.MS_TOPO_TIMEOUT, self.cfg.topo_timeout)
            return
        names = []
        for r in missing:
            node_id = P.worker_node_id(r)
            host = self.node_host.get(node_id)
            names.append(f"{node_id} (expected on {host})" if host else node_id)
        what = f"re-forming generation {self.generation}" if self.ever_formed else "cluster formation"
        reason = (f"{what} timed out after {self.cfg.topo_timeout:g} s ({E.MS_TOPO_TIMEOUT}): "
                  f"{len(missing)} of {self.cfg.world_size} workers never registered: {', '.join(names)}; "
                  f"check their logs (logs/worker_<rank>.log) and that they reach "
                  f"{self.cfg.host}:{self.cfg.port}")
        self._fail(reason, EXIT_FORMATION)

    # ---------------------------------------------------------------- persistence

    def _state_path(self) -> Path | None:
        if not self.cfg.recovery or self.cfg.recovery_path is None:
            return None
        return self.cfg.recovery_path / STATE_FILE

    def _persist(self, force: bool = False) -> None:
        path = self._state_path()
        now = self.clock()
        commits_due = self.commits_dirty and now >= self.commits_persist_at
        if path is None or not (self.dirty or force or commits_due):
            return
        committed = min(self.commits.values()) if len(self.commits) == self.cfg.world_size else None
        state = {
            "version": STATE_VERSION, "job": self.cfg.job, "world_size": self.cfg.world_size,
            "status": self.status, "failure": self.failure, "generation": self.generation, "formed": self.formed,
            "members": [m.to_json() for m in sorted(self.members.values(), key=lambda m: m.rank)],
            "done": sorted(self.done), "fenced": sorted(self.fenced),
            "commits": {str(r): s for r, s in sorted(self.commits.items())}, "committed_step": committed,
        }
        try:
            _atomic_write(path, json.dumps(state, indent=1).encode())
        except OSError as e:
            log.error("cannot persist the state to %s: %s (recovery after a scheduler crash would lose it)",
                      path, e.strerror)
            return
        self.dirty = self.commits_dirty = False
        self.commits_persist_at = now + COMMIT_PERSIST_INTERVAL

    def _restore(self) -> None:
        path = self._state_path()
        if path is None:
            return
        try:
            state = json.loads(path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: unreadable scheduler state ({e}); move it away to start the job afresh") \
                from None
        if state.get("job") != self.cfg.job or state.get("world_size") != self.cfg.world_size:
            raise ConfigError(
                f"{path} belongs to job {state.get('job')!r} with {state.get('world_size')} workers, not "
                f"{self.cfg.job!r} with {self.cfg.world_size}; point {E.MS_RECOVERY_PATH} elsewhere or remove it")
        if state.get("status") != "running":
            log.info("the previous run of job %s %s (committed step %s): this run starts at generation 0, its "
                     "workers resume from their own checkpoints%s", self.cfg.job, state.get("status"),
                     state.get("committed_step"), "; 'fleet train --fresh' starts a finished job over"
                     if state.get("status") == "finished" else "")
            self.fenced = set(state.get("fenced", []))
            return
        now = self.clock()
        self.generation = int(state["generation"])
        self.formed = bool(state["formed"])
        self.gather_since = None if self.formed else now
        self.done = {int(r) for r in state.get("done", [])}
        self.fenced = set(state.get("fenced", []))
        self.commits = {int(r): int(s) for r, s in state.get("commits", {}).items()}
        for m in state.get("members", []):
            self.members[int(m["rank"])] = Member(int(m["rank"]), m["node_id"], m["incarnation"], int(m["pid"]),
                                                  m["host"], m["addr"], now, None)
            self.node_host.setdefault(m["node_id"], m["host"])
        self.ever_registered = bool(self.members) or bool(self.fenced)
        self.ever_formed = self.formed or self.generation > 0
        self.hb_check_at = now + self.cfg.node_timeout
        log.info("resumed job %s from %s: generation %d (%s), %d members waiting to reconnect within %g s",
                 self.cfg.job, path, self.generation, "formed" if self.formed else "gathering", len(self.members),
                 self.cfg.node_timeout)


def _atomic_write(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename, fsync the directory: a crash leaves the old state or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _warn_if_token_readable(path: str) -> None:
    """The token is the only thing keeping strangers out of the job; say so if others can read it."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        return
    if mode & 0o077:
        log.warning("%s=%s is readable by others (mode %o): chmod 600 it", E.TOOLKIT_TOKEN_FILE, path, mode)


def _how(code: Any, sig: Any) -> str:
    if sig:
        return f"signal {sig}"
    return f"exit code {code}"


def main() -> int:
    logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                        format="%(asctime)s.%(msecs)03d sched %(levelname)s %(message)s", datefmt="%Y-%m-%dT%H:%M:%S")
    try:
        config = Config.from_env(os.environ)
        _warn_if_token_readable(os.environ[E.TOOLKIT_TOKEN_FILE])
        return Scheduler(config).serve()
    except ConfigError as e:
        log.error("%s", e)
        print(f"scheduler: error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
