"""A process that plays whole hosts of a job (each an agent and its workers) against the real scheduler, for the
scale harness (toolkit.testing.simjob, which starts several of these and drives them).

Why: how the scheduler behaves with thousands of ranks can only be seen with thousands of connections that speak
its protocol exactly, and thousands of Python processes with torch would measure the machine, not the scheduler.
Here one `selectors` loop over plain non-blocking sockets plays hundreds of agents and workers. Plain sockets, not
asyncio streams nor TCPStore clients: nothing here shares a lock or a thread with another connection
(REFERENCE.md's one-process TCPStore stall does not apply).

What a simulated process does, as the real one does it (toolkit.agent, toolkit.train.runtime, toolkit.train.store,
torch's gloo and NCCL bootstraps):
- every connection answers the challenge with an HMAC proof and checks the server's proof before believing the
  answer (toolkit.contracts.protocol); a connection closed or refused before that is counted as refused and tried again
  (a worker's control connection every CONTROL_RETRY, its store connection with STORE_RETRY_* backoff, an agent's
  every AGENT_RETRY);
- an agent says `agent_hello {host, node_ids}`, heartbeats every `beat` its welcome gives naming its running workers
  (`running {node_id: pid}`), reports a killed worker's `exited {signal: SIGKILL}` and relaunches it (a new
  incarnation) after the driver's delay;
- a worker `register`s (in-place recovery), heartbeats every TOOLKIT_HEARTBEAT_INTERVAL the plan gives a job of
  this size (envvars.heartbeat_interval), at its own phase within it, with every pace field, sends `commit` every
  COMMIT_EVERY steps; after each `formed` it opens a new store connection and runs the bootstrap patterns in order,
  then says `recovered`; a `generation` notice leaves the group (a bootstrap still running is cut short, as the
  runtime's fence does);
- the store patterns (values checked byte for byte against what their writers set), gloo's after the runtime's
  arrival wait (`add` to the arrivals, the last rank `set`s the key every rank `wait`s for);
  `gloo`          set one 154-byte value, then multi_get every rank's, 128 keys a request (GLOO_ENABLE_STORE_V2_API
                  with GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER); a store that answers "unknown store command" gets a
                  wait and a get per key, as gloo then does;
  `gloo-legacy`   gloo without those variables: a value of 154 + 8N bytes, then a wait and a get per rank;
  `nccl`          rank 0 sets the unique id (128 bytes), every other rank gets it (N - 1 waiters on one key);
  `nccl-scalable` every NCCL_RANKS_PER_ROOT-th rank sets its id, every rank one multi_get of them;
  with a monitor (NCCL's heartbeat monitor), every rank `check`s ["exception_dump"] each
  TORCH_NCCL_COORD_CHECK_MILSEC the plan would give (envvars.nccl_coord_check_ms).

The driver talks to this process over a socketpair (the descriptor named by --channel) in JSON lines: commands
`go`, `wait {gen}`, `kill {rank, host: bool, delay}`, `stats`, `done`; events `ready`, `built {gen, ranks}`,
`killed {t, ranks}`, `stats {...}`, `finished {...}`. Times are time.monotonic() (CLOCK_MONOTONIC is system-wide, so
they compare across processes).
"""

from __future__ import annotations

import argparse
import base64
import errno
import heapq
import itertools
import json
import os
import random
import secrets
import selectors
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

from toolkit import procs
from toolkit.contracts import envvars, protocol
from toolkit.contracts import messages as wire

GLOO_VALUE = 154  # bytes of a rank's address with GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER (torch 2.13, measured)
NCCL_VALUE = 128  # bytes of an ncclUniqueId
BATCH = 128  # keys per multi_get: what gloo asks for
NCCL_RANKS_PER_ROOT = 128  # TORCH_NCCL_RANKS_PER_ROOT
BUILD_TIMEOUT = 66.0  # s a store wait may take: the runtime's build bound (2 x the collective timeout + node timeout)
AGENT_HEARTBEAT = envvars.DEFAULT_AGENT_HEARTBEAT  # s, unless the welcome says otherwise (toolkit.agent.link)
CONTROL_RETRY = 0.25  # s: toolkit.train.runtime.CONNECT_RETRY (not imported here: that module imports torch)
STORE_RETRY_FIRST, STORE_RETRY_MAX = 0.05, 1.0  # s: toolkit.train.store's connect backoff
AGENT_RETRY = 1.0  # s: toolkit.agent.link.LINK_RETRY_INTERVAL
STEP_RATE = 10.0  # simulated steps per second
COMMIT_EVERY = 50  # steps between checkpoints (each rank says `commit`)
RECV_SIZE = 1 << 16
MAX_SAMPLES = 20  # error texts kept for the driver
PATTERNS = ("gloo", "gloo-legacy", "nccl", "nccl-scalable")


