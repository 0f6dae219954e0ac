"""The client of the job's store (toolkit.scheduler.kvstore), as a `torch.distributed.Store`: what process groups
bootstrap from under toolkit, in place of torch's TCPStore (which has no authentication and listens everywhere).

One authenticated connection per client (toolkit.contracts.session), one request at a time (torch calls a store from the
thread that builds the group). Every wait is bounded by the store's timeout; a connection the fence shut down
(toolkit.train.fence: a newer generation overtook the build) fails the pending call at once.

`multi_get` (one request for up to P.MAX_STORE_KEYS keys) and `has_extended_api()` make gloo's bootstrap cost one
`set` and about N/128 requests per rank instead of 2N, when the worker runs with GLOO_ENABLE_STORE_V2_API=1 (the
agent sets it, with GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1: docs/architecture.md). `connect` retries a refused or
reset connection until the build's deadline: after each `formed` every rank connects at once, and a scheduler
under that burst may close some connections at accept; one of them must not kill its worker.
"""

from __future__ import annotations

import base64
import binascii
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol
from toolkit.contracts.session import AT_ONCE, Unproven, evicted, open_session
from toolkit.train.faults import StoreError, StoreRefused

CONNECT_TIMEOUT = 2.0  # s for the TCP connect
HANDSHAKE_TIMEOUT = 10.0  # s for the challenge and the answer
SLACK = 5.0  # s the client waits beyond a timed wait's own timeout for the server's answer
RETRY_FIRST = 0.05  # s: the first pause before connecting again to a store that refused or reset the connection
RETRY_MAX = 1.0  # s: the longest pause between two attempts (doubling from RETRY_FIRST, jittered)


class _TooLong(StoreError):
    """The store's reply to a multi_get would be over P.MAX_STORE_REPLY bytes: ask for fewer keys."""


