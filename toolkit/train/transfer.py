"""Give the training state to the ranks that need it, as tensors, at the speed of the link.

Why: after a fault the replacement (and any survivor a step behind) must take the newest state from a survivor.
Pickling it into bytes (torch.save into a buffer, a broadcast of the bytes, torch.load) copies the payload four
times, makes every rank of the group receive it, and on CUDA takes it off the device: about 120 MB/s here, where
the link moves 1.7-1.9 GB/s. Here the tensors travel as themselves:

- the state (model, optimizer, extra state: nested dicts, lists and tuples of tensors and plain values) is split
  into a small description (its structure, the plain values, each tensor's dtype and shape) and its tensors;
- a contiguous tensor of at least `DIRECT_MIN` bytes on the transport device is one message, sent from its own
  storage and, where the receiver holds a tensor of the same dtype and shape at the same place in its own state
  (the model's parameters, an optimizer state already initialised), received straight into that storage: no copy
  on either side (a tensor the receiver lacks is new memory, faulted in by a helper thread ahead of its bytes);
  smaller tensors, non-contiguous ones and those off the transport device are packed into byte buffers of at most
  `PACK_BYTES` (one at a time: the extra memory is one buffer, never a copy of the state);
- the description goes as JSON with tags for what JSON cannot say (tuples, int keys, exact floats, tensors): a
  peer's bytes are parsed and validated, never unpickled;
- only the ranks that need the state receive it, point to point, and several holders share the receivers between
  them (point to point also when one rank sends to all: gloo runs a broadcast on the group's own threads, and
  one stuck there, see below, would hold up the group's destruction);
- the transport device is the group's: gloo moves CPU tensors, NCCL moves device tensors between devices (tensors
  that live on the host under NCCL are packed onto the device for the trip). Nothing is staged through the host.

A receiver's state is undefined while it receives (some tensors new, some old): the caller must not count it as a
state of any step until `share` returns. A sender that dies mid-transfer makes the receive fail like any collective
(the runtime turns that into a new generation, and another holder sends). Given the group's fence, the transfer
runs in a helper thread that a trip abandons: gloo never wakes a receive whose message had begun to arrive when
the connection broke (toolkit.train.fence).
"""

from __future__ import annotations

import json
import math
import mmap
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from toolkit.contracts.protocol import is_int
from toolkit.train import log
from toolkit.train.digest import Digester
from toolkit.train.faults import TransferError
from toolkit.train.newmemory import unfilled

DIRECT_MIN = 1 << 20  # bytes: a contiguous tensor at least this large travels as its own message
PACK_BYTES = 64 << 20  # bytes: small tensors are packed into buffers of at most this size
WINDOW_MESSAGES = 16  # messages in flight at once (gloo waits a round trip per message before its bytes move)
WINDOW_BYTES = 2 * PACK_BYTES  # staging buffers (packed or copied messages) in flight at once
ALIGN = 64  # bytes: each packed tensor starts at a multiple of this (any dtype can be viewed there)
MAX_META = 256 << 20  # bytes: the longest description a receiver accepts
MAX_DEPTH = 64  # nesting a receiver accepts in a description
# A receiver allocates what the sender declares before a byte of it arrives, so it bounds the declared sizes by what
# it expects: each message exactly the bytes of its entries, and the tensors it lacks (a replacement's optimizer
# state) at most NEW_STATE_FACTOR times its own state's bytes plus NEW_STATE_SLACK (optimizers hold a few times
# the parameters: Adam two, with the model three).
NEW_STATE_FACTOR = 8
NEW_STATE_SLACK = PACK_BYTES
MAX_SENDS = 3  # a receiver whose bytes fail the sender's digest is sent the state again, this many times in all
MAGIC = 0x544B5354  # "TKST"
VERSION = 1
HOME_CPU, HOME_DEVICE = "cpu", "device"
KIND_TENSOR, KIND_ARRAY, KIND_SCALAR = "tensor", "ndarray", "npscalar"

DTYPES: Mapping[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128, torch.int64,
    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2)}


# -- the description: structure, plain values, tensors by index (pure)

def flatten(state: Any) -> tuple[Any, list[Any]]:
    """(skeleton, leaves): `state` with each tensor, numpy array and numpy scalar replaced by a reference to its
    index in `leaves`, and everything else encoded for JSON. TransferError names the place of a value that cannot
    travel (a function, an arbitrary object)."""
    leaves: list[Any] = []
    return _enc(state, "state", leaves), leaves