class Timers:
    """Callbacks at monotonic times, in a heap."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.heap, (when, next(self.seq), fn))

    def run_due(self, now: float) -> None:
        while self.heap and self.heap[0][0] <= now:
            heapq.heappop(self.heap)[2]()

    def wait(self, now: float) -> float | None:
        return max(0.0, self.heap[0][0] - now) if self.heap else None


class Link:
    """One non-blocking authenticated connection of a simulated process: connect (from `source`), answer the
    challenge with `op` and `fields`, check the server's proof, then lines in (`on_line`) and out (`send`).

    `on_up(reply)` gets the proven answer to the hello; `on_end(why, up)` is called once when the connection ends
    for any reason but our own `close`/`abort` (`up`: whether the hello had been answered)."""

    def __init__(self, sim: Sim, port: int, source: str | None, op: str, fields: dict[str, Any], limit: int,
                 on_up: Callable[[dict[str, Any]], None], on_line: Callable[[bytes], None],
                 on_end: Callable[[str, bool], None]) -> None:
        self.sim, self.op, self.fields, self.limit = sim, op, fields, limit
        self.on_up, self.on_line, self.on_end = on_up, on_line, on_end
        self.state = "connecting"
        self.inbuf = bytearray()
        self.scan = 0
        self.out = bytearray()
        self.nonces = ("", "")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if source is not None:  # a simulated host's own address; the port is chosen at connect (per destination)
            self.sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24), 1)
            self.sock.bind((source, 0))
        code = self.sock.connect_ex((sim.host, port))
        self.failed = 0 if code == errno.EINPROGRESS else code  # refused at once: said at the first event
        sim.sel.register(self.sock, selectors.EVENT_WRITE, self)

    @property
    def up(self) -> bool:
        return self.state == "up"

    def on_event(self, mask: int) -> None:
        if self.state == "connecting":
            code = self.failed or self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                self._end(f"connect: {os.strerror(code)}")
                return
            self.state = "challenge"
            self.sim.sel.modify(self.sock, selectors.EVENT_READ, self)
            return
        if mask & selectors.EVENT_READ:
            self._read()
        if mask & selectors.EVENT_WRITE and self.state != "closed":
            self._flush()

    def send(self, data: bytes) -> None:
        """Queue `data` and write what the socket takes now."""
        if self.state == "closed":
            return
        self.out += data
        self.sim.sent += 1
        self._flush()

    def close(self) -> None:
        """Our end of the connection (FIN): no callback."""
        if self.state != "closed":
            self.state = "closed"
            self.sim.sel.unregister(self.sock)
            self.sock.close()

    def abort(self) -> None:
        """The process died: the kernel resets its connections (RST); no callback."""
        if self.state != "closed":
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.close()

    def _flush(self) -> None:
        if not self.out or self.state in ("connecting", "closed"):
            return
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            self._end(f"send: {e.strerror}")
            return
        del self.out[:sent]
        self.sim.sel.modify(self.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if self.out else 0), self)

    def _read(self) -> None:
        try:
            data = self.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._end(f"recv: {e.strerror}")
            return
        if not data:
            self._end("closed by the scheduler")
            return
        self.sim.received += len(data)
        self.inbuf += data
        while self.state != "closed":
            end = self.inbuf.find(b"\n", self.scan)
            if end < 0:
                self.scan = len(self.inbuf)
                if self.scan > self.limit:
                    self._end(f"a line longer than {self.limit} bytes")
                return
            line = bytes(self.inbuf[:end])
            del self.inbuf[:end + 1]
            self.scan = 0
            self._line(line)

    def _line(self, line: bytes) -> None:
        if self.state == "up":
            self.on_line(line)
        elif self.state == "challenge":
            server_nonce = protocol.challenge_nonce(protocol.decode(line))
            hello, client_nonce = protocol.hello(self.op, self.sim.token, server_nonce, **self.fields)
            self.nonces = (server_nonce, client_nonce)
            self.state = "hello"
            self.send(hello)
        else:
            reply = protocol.decode(line)
            if not protocol.check_server(self.sim.token, *self.nonces, reply):
                self.sim.count("unproven")
                self._end(f"{self.op}: an answer without the server's proof: {str(reply)[:200]}")
                return
            self.state = "up"
            self.on_up(reply)

    def _end(self, why: str) -> None:
        if self.state == "closed":
            return
        up = self.state == "up"
        self.close()
        self.on_end(why, up)


@dataclass
class Bootstrap:
    """What every rank sets and reads in one generation's store patterns: the values as base64 (all ranks', to check
    replies byte for byte), the keys, and multi_get requests and their expected replies, built once per generation
    and shared by the ranks of this process."""

    prefix: str
    world: int

    def __post_init__(self) -> None:
        self.cache: dict[Any, Any] = {}

    def key(self, pattern: str, rank: int) -> str:
        if pattern.startswith("gloo"):
            return f"{self.prefix}/0//cpu//0/{rank}"
        return f"{self.prefix}/0//cuda//0/{rank}"

    def value(self, pattern: str, rank: int) -> str:
        """Base64 of rank `rank`'s value in `pattern` (what the store keeps and replies carry)."""
        k = ("value", pattern, rank)
        if k not in self.cache:
            size = GLOO_VALUE + 8 * self.world if pattern == "gloo-legacy" else \
                GLOO_VALUE if pattern == "gloo" else NCCL_VALUE
            raw = f"{self.prefix}|{pattern}|{rank}|".encode().ljust(size, b".")[:size]
            self.cache[k] = base64.b64encode(raw).decode()
        return self.cache[k]

    def batches(self, pattern: str, ranks: list[int]) -> list[tuple[bytes, bytes, bytes]]:
        """multi_get requests for the keys of `ranks`, BATCH a request: (request head up to the id, the rest,
        the expected reply's values part)."""
        k = ("batches", pattern, tuple(ranks))
        if k not in self.cache:
            out = []
            for i in range(0, len(ranks), BATCH):
                part = ranks[i:i + BATCH]
                line = protocol.encode(protocol.KV, id=0, cmd="multi_get", keys=[self.key(pattern, r) for r in part],
                                timeout=BUILD_TIMEOUT)
                expect = '","'.join(self.value(pattern, r) for r in part).encode()
                out.append((*_split_id(line), expect))
            self.cache[k] = out
        return self.cache[k]


