"""Test harness for the scheduler and the worker runtime: a job's environment built the way the launch plan builds
it, real processes whose output can be waited on line by line, and a small control-protocol client that plays a
worker or a host agent.

Imported by tests/test_scheduler.py and tests/train/test_runtime.py (not a test itself).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from toolkit.contracts import envvars as E
from toolkit.contracts import protocol as P
from toolkit.freeports import free_port_pair

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
PYTHON = sys.executable


class Proc:
    """A child process whose combined output is collected line by line, so a test waits on what it prints (an
    event) instead of sleeping."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log: Path, cwd: Path | None = None) -> None:
        self.log = log
        self.lines: list[str] = []
        self.cond = threading.Condition()
        # in its log's directory unless told: what it writes to relative paths (./tb) never lands in the clone
        self.popen = subprocess.Popen(argv, env=dict(env), cwd=str(cwd or log.parent), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log, "ab") as out:
            for raw in self.popen.stdout:
                out.write(raw)
                out.flush()
                with self.cond:
                    self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                    self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        """The first line from index `start` on that matches `pattern`; fails with the output if none in time."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            i = start
            while True:
                while i < len(self.lines):
                    m = regex.search(self.lines[i])
                    if m:
                        return m
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r} from pid {self.pid} within {timeout} s; "
                                         f"output:\n{self.text()[-4000:]}") from None
                self.cond.wait(min(left, 0.5))

    def count(self, pattern: str) -> int:
        regex = re.compile(pattern)
        with self.cond:
            return sum(1 for line in self.lines if regex.search(line))

    def text(self) -> str:
        with self.cond:
            return "\n".join(self.lines)

    def wait(self, timeout: float) -> int:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            output = self.text()[-4000:]
            raise AssertionError(f"pid {self.pid} still running after {timeout} s; output:\n{output}") from None
        self._reader.join(5)
        return code

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL this child's own session (it was started in a new one), by its recorded id only."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass


class Job:
    """One test job: a directory, a token file (0600), ports, and the environment of every process as the
    launch plan renders it (docs/architecture.md)."""

    def __init__(self, root: Path, world: int, *, node_timeout: float = 2.0, topo_timeout: float = 60.0,
                 heartbeat: float = 0.25, recovery: bool = True, name: str = "testjob") -> None:
        self.root = root
        self.world = world
        self.name = name
        self.port = free_port_pair()
        self.token = secrets.token_hex(16)
        self.token_file = root / "token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, (self.token + "\n").encode())
        os.close(fd)
        self.recovery_path = root / "recovery"
        self.ckpt = root / "ckpt"
        self.logs = root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.node_timeout = node_timeout
        self.topo_timeout = topo_timeout
        self.heartbeat = heartbeat
        self.recovery = recovery
        self.procs: list[Proc] = []
        self.extra: dict[str, str] = {}

    def common(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "TOOLKIT_", "TORCHELASTIC_"))
               and k not in (E.RANK, E.WORLD_SIZE, E.MASTER_ADDR, E.MASTER_PORT, E.LOCAL_RANK, E.RANK_ID)}
        env.update({
            E.MS_SCHED_HOST: "127.0.0.1", E.MS_SCHED_PORT: str(self.port),
            E.MASTER_ADDR: "127.0.0.1", E.MASTER_PORT: str(self.port + 1),
            E.MS_WORKER_NUM: str(self.world), E.RANK_SIZE: str(self.world), E.WORLD_SIZE: str(self.world),
            E.MS_TOPO_TIMEOUT: f"{self.topo_timeout:g}", E.MS_NODE_TIMEOUT: f"{self.node_timeout:g}",
            E.MS_ENABLE_RECOVERY: "1" if self.recovery else "0", E.MS_RECOVERY_PATH: str(self.recovery_path),
            E.TOOLKIT_JOB: self.name, E.TOOLKIT_TOKEN_FILE: str(self.token_file), E.OMP_NUM_THREADS: "1",
            "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
        })
        env.update(self.extra)
        return env

    def sched_env(self) -> dict[str, str]:
        return {**self.common(), E.MS_ROLE: E.ROLE_SCHED, E.MS_NODE_ID: "sched"}

    def worker_env(self, rank: int) -> dict[str, str]:
        return {**self.common(), E.MS_ROLE: E.ROLE_WORKER, E.MS_NODE_ID: P.worker_node_id(rank),
                E.RANK_ID: str(rank), E.RANK: str(rank), E.LOCAL_RANK: str(rank), E.DEVICE_ID: str(rank),
                E.LOCAL_WORLD_SIZE: str(self.world), E.GROUP_RANK: "0",
                E.TOOLKIT_HEARTBEAT_INTERVAL: f"{self.heartbeat:g}", E.TORCHELASTIC_USE_AGENT_STORE: "True",
                E.CKPT_DIR: str(self.ckpt)}

    def start(self, argv: list[str], env: Mapping[str, str], log_name: str) -> Proc:
        proc = Proc(argv, env, self.logs / log_name)
        self.procs.append(proc)
        return proc

    def scheduler(self, env: Mapping[str, str] | None = None) -> Proc:
        return self.start([PYTHON, "-m", "toolkit.scheduler"], env or self.sched_env(), "scheduler.log")

    def wait_serving(self, sched: Proc, timeout: float = 60.0) -> None:
        sched.wait_for(r"control server on", timeout)

    def worker(self, rank: int, script: str = "runtime_worker.py", args: list[str] | None = None,
               env: Mapping[str, str] | None = None) -> Proc:
        return self.start([PYTHON, str(SCRIPTS / script), *(args or [])], env or self.worker_env(rank),
                          f"worker_{rank}.log")

    def cleanup(self) -> None:
        for proc in self.procs:
            proc.kill()


class Client:
    """A blocking control-protocol peer for tests: plays a worker (register, heartbeat, done) or an agent."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.lines = P.LineBuffer()
        self.queue: list[dict[str, Any]] = []
        self.incarnation = secrets.token_hex(8)
        self.server_nonce: str | None = None
        self.client_nonce: str | None = None

    def challenge(self) -> str:
        """The server's nonce (its first message on every connection)."""
        if self.server_nonce is None:
            self.server_nonce = P.challenge_nonce(self.recv())
        return self.server_nonce

    def say_hello(self, op: str, token: str, plain: bool = False, **fields: Any) -> None:
        """The first message: authenticated as toolkit does it (a proof over the nonces), or `plain`: the token
        itself, as before the handshake existed (refused)."""
        if plain:
            self.challenge()
            self.send(op, token=token, **fields)
            return
        data, self.client_nonce = P.hello(op, token, self.challenge(), **fields)
        self.sock.sendall(data)

    def proven(self, job: Job, msg: dict[str, Any]) -> bool:
        """Whether an answer to the hello proves the job token (the scheduler is the real one)."""
        return P.check_server(job.token, self.challenge(), self.client_nonce or "", msg)

    @property
    def local_addr(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def send(self, op: str, **fields: Any) -> None:
        self.sock.sendall(P.encode(op, **fields))

    def register(self, job: Job, rank: int, token: str | None = None, pid: int | None = None,
                 incarnation: str | None = None, rejoin: bool = False, plain: bool = False) -> None:
        self.say_hello(P.REGISTER, job.token if token is None else token, plain, node_id=P.worker_node_id(rank),
                       rank=rank, world_size=job.world, incarnation=incarnation or self.incarnation,
                       pid=pid if pid is not None else 100000 + rank, host="testhost", generation=None, rejoin=rejoin)

    def hello(self, job: Job, host: str, node_ids: list[str], token: str | None = None, plain: bool = False) -> None:
        self.say_hello(P.AGENT_HELLO, job.token if token is None else token, plain, host=host, node_ids=node_ids)

    def recv(self, timeout: float = 10.0) -> dict[str, Any] | None:
        """The next message, or None once the scheduler closed the connection."""
        deadline = time.monotonic() + timeout
        while not self.queue:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no message from the scheduler within {timeout} s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.queue.extend(self.lines.feed(data))
        return self.queue.pop(0)

    def expect(self, op: str, timeout: float = 10.0) -> dict[str, Any]:
        """Skip other messages until one with `op` arrives."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if msg is None:
                raise AssertionError(f"connection closed while waiting for {op!r}; got {seen}")
            if msg["op"] == op:
                return msg
            seen.append(msg)

    def close(self) -> None:
        self.sock.close()


class FakeAgent(threading.Thread):
    """Plays one host's agent: says hello for `node_ids`, and calls `on_kill(node_id, pid)` for every `kill`
    the scheduler sends (the real agent SIGKILLs and relaunches). Records every message."""

    def __init__(self, job: Job, host: str, node_ids: list[str],
                 on_kill: Callable[[str, int], None] | None = None) -> None:
        super().__init__(daemon=True)
        self.client = Client(job.port)
        self.client.hello(job, host, node_ids)
        self.on_kill = on_kill
        self.messages: list[dict[str, Any]] = []
        self.cond = threading.Condition()

    def run(self) -> None:
        while True:
            try:
                msg = self.client.recv(timeout=3600)
            except (OSError, AssertionError):
                msg = None
            with self.cond:
                if msg is not None:
                    self.messages.append(msg)
                self.cond.notify_all()
            if msg is None:
                return
            if msg["op"] == P.KILL and self.on_kill is not None:
                self.on_kill(msg["node_id"], msg["pid"])

    def exited(self, node_id: str, pid: int, code: int | None, sig: str | None = None) -> None:
        self.client.send(P.EXITED, node_id=node_id, pid=pid, code=code, signal=sig)

    def wait_message(self, op: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for msg in self.messages:
                    if msg["op"] == op:
                        return msg
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"agent got no {op!r} within {timeout} s; got {self.messages}")
                self.cond.wait(left)


@contextmanager
def job_factory(root: Path) -> Iterator[Callable[..., Job]]:
    """make(world, **kw) -> a Job in its own directory under root; every job made is cleaned up at the end."""
    jobs: list[Job] = []

    def make(world: int, **kw: Any) -> Job:
        job_root = root / f"job{len(jobs)}"
        job_root.mkdir()
        jobs.append(Job(job_root, world, **kw))
        return jobs[-1]

    try:
        yield make
    finally:
        for job in jobs:
            job.cleanup()


def expected_weights(world: int, steps: int, dim: int = 4) -> list[float]:
    """What runtime_worker.py computes without any fault, replayed in the same float64 operations."""
    import torch

    w = torch.zeros(dim, dtype=torch.float64)
    for step in range(steps):
        g = torch.full((dim,), float(sum(r + 1 for r in range(world)) * (step + 1)), dtype=torch.float64)
        w = w * 0.999 + g * 0.001
    return w.tolist()


def read_result(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