def _enc(obj: Any, path: str, leaves: list[Any]) -> Any:
    # A module-level function, not a closure: a recursive closure is a reference cycle holding `leaves` (a state's
    # tensors) until the garbage collector's next full pass, hundreds of MB per call at scale.
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int) and not isinstance(obj, np.generic):
        return obj
    if isinstance(obj, float) and not isinstance(obj, np.generic):
        return {"f": obj.hex()}
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        leaves.append(obj)
        return {"x": len(leaves) - 1}
    if isinstance(obj, dict):
        return {"d": [[_enc(k, f"{path} key", leaves), _enc(v, f"{path}[{k!r}]", leaves)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"l": [_enc(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj)]}
    if isinstance(obj, tuple):
        return {"u": [_enc(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj)]}
    raise TransferError(f"{path} is a {type(obj).__name__}: the training state may hold tensors, numpy arrays, "
                        "numbers, strings, None and dicts, lists and tuples of them")


def inflate(skeleton: Any, values: Sequence[Any]) -> Any:
    """The state `flatten` described, with leaf i taken from values[i]. TransferError for a skeleton that is
    not one `flatten` wrote (checked all the way down: it comes from a peer)."""
    return _dec(skeleton, 0, values)


def _dec(obj: Any, depth: int, values: Sequence[Any]) -> Any:
    # Module-level for the reason _enc is: a recursive closure would hold `values` in a reference cycle.
    if depth > MAX_DEPTH:
        raise TransferError(f"state description nested deeper than {MAX_DEPTH}")
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if not isinstance(obj, dict) or len(obj) != 1:
        raise TransferError(f"state description holds {type(obj).__name__} where a tagged value belongs")
    ((tag, inner),) = obj.items()
    if tag == "f" and isinstance(inner, str):
        try:
            return float.fromhex(inner)
        except ValueError:
            raise TransferError(f"state description: {inner[:40]!r} is not a float") from None
    if tag == "x" and is_int(inner) and 0 <= inner < len(values):
        return values[inner]
    if tag in ("l", "u", "d") and isinstance(inner, list):
        if tag == "l":
            return [_dec(v, depth + 1, values) for v in inner]
        if tag == "u":
            return tuple(_dec(v, depth + 1, values) for v in inner)
        out = {}
        for pair in inner:
            if not isinstance(pair, list) or len(pair) != 2:
                raise TransferError("state description: a dict item is not a [key, value] pair")
            key = _dec(pair[0], depth + 1, values)
            if not isinstance(key, (str, int, float, bool, type(None), tuple)):
                raise TransferError(f"state description: a dict key of type {type(key).__name__}")
            out[key] = _dec(pair[1], depth + 1, values)
        return out
    raise TransferError(f"state description: unknown or malformed tag {tag!r}")


def leaf_paths(skeleton: Any) -> dict[int, tuple[Any, ...]]:
    """{leaf index: its path of keys and positions} in a skeleton `flatten` wrote (for finding a receiver's own
    tensor at the same place). Paths through dict keys that are not str or int are left out."""
    out: dict[int, tuple[Any, ...]] = {}
    stack: list[tuple[Any, tuple[Any, ...]]] = [(skeleton, ())]
    while stack:
        obj, path = stack.pop()
        if not isinstance(obj, dict) or len(obj) != 1 or len(path) > MAX_DEPTH:
            continue
        ((tag, inner),) = obj.items()
        if tag == "x" and isinstance(inner, int):
            out[inner] = path
        elif tag in ("l", "u") and isinstance(inner, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(inner))
        elif tag == "d" and isinstance(inner, list):
            for pair in inner:
                if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int)):
                    stack.append((pair[1], (*path, pair[0])))
    return out


def lookup(state: Any, path: tuple[Any, ...]) -> Any:
    """The value at `path` in a (receiver's own) state, or None where there is none."""
    for key in path:
        try:
            state = state[key]
        except (KeyError, IndexError, TypeError):
            return None
    return state


# -- the layout: which bytes travel in which message (pure)

