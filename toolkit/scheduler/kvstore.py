"""The job's key-value store, which process groups bootstrap from (what torch's TCPStore is to torchrun). Pure: no
sockets, no clock of its own; the server hands it requests and the time, and delivers the replies it returns.

Why not torch's TCPStore: it listens on every interface whatever address it is given, has no authentication
(anyone who can reach the port can read, write and delete keys) and no bound on memory. This store is reached
only through the scheduler's authenticated connections (toolkit.contracts.protocol), bounded in keys, bytes and value
size (`bounds`: from the job's size), and forgets a generation's keys once the job has moved past it.

Requests (`kv` messages; keys are strings, values base64 on the wire and here):

    set {key, value}                      -> ok
    get {key, timeout}                    -> ok {value} once the key exists; error "timeout" after `timeout` s
    multi_get {keys, timeout}             -> ok {values: [...]} in the order of `keys`, once every key exists;
                                             error "timeout" {keys: the missing ones} after `timeout` s; error
                                             {limit} if the reply would be over P.MAX_STORE_REPLY bytes
    add {key, amount}                     -> ok {value: the new integer} (the value is kept as decimal digits)
    compare_set {key, expected, desired}  -> ok {value: what the key holds afterwards}
    check {keys}                          -> ok {present: bool}
    wait {keys, timeout}                  -> ok once every key exists; error "timeout" {keys} after `timeout` s
    delete {key}                          -> ok {deleted: bool}
    num_keys {}                           -> ok {count}

`keys` lists hold 1 to MAX_MULTI keys. A set, add, compare_set, get, wait or multi_get on a key of a generation
the job has left (`drop_prefix`) is error "generation over", and so is a get, wait or multi_get pending when its
generation is dropped: a rank still building a left generation's group fails at once instead of at its timeout.

Why it stays cheap with thousands of ranks (a gloo bootstrap is N sets and N x N/128 multi_gets per generation,
with GLOO_ENABLE_STORE_V2_API): a write wakes only the waiters of its key (`waiting` indexes them by key), wait
deadlines sit in a heap (`next_deadline` is O(1) amortized), keys are filed by generation so dropping one costs
the keys of that generation, and values are kept as the base64 text replies carry, so a reply is joined from
cached strings instead of encoded per request.

A connection has at most one request outstanding (the client is synchronous), so waiters are bounded by the
connections the server accepts.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from toolkit.contracts import protocol

MAX_KEYS = 1 << 16  # the least a store holds, whatever the job's size
MAX_BYTES = 64 << 20  # keys and values together, the least
KEYS_PER_RANK = 16  # a gloo bootstrap needs 1 key per rank per group; NCCL fewer
BYTES_PER_RANK = 64 << 10
MAX_KEY = 1 << 10
MAX_MULTI = protocol.MAX_STORE_KEYS  # keys in one wait, check or multi_get (gloo asks for 128 at a time)
MAX_WAIT = 86400.0  # s: the longest a get or wait may ask for (a group build waits 2 x its collective timeout)
REPLY_OVERHEAD = 256  # bytes of a kv_reply besides its values
GENERATION_OVER = "generation over"


def bounds(world_size: int) -> tuple[int, int]:
    """(max_keys, max_bytes) for a job of `world_size` ranks: at least MAX_KEYS and MAX_BYTES, and room for
    KEYS_PER_RANK keys and BYTES_PER_RANK bytes per rank (gloo's default bootstrap stores 154 + 8N bytes per rank,
    8N^2 in all: 128 MiB at 4096 ranks; with GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER 154 bytes per rank)."""
    return max(MAX_KEYS, KEYS_PER_RANK * world_size), max(MAX_BYTES, BYTES_PER_RANK * world_size)


@dataclass(frozen=True)
class Reply:
    """What to send to `peer`: the answer to its request `id`; `values` (a multi_get's) are base64 texts."""

    peer: int
    id: int
    ok: bool
    fields: dict[str, Any] = field(default_factory=dict)
    values: tuple[str, ...] | None = None

    def message(self) -> bytes:
        """The encoded `kv_reply {id, ok, ..., values}` line. Values are joined as they are: base64 needs no JSON
        escaping, so a multi_get reply costs one join of cached strings."""
        line = protocol.encode(protocol.KV_REPLY, id=self.id, ok=self.ok, **self.fields)
        if self.values is None:
            return line
        return b"".join((line[:-2], b',"values":["', '","'.join(self.values).encode(), b'"]}\n'))


@dataclass
class _Waiter:
    """A pending get, wait or multi_get: `missing` are the keys it still waits for, `generations` the prefixes of
    the generations they belong to (a dropped one fails it), `seq` tells its heap entry from stale ones."""

    peer: int
    id: int
    cmd: str
    keys: tuple[str, ...]
    deadline: float
    seq: int
    missing: set[str]
    generations: set[str]


class StoreError(Exception):
    """A malformed or refused request; the message goes back to the client."""


class KVStore:
    """The store's state: keys to values (base64), at most `max_keys` keys and `max_bytes` of keys and values
    together (decoded), and at most one pending get, wait or multi_get per connection (`waiters`). Every request
    is treated as hostile: a malformed or refused one is an error reply to that request (StoreError inside), never
    an exception to the server. Peers are the server's connection ids.

    `generation_prefix` (protocol.generation_prefix) is what every generation's key prefix starts with: a key
    `<generation_prefix><n>/...` is filed under `<generation_prefix><n>/`, which `drop_prefix` deletes in
    O(its keys). Without it (or for another prefix), `drop_prefix` scans every key."""

    def __init__(self, max_keys: int = MAX_KEYS, max_bytes: int = MAX_BYTES,
                 generation_prefix: str | None = None) -> None:
        self.data: dict[str, str] = {}
        self.size = 0
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self.generation_prefix = generation_prefix
        self.by_generation: dict[str, set[str]] = {}  # generation prefix -> its keys
        self.over: set[str] = set()  # generation prefixes dropped: the job has left them
        self.waiters: dict[int, _Waiter] = {}
        self.waiting: dict[str, set[int]] = {}  # missing key -> the peers waiting for it
        self.waiting_in: dict[str, set[int]] = {}  # generation prefix -> the peers waiting for one of its keys
        self._heap: list[tuple[float, int, int]] = []  # (deadline, seq, peer); entries of answered waits are stale
        self._stale = 0
        self._seq = itertools.count()
        self._due: list[Reply] = []  # replies made outside a request (a dropped generation): `expire` returns them

    def request(self, peer: int, msg: dict[str, Any], now: float) -> list[Reply]:
        """Handle connection `peer`'s `kv` request at time `now`; returns the replies to send.

        They go to `peer` (none yet if its get, wait or multi_get must wait for keys: `expire` or a later write
        answers it) and to any waiters a write (set, add, compare_set) woke. A request without an integer id, one
        sent while the connection still waits, a malformed field, a full store or an unknown command is an error
        reply."""
        rid = msg.get("id")
        if not protocol.is_int(rid):
            return [Reply(peer, -1, False, {"error": "request without an integer id"})]
        if peer in self.waiters:
            return [Reply(peer, rid, False, {"error": "one request at a time per connection"})]
        try:
            return self._handle(peer, rid, msg, now)
        except StoreError as e:
            return [Reply(peer, rid, False, {"error": str(e)})]

    def expire(self, now: float) -> list[Reply]:
        """The replies due now: error "timeout" for the waits whose deadline passed (in deadline order), and error
        "generation over" for those a `drop_prefix` failed since the last call."""
        out, self._due = self._due, []
        while self._heap and self._heap[0][0] <= now:
            _, seq, peer = heapq.heappop(self._heap)
            w = self.waiters.get(peer)
            if w is None or w.seq != seq:
                self._stale -= 1
                continue
            self._unpark(w, stale=False)
            out.append(Reply(peer, w.id, False, {"error": "timeout", "keys": sorted(w.missing)}))
        return out

    def next_deadline(self) -> float:
        """When `expire` next has work: the earliest deadline of a pending wait, -inf if replies are due already,
        inf if nothing waits. Skips the stale heap entries it meets (O(1) amortized)."""
        if self._due:
            return -math.inf
        while self._heap:
            deadline, seq, peer = self._heap[0]
            w = self.waiters.get(peer)
            if w is not None and w.seq == seq:
                return deadline
            heapq.heappop(self._heap)
            self._stale -= 1
        return math.inf

    def forget(self, peer: int) -> None:
        """The connection closed: its wait goes with it."""
        w = self.waiters.get(peer)
        if w is not None:
            self._unpark(w)

    def drop_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix` (a generation the job has left); returns how many. For a generation's
        prefix: O(its keys), its pending waits fail with "generation over" (their replies come from `expire`), and
        later requests on its keys are refused the same way."""
        if self._generation(prefix) != prefix:
            gone = [k for k in self.data if k.startswith(prefix)]
        else:
            self.over.add(prefix)
            gone = list(self.by_generation.pop(prefix, ()))
            for peer in list(self.waiting_in.get(prefix, ())):
                w = self.waiters[peer]
                self._unpark(w)
                self._due.append(Reply(peer, w.id, False, {"error": GENERATION_OVER, "keys": sorted(w.missing)}))
        for key in gone:
            self._delete(key)
        return len(gone)

    # -- internals

    def _handle(self, peer: int, rid: int, msg: dict[str, Any], now: float) -> list[Reply]:
        cmd = msg.get("cmd")
        if cmd == "set":
            return [Reply(peer, rid, True)] + self._set(self._live(_key(msg)), _value(msg, "value"))
        if cmd in ("get", "wait", "multi_get"):
            keys = (self._live(_key(msg)),) if cmd == "get" else self._live_keys(_keys(msg))
            return self._wait(peer, rid, str(cmd), keys, now + _timeout(msg))
        if cmd == "add":
            return self._add(peer, rid, self._live(_key(msg)), msg.get("amount"))
        if cmd == "compare_set":
            key, expected, desired = self._live(_key(msg)), _value(msg, "expected"), _value(msg, "desired")
            current = self.data.get(key)
            woken: list[Reply] = []
            if (current is None and expected == "") or current == expected:
                woken = self._set(key, desired)
                current = desired
            return [Reply(peer, rid, True, {"value": current if current is not None else expected})] + woken
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

    def _add(self, peer: int, rid: int, key: str, amount: Any) -> list[Reply]:
        if not protocol.is_int(amount) or abs(amount) > 1 << 62:
            raise StoreError("add needs an integer amount")
        try:
            current = int(base64.b64decode(self.data.get(key, "MA==")))  # "0"
        except ValueError:
            raise StoreError(f"add: the value of {key!r} is not a number") from None
        total = current + amount
        return [Reply(peer, rid, True, {"value": total})] + self._set(key, _b64(str(total).encode()))

    def _set(self, key: str, value: str) -> list[Reply]:
        """Store `value` (canonical base64) under `key`; a new key wakes the waiters of that key only."""
        old = self.data.get(key)
        grow = _decoded(value) - (_decoded(old) if old is not None else -len(key))
        if old is None and len(self.data) >= self.max_keys:
            raise StoreError(f"the job's store is full ({self.max_keys} keys); a process group bootstrap needs one "
                             "key per rank, so something else is writing keys it never deletes")
        if self.size + grow > self.max_bytes:
            raise StoreError(f"the job's store is full ({self.max_bytes} bytes); gloo without "
                             "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1 stores 8 x world_size^2 bytes per group")
        self.data[key] = value
        self.size += grow
        if old is not None:
            return []
        generation = self._generation(key)
        if generation is not None:
            self.by_generation.setdefault(generation, set()).add(key)
        woken = []
        for peer in self.waiting.pop(key, ()):
            w = self.waiters[peer]
            w.missing.discard(key)
            if not w.missing:
                woken += self._complete(w)
        return woken

    def _delete(self, key: str) -> None:
        value = self.data.pop(key)
        self.size -= len(key) + _decoded(value)
        generation = self._generation(key)
        keys = self.by_generation.get(generation) if generation is not None else None
        if keys is not None:
            keys.discard(key)

    def _wait(self, peer: int, rid: int, cmd: str, keys: tuple[str, ...], deadline: float) -> list[Reply]:
        """Answer a get, wait or multi_get now if every key exists, else park it until they do or `deadline`."""
        w = _Waiter(peer, rid, cmd, keys, deadline, next(self._seq), set(), set())
        done = self._complete(w)
        if not done:
            self.waiters[peer] = w
            heapq.heappush(self._heap, (deadline, w.seq, peer))
        return done

    def _complete(self, w: _Waiter) -> list[Reply]:
        """The answer to `w` if every key exists (and `w` is no longer parked); else `w` waits for those missing
        (a key present when it asked may have been deleted since)."""
        w.missing = set(w.keys).difference(self.data)
        if w.missing:
            for key in w.missing:
                self.waiting.setdefault(key, set()).add(w.peer)
            for generation in self._generations(w.missing) - w.generations:
                w.generations.add(generation)
                self.waiting_in.setdefault(generation, set()).add(w.peer)
            return []
        if self.waiters.get(w.peer) is w:
            self._unpark(w)
        return [self._answer(w)]

    def _unpark(self, w: _Waiter, stale: bool = True) -> None:
        """`w` is answered or gone: out of every index (its heap entry, unless popped, becomes stale)."""
        del self.waiters[w.peer]
        for key in w.missing:
            peers = self.waiting.get(key)
            if peers is not None:
                peers.discard(w.peer)
                if not peers:
                    del self.waiting[key]
        for generation in w.generations:
            peers = self.waiting_in.get(generation)
            if peers is not None:
                peers.discard(w.peer)
                if not peers:
                    del self.waiting_in[generation]
        if stale:
            self._stale += 1
            if self._stale > 64 and self._stale > len(self._heap) // 2:  # compact: amortized O(1) per wait
                self._heap = [e for e in self._heap if (x := self.waiters.get(e[2])) is not None and x.seq == e[1]]
                heapq.heapify(self._heap)
                self._stale = 0

    def _answer(self, w: _Waiter) -> Reply:
        if w.cmd == "get":
            return Reply(w.peer, w.id, True, {"value": self.data[w.keys[0]]})
        if w.cmd == "wait":
            return Reply(w.peer, w.id, True)
        values = tuple(map(self.data.__getitem__, w.keys))
        size = sum(map(len, values)) + 3 * len(values) + REPLY_OVERHEAD
        if size > protocol.MAX_STORE_REPLY:
            return Reply(w.peer, w.id, False, {"error": f"a multi_get reply of {size} bytes is over the "
                                                        f"{protocol.MAX_STORE_REPLY}-byte limit: ask for fewer keys",
                                               "limit": protocol.MAX_STORE_REPLY})
        return Reply(w.peer, w.id, True, values=values)

    def _generation(self, key: str) -> str | None:
        """The generation prefix `key` is filed under (`<generation_prefix><n>/`), None if under none."""
        start = self.generation_prefix
        if start is None or not key.startswith(start):
            return None
        end = key.find("/", len(start))
        return key[:end + 1] if end >= 0 else None

    def _generations(self, keys: set[str] | tuple[str, ...]) -> set[str]:
        """The generation prefixes `keys` are filed under (`_generation` of each, inline: a multi_get has 128)."""
        start = self.generation_prefix
        if start is None:
            return set()
        n = len(start)
        found = {k[:k.find("/", n) + 1] for k in keys if k.startswith(start)}
        found.discard("")  # a key with no "/" after the generation number is under none
        return found

    def _live(self, key: str) -> str:
        """`key`, unless it belongs to a generation the job has left."""
        generation = self._generation(key)
        if generation is not None and generation in self.over:
            raise StoreError(f"{GENERATION_OVER}: the job has left {generation} (key {key[:100]!r})")
        return key

    def _live_keys(self, keys: tuple[str, ...]) -> tuple[str, ...]:
        """`keys`, unless one belongs to a generation the job has left."""
        left = self._generations(keys) & self.over if self.over else None
        if left:
            raise StoreError(f"{GENERATION_OVER}: the job has left {min(left)}")
        return keys


def _key(msg: dict[str, Any], name: str = "key") -> str:
    key = msg.get(name)
    if not isinstance(key, str) or not key or len(key) > MAX_KEY:
        raise StoreError(f"{name} must be a string of 1 to {MAX_KEY} characters")
    return key


def _keys(msg: dict[str, Any]) -> tuple[str, ...]:
    """Field `keys`: a list of 1 to MAX_MULTI strings of 1 to MAX_KEY characters (checked in bulk: gloo sends 128)."""
    keys = msg.get("keys")
    if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_MULTI or set(map(type, keys)) != {str} \
            or not 0 < min(map(len, keys)) <= max(map(len, keys)) <= MAX_KEY:
        raise StoreError(f"keys must be a list of 1 to {MAX_MULTI} strings of 1 to {MAX_KEY} characters")
    return tuple(keys)


def _value(msg: dict[str, Any], name: str) -> str:
    """Field `name` as canonical base64 (what the store keeps and replies carry), at most P.MAX_STORE_VALUE bytes
    decoded."""
    text = msg.get(name)
    if not isinstance(text, str) or len(text) > (protocol.MAX_STORE_VALUE * 4) // 3 + 4:
        raise StoreError(f"{name} must be base64 of at most {protocol.MAX_STORE_VALUE} bytes")
    try:
        value = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise StoreError(f"{name} is not base64") from None
    if len(value) > protocol.MAX_STORE_VALUE:
        raise StoreError(f"{name} is over {protocol.MAX_STORE_VALUE} bytes")
    return _b64(value)


def _timeout(msg: dict[str, Any]) -> float:
    value = msg.get("timeout")
    if not protocol.is_number(value) or not 0 < value <= MAX_WAIT:
        raise StoreError(f"timeout must be a number of seconds from 0 to {MAX_WAIT:g}")
    return float(value)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _decoded(text: str) -> int:
    """Bytes that canonical base64 `text` decodes to."""
    return len(text) // 4 * 3 - text[-2:].count("=")
