"""The client of the job's store (toolkit.scheduler.kvstore), as a `torch.distributed.Store`: what process groups
bootstrap from under toolkit, in place of torch's TCPStore (which has no authentication and listens everywhere).

One authenticated connection per client (toolkit.session), one request at a time (torch calls a store from the
thread that builds the group). Every wait is bounded by the store's timeout; a connection the fence shut down
(toolkit.train.fence: a newer generation overtook the build) fails the pending call at once.
"""

from __future__ import annotations

import base64
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from toolkit import protocol as P
from toolkit.session import ClosedEarly, Unproven, open_session

CONNECT_TIMEOUT = 2.0  # s for the TCP connect
HANDSHAKE_TIMEOUT = 10.0  # s for the challenge and the answer (all attempts together)
HANDSHAKE_ATTEMPTS = 4  # connections tried when the store closes one before the handshake is over
RETRY_PAUSE = 0.1  # s before the second attempt (then 2x, 3x)
SLACK = 5.0  # s the client waits beyond a timed wait's own timeout for the server's answer


class StoreError(RuntimeError):
    """The store refused a request, or it timed out; torch reports it like a TCPStore error."""


class JobStore(dist.Store):
    """torch.distributed.Store over one authenticated connection to the job's store: what Runtime._build and the
    wrapper's rendezvous hand torch, under PrefixStore(the generation's prefix, ...).

    Construct it through `connect`, which turns every failure into StoreError; here the handshake (bounded by
    CONNECT_TIMEOUT and HANDSHAKE_TIMEOUT) raises OSError, ProtocolError or Unproven, and a refusal by the store
    StoreError. `timeout` is the store's timeout: how long `get` and a `wait` without one wait for keys.

    Every call is one request and its reply, serialized by a lock (safe to share between threads; replies are
    matched by request id), each socket operation bounded by the request's own wait + SLACK + the store's timeout.
    Every call raises StoreError when the store refuses it, times out, or the connection fails or is shut down (by
    the fence: at once); torch reports it like a TCPStore error."""

    def __init__(self, host: str, port: int, token: str, node_id: str, timeout: timedelta) -> None:
        super().__init__()
        self._timeout = timeout
        self._lock = threading.Lock()
        self._next = 0
        session = open_session((host, port), token, P.STORE_HELLO, {"node_id": node_id}, HANDSHAKE_TIMEOUT,
                               CONNECT_TIMEOUT, limit=P.MAX_STORE_LINE)
        if session.reply.get("op") != P.WELCOME:
            session.sock.close()
            raise StoreError(f"the job's store at {host}:{port} refused {node_id}: {session.reply.get('reason')}")
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
                self._sock.sendall(P.encode(P.KV, id=rid, cmd=cmd, **fields))
                while True:
                    reply = self._read()
                    if reply.get("op") == P.KV_REPLY and reply.get("id") == rid:
                        break
            except (OSError, P.ProtocolError) as e:
                raise StoreError(f"the job's store at {self._address}: {cmd} failed ({e})") from None
        if not reply.get("ok"):
            error = str(reply.get("error"))[:300]
            if error == "timeout":
                raise StoreError(f"the job's store at {self._address}: timed out waiting for "
                                 f"{fields.get('key') or fields.get('keys')} after {fields.get('timeout')} s")
            raise StoreError(f"the job's store at {self._address} refused {cmd}: {error}")
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
    if len(data) > P.MAX_STORE_VALUE:
        raise StoreError(f"a store value of {len(data)} bytes is over the {P.MAX_STORE_VALUE}-byte limit")
    return base64.b64encode(data).decode()


def connect(host: str, port: int, token: str, node_id: str, timeout: timedelta) -> JobStore:
    """The job's store, or StoreError if it cannot be reached and trusted within the handshake bound.

    A connection the store closed before the handshake ended (under a flood of strangers the scheduler makes room
    by closing the oldest connections still waiting to authenticate: toolkit.scheduler.admission) is tried again,
    up to HANDSHAKE_ATTEMPTS times within HANDSHAKE_TIMEOUT; a refused connection, a timeout or an unproven answer
    is not."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    attempt = 1
    while True:
        try:
            return JobStore(host, port, token, node_id, timeout)
        except (ConnectionResetError, BrokenPipeError, ClosedEarly) as e:
            pause = RETRY_PAUSE * attempt
            if attempt == HANDSHAKE_ATTEMPTS or time.monotonic() + pause > deadline:
                raise StoreError(f"cannot use the job's store at {host}:{port}: {e} ({attempt} attempts)") from None
        except (OSError, P.ProtocolError, Unproven) as e:
            raise StoreError(f"cannot use the job's store at {host}:{port}: {e}") from None
        time.sleep(pause)
        attempt += 1