@dataclass(frozen=True)
class Entry:
    """One leaf: its dtype, shape, where it lives, what it is, and where its bytes are (message index and byte
    offset; message -1 for an empty tensor), or `alias`: the index of an earlier leaf with the same storage."""

    dtype: str
    shape: tuple[int, ...]
    home: str = HOME_CPU
    kind: str = KIND_TENSOR
    message: int = -1
    offset: int = 0
    alias: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Layout:
    """The leaves' entries and the messages' sizes in bytes, in the order they are sent."""

    entries: tuple[Entry, ...]
    messages: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.messages)

    def encode(self, skeleton: Any) -> bytes:
        entries = [["alias", e.alias] if e.alias is not None else
                   [e.dtype, list(e.shape), e.home, e.kind, e.message, e.offset] for e in self.entries]
        return json.dumps({"v": VERSION, "skeleton": skeleton, "entries": entries, "messages": list(self.messages)},
                          separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def decode(cls, data: bytes) -> tuple[Any, Layout]:
        """(skeleton, layout) from a peer's description; TransferError for anything this module did not write."""
        try:
            doc = json.loads(data.decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise TransferError(f"the peer's state description is not JSON ({str(e)[:80]})") from None
        if not isinstance(doc, dict) or doc.get("v") != VERSION or set(doc) != {"v", "skeleton", "entries",
                                                                                "messages"}:
            raise TransferError(f"the peer's state description is not version {VERSION} of this format")
        messages = doc["messages"]
        if not isinstance(messages, list) or not all(_count(m) for m in messages):
            raise TransferError("the peer's state description: message sizes are not byte counts")
        if not isinstance(doc["entries"], list):
            raise TransferError("the peer's state description: no list of entries")
        entries = tuple(_entry(raw, i, messages) for i, raw in enumerate(doc["entries"]))
        _check_extents(entries, messages)
        return doc["skeleton"], cls(entries, tuple(messages))


def _count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _entry(raw: Any, index: int, messages: list[int]) -> Entry:
    """One entry of a peer's layout, checked: a known dtype, a shape of counts, bytes inside their message."""
    where = f"the peer's state description, entry {index}"
    if isinstance(raw, list) and len(raw) == 2 and raw[0] == "alias":
        if not _count(raw[1]) or raw[1] >= index:
            raise TransferError(f"{where}: an alias of no earlier entry")
        return Entry("uint8", (0,), alias=raw[1])
    if not (isinstance(raw, list) and len(raw) == 6):
        raise TransferError(f"{where}: malformed")
    dtype, shape, home, kind, message, offset = raw
    if dtype not in DTYPES or home not in (HOME_CPU, HOME_DEVICE) or kind not in (KIND_TENSOR, KIND_ARRAY,
                                                                                  KIND_SCALAR):
        raise TransferError(f"{where}: unknown dtype, home or kind ({str(raw[:1] + raw[2:4])[:80]})")
    if not (isinstance(shape, list) and len(shape) <= MAX_DEPTH and all(_count(n) for n in shape)):
        raise TransferError(f"{where}: the shape is not a list of sizes")
    entry = Entry(dtype, tuple(shape), home, kind, message, offset)
    if not (isinstance(message, int) and -1 <= message < len(messages) and _count(offset)):
        raise TransferError(f"{where}: no such message or offset")
    if (message == -1) != (entry.nbytes == 0) or message >= 0 and offset + entry.nbytes > messages[message]:
        raise TransferError(f"{where}: its bytes lie outside its message")
    return entry


def _check_extents(entries: Sequence[Entry], messages: Sequence[int]) -> None:
    """Each message of a peer's layout is exactly the bytes of its entries (`plan_layout` leaves no slack after
    the last one), so a declared size never exceeds what the entries' dtypes and shapes account for."""
    ends = [0] * len(messages)
    for e in entries:
        if e.alias is None and e.message >= 0:
            ends[e.message] = max(ends[e.message], e.offset + e.nbytes)
    for m, (size, end) in enumerate(zip(messages, ends, strict=True)):
        if size != end:
            raise TransferError(f"the peer's state description: message {m} declares {size} bytes, its entries "
                                f"{end}")


def state_bytes(state: Any) -> int:
    """The bytes of the tensors, numpy arrays and numpy scalars in `state` (0 for None)."""
    _, leaves = flatten(state)
    return sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else np.asarray(v).nbytes
               for v in leaves)


def check_new_bytes(new_bytes: int, own_bytes: int, src: int) -> None:
    """TransferError unless the tensors a receiver must allocate (`new_bytes`) are within what it expects of a
    state whose own tensors hold `own_bytes` (NEW_STATE_FACTOR, NEW_STATE_SLACK): a peer's declared sizes are never
    allocated unbounded."""
    limit = NEW_STATE_FACTOR * own_bytes + NEW_STATE_SLACK
    if new_bytes > limit:
        raise TransferError(f"rank {src} declares {new_bytes} bytes of tensors this rank lacks, more than "
                            f"{NEW_STATE_FACTOR} times its own state's {own_bytes} bytes plus {NEW_STATE_SLACK}: "
                            "not received")


def plan_layout(leaves: Sequence[torch.Tensor], kinds: Sequence[str], transport: torch.device) -> Layout:
    """Where each leaf's bytes travel: a contiguous tensor of at least DIRECT_MIN bytes on `transport` is its
    own message; the rest are packed, each at an ALIGN boundary, into buffers of at most PACK_BYTES (a larger one
    gets a buffer of its own). A leaf with the same storage, offset, shape and strides as an earlier one is an
    alias of it (tied parameters travel once)."""
    entries: list[Entry] = []
    messages: list[int] = []
    seen: dict[tuple[Any, ...], int] = {}
    pack: int | None = None  # index of the message being filled
    for i, (t, kind) in enumerate(zip(leaves, kinds, strict=True)):
        key = _identity(t)
        if key is not None and key in seen:
            entries.append(Entry("uint8", (0,), alias=seen[key]))
            continue
        if key is not None:
            seen[key] = i
        dtype, shape = _dtype_name(t, i), tuple(t.shape)
        home = HOME_CPU if t.device.type == "cpu" else HOME_DEVICE
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            entries.append(Entry(dtype, shape, home, kind))
        elif t.device == transport and t.is_contiguous() and nbytes >= DIRECT_MIN or nbytes > PACK_BYTES:
            messages.append(nbytes)
            entries.append(Entry(dtype, shape, home, kind, len(messages) - 1, 0))
        else:
            start = _aligned(messages[pack]) if pack is not None else 0
            if pack is None or start + nbytes > PACK_BYTES:
                messages.append(0)
                pack, start = len(messages) - 1, 0
            messages[pack] = start + nbytes
            entries.append(Entry(dtype, shape, home, kind, pack, start))
    return Layout(tuple(entries), tuple(messages))


def _identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype) if ptr else None