def _split_id(line: bytes) -> tuple[bytes, bytes]:
    """A request encoded with id 0, split around the id (head ends with `"id":`), so an id can be put between."""
    head = b'{"op":"kv","id":'
    assert line.startswith(head + b"0,")
    return head, line[len(head) + 1:]


def _request(cmd: str, **fields: Any) -> tuple[bytes, bytes, bytes | None]:
    return (*_split_id(protocol.encode(protocol.KV, id=0, cmd=cmd, **fields)), None)


class StoreFailed(Exception):
    """A store reply that is not the one expected."""


Script = Generator[tuple[bytes, bytes, bytes | None], bytes, None]


def _ok(line: bytes) -> dict[str, Any]:
    reply = protocol.decode(line)
    if reply.get("op") != protocol.KV_REPLY or reply.get("ok") is not True:
        raise StoreFailed(str(reply.get("error") or reply)[:300])
    return reply


def _values_match(line: bytes, rid: int, expect: bytes) -> bool:
    """Whether `line` is the ok reply to multi_get `rid` with exactly the expected values (no JSON parse: a gloo
    bootstrap at 4096 ranks reads 3.5 GB of replies)."""
    head = b'{"op":"kv_reply","id":%d,"ok":true,"values":["' % rid
    return line.startswith(head) and line.endswith(b'"]}') and line[len(head):-3] == expect


def pattern_script(pattern: str, boot: Bootstrap, rank: int, rid: Callable[[], int],
                   tally: Callable[[str], None]) -> Script:
    """The store requests of one rank in one pattern, in order: each yield is a request (head, tail, expected
    multi_get values or None) and receives the reply line; StoreFailed when a reply is wrong. `rid()` is the id the
    request went out with; `tally(what)` counts replies checked."""
    world = boot.world
    if pattern in ("gloo", "gloo-legacy"):
        yield from _arrive(f"{boot.prefix}/{pattern}/", world)
        _ok((yield _request("set", key=boot.key(pattern, rank), value=boot.value(pattern, rank))))
        if pattern == "gloo":
            yield from _multi_get(pattern, boot, list(range(world)), rid, tally)
        else:
            yield from _wait_get(pattern, boot, list(range(world)), tally)
    elif pattern == "nccl":
        key = f"{boot.prefix}/0//cuda//0"
        if rank == 0:
            _ok((yield _request("set", key=key, value=boot.value(pattern, 0))))
        else:
            got = _ok((yield _request("get", key=key, timeout=BUILD_TIMEOUT)))
            if got.get("value") != boot.value(pattern, 0):
                raise StoreFailed(f"get {key}: not the value rank 0 set")
            tally("get values checked")
    elif pattern == "nccl-scalable":
        roots = list(range(0, world, NCCL_RANKS_PER_ROOT))
        if rank in roots:
            _ok((yield _request("set", key=boot.key(pattern, rank), value=boot.value(pattern, rank))))
        yield from _multi_get(pattern, boot, roots, rid, tally)
    else:
        raise StoreFailed(f"unknown pattern {pattern!r}")