class JobStore(dist.Store):
    """torch.distributed.Store over one authenticated connection to the job's store: what Runtime._build and the
    wrapper's rendezvous hand torch, under PrefixStore(the generation's prefix, ...).

    Construct it through `connect`, which retries what may pass and turns every failure into StoreError; here the
    handshake (bounded by `connect_timeout` and `handshake`) raises OSError, ProtocolError or Unproven, and a proven
    refusal by the store StoreRefused. `timeout` is the store's timeout: how long `get`, `multi_get` and a `wait`
    without one wait for keys.

    Every call is one request and its reply, serialized by a lock (safe to share between threads; replies are
    matched by request id), each socket operation bounded by the request's own wait + SLACK + the store's timeout.
    Every call raises StoreError when the store refuses it, times out, or the connection fails or is shut down (by
    the fence: at once); torch reports it like a TCPStore error."""

    def __init__(self, host: str, port: int, token: str, node_id: str, timeout: timedelta,
                 connect_timeout: float = CONNECT_TIMEOUT, handshake: float = HANDSHAKE_TIMEOUT) -> None:
        super().__init__()
        self._timeout = timeout
        self._lock = threading.Lock()
        self._next = 0
        session = open_session((host, port), token, wire.StoreHello(node_id), handshake,
                               connect_timeout, limit=protocol.MAX_STORE_LINE)
        if not isinstance(session.reply, wire.Welcome):
            session.sock.close()
            why, retry = wire.refusal(session.reply)
            raise StoreRefused(f"the job's store at {host}:{port} refused {node_id}: {why[:300]}", retry)
        session.lines.limit = protocol.MAX_STORE_REPLY  # the server proved the token: a multi_get's reply may be long
        self._sock, self._lines, self._queued = session.sock, session.lines, session.queued
        self._address = f"{host}:{port}"

    # -- torch.distributed.Store

    def set(self, key: str, value: Any) -> None:
        """Store.set: set `key` to `value` (str, encoded UTF-8, or bytes), waking whoever waits for it; returns once
        the store acknowledged it. StoreError for a value over P.MAX_STORE_VALUE (before sending) or a full store
        (the server's key and byte bounds)."""
        self._call("set", key=key, value=_b64(value))

    def get(self, key: str) -> bytes:
        """Store.get: the value of `key`, blocking until the key exists, at most the store's timeout (then
        StoreError naming the key). The server refuses a timeout over kvstore.MAX_WAIT (a day): StoreError."""
        return base64.b64decode(self._call("get", key=key, timeout=self._seconds())["value"])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Store.multi_get: the values of `keys` in order, blocking until every one exists, at most the store's
        timeout for all of them (then StoreError naming the missing keys). One request per P.MAX_STORE_KEYS keys
        (gloo asks for 128 at a time); a request whose values would be over P.MAX_STORE_REPLY bytes is asked again
        in halves (values are at most P.MAX_STORE_VALUE bytes, so one always fits)."""
        deadline = time.monotonic() + self._seconds()
        values: list[bytes] = []
        pending = list(_batches(list(keys)))
        while pending:
            batch = pending.pop(0)
            try:
                reply = self._call("multi_get", keys=batch, timeout=max(0.001, deadline - time.monotonic()))
            except _TooLong:
                if len(batch) == 1:
                    raise
                pending[:0] = [batch[:len(batch) // 2], batch[len(batch) // 2:]]
                continue
            got = reply.get("values")
            if not isinstance(got, list) or len(got) != len(batch):
                raise StoreError(f"the job's store at {self._address}: a multi_get reply without its "
                                 f"{len(batch)} values")
            try:
                values += [base64.b64decode(v) for v in got]
            except (TypeError, binascii.Error):
                raise StoreError(f"the job's store at {self._address}: a multi_get value is not base64") from None
        return values

    def has_extended_api(self) -> bool:
        """Store.has_extended_api: True, so gloo (with GLOO_ENABLE_STORE_V2_API=1) fetches its peers' addresses
        with `multi_get`. torch's own loops over `set` serve `multi_set`; `append` is not offered."""
        return True

    def add(self, key: str, amount: int) -> int:
        """Store.add: add `amount` to the integer in `key` (missing: 0) and return the new value; the value is kept
        as decimal digits, so `get` returns them (as with TCPStore). Does not block. StoreError if the key holds
        something else or |amount| > 2**62."""
        return int(self._call("add", key=key, amount=int(amount))["value"])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """Store.compare_set: set `key` to `desired` if it holds `expected` (or is missing and `expected` is empty);
        returns what the key holds afterwards, or `expected` if it is missing and was not set (TCPStore's
        semantics). Does not block."""
        return base64.b64decode(self._call("compare_set", key=key, expected=_b64(expected),
                                           desired=_b64(desired))["value"])

    def check(self, keys: list[str]) -> bool:
        """Store.check: whether every key in `keys` (1 to 1024) exists now; does not wait."""
        return bool(self._call("check", keys=list(keys))["present"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Store.wait: block until every key in `keys` (1 to 1024) exists, at most `timeout` (default: the store's
        timeout), then StoreError naming the keys. As for `get`, over a day is refused."""
        seconds = timeout.total_seconds() if timeout is not None else self._seconds()
        self._call("wait", keys=list(keys), timeout=max(0.001, seconds))

    def delete_key(self, key: str) -> bool:
        """Store.delete_key: delete `key`; whether it existed."""
        return bool(self._call("delete", key=key)["deleted"])

    def num_keys(self) -> int:
        """Store.num_keys: how many keys the whole job's store holds, every prefix (PrefixStore passes it through);
        the keys of generations the job has left are deleted by the scheduler."""
        return int(self._call("num_keys")["count"])

    def set_timeout(self, timeout: timedelta) -> None:
        """Store.set_timeout: the wait of later `get` and default `wait` calls, and part of their socket bound;
        client-side only."""
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        """Store.timeout: the store's current timeout (see `set_timeout`)."""
        return self._timeout

    def close(self) -> None:
        """Close the connection (toolkit's own, not part of torch's interface): the runtime closes the store when it
        leaves a process group. Later calls raise StoreError."""
        self._sock.close()

    # -- the wire

    def _seconds(self) -> float:
        return max(0.001, self._timeout.total_seconds())

    def _call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            self._next += 1
            rid = self._next
            bound = fields.get("timeout", 0.0) + SLACK + self._seconds()
            try:
                self._sock.settimeout(bound)
                self._sock.sendall(protocol.encode(protocol.KV, id=rid, cmd=cmd, **fields))
                while True:
                    reply = self._read()
                    if reply.get("op") == protocol.KV_REPLY and reply.get("id") == rid:
                        break
            except (OSError, protocol.ProtocolError) as e:
                raise StoreError(f"the job's store at {self._address}: {cmd} failed ({e})") from None
        if not reply.get("ok"):
            error = str(reply.get("error"))[:300]
            if error == "timeout":
                missing = reply.get("keys") if isinstance(reply.get("keys"), list) else fields.get("keys")
                raise StoreError(f"the job's store at {self._address}: timed out after {fields.get('timeout'):.3g} s "
                                 f"waiting for {_names(missing or [fields.get('key')])}")
            raise (_TooLong if "limit" in reply else StoreError)(f"the job's store at {self._address} refused "
                                                                 f"{cmd}: {error}")
        return reply

    def _read(self) -> dict[str, Any]:
        while not self._queued:
            data = self._sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the scheduler closed the store connection")
            self._queued.extend(self._lines.feed(data))
        return self._queued.pop(0)


def _b64(value: Any) -> str:
    data = value.encode() if isinstance(value, str) else bytes(value)
    if len(data) > protocol.MAX_STORE_VALUE:
        raise StoreError(f"a store value of {len(data)} bytes is over the {protocol.MAX_STORE_VALUE}-byte limit")
    return base64.b64encode(data).decode()


def _batches(keys: list[str]) -> Iterator[list[str]]:
    """`keys` in runs that fit one request: at most P.MAX_STORE_KEYS keys, and well inside the server's line limit
    (P.MAX_STORE_LINE) once encoded."""
    batch: list[str] = []
    size = 0
    for key in keys:
        n = len(json.dumps(key)) + 1
        if batch and (len(batch) == protocol.MAX_STORE_KEYS or size + n > protocol.MAX_STORE_LINE // 2):
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch


def _names(keys: list[Any]) -> str:
    shown = ", ".join(repr(str(k)[:100]) for k in keys[:3])
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def retry_pause(attempt: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds to pause before connection attempt `attempt` + 1 (0 is the first retry): RETRY_FIRST doubling to
    RETRY_MAX, each between half and all of that (jitter: ranks refused in one burst come back spread out)."""
    full = min(RETRY_MAX, RETRY_FIRST * 2 ** min(attempt, 30))
    return full * (0.5 + 0.5 * rng())


def connect(host: str, port: int, token: str, node_id: str, timeout: timedelta, deadline: float | None = None,
            sleep: Callable[[float], None] = time.sleep) -> JobStore:
    """The job's store, or StoreError if it cannot be reached and trusted by `deadline` (time.monotonic();
    default: `timeout` from now, the bound of the build that needs the store).

    A connection the scheduler closed during the handshake (to make room, under a flood: session.evicted) is tried
    again at once, up to AT_ONCE times in a row; a refused connection, or more of those, after `retry_pause`, until
    the deadline; each attempt is bounded by
    CONNECT_TIMEOUT and HANDSHAKE_TIMEOUT and by what is left. A peer that cannot prove the job token (Unproven),
    a proven refusal without `retry`, a timeout and anything else the network says fail at once."""
    if deadline is None:
        deadline = time.monotonic() + timeout.total_seconds()
    attempt = at_once = 0
    while True:
        left = deadline - time.monotonic()
        try:
            return JobStore(host, port, token, node_id, timeout, max(0.01, min(CONNECT_TIMEOUT, left)),
                            max(0.01, min(HANDSHAKE_TIMEOUT, left)))
        except (ConnectionError, StoreRefused) as e:
            if isinstance(e, StoreRefused) and not e.retry:
                raise
            if evicted(e) and at_once < AT_ONCE and time.monotonic() < deadline:
                at_once += 1  # closed to make room (a flood): at once, the hello is read at accept this time
                continue
            at_once = 0
            pause = retry_pause(attempt)
            if time.monotonic() + pause >= deadline:
                raise StoreError(f"cannot use the job's store at {host}:{port} after {attempt + 1} attempts: "
                                 f"{e}") from None
            sleep(pause)
            attempt += 1
        except (OSError, protocol.ProtocolError, Unproven) as e:
            raise StoreError(f"cannot use the job's store at {host}:{port}: {e}") from None