def _dtype_name(t: torch.Tensor, index: int) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES or t.layout != torch.strided or t.is_quantized:
        raise TransferError(f"leaf {index} of the state is a {t.dtype} {t.layout} tensor: only dense tensors of "
                            f"{', '.join(DTYPES)} travel")
    return name


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def assign(holders: Sequence[int], world: int, members: Sequence[int] | None = None) -> dict[int, int]:
    """{receiver: sender}: every rank not in `holders` (of `members`, default every rank of the world) receives
    from one holder, round-robin, so that several holders share the sending. Pure."""
    order = sorted(holders)
    if not order:
        raise ValueError("no rank holds the state")
    receivers = [r for r in (range(world) if members is None else members) if r not in holders]
    return {r: order[i % len(order)] for i, r in enumerate(receivers)}


# -- the executor

def share(state: Any, holders: Sequence[int], *, rank: int, world: int, device: torch.device, group: Any = None,
          fence: Any = None, tamper: Any = None, members: Sequence[int] | None = None) -> tuple[Any, int]:
    """Collective over `group` (every rank calls it with the same `holders`): the ranks not in `holders` receive
    the state the holders hold. A holder passes its state and gets (None, bytes it sent); a receiver passes its
    own state (its tensors are where matching ones are received) and gets (the state received, bytes received).
    Tensors travel on `device` (the group's: CPU for gloo, the rank's GPU for NCCL). With `fence` (the group's
    toolkit.train.fence.Fence) a trip ends the wait at once (fence.Abandoned).

    Verified: after the tensors, the sender sends the digest of what it sent (toolkit.train.digest, every byte in
    order); a receiver checks its own bytes against it before using them, and answers; one that refuses is sent the
    state again (MAX_SENDS in all, then TransferError). `tamper(attempt, message, buffer)`: a test's hook, called
    by a receiver on each message's bytes as they arrive (a byte changed in flight). `members`: the ranks taking
    part (a shard's column: toolkit.train.shardstate), every rank by default; only they call it."""
    senders = assign(holders, world, members)
    if world == 1 or not senders:
        return None, 0
    if rank in holders:
        mine = sorted(r for r, s in senders.items() if s == rank)
        if not mine:
            return None, 0
        link = _Link(device, group, src=rank, peers=mine)
        return _run(lambda: (None, _send(state, link)), fence, device)
    link = _Link(device, group, src=senders[rank], peers=[rank])
    return _run(lambda: _receive(state, link, tamper), fence, device)


