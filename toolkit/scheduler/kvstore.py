"""The job's key-value store, which process groups bootstrap from (what torch's TCPStore is to torchrun). Pure: no
sockets, no clock of its own; the server hands it requests and the time, and delivers the replies it returns.

Why not torch's TCPStore: it listens on every interface whatever address it is given, has no authentication
(anyone who can reach the port can read, write and delete keys) and no bound on memory. This store is reached
only through the scheduler's authenticated connections (toolkit.protocol), bounded in keys, bytes and value size,
and forgets a generation's keys once the job has moved past it.

Requests (`kv` messages; keys are strings, values base64 on the wire, bytes here):

    set {key, value}                      -> ok
    get {key, timeout}                    -> ok {value} once the key exists; error "timeout" after `timeout` s
    add {key, amount}                     -> ok {value: the new integer} (the value is kept as decimal digits)
    compare_set {key, expected, desired}  -> ok {value: what the key holds afterwards}
    check {keys}                          -> ok {present: bool}
    wait {keys, timeout}                  -> ok once every key exists; error "timeout" after `timeout` s
    delete {key}                          -> ok {deleted: bool}
    num_keys {}                           -> ok {count}

A connection has at most one request outstanding (the client is synchronous), so waiters are bounded by the
connections the server accepts.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any

from toolkit import protocol as P

MAX_KEYS = 1 << 16
MAX_BYTES = 64 << 20  # keys and values together
MAX_KEY = 1 << 10
MAX_WAIT = 86400.0  # s: the longest a get or wait may ask for (a group build waits 2 x its collective timeout)


@dataclass(frozen=True)
class Reply:
    """What to send to `peer`: the answer to its request `id`."""

    peer: int
    id: int
    ok: bool
    fields: dict[str, Any] = field(default_factory=dict)

    def message(self) -> bytes:
        """The encoded `kv_reply {id, ok, ...}` line."""
        return P.encode(P.KV_REPLY, id=self.id, ok=self.ok, **self.fields)


@dataclass
class _Waiter:
    peer: int
    id: int
    cmd: str
    keys: tuple[str, ...]
    deadline: float


class StoreError(Exception):
    """A malformed or refused request; the message goes back to the client."""


class KVStore:
    """The store's state: keys to values, at most `max_keys` keys and `max_bytes` of keys and values together, and
    at most one pending get or wait per connection (`waiters`). Every request is treated as hostile: a malformed or
    refused one is an error reply to that request (StoreError inside), never an exception to the server. Peers are
    the server's connection ids."""

    def __init__(self, max_keys: int = MAX_KEYS, max_bytes: int = MAX_BYTES) -> None:
        self.data: dict[str, bytes] = {}
        self.size = 0
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self.waiters: dict[int, _Waiter] = {}

    def request(self, peer: int, msg: dict[str, Any], now: float) -> list[Reply]:
        """Handle connection `peer`'s `kv` request at time `now`; returns the replies to send.

        They go to `peer` (none yet if its get or wait must wait for keys: `expire` or a later write answers it) and
        to any waiters a write (set, add, compare_set) woke. A request without an integer id, one sent while the
        connection still waits, a malformed field, a full store or an unknown command is an error reply."""
        rid = msg.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool):
            return [Reply(peer, -1, False, {"error": "request without an integer id"})]
        if peer in self.waiters:
            return [Reply(peer, rid, False, {"error": "one request at a time per connection"})]
        try:
            return self._handle(peer, rid, msg, now)
        except StoreError as e:
            return [Reply(peer, rid, False, {"error": str(e)})]

    def expire(self, now: float) -> list[Reply]:
        """Time out the waits whose deadline passed."""
        out = []
        for peer, w in list(self.waiters.items()):
            if now >= w.deadline:
                del self.waiters[peer]
                out.append(Reply(peer, w.id, False, {"error": "timeout", "keys": list(w.keys)}))
        return out

    def next_deadline(self) -> float:
        """The earliest deadline of a pending get or wait, inf if none: when `expire` next has work."""
        return min((w.deadline for w in self.waiters.values()), default=math.inf)

    def forget(self, peer: int) -> None:
        """The connection closed: its wait goes with it."""
        self.waiters.pop(peer, None)

    def drop_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix` (a generation the job has left); returns how many."""
        gone = [k for k in self.data if k.startswith(prefix)]
        for key in gone:
            self._delete(key)
        return len(gone)

    # -- internals

    def _handle(self, peer: int, rid: int, msg: dict[str, Any], now: float) -> list[Reply]:
        cmd = msg.get("cmd")
        if cmd == "set":
            return [Reply(peer, rid, True)] + self._set(_key(msg), _value(msg, "value"))
        if cmd == "get" or cmd == "wait":
            keys = (_key(msg),) if cmd == "get" else _keys(msg)
            if all(k in self.data for k in keys):
                return [self._answer(peer, rid, cmd, keys)]
            self.waiters[peer] = _Waiter(peer, rid, cmd, keys, now + _timeout(msg))
            return []
        if cmd == "add":
            key, amount = _key(msg), msg.get("amount")
            if not isinstance(amount, int) or isinstance(amount, bool) or abs(amount) > 1 << 62:
                raise StoreError("add needs an integer amount")
            try:
                current = int(self.data.get(key, b"0"))
            except ValueError:
                raise StoreError(f"add: the value of {key!r} is not a number") from None
            total = current + amount
            return [Reply(peer, rid, True, {"value": total})] + self._set(key, str(total).encode())
        if cmd == "compare_set":
            key, expected, desired = _key(msg), _value(msg, "expected"), _value(msg, "desired")
            current = self.data.get(key)
            woken: list[Reply] = []
            if (current is None and expected == b"") or current == expected:
                woken = self._set(key, desired)
                current = desired
            return [Reply(peer, rid, True, {"value": _b64(current if current is not None else expected)})] + woken
        if cmd == "check":
            return [Reply(peer, rid, True, {"present": all(k in self.data for k in _keys(msg))})]
        if cmd == "delete":
            key = _key(msg)
            found = key in self.data
            if found:
                self._delete(key)
            return [Reply(peer, rid, True, {"deleted": found})]
        if cmd == "num_keys":
            return [Reply(peer, rid, True, {"count": len(self.data)})]
        raise StoreError(f"unknown store command {str(cmd)[:40]!r}")

    def _set(self, key: str, value: bytes) -> list[Reply]:
        old = self.data.get(key)
        grow = len(value) - (len(old) if old is not None else -len(key))
        if old is None and len(self.data) >= self.max_keys:
            raise StoreError(f"the job's store is full ({self.max_keys} keys)")
        if self.size + grow > self.max_bytes:
            raise StoreError(f"the job's store is full ({self.max_bytes} bytes)")
        self.data[key] = value
        self.size += grow
        woken = []
        for peer, w in list(self.waiters.items()):
            if key in w.keys and all(k in self.data for k in w.keys):
                del self.waiters[peer]
                woken.append(self._answer(peer, w.id, w.cmd, w.keys))
        return woken

    def _delete(self, key: str) -> None:
        value = self.data.pop(key)
        self.size -= len(key) + len(value)

    def _answer(self, peer: int, rid: int, cmd: str, keys: tuple[str, ...]) -> Reply:
        return Reply(peer, rid, True, {"value": _b64(self.data[keys[0]])} if cmd == "get" else {})


def _key(msg: dict[str, Any], name: str = "key") -> str:
    key = msg.get(name)
    if not isinstance(key, str) or not key or len(key) > MAX_KEY:
        raise StoreError(f"{name} must be a string of 1 to {MAX_KEY} characters")
    return key


def _keys(msg: dict[str, Any]) -> tuple[str, ...]:
    keys = msg.get("keys")
    if not isinstance(keys, list) or not 1 <= len(keys) <= 1024:
        raise StoreError("keys must be a list of 1 to 1024 keys")
    return tuple(_key({"key": k}) for k in keys)


def _value(msg: dict[str, Any], name: str) -> bytes:
    text = msg.get(name)
    if not isinstance(text, str) or len(text) > (P.MAX_STORE_VALUE * 4) // 3 + 4:
        raise StoreError(f"{name} must be base64 of at most {P.MAX_STORE_VALUE} bytes")
    try:
        value = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise StoreError(f"{name} is not base64") from None
    if len(value) > P.MAX_STORE_VALUE:
        raise StoreError(f"{name} is over {P.MAX_STORE_VALUE} bytes")
    return value


def _timeout(msg: dict[str, Any]) -> float:
    value = msg.get("timeout")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_WAIT:
        raise StoreError(f"timeout must be a number of seconds from 0 to {MAX_WAIT:g}")
    return float(value)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
