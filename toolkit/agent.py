"""The per-host supervisor: `python -m toolkit.agent --job-dir DIR`.

It starts this host's processes (the scheduler if it lives here, and the workers) from host.json, each in its own
session with its env file and log file, and keeps them alive: a child's death is an event on its pidfd, reported
to the scheduler at once (so the other workers roll back without waiting for a heartbeat to expire) and followed
by a relaunch with the same environment and rank. One thread, one selector loop: children's pidfds, the control
socket, the progress socket, the scheduler link, signals (through the wakeup fd) and timers.

Restart policy, per process (`max_restarts`, default 3; `backoff_base`, `backoff_max`, `healthy_reset`):
the first restart is immediate (time to recovery matters), the next ones wait backoff_base * 2^(k-1) seconds,
capped at backoff_max, unless the process had trained since its launch (reported a step or joined its group: a
crash loop never does), which restarts at once; a process that ran healthy_reset seconds before dying starts its
count again. Past
max_restarts the job fails: the agent reports `gave_up` with the exit status and the last lines of the log,
stops every local child and exits non-zero (the scheduler stops the other hosts). Compared with torchrun:
torchrun's --max-restarts (0 by default on its command line, 3 in its LaunchConfig) is one budget for the whole
worker group that never refills, every failure restarts *all* workers (restart the world), and there is no
backoff (a crash loop ends in ~2 s); here the budget is per process, only the dead process restarts, the delay
grows, and a long healthy run refills the budget. A manual restart (recover.sh, `fab restart --node`) does not
count.

Subcommands (client side of the agent's sockets, used by launch.sh, recover.sh, stop.sh and the Fabric tasks):

    python -m toolkit.agent [run] --job-dir DIR       supervise in the foreground
    python -m toolkit.agent start --job-dir DIR       start detached unless already running (launch.sh)
    python -m toolkit.agent restart --job-dir DIR N   restart process N through the agent (recover.sh)
    python -m toolkit.agent status --job-dir DIR      print agent.json, with "alive"
    python -m toolkit.agent stop --job-dir DIR        SIGTERM, bounded wait, SIGKILL; verify nothing is left
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import heapq
import itertools
import json
import math
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from toolkit import atomicfile
from toolkit import envvars as E
from toolkit import netif, procs
from toolkit import protocol as P
from toolkit import standby
from toolkit.errors import UserError
from toolkit.procs import Child, ExitStatus, LaunchSpec
from toolkit.session import Unproven, open_session

# Named intervals and bounds.
LINK_RETRY_INTERVAL = 1.0  # s between attempts to reach the scheduler while it is down
LINK_REJECTED_RETRY = 10.0  # s before trying again after the scheduler rejected us (e.g. a token being re-deployed)
LINK_CONNECT_TIMEOUT = 3.0  # s for one TCP connect to the scheduler
REPORT_FLUSH_TIMEOUT = 3.0  # s to deliver the last reports (gave_up) before exiting
PROGRESS_WRITE_INTERVAL = 1.0  # s: agent.json is rewritten for progress at most this often
SPARE_DELAY = 10.0  # s after a launch before the warm spare is (re)built, unless every worker already made progress
SPARE_MAX_FAILURES = 3  # spares that die on their own before the agent stops making them
IDLE_WAKE = 30.0  # s: the loop wakes at least this often (nothing depends on it; it bounds every select)
CLIENT_TIMEOUT = 5.0  # s for one control-socket conversation, either side
START_TIMEOUT = 30.0  # s for a detached agent to say it is up
STOP_MARGIN = 10.0  # s beyond the grace period that `stop` waits for the agent to finish stopping
LOG_TAIL_LINES = 20
QUEUE_LIMIT = 1000  # reports held for the scheduler while it is unreachable
MAX_CONTROL_LINE = 64 << 10
GAVE_UP_TAIL_BYTES = 8 << 10  # of the log tail sent with gave_up (a message is at most protocol.MAX_LINE)
EXIT_HISTORY = 10

EXIT_OK = 0
EXIT_FAILED = 1  # a process passed max_restarts here, or the scheduler stopped the job
EXIT_USAGE = 2  # bad host.json or command line (UserError)
EXIT_STOPPED = 3  # stopped by the operator (SIGTERM, stop)

FINAL_STATES = ("succeeded", "failed", "stopped")


# --- the spec: host.json --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcSpec:
    """One process this host runs; paths are absolute."""

    node_id: str
    role: str
    rank: int | None
    local_rank: int | None
    argv: tuple[str, ...]
    cwd: str
    env_file: str
    log_file: str

    @property
    def is_worker(self) -> bool:
        return self.role == E.ROLE_WORKER


@dataclass(frozen=True)
class RestartDecision:
    give_up: bool
    delay: float
    counted: int  # restarts counted against max_restarts once this one is done


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3
    backoff_base: float = 1.0
    backoff_max: float = 30.0
    healthy_reset: float = 300.0

    def backoff(self, counted: int) -> float:
        """Delay before the restart that follows `counted` counted restarts: 0, base, 2 base, 4 base ... max."""
        if counted <= 0:
            return 0.0
        return min(self.backoff_base * 2.0 ** min(counted - 1, 62), self.backoff_max)

    def after_failure(self, counted: int, ran_for: float, progressed: bool = False) -> RestartDecision:
        """What to do after a failed exit, `counted` restarts already counted. Every failure counts against
        max_restarts (a run of healthy_reset seconds refills the budget). The backoff is for crash loops, which
        never get to train: a process that had made progress (reported a step, or joined its group) since its
        launch is relaunched at once, however many faults came before."""
        if ran_for >= self.healthy_reset:
            counted = 0
        if counted >= self.max_restarts:
            return RestartDecision(True, 0.0, counted)
        return RestartDecision(False, 0.0 if progressed else self.backoff(counted), counted + 1)


@dataclass(frozen=True)
class HostSpec:
    job: str
    host: str
    job_dir: Path
    sched_host: str
    sched_port: int
    token_file: Path
    policy: RestartPolicy
    grace: float
    bind_core: bool
    warm_spare: bool
    processes: tuple[ProcSpec, ...]

    @property
    def state_dir(self) -> Path:
        return self.job_dir / "state"

    @property
    def agent_json(self) -> Path:
        return self.state_dir / "agent.json"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "agent.pid"

    @property
    def lock_file(self) -> Path:
        return self.state_dir / "agent.lock"

    @property
    def control_socket(self) -> Path:
        return self.state_dir / "agent.sock"

    @property
    def progress_socket(self) -> Path:
        return self.state_dir / "progress.sock"

    @property
    def agent_log(self) -> Path:
        return self.job_dir / "logs" / "agent.log"

    @property
    def standby_log(self) -> Path:
        return self.job_dir / "logs" / "standby.log"

    def proc(self, node_id: str) -> ProcSpec | None:
        return next((p for p in self.processes if p.node_id == node_id), None)


def load_spec(job_dir: str | Path) -> HostSpec:
    """Read and check host.json; every problem is one line naming the file and the key."""
    job_dir = Path(job_dir).resolve()
    path = job_dir / "host.json"
    where = str(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; --job-dir must be a job directory rendered by fleet deploy") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: line {e.lineno}: not valid JSON ({e.msg}); re-render the job") from None
    if not isinstance(doc, dict):
        raise UserError(f"{where}: expected a JSON object; re-render the job")

    def get(obj: dict, key: str, kind: type | tuple, label: str, default: Any = ..., check=None, hint: str = ""):
        if key not in obj:
            if default is ...:
                raise UserError(f"{where}: {label} is missing; re-render the job")
            return default
        value = obj[key]
        bad = isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))
        if bad or not isinstance(value, kind) or (check is not None and not check(value)):
            raise UserError(f"{where}: {label}={json.dumps(value)}: {hint or 'wrong type'}")
        return value

    if get(doc, "version", int, "version") != 1:
        raise UserError(f"{where}: version {doc['version']} is not supported by this toolkit (1); update toolkit")
    nonneg = lambda v: 0 <= v < math.inf  # noqa: E731
    sched = get(doc, "scheduler", dict, "scheduler")
    policy = RestartPolicy(
        max_restarts=get(doc, "max_restarts", int, "max_restarts", 3, nonneg, "give 0 or more"),
        backoff_base=float(get(doc, "backoff_base", (int, float), "backoff_base", 1.0, nonneg, "give 0 or more")),
        backoff_max=float(get(doc, "backoff_max", (int, float), "backoff_max", 30.0, nonneg, "give 0 or more")),
        healthy_reset=float(get(doc, "healthy_reset", (int, float), "healthy_reset", 300.0, lambda v: v > 0,
                                "give a positive number of seconds")),
    )
    raw = get(doc, "processes", list, "processes", check=lambda v: len(v) > 0, hint="a host runs at least one")
    processes = []
    seen: set[str] = set()
    for i, p in enumerate(raw):
        label = f"processes[{i}]"
        if not isinstance(p, dict):
            raise UserError(f"{where}: {label}: expected an object; re-render the job")
        node_id = get(p, "node_id", str, f"{label}.node_id", check=lambda v: v and "/" not in v,
                      hint="a non-empty name without '/'")
        if node_id in seen:
            raise UserError(f"{where}: {label}.node_id={node_id!r} appears twice; every process needs its own")
        seen.add(node_id)
        argv = get(p, "argv", list, f"{label}.argv", check=lambda v: v and all(isinstance(a, str) for a in v),
                   hint="a non-empty list of strings")
        opt_int = (int, type(None))
        processes.append(ProcSpec(
            node_id=node_id,
            role=get(p, "role", str, f"{label}.role", check=lambda v: v in (E.ROLE_SCHED, E.ROLE_WORKER),
                     hint=f"{E.ROLE_SCHED} or {E.ROLE_WORKER}"),
            rank=get(p, "rank", opt_int, f"{label}.rank", None),
            local_rank=get(p, "local_rank", opt_int, f"{label}.local_rank", None),
            argv=tuple(argv),
            cwd=str(job_dir / get(p, "cwd", str, f"{label}.cwd", ".")),
            env_file=str(job_dir / get(p, "env_file", str, f"{label}.env_file")),
            log_file=str(job_dir / get(p, "log_file", str, f"{label}.log_file", f"logs/{node_id}.log")),
        ))
    spec = HostSpec(
        job=get(doc, "job", str, "job"),
        host=get(doc, "host", str, "host"),
        job_dir=job_dir,
        sched_host=get(sched, "host", str, "scheduler.host"),
        sched_port=get(sched, "port", int, "scheduler.port", check=lambda v: 0 < v < 65536, hint="not a port"),
        token_file=job_dir / get(doc, "token_file", str, "token_file", "token"),
        policy=policy,
        grace=float(get(doc, "grace", (int, float), "grace", 10.0, nonneg, "give 0 or more seconds")),
        bind_core=get(doc, "bind_core", bool, "bind_core", False),
        warm_spare=get(doc, "warm_spare", bool, "warm_spare", True),
        processes=tuple(processes),
    )
    for sock in (spec.control_socket, spec.progress_socket):
        if len(os.fsencode(str(sock))) > 107:
            raise UserError(f"{sock}: longer than a unix socket path may be (107 bytes); use a shorter --workdir")
    return spec


def cpu_sets(cpus: set[int] | frozenset[int], n: int, host: str = "this host") -> list[frozenset[int]]:
    """`n` disjoint CPU sets of equal size from `cpus`, in order (msrun's --bind_core: each worker its own)."""
    if n == 0:
        return []
    ordered = sorted(cpus)
    if len(ordered) < n:
        raise UserError(f"{host}: bind_core needs one CPU per worker, but {n} workers share {len(ordered)} usable "
                        f"CPUs ({','.join(map(str, ordered))}); run fewer workers there or turn bind_core off")
    size = len(ordered) // n
    return [frozenset(ordered[i * size:(i + 1) * size]) for i in range(n)]


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of a log, read from its end (logs grow without bound)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


# --- the agent's own log ------------------------------------------------------------------------------------


class AgentLog:
    """Lines `time host:who: message` appended to logs/agent.log, and to stderr when that is somewhere else."""

    def __init__(self, path: Path, host: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.host = host
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        mine = os.fstat(self._fd)
        try:
            err = os.fstat(2)
            self._mirror = (err.st_dev, err.st_ino) != (mine.st_dev, mine.st_ino)
        except OSError:
            self._mirror = False

    def __call__(self, who: str, message: str) -> None:
        stamp = iso(time.time())
        text = "".join(f"{stamp} {self.host}:{who}: {line}\n" for line in message.splitlines() or [""])
        data = text.encode(errors="replace")
        os.write(self._fd, data)
        if self._mirror:
            try:
                os.write(2, data)
            except OSError:
                self._mirror = False

    def close(self) -> None:
        os.close(self._fd)


# --- timers ------------------------------------------------------------------------------------------------


class Timer:
    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    """Deadlines of the event loop (backoffs, grace periods, retries), in one heap on the monotonic clock."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()

    def after(self, delay: float, fn: Callable[[], None]) -> Timer:
        t = Timer(time.monotonic() + max(0.0, delay), fn)
        heapq.heappush(self._heap, (t.when, next(self._seq), t))
        return t

    def timeout(self, cap: float) -> float:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        if not self._heap:
            return cap
        return min(cap, max(0.0, self._heap[0][0] - time.monotonic()))

    def run_due(self) -> None:
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            _, _, t = heapq.heappop(self._heap)
            if not t.cancelled:
                t.cancelled = True
                t.fn()


# --- runtime state of one process ----------------------------------------------------------------------------


class Slot:
    """What the agent knows of one process across its incarnations."""

    def __init__(self, spec: ProcSpec, cpus: frozenset[int] | None) -> None:
        self.spec = spec
        self.cpus = cpus
        self.child: Child | None = None
        self.state = "pending"  # running, backoff, restarting, succeeded, failed, stopped
        self.launches = 0
        self.counted = 0
        self.started_mono = 0.0
        self.started_wall: float | None = None
        self.warm = False
        self.last_exit: dict[str, Any] | None = None
        self.exits: list[dict[str, Any]] = []
        self.step: int | None = None
        self.epoch: int | None = None
        self.step_at: float | None = None
        self.progressed = False  # progress reported since the latest launch
        self.timer: Timer | None = None
        self.next_start: float | None = None
        self.manual = False  # the operator asked for a restart: the coming death is expected and not counted
        self.kill_timer: Timer | None = None
        self.pids: list[int] = []
        self.last_pid: int | None = None  # the latest incarnation (running or not): what `stop` verifies
        self.last_ticks: int | None = None
        self.seen_dead: float | None = None  # monotonic time the latest death was seen, until the relaunch
        self.recovery: str | None = None  # how the worker said it recovers (protocol.RECOVERY_*), once it did

    def document(self, policy: RestartPolicy) -> dict[str, Any]:
        c = self.child
        return {
            "node_id": self.spec.node_id, "role": self.spec.role, "rank": self.spec.rank,
            "local_rank": self.spec.local_rank, "state": self.state,
            "pid": c.pid if c else None, "pgid": c.pgid if c else None, "start_ticks": c.start_ticks if c else None,
            "last_pid": self.last_pid, "last_start_ticks": self.last_ticks,
            "started_at": iso(self.started_wall), "warm": self.warm if c else None,
            "restarts": max(0, self.launches - 1), "counted_restarts": self.counted,
            "max_restarts": policy.max_restarts, "next_start_at": iso(self.next_start),
            "last_exit": self.last_exit, "exits": self.exits,
            "step": self.step, "epoch": self.epoch, "step_at": iso(self.step_at), "recovery": self.recovery,
            "cpus": sorted(self.cpus) if self.cpus else None,
            "log_file": self.spec.log_file, "argv": list(self.spec.argv),
        }


class Spare:
    """A warm interpreter waiting on `sock` (see toolkit.standby)."""

    def __init__(self, child: Child, sock: socket.socket, interpreter: str) -> None:
        self.child, self.sock, self.interpreter = child, sock, interpreter
        self.ready = False
        self.started = time.monotonic()


# --- the scheduler link ----------------------------------------------------------------------------------------


class SchedulerLink:
    """The agent's one connection to the scheduler, driven by the agent's selector. Never blocks the loop: a
    down scheduler means reports wait in a queue (an `exited` per node coalesced to the latest) and a reconnect
    is tried every LINK_RETRY_INTERVAL.

    States: down -> connecting (TCP) -> hello (the server's challenge answered, its proof awaited) -> up. Nothing
    the scheduler says is acted on, and no report is sent, before it proved the job token (toolkit.protocol)."""

    def __init__(self, spec: HostSpec, sel: selectors.BaseSelector, timers: Timers, log: AgentLog,
                 on_message: Callable[[dict[str, Any]], None], on_change: Callable[[], None]) -> None:
        self.spec, self.sel, self.timers, self.log = spec, sel, timers, log
        self.on_message, self.on_change = on_message, on_change
        self.sock: socket.socket | None = None
        self.state = "down"
        self.since = time.time()
        self.queue: list[tuple[str | None, bytes]] = []  # (node_id of a coalescible exited report, message)
        self.wbuf = bytearray()
        self.lines = P.LineBuffer()
        self.retry: Timer | None = None
        self.connect_timer: Timer | None = None
        self.nonces: tuple[str, str] | None = None  # (server's, ours) while the hello is unanswered
        self.token = ""  # read from the token file at each connection (a re-deploy may have replaced it)
        self.closed = False
        self._said_down = False

    def start(self) -> None:
        self._attempt()

    def report(self, op: str, coalesce: str | None = None, **fields: Any) -> None:
        msg = P.encode(op, **fields)
        if coalesce is not None:
            self.queue = [q for q in self.queue if q[0] != coalesce]
        self.queue.append((coalesce, msg))
        if len(self.queue) > QUEUE_LIMIT:
            del self.queue[0]
        if self.state == "up":
            self._pump()

    def _set(self, state: str) -> None:
        if state != self.state:
            self.state, self.since = state, time.time()
            self.on_change()

    def _attempt(self) -> None:
        self.retry = None
        if self.closed or self.state != "down":
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
        self.lines = P.LineBuffer()
        self.nonces = None
        self._set("connecting")
        self.sel.register(sock, selectors.EVENT_WRITE, self._on_event)
        self.connect_timer = self.timers.after(LINK_CONNECT_TIMEOUT, lambda: self._drop("connect timed out"))

    def _on_event(self, mask: int) -> None:
        if self.sock is None:
            return
        if self.state == "connecting" and mask & selectors.EVENT_WRITE and self.nonces is None:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._drop(os.strerror(err))
                return
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sel.modify(self.sock, selectors.EVENT_READ, self._on_event)  # the challenge comes first
            return
        if mask & selectors.EVENT_READ:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError as e:
                self._drop(str(e))
                return
            if data == b"":
                self._drop("the scheduler closed the connection")
                return
            if data:
                try:
                    messages = self.lines.feed(data)
                    for msg in messages:
                        if not self._handle(msg) or self.sock is None:
                            return
                except P.ProtocolError as e:
                    self._drop(f"bad message from the scheduler: {e}")
                    return
        if mask & selectors.EVENT_WRITE and self.sock is not None:
            self._pump()

    def _handle(self, msg: dict[str, Any]) -> bool:
        """One message; False once the link was dropped."""
        if self.state == "connecting":
            server_nonce = P.challenge_nonce(msg)
            try:
                token = self.spec.token_file.read_text(encoding="utf-8").strip()
            except OSError as e:
                self._drop(f"cannot read the job token {self.spec.token_file}: {e}")
                return False
            hello, nonce = P.hello(P.AGENT_HELLO, token, server_nonce, host=self.spec.host,
                                   node_ids=[p.node_id for p in self.spec.processes])
            self.nonces = (server_nonce, nonce)
            self.token = token
            self.wbuf = bytearray(hello)
            self._set("hello")
            self._pump()
            return self.sock is not None
        if self.state == "hello":
            assert self.nonces is not None
            if not P.check_server(self.token, *self.nonces, msg):
                reason = str(msg.get("reason"))[:300] if msg.get("op") == P.REJECT else f"{msg['op'][:40]} unproven"
                self.log("agent", f"the scheduler's answer did not prove the job token ({reason}): a wrong token "
                                  "here, or not this job's scheduler")
                self._drop("unproven answer", LINK_REJECTED_RETRY)
                return False
            if msg["op"] == P.REJECT:
                self.log("agent", f"the scheduler rejected this agent: {str(msg.get('reason'))[:300]}")
                self._drop("rejected", LINK_REJECTED_RETRY)
                return False
            if self.connect_timer:
                self.connect_timer.cancel()
            self.nonces = None
            self._set("up")
            self._said_down = False
            self.log("agent", f"connected to the scheduler at {self.spec.sched_host}:{self.spec.sched_port}")
            self._pump()
            return self.sock is not None
        self.on_message(msg)
        return True

    def _pump(self) -> None:
        if self.state == "up":
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

    def _drop(self, why: str, retry: float = LINK_RETRY_INTERVAL) -> None:
        if self.connect_timer:
            self.connect_timer.cancel()
        if self.sock is not None:
            self.sel.unregister(self.sock)
            self.sock.close()
            self.sock = None
        self.wbuf.clear()
        self.nonces = None
        self._down(why, retry)

    def _down(self, why: str, retry: float = LINK_RETRY_INTERVAL) -> None:
        if self.closed:
            return
        if not self._said_down:
            self.log("agent", f"scheduler {self.spec.sched_host}:{self.spec.sched_port} unreachable ({why}); "
                              f"retrying every {retry:g} s, supervision goes on")
            self._said_down = True
        self._set("down")
        if not self.closed:
            self.retry = self.timers.after(retry, self._attempt)

    def flush(self, timeout: float) -> bool:
        """At exit: deliver what is queued within `timeout`, connecting if needed; True if nothing is left."""
        self.closed = True
        if self.retry:
            self.retry.cancel()
        if not self.queue and not (self.state == "up" and self.wbuf):
            return True
        deadline = time.monotonic() + timeout
        if self.state != "up":
            if self.sock is not None:
                self.sel.unregister(self.sock)
                self.sock.close()
                self.sock = None
            try:
                token = self.spec.token_file.read_text(encoding="utf-8").strip()
                fields = {"host": self.spec.host, "node_ids": [p.node_id for p in self.spec.processes]}
                session = open_session((self.spec.sched_host, self.spec.sched_port), token, P.AGENT_HELLO, fields,
                                       timeout, min(timeout, LINK_CONNECT_TIMEOUT))
            except (OSError, P.ProtocolError, Unproven):
                return False
            if session.reply.get("op") != P.WELCOME:
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
        self.closed = True
        self.state = "closed"
        if self.retry:
            self.retry.cancel()
        if self.connect_timer:
            self.connect_timer.cancel()
        if self.sock is not None:
            try:
                self.sel.unregister(self.sock)
            except (KeyError, ValueError):
                pass
            self.sock.close()
            self.sock = None


# --- the supervisor ------------------------------------------------------------------------------------------


class Agent:
    def __init__(self, spec: HostSpec, log: AgentLog) -> None:
        self.spec, self.log = spec, log
        self.sel = selectors.DefaultSelector()
        self.timers = Timers()
        workers = [p for p in spec.processes if p.is_worker]
        sets = cpu_sets(os.sched_getaffinity(0), len(workers), spec.host) if spec.bind_core else []
        by_node = dict(zip((p.node_id for p in workers), sets))
        self.slots = {p.node_id: Slot(p, by_node.get(p.node_id)) for p in spec.processes}
        self.state = "starting"
        self.reason: str | None = None
        self.exit_code: int | None = None
        self.failure: dict[str, Any] | None = None
        self.closing = False  # finishing or stopping: nothing is relaunched any more
        self.pid = os.getpid()
        self.ticks = procs.start_ticks(self.pid)
        self.started = time.time()
        self.base_env = dict(os.environ)  # a copy: the agent's own environment is never written
        if E.GLOO_SOCKET_IFNAME not in self.base_env:  # gloo's own choice is loopback where the hostname misleads
            interface = netif.interface_toward(spec.sched_host, spec.sched_port)
            if interface is not None:
                self.base_env[E.GLOO_SOCKET_IFNAME] = interface
        self.spare: Spare | None = None
        self.spare_timer: Timer | None = None
        self.spare_failures = 0
        self.spare_enabled = spec.warm_spare and bool(workers)
        self.progress_dirty = False
        self.progress_timer: Timer | None = None
        self.last_write = 0.0
        self.link = SchedulerLink(spec, self.sel, self.timers, log, self._on_scheduler, self._changed)
        self._stop_after: Timer | None = None
        self._wake_r: socket.socket | None = None
        self._control: socket.socket | None = None
        self._progress: socket.socket | None = None

    # -- life cycle

    def run(self, ready: Callable[[str], None] | None = None) -> int:
        try:
            self._setup()
        except BaseException:
            self._close_sockets()
            raise
        self.log("agent", f"agent pid {self.pid} supervising {', '.join(self.slots)} of job {self.spec.job} "
                          f"(max_restarts {self.spec.policy.max_restarts}, grace {self.spec.grace:g} s, "
                          f"warm spare {'on' if self.spare_enabled else 'off'}"
                          f"{', bind_core' if self.spec.bind_core else ''})")
        for slot in sorted(self.slots.values(), key=lambda s: s.spec.is_worker):
            self._launch(slot, "first start")
        if self.state == "starting":
            self.state = "running"
        self._write()
        self.link.start()
        if self.spare_enabled:
            self.spare_timer = self.timers.after(SPARE_DELAY, self._start_spare)
        if ready is not None:
            ready(f"ready {self.pid}")
        while self.exit_code is None:
            for key, mask in self.sel.select(self.timers.timeout(IDLE_WAKE)):
                if self.sel.get_map().get(key.fd) is not key:
                    continue  # unregistered by an earlier event of this batch
                key.data(mask)
                if self.exit_code is not None:
                    break
            self.timers.run_due()
        return self._shutdown()

    def _setup(self) -> None:
        spec = self.spec
        spec.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._reclaim_previous()
        atomicfile.write(spec.pid_file, f"{self.pid} {self.ticks}\n")
        self._wake_r, wake_w = socket.socketpair()
        self._wake_w = wake_w
        for s in (self._wake_r, wake_w):
            s.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # the number arrives through the wakeup fd
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._on_signal)

        spec.control_socket.unlink(missing_ok=True)
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control.bind(str(spec.control_socket))
        os.chmod(spec.control_socket, 0o600)  # whoever can talk to it can stop the job
        self._control.listen(16)
        self._control.setblocking(False)
        self.sel.register(self._control, selectors.EVENT_READ, self._on_accept)

        spec.progress_socket.unlink(missing_ok=True)
        self._progress = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._progress.bind(str(spec.progress_socket))
        os.chmod(spec.progress_socket, 0o600)
        self._progress.setblocking(False)
        self.sel.register(self._progress, selectors.EVENT_READ, self._on_progress)

    def _reclaim_previous(self) -> None:
        """A previous agent of this job was killed (we hold the lock, so it is not running): whatever is left
        of the process groups it recorded must not run on unsupervised."""
        for node_id, pgid, ticks in _recorded_groups(self.spec):
            killed = procs.reclaim_group(pgid, ticks)
            if killed:
                self.log(node_id, f"killed {len(killed)} process(es) left running by the previous agent in "
                                  f"group {pgid}: {killed}")

    def _finish(self, state: str, code: int, reason: str | None) -> None:
        """Leave the loop; _shutdown does the stopping."""
        if self.exit_code is None:
            self.state, self.exit_code, self.reason = state, code, reason
            self.closing = True

    def _shutdown(self) -> int:
        for slot in self.slots.values():
            for t in (slot.timer, slot.kill_timer):
                if t:
                    t.cancel()
            slot.next_start = None
        if self.spare_timer:
            self.spare_timer.cancel()
        live = [s for s in self.slots.values() if s.child is not None]
        for slot in live:
            self.sel.unregister(slot.child)  # reaped below, outside the loop
        final_state = self.state
        if live or self.spare:
            self.state = "stopping"
            self._write()
        if (self.link.queue or self.link.wbuf) and not self.link.closed:
            if not self.link.flush(REPORT_FLUSH_TIMEOUT):
                self.log("agent", "could not deliver the last reports to the scheduler")
        self.link.close()
        if self.spare is not None:
            for obj in (self.spare.child, self.spare.sock):
                if obj in (k.fileobj for k in self.sel.get_map().values()):
                    self.sel.unregister(obj)
            self.spare.child.signal_group(signal.SIGKILL)  # holds no state worth a grace period
            self.spare.child.wait(procs.KILL_WAIT)
            self.spare.sock.close()
            self.spare = None
        if live:
            names = {s.child.pid: s for s in live}
            self.log("agent", f"stopping {', '.join(s.spec.node_id for s in live)}: SIGTERM, "
                              f"then SIGKILL after {self.spec.grace:g} s")
            out = procs.stop_all(
                [s.child for s in live], self.spec.grace,
                on_kill=lambda c: self.log(names[c.pid].spec.node_id,
                                           f"pid {c.pid} still running after {self.spec.grace:g} s: SIGKILL"))
            for pid, status in out.items():
                slot = names[pid]
                self._record_exit(slot, status)
                self.log(slot.spec.node_id, f"pid {pid} stopped ({status.describe()})")
            for slot in live:
                slot.child = None
                if slot.state not in ("succeeded", "failed"):
                    slot.state = "stopped"
        for slot in self.slots.values():
            if slot.state in ("backoff", "pending", "restarting", "running"):
                slot.state = "stopped"
        self.state = final_state
        self._write()
        self.log("agent", f"agent exits: {self.state}" + (f" ({self.reason})" if self.reason else "")
                 + f", exit status {self.exit_code}")
        self._close_sockets()
        return self.exit_code

    def _close_sockets(self) -> None:
        signal.set_wakeup_fd(-1)
        for sock, path in ((self._control, self.spec.control_socket), (self._progress, self.spec.progress_socket)):
            if sock is not None:
                sock.close()
                path.unlink(missing_ok=True)
        for s in (self._wake_r, getattr(self, "_wake_w", None)):
            if s is not None:
                s.close()
        self.sel.close()

    # -- launching

    def _launch(self, slot: Slot, why: str) -> None:
        slot.timer, slot.next_start = None, None
        if self.closing:
            return
        n = slot.launches
        env = dict(self.base_env)
        env[E.TORCHELASTIC_RESTART_COUNT] = str(n)
        marker = (f"--- toolkit agent {self.spec.host}: start {slot.spec.node_id} #{n + 1} ({why}) "
                  f"at {iso(time.time())} ---")
        child = self._handoff(slot, env, marker)
        slot.warm = child is not None
        if child is None:
            try:
                child = procs.spawn(LaunchSpec(
                    argv=tuple(procs.env_argv(slot.spec.env_file, slot.spec.argv)), env=env, cwd=slot.spec.cwd,
                    log_file=slot.spec.log_file, cpus=slot.cpus, marker=marker))
            except (OSError, subprocess.SubprocessError) as e:
                self.log(slot.spec.node_id, f"could not start {' '.join(slot.spec.argv)}: {e}")
                try:
                    with open(slot.spec.log_file, "a", encoding="utf-8") as f:
                        f.write(f"{marker}\ntoolkit agent: could not start: {e}\n")
                except OSError:
                    pass
                slot.launches += 1
                slot.started_mono, slot.started_wall = time.monotonic(), time.time()
                slot.state = "running"
                # as if it had died at once with "command not found": the normal policy applies
                self.timers.after(0, lambda: self._after_exit(slot, None, ExitStatus(127, None)))
                return
        slot.child = child
        slot.last_pid, slot.last_ticks = child.pid, child.start_ticks
        slot.launches += 1
        slot.pids = (slot.pids + [child.pid])[-EXIT_HISTORY:]
        slot.started_mono, slot.started_wall = time.monotonic(), time.time()
        slot.state = "running"
        slot.progressed = False
        self.sel.register(child, selectors.EVENT_READ, lambda _m, s=slot, c=child: self._on_child(s, c))
        since = ""
        if slot.seen_dead is not None:
            since = f", {1000 * (time.monotonic() - slot.seen_dead):.1f} ms after its exit was seen"
            slot.seen_dead = None
        self.log(slot.spec.node_id, f"started pid {child.pid} ({why}{', warm spare' if slot.warm else ''}"
                                    f"{', restart count ' + str(n) if n else ''}{since})")
        self._write()

    def _on_child(self, slot: Slot, child: Child) -> None:
        self.sel.unregister(child)  # before reaping closes the pidfd
        slot.seen_dead = time.monotonic()
        status = child.reap()
        if status is None:  # a pidfd is readable only once the process exited; stay safe anyway
            self.sel.register(child, selectors.EVENT_READ, lambda _m: self._on_child(slot, child))
            return
        slot.child = None
        self._after_exit(slot, child, status)

    def _record_exit(self, slot: Slot, status: ExitStatus, pid: int | None = None) -> dict[str, Any]:
        ran = time.monotonic() - slot.started_mono
        rec = {**status.as_dict(), "pid": pid, "at": iso(time.time()), "ran_for": round(ran, 3)}
        slot.last_exit = rec
        slot.exits = (slot.exits + [rec])[-EXIT_HISTORY:]
        return rec

    def _after_exit(self, slot: Slot, child: Child | None, status: ExitStatus) -> None:
        pid = child.pid if child else None
        ran = time.monotonic() - slot.started_mono
        self._record_exit(slot, status, pid)
        if slot.kill_timer:
            slot.kill_timer.cancel()
            slot.kill_timer = None
        if pid is not None:
            self.link.report(P.EXITED, coalesce=slot.spec.node_id, node_id=slot.spec.node_id, pid=pid,
                             code=status.code, signal=status.signal_name)
        node = slot.spec.node_id
        if self.closing:
            slot.state = "succeeded" if status.ok else "stopped"
            self.log(node, f"pid {pid} exited ({status.describe()})")
            self._write()
            if self.state == "finishing" and not any(s.child for s in self.slots.values()):
                self._finish_now()
            return
        if slot.manual:
            slot.manual = False
            self.log(node, f"pid {pid} ended ({status.describe()}) for the requested restart")
            self._launch(slot, "restart requested by the operator")
            return
        if status.ok:
            slot.state = "succeeded"
            self.log(node, f"pid {pid} finished (exit code 0 after {ran:.1f} s)")
            self._write()
            if all(s.state == "succeeded" for s in self.slots.values()):
                self._finish("succeeded", EXIT_OK, "every process of this host exited 0")
            return
        if status.code in (P.EXIT_FENCED, P.EXIT_REJOIN):
            # Not the process's fault: the scheduler fenced a stale incarnation, or a wrapped torchrun-style
            # script left a broken generation. Relaunch at once, outside the crash budget.
            self.log(node, f"pid {pid} {status.describe()} (told to by the scheduler); relaunching now")
            self._launch(slot, f"relaunch after {status.describe()}")
            return
        decision = self.spec.policy.after_failure(slot.counted, ran, slot.progressed)
        if decision.give_up:
            self._give_up(slot, pid, status, ran)
            return
        slot.counted = decision.counted
        budget = f"restart {decision.counted} of {self.spec.policy.max_restarts}"
        if decision.delay <= 0:
            self.log(node, f"pid {pid} {status.describe()} after {ran:.1f} s; restarting now ({budget})")
            self._launch(slot, f"{budget} after {status.describe()}")
        else:
            self.log(node, f"pid {pid} {status.describe()} after {ran:.1f} s; restarting in "
                           f"{decision.delay:g} s ({budget})")
            slot.state = "backoff"
            slot.next_start = time.time() + decision.delay
            why = f"{budget} after {status.describe()}"
            slot.timer = self.timers.after(decision.delay, lambda: self._launch(slot, why))
            self._write()

    def _give_up(self, slot: Slot, pid: int | None, status: ExitStatus, ran: float) -> None:
        spec = slot.spec
        tail = log_tail(spec.log_file)
        n = slot.counted
        self.failure = {
            "host": self.spec.host, "node_id": spec.node_id, "rank": spec.rank, "pid": pid,
            "code": status.code, "signal": status.signal_name, "status": status.describe(),
            "restarts": n, "log_file": spec.log_file, "log_tail": tail, "at": iso(time.time()),
        }
        slot.state = "failed"
        reason = f"{spec.node_id} {status.describe()} after {n} restart{'s' if n != 1 else ''} (max_restarts " \
                 f"{self.spec.policy.max_restarts}); the job has failed"
        where = f"rank {spec.rank}, " if spec.rank is not None else ""
        self.log(spec.node_id, f"GAVE UP: {where}pid {pid} {status.describe()} after {ran:.1f} s, and its "
                               f"{n} allowed restart(s) are used up; last {len(tail)} lines of {spec.log_file}:")
        for line in tail:
            self.log(spec.node_id, f"| {line}")
        self.link.report(P.GAVE_UP, node_id=spec.node_id, code=status.code, signal=status.signal_name,
                         log_tail="\n".join(tail)[-GAVE_UP_TAIL_BYTES:])
        self._finish("failed", EXIT_FAILED, reason)

    # -- warm spare

    def _start_spare(self) -> None:
        self.spare_timer = None
        if self.closing or self.spare is not None or not self.spare_enabled:
            return
        template = next(p for p in self.spec.processes if p.is_worker)
        interpreter = template.argv[0]
        mine, theirs = socket.socketpair()
        argv = [interpreter, "-m", "toolkit.standby", "--fd", str(theirs.fileno())]
        try:
            child = procs.spawn(LaunchSpec(
                argv=tuple(procs.env_argv(template.env_file, argv)), env=self.base_env, cwd=str(self.spec.job_dir),
                log_file=str(self.spec.standby_log), pass_fds=(theirs.fileno(),),
                marker=f"--- toolkit agent {self.spec.host}: warm spare at {iso(time.time())} ---"))
        except (OSError, subprocess.SubprocessError) as e:
            mine.close()
            self.log("agent", f"could not start a warm spare: {e}; workers restart cold")
            self.spare_enabled = False
            return
        finally:
            theirs.close()
        mine.setblocking(False)
        self.spare = Spare(child, mine, interpreter)
        self.log("agent", f"warm spare pid {child.pid} starting (importing {', '.join(standby.WARM_MODULES)})")
        self.sel.register(mine, selectors.EVENT_READ, lambda _m: self._on_spare_sock())
        self.sel.register(child, selectors.EVENT_READ, lambda _m: self._on_spare_exit())
        self._write()

    def _on_spare_sock(self) -> None:
        sp = self.spare
        try:
            data = sp.sock.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == standby.READY:
            sp.ready = True
            self.log("agent", f"warm spare pid {sp.child.pid} ready after {time.monotonic() - sp.started:.1f} s")
            self._write()
        else:
            self.sel.unregister(sp.sock)  # it went away: its pidfd tells the rest

    def _on_spare_exit(self) -> None:
        sp = self.spare
        self.sel.unregister(sp.child)
        status = sp.child.reap()
        if status is None:
            self.sel.register(sp.child, selectors.EVENT_READ, lambda _m: self._on_spare_exit())
            return
        try:
            self.sel.unregister(sp.sock)
        except (KeyError, ValueError):
            pass
        sp.sock.close()
        self.spare = None
        self.spare_failures += 1
        tail = log_tail(self.spec.standby_log, 3)
        self.log("agent", f"warm spare pid {sp.child.pid} {status.describe()}"
                          + (f": {tail[-1]}" if tail else "") + f" (see {self.spec.standby_log})")
        if self.spare_failures >= SPARE_MAX_FAILURES:
            self.spare_enabled = False
            self.log("agent", f"{self.spare_failures} warm spares died: no more spares, workers restart cold")
        elif not self.closing:
            self.spare_timer = self.timers.after(SPARE_DELAY, self._start_spare)
        self._write()

    def _handoff(self, slot: Slot, env: dict[str, str], marker: str) -> Child | None:
        """Give `slot`'s place to the ready spare; None (and a cold start) if there is none or it cannot."""
        sp = self.spare
        if sp is None or not sp.ready or not standby.eligible(slot.spec.argv, sp.interpreter):
            return None
        try:
            full = procs.resolve_env(slot.spec.env_file, env, slot.spec.cwd)
        except (OSError, subprocess.SubprocessError) as e:
            self.log(slot.spec.node_id, f"warm spare not used: {e}")
            return None
        payload = json.dumps({"argv": list(slot.spec.argv), "env": full, "cwd": slot.spec.cwd,
                              "log_file": slot.spec.log_file,
                              "cpus": sorted(slot.cpus) if slot.cpus else None}) + "\n"
        try:
            with open(slot.spec.log_file, "a", encoding="utf-8") as f:
                f.write(marker + "\n")
            sp.sock.settimeout(CLIENT_TIMEOUT)
            sp.sock.sendall(payload.encode())
        except OSError as e:
            self.log(slot.spec.node_id, f"warm spare pid {sp.child.pid} did not take the handoff ({e})")
            return None
        self.sel.unregister(sp.sock)
        self.sel.unregister(sp.child)
        sp.sock.close()
        self.spare = None
        self.spare_failures = 0
        self._schedule_spare()
        return sp.child

    def _schedule_spare(self) -> None:
        if self.spare_enabled and not self.closing and self.spare is None:
            if self.spare_timer:
                self.spare_timer.cancel()
            self.spare_timer = self.timers.after(SPARE_DELAY, self._start_spare)

    # -- the scheduler's messages

    def _on_scheduler(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == P.KILL:
            slot = self.slots.get(str(msg.get("node_id")))
            pid = msg.get("pid")
            if slot is None or slot.child is None or (pid is not None and pid != slot.child.pid):
                self.log("agent", f"scheduler asked to kill {msg.get('node_id')} pid {pid}: not running here")
                return
            self.log(slot.spec.node_id, f"the scheduler declared pid {slot.child.pid} dead: SIGKILL (fencing)")
            slot.child.signal_group(signal.SIGKILL)
        elif op == P.STOP:
            reason = str(msg.get("reason") or "no reason given")
            self.log("agent", f"the scheduler stopped the job: {reason}")
            self._finish("failed", EXIT_FAILED, f"stopped by the scheduler: {reason}")
        elif op == P.FINISHED:
            if self.closing:
                return
            self.log("agent", "the scheduler says the job finished")
            self.link.close()  # it exits now; nothing more to tell it
            self.closing = True
            self.state = "finishing"
            for slot in self.slots.values():
                if slot.timer:
                    slot.timer.cancel()
                    slot.timer, slot.next_start, slot.state = None, None, "stopped"
            if not any(s.child for s in self.slots.values()):
                self._finish_now()
            else:
                self._stop_after = self.timers.after(self.spec.grace, self._finish_now)
                self._write()
        else:
            self.log("agent", f"ignored a {op!r} message from the scheduler")

    def _finish_now(self) -> None:
        if self._stop_after:
            self._stop_after.cancel()
        self._finish("succeeded", EXIT_OK, "the scheduler said the job finished")

    # -- signals, control socket, progress

    def _on_signal(self, _mask: int) -> None:
        try:
            data = self._wake_r.recv(64)
        except BlockingIOError:
            return
        for signum in data:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                self.log("agent", "SIGHUP ignored (the agent outlives the session that started it)")
                continue
            self.log("agent", f"{name} received: stopping")
            self._finish("stopped", EXIT_STOPPED, f"stopped by {name}")

    def _on_accept(self, _mask: int) -> None:
        try:
            conn, _ = self._control.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        state = {"buf": b""}
        deadline = self.timers.after(CLIENT_TIMEOUT, lambda: self._close_conn(conn))
        self.sel.register(conn, selectors.EVENT_READ, lambda _m: self._on_conn(conn, state, deadline))

    def _close_conn(self, conn: socket.socket) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _on_conn(self, conn: socket.socket, state: dict, deadline: Timer) -> None:
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        state["buf"] += data
        if not data or b"\n" in state["buf"] or len(state["buf"]) > MAX_CONTROL_LINE:
            deadline.cancel()
            line = state["buf"].split(b"\n", 1)[0]
            if line.strip():
                try:
                    reply, after = self._control_request(json.loads(line))
                except (ValueError, TypeError, AttributeError, RecursionError):
                    reply, after = {"ok": False, "error": "not a JSON object line"}, None
                try:
                    conn.settimeout(CLIENT_TIMEOUT)
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass
            else:
                after = None
            self._close_conn(conn)
            if after is not None:
                after()

    def _control_request(self, req: dict) -> tuple[dict, Callable[[], None] | None]:
        op = req.get("op")
        if op == "status":
            return self.document(), None
        if op == "stop":
            self.log("agent", "stop requested on the control socket")
            return {"ok": True}, lambda: self._finish("stopped", EXIT_STOPPED, "stop requested")
        if op == "restart":
            return self._manual_restart(str(req.get("node_id"))), None
        return {"ok": False, "error": f"unknown op {op!r}; one of status, restart, stop"}, None

    def _manual_restart(self, node_id: str) -> dict:
        slot = self.slots.get(node_id)
        if slot is None:
            return {"ok": False, "error": f"no process {node_id} on {self.spec.host}; this host runs "
                                          f"{', '.join(self.slots)}"}
        if self.closing:
            return {"ok": False, "error": f"the agent on {self.spec.host} is {self.state}; nothing is restarted"}
        self.log(node_id, "restart requested by the operator (not counted against max_restarts)")
        if slot.child is None:
            if slot.timer:
                slot.timer.cancel()
            self._launch(slot, "restart requested by the operator")
            return {"ok": True, "node_id": node_id, "was_pid": None,
                    "pid": slot.child.pid if slot.child else None}
        child = slot.child
        if not slot.manual:
            slot.manual = True
            slot.state = "restarting"
            child.signal_group(signal.SIGTERM)
            slot.kill_timer = self.timers.after(self.spec.grace, lambda: child.signal_group(signal.SIGKILL))
            self._write()
        return {"ok": True, "node_id": node_id, "was_pid": child.pid, "pid": None}

    def _on_progress(self, _mask: int) -> None:
        for _ in range(256):  # bounded per wake-up; the rest is read at the next one
            try:
                data = self._progress.recv(4096)
            except BlockingIOError:
                break
            try:
                msg = json.loads(data)
                slot = self.slots[msg["node_id"]]
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
            recovery = msg.get("recovery")
            if recovery in (P.RECOVERY_IN_PLACE, P.RECOVERY_RESTART):
                slot.progressed = True  # it got as far as its process group: not a crash loop
                if recovery != slot.recovery:
                    slot.recovery = recovery
                    self.progress_dirty = True
            step = msg.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            slot.step, slot.step_at, slot.progressed = step, time.time(), True
            epoch = msg.get("epoch")
            if isinstance(epoch, int):
                slot.epoch = epoch
            self.progress_dirty = True
        if self.progress_dirty and self.progress_timer is None:
            delay = self.last_write + PROGRESS_WRITE_INTERVAL - time.monotonic()
            self.progress_timer = self.timers.after(delay, self._write_progress)
        running = [s for s in self.slots.values() if s.spec.is_worker and s.state == "running"]
        if (self.spare_enabled and self.spare is None and self.spare_timer is not None and running
                and all(s.progressed for s in running)):
            self.spare_timer.cancel()
            self._start_spare()  # the job is running: building a spare no longer competes with its start

    def _write_progress(self) -> None:
        self.progress_timer = None
        if self.progress_dirty:
            self._write()

    # -- agent.json

    def _changed(self) -> None:
        if self.exit_code is None:
            self._write()

    def document(self) -> dict[str, Any]:
        sp = self.spare
        return {
            "version": 1, "job": self.spec.job, "host": self.spec.host, "job_dir": str(self.spec.job_dir),
            "agent": {"pid": self.pid, "start_ticks": self.ticks, "started_at": iso(self.started),
                      "python": sys.executable},
            "state": self.state, "reason": self.reason, "exit_code": self.exit_code, "updated_at": iso(time.time()),
            "scheduler": {"address": f"{self.spec.sched_host}:{self.spec.sched_port}", "link": self.link.state,
                          "since": iso(self.link.since)},
            "warm_spare": {"enabled": self.spare_enabled, "pid": sp.child.pid if sp else None,
                           "ready": bool(sp and sp.ready)},
            "bind_core": self.spec.bind_core,
            "processes": [s.document(self.spec.policy) for s in self.slots.values()],
            "failure": self.failure,
        }

    def _write(self) -> None:
        self.progress_dirty = False
        self.last_write = time.monotonic()
        atomicfile.write(self.spec.agent_json, json.dumps(self.document(), indent=1) + "\n")


# --- entry points --------------------------------------------------------------------------------------------


def _lock(spec: HostSpec) -> int | None:
    spec.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(spec.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_pid_file(spec: HostSpec) -> tuple[int, int] | None:
    """(pid, start ticks) from the pid file; None if it is missing or not in that form. A pid alone is never
    trusted: pids are reused, and a pid file from before a reboot (or written by someone else) would name an
    unrelated process that `stop` would then signal."""
    try:
        fields = spec.pid_file.read_text().split()
        pid, ticks = int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return (pid, ticks) if pid > 1 and ticks >= 0 else None


def running_agent(spec: HostSpec) -> tuple[int, int] | None:
    """(pid, ticks) of this job's live agent: the pid file names a process that exists with the same start time."""
    rec = read_pid_file(spec)
    if rec is not None and procs.is_running(*rec):
        return rec
    return None


def run(spec: HostSpec, ready_fd: int | None = None) -> int:
    lock = _lock(spec)
    ready: Callable[[str], None] | None = None
    if ready_fd is not None:
        def ready(text: str) -> None:
            try:
                os.write(ready_fd, text.encode() + b"\n")
            finally:
                os.close(ready_fd)
    if lock is None:
        rec = read_pid_file(spec)
        msg = f"{spec.host}: agent of job {spec.job} already running (pid {rec[0] if rec else '?'})"
        print(msg, file=sys.stderr)
        if ready:
            ready(f"running {rec[0] if rec else 0}")
        return EXIT_OK
    log = AgentLog(spec.agent_log, spec.host)
    try:
        return Agent(spec, log).run(ready)
    except UserError as e:
        log("agent", str(e))
        raise
    finally:
        log.close()
        os.close(lock)


def start(spec: HostSpec, timeout: float = START_TIMEOUT, overrides: list[str] | None = None) -> int:
    """launch.sh: start the agent detached (its own session, stdout/stderr to agent.log) unless it runs."""
    rec = running_agent(spec)
    if rec is not None:
        print(f"{spec.host}: agent of job {spec.job} already running (pid {rec[0]})")
        return EXIT_OK
    spec.agent_log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    r, w = os.pipe()
    os.set_inheritable(w, True)
    argv = [sys.executable, "-m", "toolkit.agent", "run", "--job-dir", str(spec.job_dir), "--ready-fd", str(w),
            *(overrides or [])]
    try:
        pid = os.posix_spawn(sys.executable, argv, dict(os.environ), setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(spec.agent_log), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ])
    finally:
        os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        text = os.read(r, 256).decode(errors="replace").strip() if ready else ""
    finally:
        os.close(r)
    if text.startswith("ready "):
        print(f"{spec.host}: agent started (pid {text.split()[1]}), supervising "
              f"{', '.join(p.node_id for p in spec.processes)}; logs in {spec.job_dir / 'logs'}")
        return EXIT_OK
    if text.startswith("running "):
        print(f"{spec.host}: agent of job {spec.job} already running (pid {text.split()[1]})")
        return EXIT_OK
    if not ready:
        print(f"{spec.host}: the agent (pid {pid}) did not come up within {timeout:g} s; see {spec.agent_log}",
              file=sys.stderr)
        return EXIT_FAILED
    os.waitpid(pid, 0)
    last = [line for line in log_tail(spec.agent_log, 5) if line.strip()]
    print(f"{spec.host}: the agent failed to start: {last[-1] if last else 'no output'} (see {spec.agent_log})",
          file=sys.stderr)
    return EXIT_FAILED


def request(spec: HostSpec, msg: dict, timeout: float = CLIENT_TIMEOUT) -> dict:
    """One conversation on the agent's control socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(spec.control_socket))
        s.sendall(json.dumps(msg).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    if not buf.strip():
        raise OSError("the agent closed the connection without answering")
    return json.loads(buf)


def status(spec: HostSpec) -> dict[str, Any]:
    """agent.json plus "alive": a recorded agent that no longer runs is reported as gone."""
    rec = running_agent(spec)
    if rec is not None:
        try:
            return {**request(spec, {"op": "status"}), "alive": True}
        except (OSError, ValueError):
            pass
    try:
        doc = json.loads(spec.agent_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"version": 1, "job": spec.job, "host": spec.host, "state": "absent", "alive": rec is not None,
                "processes": []}
    alive = rec is not None and doc.get("agent", {}).get("pid") == rec[0]
    if not alive and doc.get("state") not in FINAL_STATES:
        doc["state"] = "gone"
    return {**doc, "alive": alive}


def restart(spec: HostSpec, node_id: str) -> int:
    if spec.proc(node_id) is None:
        raise UserError(f"{spec.host}: no process {node_id!r} in this job here; this host runs "
                        f"{', '.join(p.node_id for p in spec.processes)}")
    if running_agent(spec) is None:
        print(f"{spec.host}: the agent was not running; starting it (it starts {node_id} with the others)")
        return start(spec)
    try:
        reply = request(spec, {"op": "restart", "node_id": node_id})
    except (OSError, ValueError) as e:
        print(f"{spec.host}: the agent did not answer on {spec.control_socket} ({e}); try stop.sh then launch.sh",
              file=sys.stderr)
        return EXIT_FAILED
    if not reply.get("ok"):
        print(f"{spec.host}: {reply.get('error')}", file=sys.stderr)
        return EXIT_FAILED
    was = reply.get("was_pid")
    print(f"{spec.host}: restarting {node_id}" + (f" (pid {was} gets SIGTERM, then a new process starts)"
                                                  if was else f" (new pid {reply.get('pid')})"))
    return EXIT_OK


def stop(spec: HostSpec, timeout: float | None = None) -> int:
    """stop.sh: SIGTERM the agent, wait (bounded) for it to stop its processes, SIGKILL it if it must, then make
    sure no process of the groups it recorded is left."""
    timeout = spec.grace + STOP_MARGIN if timeout is None else timeout
    rec = running_agent(spec)
    said = f"{spec.host}: agent was not running"
    if rec is not None:
        pid, ticks = rec
        procs.kill_quietly(pid, signal.SIGTERM)
        if procs.wait_gone(pid, ticks, timeout):
            said = f"{spec.host}: stopped (agent pid {pid})"
        else:
            procs.kill_quietly(pid, signal.SIGKILL)
            procs.wait_gone(pid, ticks, procs.KILL_WAIT)
            said = f"{spec.host}: agent pid {pid} did not stop within {timeout:g} s: killed"
    left = _leftovers(spec)
    if left:
        print(f"{spec.host}: processes still running after stop: {', '.join(map(str, left))}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{said}; no process of the job is left")
    return EXIT_OK


def _recorded_groups(spec: HostSpec) -> list[tuple[str, int, int]]:
    """(node_id, pgid, leader start ticks) of every process the last agent.json names. An entry without its
    leader's start time is skipped: a group id alone may name someone else's processes by now."""
    try:
        doc = json.loads(spec.agent_json.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return []
    out = []
    for p in doc.get("processes", []) if isinstance(doc, dict) else []:
        if not isinstance(p, dict):
            continue
        pgid = p.get("pgid") or p.get("last_pid")  # a session leader's pgid is its pid
        ticks = p.get("start_ticks") if p.get("pgid") else p.get("last_start_ticks")
        if (isinstance(pgid, int) and not isinstance(pgid, bool) and pgid > 1 and isinstance(ticks, int)
                and not isinstance(ticks, bool)):
            out.append((str(p.get("node_id")), pgid, ticks))
    return out


def _leftovers(spec: HostSpec) -> list[int]:
    """SIGKILL what is left of the groups in agent.json (the agent normally leaves nothing); return survivors."""
    groups = _recorded_groups(spec)
    for _, pgid, ticks in groups:
        for pid in procs.reclaim_group(pgid, ticks):
            procs.wait_gone(pid, None, procs.KILL_WAIT)
    return [info.pid for _, pgid, ticks in groups for info in procs.owned_group_members(pgid, ticks)]


def with_overrides(spec: HostSpec, args: argparse.Namespace) -> tuple[HostSpec, list[str]]:
    """Apply --max-restarts/--grace/--bind-core/--warm-spare over host.json; also returns them as flags, which
    `start` hands on to the detached agent."""
    flags: list[str] = []
    if args.max_restarts is not None:
        if args.max_restarts < 0:
            raise UserError(f"--max-restarts {args.max_restarts}: give 0 or more")
        spec = dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, max_restarts=args.max_restarts))
        flags += ["--max-restarts", str(args.max_restarts)]
    if args.grace is not None:
        if not 0 <= args.grace < math.inf:
            raise UserError(f"--grace {args.grace}: give 0 or more seconds, a finite number")
        spec = dataclasses.replace(spec, grace=args.grace)
        flags += ["--grace", str(args.grace)]
    for name in ("bind_core", "warm_spare"):
        value = getattr(args, name)
        if value is not None:
            spec = dataclasses.replace(spec, **{name: value})
            flags.append(("--" if value else "--no-") + name.replace("_", "-"))
    return spec, flags


COMMANDS = ("run", "start", "stop", "status", "restart")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    parts = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(prog=f"python -m toolkit.agent {command}", description=parts[0],
                                 epilog="\n\n".join(parts[2:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job-dir", required=True, help="the job directory (holds host.json)")
    if command == "run":
        ap.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    if command == "restart":
        ap.add_argument("node_id", help="the process to restart, e.g. worker_3")
    if command == "stop":
        ap.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the agent before SIGKILL (default: grace + 10)")
    if command in ("run", "start"):
        ap.add_argument("--max-restarts", type=int, default=None,
                        help="restarts of one process before the job fails (host.json: max_restarts, default 3)")
        ap.add_argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL")
        ap.add_argument("--bind-core", action=argparse.BooleanOptionalAction, default=None,
                        help="pin each worker to its own CPUs (msrun's --bind_core)")
        ap.add_argument("--warm-spare", action=argparse.BooleanOptionalAction, default=None,
                        help="keep an interpreter with torch imported for fast replacement")
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.job_dir)
        if command in ("run", "start"):
            spec, overrides = with_overrides(spec, args)
        if command == "run":
            return run(spec, args.ready_fd)
        if command == "start":
            return start(spec, overrides=overrides)
        if command == "restart":
            return restart(spec, args.node_id)
        if command == "stop":
            return stop(spec, args.timeout)
        print(json.dumps(status(spec), indent=1))
        return EXIT_OK
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