def _run(fn: Any, fence: Any, device: torch.device) -> tuple[Any, int]:
    """On CPU with a fence, in a helper thread the fence can abandon; else here (NCCL: the fence aborts the
    communicator, which fails the call itself)."""
    if fence is None or device.type != "cpu":
        return fn()
    return fence.call(fn, "state transfer")


@dataclass
class _Link:
    """How buffers move: point to point from `src` to each of `peers`, each message under its own tag."""

    device: torch.device
    group: Any
    src: int
    peers: list[int]

    def post_send(self, buf: torch.Tensor, tag: int) -> list[Any]:
        ops = [dist.P2POp(dist.isend, buf, peer, group=self.group, tag=tag) for peer in self.peers]
        return dist.batch_isend_irecv(ops)

    def post_receive(self, buf: torch.Tensor, tag: int) -> list[Any]:
        return dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, self.src, group=self.group, tag=tag)])

    def answers(self, tag: int) -> dict[int, bool]:
        """Each peer's answer to the digest (True: accepted), received under `tag`."""
        bufs = {peer: torch.zeros(1, dtype=torch.int64, device=self.device) for peer in self.peers}
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, peer, group=self.group, tag=tag)
                                      for peer, buf in bufs.items()]))
        return {peer: bool(buf.item()) for peer, buf in bufs.items()}

    def answer(self, ok: bool, tag: int) -> None:
        buf = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, self.src, group=self.group, tag=tag)]))


class _Window:
    """Messages in flight, oldest first: up to WINDOW_MESSAGES of them and WINDOW_BYTES of staging buffers, so that
    the link never waits on a round trip between two messages (gloo's handshake per message) and the staging memory
    stays bounded. `done(m, buf)` runs as each message completes, in order."""

    def __init__(self, done: Any = None) -> None:
        self.done = done
        self.inflight: list[tuple[int, list[Any], torch.Tensor, int]] = []
        self.staged = 0

    def add(self, m: int, works: list[Any], buf: torch.Tensor, staged: int) -> None:
        self.inflight.append((m, works, buf, staged))
        self.staged += staged
        while len(self.inflight) > WINDOW_MESSAGES or self.staged > WINDOW_BYTES:
            self.finish_one()

    def finish_one(self) -> None:
        m, works, buf, staged = self.inflight.pop(0)
        for work in works:
            work.wait()
        self.staged -= staged
        if self.done is not None:
            self.done(m, buf)

    def drain(self) -> None:
        while self.inflight:
            self.finish_one()


def _send(state: Any, link: _Link) -> int:
    skeleton, raw = flatten(state)
    leaves, kinds = _as_tensors(raw)
    layout = plan_layout(leaves, kinds, link.device)
    meta = layout.encode(skeleton)
    header = torch.tensor([MAGIC, VERSION, len(meta), layout.total], dtype=torch.int64, device=link.device)
    window = _Window()
    window.add(-2, link.post_send(header, 0), header, 0)
    meta_buf = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(link.device)
    window.add(-1, link.post_send(meta_buf, 1), meta_buf, 0)
    window.drain()
    members = _by_message(layout)
    sent = len(meta) + header.numel() * 8
    digest = None
    for _ in range(MAX_SENDS):
        _send_messages(leaves, layout, members, link)
        if digest is None:  # after the bytes went: the receiver computes its own meanwhile
            digest = torch.tensor([Digester().tensors(leaves)], dtype=torch.int64, device=link.device)
        _wait(link.post_send(digest, 2 + len(layout.messages)))
        sent += layout.total + 8
        refused = [peer for peer, ok in link.answers(3 + len(layout.messages)).items() if not ok]
        if not refused:
            break
        link = _Link(link.device, link.group, link.src, refused)  # again, to those that refused
    return sent


def _send_messages(leaves: list[torch.Tensor], layout: Layout, members: list[list[int]], link: _Link) -> None:
    window = _Window()
    for m, inside in enumerate(members):
        size = layout.messages[m]
        first = leaves[inside[0]]
        if len(inside) == 1 and first.device == link.device and first.is_contiguous() and _bytes(first).numel() \
                == size:
            window.add(m, link.post_send(_bytes(first), 2 + m), first, 0)  # its own storage: no copy
            continue
        buf = torch.empty(size, dtype=torch.uint8, device=link.device)
        for i in inside:
            _typed(buf, layout.entries[i]).copy_(leaves[i])  # copy_ reads any strides, from any device
        window.add(m, link.post_send(buf, 2 + m), buf, size)
    window.drain()