def _arrive(prefix: str, world: int) -> Script:
    """What a worker does before each build (toolkit.train.runtime._arrive): add 1 to the arrivals, set the key
    every rank waits on if it was the last, and wait for that key."""
    got = _ok((yield _request("add", key=prefix + protocol.ARRIVED, amount=1)))
    if got.get("value", 0) >= world:
        _ok((yield _request("set", key=prefix + protocol.ALL_ARRIVED, value=base64.b64encode(b"1").decode())))
    _ok((yield _request("wait", keys=[prefix + protocol.ALL_ARRIVED], timeout=BUILD_TIMEOUT)))


def _multi_get(pattern: str, boot: Bootstrap, ranks: list[int], rid: Callable[[], int],
               tally: Callable[[str], None]) -> Script:
    """multi_get of the ranks' keys, BATCH at a time; a store without multi_get gets gloo's fallback."""
    for i, (head, tail, expect) in enumerate(boot.batches(pattern, ranks)):
        line = yield (head, tail, expect)
        if _values_match(line, rid(), expect):
            tally("multi_get values checked")
            continue
        reply = protocol.decode(line)
        if reply.get("ok") is False and "unknown store command" in str(reply.get("error")):
            yield from _wait_get(pattern, boot, ranks[i * BATCH:(i + 1) * BATCH], tally)
            continue
        raise StoreFailed(f"multi_get: {str(reply.get('error') or 'values not the ones set')[:300]}")


def _wait_get(pattern: str, boot: Bootstrap, ranks: list[int], tally: Callable[[str], None]) -> Script:
    """gloo's pattern without multi_get: for every rank, wait for its key, then get it."""
    for r in ranks:
        key = boot.key(pattern, r)
        _ok((yield _request("wait", keys=[key], timeout=BUILD_TIMEOUT)))
        got = _ok((yield _request("get", key=key, timeout=BUILD_TIMEOUT)))
        if got.get("value") != boot.value(pattern, r):
            raise StoreFailed(f"get {key}: not the value rank {r} set")
        tally("get values checked")


