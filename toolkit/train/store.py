"""The client of the job's store (toolkit.scheduler.kvstore), as a `torch.distributed.Store`: what process groups
bootstrap from under toolkit, in place of torch's TCPStore (which has no authentication and listens everywhere).

One authenticated connection per client (toolkit.session), one request at a time (torch calls a store from the
thread that builds the group). Every wait is bounded by the store's timeout; a connection the fence shut down
(toolkit.train.fence: a newer generation overtook the build) fails the pending call at once.
"""

from __future__ import annotations

import base64
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from toolkit import protocol as P
from toolkit.session import Unproven, open_session

CONNECT_TIMEOUT = 2.0  # s for the TCP connect
HANDSHAKE_TIMEOUT = 10.0  # s for the challenge and the answer
SLACK = 5.0  # s the client waits beyond a timed wait's own timeout for the server's answer


class StoreError(RuntimeError):
    """The store refused a request, or it timed out; torch reports it like a TCPStore error."""


class JobStore(dist.Store):
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
        self._call("set", key=key, value=_b64(value))

    def get(self, key: str) -> bytes:
        return base64.b64decode(self._call("get", key=key, timeout=self._seconds())["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key=key, amount=int(amount))["value"])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return base64.b64decode(self._call("compare_set", key=key, expected=_b64(expected),
                                           desired=_b64(desired))["value"])

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys=list(keys))["present"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if timeout is not None else self._seconds()
        self._call("wait", keys=list(keys), timeout=max(0.001, seconds))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key=key)["deleted"])

    def num_keys(self) -> int:
        return int(self._call("num_keys")["count"])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def close(self) -> None:
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
    """The job's store, or StoreError if it cannot be reached and trusted within the handshake bound."""
    try:
        return JobStore(host, port, token, node_id, timeout)
    except (OSError, P.ProtocolError, Unproven) as e:
        raise StoreError(f"cannot use the job's store at {host}:{port}: {e}") from None