def _receive(own: Any, link: _Link, tamper: Any = None) -> tuple[Any, int]:
    header = torch.empty(4, dtype=torch.int64, device=link.device)
    _wait(link.post_receive(header, 0))
    magic, version, meta_len, total = (int(v) for v in header.tolist())
    if magic != MAGIC or version != VERSION or not 0 < meta_len <= MAX_META or total < 0:
        raise TransferError(f"rank {link.src} sent no state transfer of version {VERSION} of this format "
                            f"(header {[magic, version, meta_len, total]})")
    meta = torch.empty(meta_len, dtype=torch.uint8, device=link.device)
    _wait(link.post_receive(meta, 1))
    skeleton, layout = Layout.decode(meta.cpu().numpy().tobytes())
    if layout.total != total:
        raise TransferError(f"rank {link.src}'s state description does not match its header")
    dests, new = _destinations(own, skeleton, layout, link.device, link.src)
    members = _by_message(layout)
    prefault = _Prefault([[dests[i] for i in members[m] if i in new] for m in range(len(layout.messages))])
    received = meta_len + header.numel() * 8
    for attempt in range(MAX_SENDS):
        _receive_messages(dests, layout, members, link, prefault, lambda m, buf, a=attempt: tamper and tamper(a, m,
                                                                                                              buf))
        theirs = torch.empty(1, dtype=torch.int64, device=link.device)
        _wait(link.post_receive(theirs, 2 + len(layout.messages)))
        received += total + 8
        ok = Digester().tensors(dests) == int(theirs.item())
        link.answer(ok, 3 + len(layout.messages))
        if ok:
            break
        log.line(f"the state received from rank {link.src} fails its digest (changed in flight): refused, "
                 f"{'asking for it again' if attempt + 1 < MAX_SENDS else 'giving up'}")
    else:
        raise TransferError(f"the state received from rank {link.src} failed its digest {MAX_SENDS} times: the link "
                            "or this host's memory changes bytes")
    values = [_as_leaf(dests[e.alias if e.alias is not None else i], layout.entries[e.alias if e.alias is not None
                                                                                     else i].kind)
              for i, e in enumerate(layout.entries)]
    return inflate(skeleton, values), received


def _receive_messages(dests: list[torch.Tensor], layout: Layout, members: list[list[int]], link: _Link,
                      prefault: _Prefault, tamper: Any) -> None:
    """Every message into its place (its tensor's own storage, or a staging buffer copied out)."""
    def unpack(m: int, buf: torch.Tensor) -> None:
        tamper(m, buf)
        if buf.data_ptr() != dests[members[m][0]].data_ptr():  # staged: copy each tensor to its place
            for i in members[m]:
                dests[i].copy_(_typed(buf, layout.entries[i]))

    window = _Window(unpack)
    for m, size in enumerate(layout.messages):
        prefault.wait(m)
        target = dests[members[m][0]] if len(members[m]) == 1 else None
        if target is not None and target.device == link.device and target.is_contiguous() and \
                _bytes(target).numel() == size:
            window.add(m, link.post_receive(_bytes(target), 2 + m), target, 0)  # into the receiver's own storage
        else:
            buf = unfilled((size,), torch.uint8, link.device)  # the message fills it
            window.add(m, link.post_receive(buf, 2 + m), buf, size)
    window.drain()


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _by_message(layout: Layout) -> list[list[int]]:
    """The entries (not aliases) in each message, in order."""
    out: list[list[int]] = [[] for _ in layout.messages]
    for i, e in enumerate(layout.entries):
        if e.alias is None and e.message >= 0:
            out[e.message].append(i)
    return out


