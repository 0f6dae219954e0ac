"""One checkpoint file (a part of one host's copy of a step): its name and its authenticated format.

Why authenticated: the checkpoint directory may be on storage others can reach, and a checkpoint is code-adjacent
(it becomes the model the job trains on and hands out). A checksum anyone can compute says a file is whole, not
whose it is. So every file carries a MAC under a key only the job's operator holds, and nothing is unpickled
before the MAC over the whole file checks.

Format: a fixed header, then a ``torch.save`` payload (always read back with ``weights_only=True``):

    magic "TKCKPT02" | step u64 | part u32 | parts u32 | payload length u64 | MAC (32 bytes)

The MAC is HMAC-SHA256 over the payload followed by the header's first five fields, so a file renamed to
another step or part, truncated, extended, or written with another key does not verify. Name:
``step_<012d>.p<part>of<parts>.ckpt`` (zero-padded: names sort as steps do).

The key: the job's (derived from its token), or alone the project's (toolkit.contracts.ckptkey).

Writing: to a random temporary name created with O_EXCL | O_NOFOLLOW in the directory's fd, the payload streamed
through the MAC (no copy of the state in memory), the header written last, fsynced, renamed over the final name in
the same directory fd, the directory fsynced. Reading: opened with O_NOFOLLOW, a regular file only, authenticated
through one small buffer, then unpickled from the same open file straight into the tensors (`open_part`).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from toolkit import atomicfile
from toolkit.train.faults import BadPart

MAGIC = b"TKCKPT02"
FIELDS = struct.Struct("<8sQIIQ")  # magic, step, part, parts, payload length
HEADER = struct.Struct("<8sQIIQ32s")  # the fields, then the MAC
MAC_SIZE = 32
NAME_RE = re.compile(r"^step_(\d{12})\.p(\d{1,5})of(\d{1,5})\.ckpt$")
TEMP_RE = re.compile(r"^" + re.escape(atomicfile.TMP_PREFIX) + r"(step_\d{12}\.p\d{1,5}of\d{1,5}\.ckpt)\.[0-9a-f]+$")
READ_CHUNK = 1 << 20  # the one buffer a file is authenticated through


@dataclass(frozen=True)
class PartName:
    """What a checkpoint file's name says: the step, and which part of how many of a host's copy it is."""

    step: int
    part: int
    parts: int

    @property
    def name(self) -> str:
        """The file name, ``step_<012d>.p<part>of<parts>.ckpt``."""
        return f"step_{self.step:012d}.p{self.part}of{self.parts}.ckpt"

    @classmethod
    def parse(cls, name: str) -> PartName | None:
        """The PartName of a checkpoint file name, None for any other name (or an impossible part number)."""
        m = NAME_RE.fullmatch(name)
        if m is None:
            return None
        step, part, parts = int(m.group(1)), int(m.group(2)), int(m.group(3))
        return cls(step, part, parts) if 0 <= part < parts else None


# ----------------------------------------------------------------------------------------------------------
# Writing


class _MacWriter:
    """The file object ``torch.save`` writes to: every chunk into the MAC and the file, nothing kept in memory. A
    failed write (ENOSPC) is kept and raised after ``torch.save`` returns: raised inside it, torch's own clean-up
    would replace it with an unrelated error."""

    def __init__(self, fd: int, mac: Any) -> None:
        self.fd = fd
        self.mac = mac
        self.length = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.length += n
        if self.error is not None:
            return n
        self.mac.update(view)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            self.error = e
        return n

    def flush(self) -> None:
        pass


def _mac(key: bytes) -> Any:
    """HMAC-SHA256: on CPUs with SHA extensions about twice BLAKE2b's speed (measured here), and the handshake's."""
    return hmac.new(key, digestmod=hashlib.sha256)


def write_part(dir_fd: int, name: PartName, obj: Any, key: bytes) -> int:
    """Write `obj` as the checkpoint file `name` in the directory `dir_fd` (module docstring: random O_EXCL |
    O_NOFOLLOW temp, MAC streamed, fsync, rename, directory fsync). Returns the file's size. OSError on failure,
    with the temp file removed; an existing file of that name is replaced only by the complete new one."""
    fd, tmp = atomicfile.create_temp(name.name, 0o600, dir_fd=dir_fd)
    try:
        try:
            os.pwrite(fd, bytes(HEADER.size), 0)
            os.lseek(fd, HEADER.size, os.SEEK_SET)
            out = _MacWriter(fd, _mac(key))
            try:
                torch.save(obj, out)
            finally:
                if out.error is not None:
                    raise out.error
            fields = FIELDS.pack(MAGIC, name.step, name.part, name.parts, out.length)
            out.mac.update(fields)
            os.pwrite(fd, fields + out.mac.digest(), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.fsync(dir_fd)
    return HEADER.size + out.length


# ----------------------------------------------------------------------------------------------------------
# Reading


def check_part(dir_fd: int, name: PartName, key: bytes) -> None:
    """Authenticate the checkpoint file `name` in `dir_fd` without unpickling it. BadPart (why) if it must not be
    used, OSError if it cannot be read."""
    with open_part(dir_fd, name, key):
        pass


def open_part(dir_fd: int, name: PartName, key: bytes) -> BinaryIO:
    """The checkpoint file `name` in `dir_fd`, authenticated, open and positioned at its payload (for `decode`).

    Why streamed: the MAC is computed over the file through one READ_CHUNK buffer, and `decode` then reads the
    payload from the same open file straight into the tensors' storage, so a restore holds the state once (plus
    one chunk), not the file, a copy of it and the tensors. The file is opened once (O_NOFOLLOW, a regular file
    only): a name swapped after the check changes nothing; only someone who may write the file itself (its owner,
    in a private directory) could change it between the check and the load.

    BadPart (why) if it is not a regular file, is truncated or too long, is not a toolkit checkpoint, says another
    step or part than its name, or fails authentication; OSError if it cannot be read."""
    fd = os.open(name.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)  # FIFO: no wait
    f = os.fdopen(fd, "rb", buffering=0)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadPart("not a regular file")
        size = st.st_size
        header = f.read(HEADER.size)
        fields, mac = _header(header, size, name)
        check = _mac(key)
        chunk = bytearray(min(READ_CHUNK, max(size - HEADER.size, 1)))
        left = size - HEADER.size
        while left > 0:
            n = f.readinto(memoryview(chunk)[:min(left, len(chunk))])
            if not n:
                raise BadPart(f"truncated while read: {left} bytes of the payload missing")
            check.update(memoryview(chunk)[:n])
            left -= n
        _authentic(check, fields, mac, name)
        f.seek(HEADER.size)
    except BaseException:
        f.close()
        raise
    return f


def verify(data: memoryview | bytes, name: PartName, key: bytes) -> memoryview:
    """The payload of `data` (a whole file in memory) if it is the authentic file `name`, else BadPart saying why."""
    data = memoryview(data)
    fields, mac = _header(data[:HEADER.size], len(data), name)
    body = data[HEADER.size:]
    check = _mac(key)
    check.update(body)
    _authentic(check, fields, mac, name)
    return body


def _header(header: bytes | memoryview, size: int, name: PartName) -> tuple[bytes, bytes]:
    """The MAC'd fields and the MAC of a file of `size` bytes starting with `header`; BadPart if its shape is wrong
    (truncated, not a checkpoint, a payload length that is not the file's)."""
    if size < HEADER.size or len(header) < HEADER.size:
        raise BadPart(f"truncated: {size} bytes, shorter than the {HEADER.size}-byte header")
    magic, step, part, parts, length, mac = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise BadPart("not a toolkit checkpoint (bad magic)")
    body = size - HEADER.size
    if body != length:
        state = "truncated" if body < length else "has trailing bytes"
        raise BadPart(f"{state}: payload is {body} bytes, header says {length}")
    return FIELDS.pack(magic, step, part, parts, length), mac


def _authentic(check: Any, fields: bytes, mac: bytes, name: PartName) -> None:
    """BadPart unless `check` (the MAC over the payload so far) with `fields` gives `mac`, and the fields say what
    `name` says."""
    check.update(fields)
    if not hmac.compare_digest(check.digest(), mac):
        raise BadPart("fails authentication: not written by this job (another key), or damaged")
    _, step, part, parts, _ = FIELDS.unpack(fields)
    if (step, part, parts) != (name.step, name.part, name.parts):
        raise BadPart(f"holds step {step} part {part} of {parts}, not what its name says")


def decode(payload: BinaryIO | memoryview) -> Any:
    """Unpickle a verified payload: an `open_part` file (read straight into the tensors) or bytes in memory (tensors
    on CPU, weights_only: no code runs even for a file that verifies)."""
    source = io.BytesIO(payload) if isinstance(payload, memoryview) else payload
    return torch.load(source, map_location="cpu", weights_only=True)