class SimWorker:
    """One simulated worker process (one incarnation of `rank`): its control connection, its store connection
    of the current generation, and what it saw when: `formed`, `notice` (a `generation` announcement) and
    `rebuilt` (its bootstrap's last reply), each by generation."""

    def __init__(self, sim: Sim, host: SimHost, rank: int, seq: int) -> None:
        self.sim, self.host, self.rank = sim, host, rank
        self.node_id = protocol.worker_node_id(rank)
        self.incarnation = secrets.token_hex(8)
        self.pid = 10_000_000 + rank * 100 + seq  # a fake pid: the scheduler only shows and matches it
        self.alive = True
        self.finishing = False
        self.ctl: Link | None = None
        self.store: Link | None = None
        self.generation: int | None = None  # the generation whose group it holds (or builds)
        self.announced: int | None = None
        self.formed: dict[int, float] = {}
        self.notice: dict[int, float] = {}
        self.rebuilt: dict[int, float] = {}
        self.script: Script | None = None
        self.rid = 0
        self.training = False
        self.step = 0
        self.ckpts = 0
        self.store_attempts = 0
        self.phase = (rank * 0.6180339887) % 1.0
        self.busy = b"%.6f" % (0.05 + (rank % 7) * 0.0005)

    def start(self) -> None:
        """Connect and register (in-place recovery, like a script that called toolkit.train.init())."""
        fields = {"node_id": self.node_id, "rank": self.rank, "world_size": self.sim.world,
                  "incarnation": self.incarnation, "pid": self.pid, "host": self.host.name,
                  "generation": self.generation, "rejoin": False, "recovery": protocol.RECOVERY_IN_PLACE}
        self.ctl = Link(self.sim, self.sim.port, self.host.ip, protocol.REGISTER, fields, protocol.MAX_LINE,
                        self._ctl_up, self._ctl_line, self._ctl_end)

    def kill(self) -> None:
        """SIGKILL: its connections are reset, its timers do nothing from now on."""
        self.alive = False
        for link in (self.ctl, self.store):
            if link is not None:
                link.abort()

    def done(self) -> None:
        """A clean finish: `done`, then nothing more is sent."""
        self.finishing = True
        if self.ctl is not None and self.ctl.up:
            self.ctl.send(protocol.encode(protocol.DONE))

    # -- the control connection

    def _ctl_up(self, reply: dict[str, Any]) -> None:
        op = reply.get("op")
        if op == protocol.WELCOME:
            self.sim.timers.at(self.sim.now + self.sim.heartbeat * (0.5 + self.phase), self._beat)
            return
        assert self.ctl is not None
        self.ctl.close()
        if op == protocol.REJECT and reply.get("retry") is True:  # the rank's holder is not known dead yet
            self.sim.count("register retried")
            self.sim.timers.at(self.sim.now + CONTROL_RETRY, self._restart)
            return
        self.sim.count("refused")
        self.sim.error(f"{self.node_id}: register answered {op}: {str(reply.get('reason'))[:200]}")

    def _restart(self) -> None:
        if self.alive:
            self.start()

    def _ctl_line(self, line: bytes) -> None:
        msg = protocol.decode(line)
        op, now = msg["op"], self.sim.now
        if op == protocol.FORMED:
            gen = protocol.whole(msg, "generation")
            if gen is None or not isinstance(msg.get("prefix"), str):
                raise protocol.ProtocolError("formed without a generation or a prefix")
            self.formed.setdefault(gen, now)
            self.announced = max(gen, self.announced if self.announced is not None else gen)
            self._build(gen, msg["prefix"])
        elif op == protocol.GENERATION:
            gen = protocol.whole(msg, "generation")
            if gen is None:
                raise protocol.ProtocolError("generation without a number")
            self.notice.setdefault(gen, now)
            self.announced = gen
            self.training = False
            if self.script is not None:  # the fence: a build of a left generation is cut short
                self._drop_store()
        elif op in (protocol.STOP, protocol.FENCED):
            self.sim.error(f"{self.node_id}: {op}: {str(msg.get('reason'))[:200]}")
            self.kill()
        else:
            self.sim.error(f"{self.node_id}: unexpected {op[:40]!r}")

    def _ctl_end(self, why: str, up: bool) -> None:
        if not self.alive or self.finishing:
            return
        if up:
            self.sim.error(f"{self.node_id}: the control connection ended: {why}")
            self.alive = False
            return
        self.sim.count("refused")
        self.sim.timers.at(self.sim.now + CONTROL_RETRY, self._restart)

    def _beat(self) -> None:
        """A heartbeat with every pace field, and a commit when a checkpoint step was passed; the next one in a
        heartbeat interval."""
        if not self.alive or self.finishing or self.ctl is None:
            return
        if self.training:
            step = int((self.sim.now - self.sim.started) * STEP_RATE)
            if step // COMMIT_EVERY > self.step // COMMIT_EVERY:
                self.ckpts += 1
                self.ctl.send(protocol.encode(protocol.COMMIT, step=step // COMMIT_EVERY * COMMIT_EVERY))
            self.step = step
        if self.ctl.up:
            self.ctl.send(b'{"op":"heartbeat","step":%d,"step_time":0.1,"busy":%s,"loss":2.5,"ckpt_stall":%.4f,'
                          b'"ckpts":%d,"ckpt_every":%d,"ckpt_why":"%d steps: fixed (ckpt_every)"}\n'
                          % (self.step, self.busy, self.ckpts * 0.01, self.ckpts, COMMIT_EVERY, COMMIT_EVERY))
        self.sim.timers.at(self.sim.now + self.sim.heartbeat, self._beat)

    # -- the store

    def _build(self, gen: int, prefix: str) -> None:
        """Leave the old group (its store connection closes) and bootstrap `gen`'s over a new one."""
        self._drop_store()
        self.generation = gen
        self.store_attempts = 0
        self._connect_store(prefix)

    def _connect_store(self, prefix: str) -> None:
        gen = self.generation

        def up(reply: dict[str, Any]) -> None:
            if reply.get("op") != protocol.WELCOME:
                self.sim.count("refused")
                self.sim.error(f"{self.node_id}: the store answered {reply.get('op')}: {reply.get('reason')}")
                return
            assert gen is not None
            boot = self.sim.bootstrap(prefix)
            self.script = self._scripts(boot)
            self._next(None)

        def end(why: str, was_up: bool) -> None:
            if not self.alive or gen != self.generation:
                return
            if was_up:
                self.sim.error(f"{self.node_id}: the store connection of generation {gen} ended: {why}")
                self.script = None
                return
            self.sim.count("refused")
            pause = min(STORE_RETRY_MAX, STORE_RETRY_FIRST * 2 ** self.store_attempts) * (0.5 + random.random() / 2)
            self.store_attempts += 1
            self.sim.timers.at(self.sim.now + pause, lambda: self._retry_store(gen, prefix))

        self.store = Link(self.sim, self.sim.store_port, self.host.ip, protocol.STORE_HELLO, {"node_id": self.node_id},
                          protocol.MAX_STORE_LINE, up, self._store_line, end)

    def _retry_store(self, gen: int | None, prefix: str) -> None:
        if self.alive and gen == self.generation and self.announced == gen:
            self._connect_store(prefix)

    def _scripts(self, boot: Bootstrap) -> Script:
        for pattern in self.sim.patterns:
            yield from pattern_script(pattern, boot, self.rank, lambda: self.rid, self.sim.count)

    def _next(self, line: bytes | None) -> None:
        """Hand the reply to the bootstrap and send its next request; at its end the group is built."""
        assert self.script is not None and self.store is not None
        try:
            head, tail, _ = self.script.send(line)  # type: ignore[arg-type]
        except StopIteration:
            self.script = None
            self._built()
            return
        except (StoreFailed, protocol.ProtocolError) as e:
            self.script = None
            if self.announced == self.generation:  # not cut short by a newer generation
                self.sim.error(f"{self.node_id}: bootstrap of generation {self.generation}: {e}")
            return
        self.rid += 1
        self.sim.requests += 1
        self.store.send(b"%s%d%s" % (head, self.rid, tail))

    def _store_line(self, line: bytes) -> None:
        if self.script is not None:
            self._next(line)
            return
        reply = _ok(line)  # the monitor's check
        if reply.get("present") is not False:
            self.sim.error(f"{self.node_id}: exception_dump is set")
        self.sim.count("checks answered")

    def _built(self) -> None:
        gen = self.generation
        assert gen is not None
        now = self.sim.now
        self.rebuilt[gen] = now
        self.training = True
        first = gen == 0
        assert self.ctl is not None
        self.ctl.send(protocol.encode(protocol.RECOVERED, generation=gen, step=self.step,
                                      source="initial" if first else "peer", from_rank=None if first else 0,
                                      recomputed=0, seconds=round(now - self.formed.get(gen, now), 4), bytes=0))
        self.sim.built(self, gen)
        if self.sim.monitor:
            self.sim.timers.at(now + self.sim.monitor_interval * (0.5 + self.phase), lambda: self._check(gen))

    def _check(self, gen: int) -> None:
        """NCCL's heartbeat monitor: is there an exception dump signal? Once a second while in this group."""
        if not self.alive or self.finishing or self.generation != gen or not self.training or self.store is None:
            return
        if self.script is None and self.store.up:
            self.rid += 1
            self.sim.requests += 1
            self.store.send(b'{"op":"kv","id":%d,"cmd":"check","keys":["exception_dump"]}\n' % self.rid)
        self.sim.timers.at(self.sim.now + self.sim.monitor_interval, lambda: self._check(gen))

    def _drop_store(self) -> None:
        self.script = None
        if self.store is not None:
            self.store.close()
            self.store = None


class SimHost:
    """One simulated host: its agent's connection and its workers (ranks `ranks`), from its own address `ip`."""

    def __init__(self, sim: Sim, index: int, ranks: list[int], ip: str | None) -> None:
        self.sim, self.index, self.ranks, self.ip = sim, index, ranks, ip
        self.name = f"sim{index}"
        self.agent: Link | None = None
        self.alive = True
        self.finished = False
        self.beat = AGENT_HEARTBEAT  # s between its heartbeats: what the scheduler's welcome said
        self.seq = itertools.count()
        self.workers = {r: SimWorker(sim, self, r, next(self.seq)) for r in ranks}

    def start(self) -> None:
        self.alive = True
        self.agent = Link(self.sim, self.sim.port, self.ip, protocol.AGENT_HELLO,
                          {"host": self.name, "node_ids": [protocol.worker_node_id(r) for r in self.ranks]},
                          protocol.MAX_LINE, self._up, self._line, self._end)

    def kill_worker(self, rank: int, delay: float) -> None:
        """A worker SIGKILLed: its agent reports the exit and relaunches it (a new incarnation) after `delay`."""
        old = self.workers[rank]
        old.kill()
        if self.agent is not None and self.agent.up:
            self.agent.send(protocol.encode(protocol.EXITED, node_id=old.node_id, pid=old.pid, code=None,
                                            signal="SIGKILL", cause=None))
        self.sim.timers.at(self.sim.now + delay, lambda: self._relaunch(rank))

    def kill(self, delay: float) -> None:
        """The whole host goes down (its agent too) and comes back after `delay`: a new agent, new workers."""
        self.alive = False
        for w in self.workers.values():
            w.kill()
        if self.agent is not None:
            self.agent.abort()
        self.sim.timers.at(self.sim.now + delay, self._reboot)

    def _reboot(self) -> None:
        self.start()
        for rank in self.ranks:
            self._relaunch(rank)

    def _relaunch(self, rank: int) -> None:
        w = self.workers[rank] = SimWorker(self.sim, self, rank, next(self.seq))
        w.start()

    def _up(self, reply: dict[str, Any]) -> None:
        if reply.get("op") != protocol.WELCOME:
            self.sim.count("refused")
            self.sim.error(f"agent of {self.name}: hello answered {reply.get('op')}: {reply.get('reason')}")
            return
        self.beat = protocol.beat_interval(reply, AGENT_HEARTBEAT)
        self.sim.timers.at(self.sim.now + self.beat * random.random(), self._beat)

    def _beat(self) -> None:
        if self.alive and self.agent is not None and self.agent.up and not self.finished:
            running = {w.node_id: w.pid for w in self.workers.values() if w.alive and not w.finishing}
            # vouches for its children, as agents do
            self.agent.send(wire.Heartbeat(running=running).line())
            self.sim.timers.at(self.sim.now + self.beat, self._beat)

    def _line(self, line: bytes) -> None:
        msg = protocol.decode(line)
        op = msg["op"]
        if op == protocol.KILL:  # a worker the scheduler found dead: killed already, unless it is the live one
            w = self.workers.get(_rank(msg.get("node_id")))
            if w is not None and w.alive and w.pid == msg.get("pid"):
                self.sim.error(f"agent of {self.name}: told to kill the live {w.node_id}")
        elif op == protocol.FINISHED:
            self.finished = True
            self.sim.host_finished()
        elif op == protocol.STOP:
            self.sim.error(f"agent of {self.name}: stop: {str(msg.get('reason'))[:300]}")
        else:
            self.sim.error(f"agent of {self.name}: unexpected {op[:40]!r}")

    def _end(self, why: str, up: bool) -> None:
        if not self.alive or self.finished:
            return
        if up:
            self.sim.error(f"agent of {self.name}: its connection ended: {why}")
        self.sim.count("refused" if not up else "agent reconnects")
        self.sim.timers.at(self.sim.now + AGENT_RETRY, self.start)


def _rank(node_id: Any) -> int:
    prefix = protocol.worker_node_id(0)[:-1]
    if isinstance(node_id, str) and node_id.startswith(prefix) and node_id[len(prefix):].isdigit():
        return int(node_id[len(prefix):])
    return -1


class Sim:
    """This process: its hosts, one selector loop, the timers, the driver's channel and the counters it reports."""

    def __init__(self, cfg: dict[str, Any], token: str, channel: socket.socket) -> None:
        self.host, self.port, self.store_port = cfg["host"], cfg["port"], cfg["store_port"]
        self.world, self.patterns, self.monitor = cfg["world"], tuple(cfg["patterns"]), cfg["monitor"]
        # what the plan gives a job of this size (TOOLKIT_HEARTBEAT_INTERVAL, TORCH_NCCL_COORD_CHECK_MILSEC)
        self.heartbeat = envvars.heartbeat_interval(self.world, envvars.DEFAULT_HEARTBEAT_INTERVAL, cfg["node_timeout"])
        self.monitor_interval = envvars.nccl_coord_check_ms(self.world) / 1000
        self.token = token
        self.sel = selectors.DefaultSelector()
        self.timers = Timers()
        self.now = time.monotonic()
        self.started = self.now
        per_host = cfg["per_host"]
        self.hosts = [SimHost(self, k, list(range(k * per_host, min(self.world, (k + 1) * per_host))),
                              _host_ip(k) if cfg["per_host_ips"] else None) for k in cfg["hosts"]]
        self.ranks = {r: h for h in self.hosts for r in h.ranks}
        self.boots: dict[str, Bootstrap] = {}
        self.counts: dict[str, int] = {}
        self.samples: list[str] = []
        self.sent = self.received = self.requests = 0
        self.waits: dict[int, bool] = {}  # generation -> reported already
        self.built_ranks: dict[int, set[int]] = {}
        self.finishing = False
        self.channel = channel
        self.chan_in = bytearray()
        channel.setblocking(False)
        self.sel.register(channel, selectors.EVENT_READ, self)
        self.stopped = False

    # -- what the workers and hosts report

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def error(self, text: str) -> None:
        self.count("errors")
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(text)

    def bootstrap(self, prefix: str) -> Bootstrap:
        if prefix not in self.boots:
            if len(self.boots) >= 2:  # only the newest generations are still being built
                del self.boots[next(iter(self.boots))]
            self.boots[prefix] = Bootstrap(prefix, self.world)
        return self.boots[prefix]

    def built(self, worker: SimWorker, gen: int) -> None:
        self.built_ranks.setdefault(gen, set()).add(worker.rank)
        self._answer_waits()

    def host_finished(self) -> None:
        if self.finishing and all(h.finished for h in self.hosts):
            self.say("finished", **self.stats())
            self.stopped = True

    # -- the driver

    def say(self, event: str, **fields: Any) -> None:
        self.channel.setblocking(True)  # the driver reads at once; a report is never half-sent
        self.channel.sendall(json.dumps({"event": event, **fields}).encode() + b"\n")
        self.channel.setblocking(False)

    def on_event(self, mask: int) -> None:
        try:
            data = self.channel.recv(RECV_SIZE)
        except BlockingIOError:
            return
        if not data:  # the driver is gone
            self.stopped = True
            return
        self.chan_in += data
        while b"\n" in self.chan_in:
            line, _, rest = bytes(self.chan_in).partition(b"\n")
            self.chan_in = bytearray(rest)
            self.command(json.loads(line))

    def command(self, msg: dict[str, Any]) -> None:
        cmd = msg["cmd"]
        if cmd == "go":
            self.started = self.now
            for h in self.hosts:
                h.start()
                for w in h.workers.values():
                    w.start()
        elif cmd == "wait":
            self.waits[int(msg["gen"])] = False
            self._answer_waits()
        elif cmd == "kill":
            host = self.ranks[int(msg["rank"])]
            if msg.get("host"):
                host.kill(float(msg["delay"]))
                ranks = host.ranks
            else:
                host.kill_worker(int(msg["rank"]), float(msg["delay"]))
                ranks = [int(msg["rank"])]
            self.say("killed", t=self.now, ranks=ranks)
        elif cmd == "stats":
            self.say("stats", **self.stats())
        elif cmd == "done":
            self.finishing = True
            for h in self.hosts:
                for w in h.workers.values():
                    w.done()
            self.host_finished()

    def stats(self) -> dict[str, Any]:
        return {"counts": self.counts, "samples": self.samples, "sent": self.sent, "received": self.received,
                "requests": self.requests, "pid": os.getpid()}

    def _answer_waits(self) -> None:
        for gen, said in self.waits.items():
            if said or len(self.built_ranks.get(gen, ())) < len(self.ranks):
                continue
            workers = [h.workers[r] for h in self.hosts for r in h.ranks]
            if not all(gen in w.rebuilt for w in workers):  # a rank built it, then died, and its successor not yet
                continue
            self.waits[gen] = True
            self.say("built", gen=gen, ranks={w.rank: [w.formed.get(gen), w.notice.get(gen), w.rebuilt[gen]]
                                              for w in workers})

    # -- the loop

    def run(self) -> None:
        self.say("ready", pid=os.getpid())
        while not self.stopped:
            self.now = time.monotonic()
            for key, mask in self.sel.select(self.timers.wait(self.now)):
                self.now = time.monotonic()
                try:
                    key.data.on_event(mask)
                except (protocol.ProtocolError, StoreFailed, KeyError, ValueError, TypeError) as e:
                    self.error(f"{type(e).__name__}: {e}")
                    if isinstance(key.data, Link):
                        key.data.close()
            self.now = time.monotonic()
            self.timers.run_due(self.now)


def _host_ip(index: int) -> str:
    """Simulated host `index`'s own loopback address (127.1.x.y): the scheduler sees each host's connections come
    from one address, as on a cluster."""
    return f"127.1.{index // 250}.{index % 250 + 1}"


def main(argv: list[str] | None = None) -> int:
    """`python -m toolkit.testing.simhosts --channel FD --config JSON --token-file PATH`: play the hosts the config
    names until the driver says `done` (or goes away)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channel", type=int, required=True, help="the descriptor of the driver's socketpair end")
    ap.add_argument("--config", required=True, help="JSON: host, port, store_port, world, hosts, per_host, "
                                                     "per_host_ips, patterns, monitor")
    ap.add_argument("--token-file", required=True)
    args = ap.parse_args(argv)
    procs.raise_open_files()  # two connections per simulated worker
    with open(args.token_file) as fh:
        token = fh.read().strip()
    channel = socket.socket(fileno=args.channel)
    Sim(json.loads(args.config), token, channel).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