def _destinations(own: Any, skeleton: Any, layout: Layout, device: torch.device,
                  src: int) -> tuple[list[torch.Tensor], set[int]]:
    """(where each leaf is received, the indices of new tensors among them): the receiver's own tensor at the same
    place in its state if it has the same dtype, shape and home (its parameters, an optimizer state already
    there), else a new tensor, allocated only once all of them are within what this rank expects
    (`check_new_bytes`)."""
    paths = leaf_paths(skeleton)
    found: list[torch.Tensor | None] = []
    for i, e in enumerate(layout.entries):
        if e.alias is not None:
            found.append(None)
            continue
        home = torch.device("cpu") if e.home == HOME_CPU or e.kind != KIND_TENSOR else device
        mine = lookup(own, paths[i]) if e.kind == KIND_TENSOR and i in paths else None
        ok = isinstance(mine, torch.Tensor) and mine.dtype == DTYPES[e.dtype] and tuple(mine.shape) == e.shape and \
            (mine.device == home or e.home == HOME_DEVICE and mine.device.type != "cpu")
        found.append(mine if ok else None)
    new = {i for i, e in enumerate(layout.entries) if e.alias is None and found[i] is None}
    check_new_bytes(sum(layout.entries[i].nbytes for i in new), state_bytes(own), src)
    out: list[torch.Tensor] = []
    for i, e in enumerate(layout.entries):
        if e.alias is not None:
            out.append(out[e.alias])
        else:
            home = torch.device("cpu") if e.home == HOME_CPU or e.kind != KIND_TENSOR else device
            out.append(found[i] if i not in new else unfilled(e.shape, DTYPES[e.dtype], home))  # its message fills
    return out, new


class _Prefault:
    """Faults in the pages of the receiver's new host tensors, message by message, in a thread of its own, ahead of
    the receives that fill them.

    Why: a replacement's optimizer state is new memory, and a receive into untouched pages takes a page fault per
    page on the thread that copies the bytes off the socket: at 600 MB that made the transfer twice as slow as into
    touched memory (bench/state_transfer.py: 0.45 s against 0.24 s). Touched ahead on another core, the faults
    overlap the bytes of the messages in flight (0.27-0.33 s). `wait(m)` returns once message m's tensors are
    touched, and the caller posts its receive only then: a touch after the bytes arrived would overwrite them.
    The thread's work is local and finite, and it marks every message ready when it ends, however it ends, so
    `wait` needs no bound of its own. Device tensors are left alone (a device allocator's memory is mapped)."""

    def __init__(self, per_message: Sequence[Sequence[torch.Tensor]]) -> None:
        self.per_message = [[t for t in ts if t.device.type == "cpu" and t.numel()] for ts in per_message]
        self.ready = 0  # messages whose tensors are touched
        self.cond = threading.Condition()
        if any(self.per_message):
            threading.Thread(target=self._run, name="toolkit-transfer-prefault", daemon=True).start()
        else:
            self.ready = len(self.per_message)

    def _run(self) -> None:
        try:
            for m, tensors in enumerate(self.per_message):
                for t in tensors:
                    flat = _bytes(t)
                    flat[::mmap.PAGESIZE].zero_()  # a byte per page: the kernel zeroes the rest as it maps the page
                    flat[-1:].zero_()
                with self.cond:
                    self.ready = m + 1
                    self.cond.notify_all()
        finally:
            with self.cond:
                self.ready = len(self.per_message)
                self.cond.notify_all()

    def wait(self, m: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.ready > m)


def _as_tensors(raw: Sequence[Any]) -> tuple[list[torch.Tensor], list[str]]:
    leaves, kinds = [], []
    for i, v in enumerate(raw):
        if isinstance(v, torch.Tensor):
            leaves.append(v.detach())
            kinds.append(KIND_TENSOR)
            continue
        arr = np.asarray(v)
        if not (arr.flags.c_contiguous and arr.flags.writeable):
            arr = np.array(arr, order="C")  # (np.ascontiguousarray would make a scalar's 0-d array 1-d)
        try:
            leaves.append(torch.from_numpy(arr))
        except TypeError:
            raise TransferError(f"leaf {i} of the state is a numpy array of {arr.dtype}, which has no torch "
                                "dtype") from None
        kinds.append(KIND_ARRAY if isinstance(v, np.ndarray) else KIND_SCALAR)
    return leaves, kinds


def _as_leaf(t: torch.Tensor, kind: str) -> Any:
    if kind == KIND_ARRAY:
        return t.numpy()
    if kind == KIND_SCALAR:
        return t.numpy()[()]
    return t


def _typed(buf: torch.Tensor, e: Entry) -> torch.Tensor:
    """Entry `e`'s bytes in the message buffer `buf`, as a tensor of its dtype and shape (a view)."""
    return buf[e.offset:e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view of the same storage."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.reshape(-1).view(torch.uint8)
