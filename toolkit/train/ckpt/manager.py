"""Checkpoints: one authenticated copy of the replicated state per host, written in the background, and the
agreement on the copy a whole-job restart resumes from.

Why: a checkpoint serves only when no survivor holds the state (a whole-job restart, a world of one). In data
parallelism every rank holds the same model, optimizer and extra state, so one copy per host is enough to restart
from, and any host's copy will do; eight copies per host (one per rank) only cost disk and bandwidth. A worker
killed mid-write, a full disk, a flipped bit or a file planted by someone else must never cost more than falling
back to an older copy, and never be resumed. So:

- ``<CKPT_DIR>/host_<host>/`` holds the host's copy (host: ``TOOLKIT_HOST``, else the hostname; see Placement).
  Each of the host's L ranks (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``) writes about 1/L of it, the file
  ``step_<012d>.p<i>of<L>.ckpt`` (toolkit.train.ckpt.parts cuts the state); the host's copy of a step is complete
  when every part is there. Bytes written per host per checkpoint: the state once.
- Every file is authenticated (toolkit.train.ckpt.partfile: a MAC under the job's key), written to a random temporary
  name without following links, fsynced and renamed (one rename commits a part), in a directory checked private
  (toolkit.train.ckpt.hostdir, toolkit.privatedir). Nothing is unpickled before its MAC checks, and then only with
  ``weights_only=True``.
- Asynchronous mode: ``save`` cuts the state and returns; the writer thread copies the rank's tensors to memory
  (the stage) and writes them. Tensors the caller says change only in ``optimizer.step()`` (``stable``) are copied
  by the writer while the loop runs the next forward and backward; ``wait_staged`` (the Trainer calls it before
  every optimizer step and before any recovery touches the state) blocks until that copy is done. So training
  stalls for the structure and the small tensors only, not for copying the state, let alone writing it.
- A full disk (ENOSPC, or EDQUOT) skips the checkpoint and nothing else: the failed write leaves nothing behind,
  the older copies stay, no error reaches the training loop, one line says so (once, until a checkpoint is written
  again, which is said too), and the next interval tries again. Any other write error is raised.
- At least ``keep_max >= 2`` complete copies are kept (MindSpore's rule), the oldest pruned only after a newer
  part is durable and that copy is complete; each rank prunes its own share, and deletes only what it wrote itself
  or what authenticates under the job's key (anything else is moved aside, never deleted).
- A whole-job restart (``agree``): every rank verifies its share of its host's files, the ranks exchange what they
  found as one small int64 tensor each (nothing unpickled from a peer), and all pick the newest step whose copy is
  complete and authentic on some host, and the lowest rank of that host to read it. Nothing is deleted for lack
  of a common step: a rank whose host has no copy gets the state from one that has. Files that fail verification
  are moved aside into ``refused/``, each named in one line; parts of steps newer than the chosen one (incomplete,
  from a timeline the job no longer follows) are removed, named in one line, so that a later write of the same
  step can never be completed by a stale part.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import io
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from toolkit import atomicfile
from toolkit.atomicfile import Durability
from toolkit.contracts import ckptkey, envvars
from toolkit.train.ckpt import parts as ckptparts
from toolkit.train.ckpt.hostdir import HostDir, complete
from toolkit.train.ckpt.partfile import PartName
from toolkit.train.ckpt.writer import SlotWriter
from toolkit.train.faults import BadPart, CheckpointError, CorruptCheckpoint, DirectoryError

log = logging.getLogger(__name__)

TMP_PREFIX = atomicfile.TMP_PREFIX
MIN_KEEP = 2
DEFAULT_WRITE_TIMEOUT = 600.0
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # a write that fails for these skips its checkpoint
MAX_CANDIDATES = 64  # steps each rank reports in the restart agreement (its newest verified ones)
SAFE_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")

_REASONS = MappingProxyType({
    errno.ENOSPC: ("no space left on device", "free space there or point CKPT_DIR at a larger disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space there or point CKPT_DIR at a larger disk"),
    errno.EACCES: ("permission denied", "make the directory writable for this user or point CKPT_DIR elsewhere"),
    errno.EPERM: ("operation not permitted", "make the directory writable for this user or point CKPT_DIR elsewhere"),
    errno.EROFS: ("read-only file system", "point CKPT_DIR at a writable file system"),
})


@dataclass(frozen=True)
class Damaged:
    """A checkpoint file that did not verify, and why; reported, then skipped for an older copy."""

    path: Path
    reason: str


@dataclass(frozen=True)
class Scan:
    """What a host's directory holds: the steps whose copy is complete and verified (ascending), and the damaged."""

    intact: tuple[int, ...]
    damaged: tuple[Damaged, ...]


@dataclass(frozen=True)
class Placement:
    """Where a rank keeps its checkpoints: the host whose copy it shares, and its share (``local_rank`` of the
    host's ``local_world`` ranks). The ranks of one host must name it alike and number themselves 0..L-1; the
    restart agreement refuses a layout where they do not."""

    host: str
    local_rank: int = 0
    local_world: int = 1

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("a checkpoint placement needs a host name")
        if not 0 <= self.local_rank < self.local_world:
            raise ValueError(f"local rank {self.local_rank} is not in 0..{self.local_world - 1}")

    @classmethod
    def from_env(cls, env: Mapping[str, str], world_size: int | None = None) -> Placement:
        """From the process contract: ``TOOLKIT_HOST`` (else the hostname), ``LOCAL_RANK`` and
        ``LOCAL_WORLD_SIZE`` (torchrun and toolkit set both; default 0 of 1). A world of one is always 0 of 1.
        ValueError naming the variable for a value that cannot be right."""
        host = (env.get(envvars.TOOLKIT_HOST) or "").strip() or socket.gethostname()
        if world_size == 1:
            return cls(host)
        values = {}
        for name, default in ((envvars.LOCAL_RANK, 0), (envvars.LOCAL_WORLD_SIZE, 1)):
            raw = (env.get(name) or "").strip()
            try:
                values[name] = int(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name}={raw!r}: expected a whole number") from None
        local_rank, local_world = values[envvars.LOCAL_RANK], values[envvars.LOCAL_WORLD_SIZE]
        if local_world < 1 or (world_size is not None and local_world > world_size):
            raise ValueError(f"{envvars.LOCAL_WORLD_SIZE}={local_world}: expected 1 to the world size ({world_size})")
        if not 0 <= local_rank < local_world:
            raise ValueError(f"{envvars.LOCAL_RANK}={local_rank}: expected 0 to {envvars.LOCAL_WORLD_SIZE}-1 "
                             f"({local_world - 1})")
        return cls(host, local_rank, local_world)

    @property
    def dirname(self) -> str:
        """The host's directory under the checkpoint root: ``host_<name>`` (a digest for a name unsafe in a path)."""
        if SAFE_HOST.fullmatch(self.host):
            return f"host_{self.host}"
        return f"host_x{hashlib.blake2b(self.host.encode(), digest_size=8).hexdigest()}"

    @property
    def key(self) -> int:
        """The host as a number for the restart agreement's tensor (63 bits of a digest of its name)."""
        return int.from_bytes(hashlib.blake2b(self.host.encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class Choice:
    """What a whole-job restart resumes from: the step, and the rank that reads its host's copy of it."""

    step: int
    source: int


# ----------------------------------------------------------------------------------------------------------
# Snapshots and RNG state


def snapshot(obj: Any) -> Any:
    """Deep copy with every tensor cloned to CPU memory. Why clone: a snapshot that aliases live parameters or
    optimizer buffers changes under the writer (or, on load, shares one buffer between two owners — DLRover's
    resume bug)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v) for v in obj)
    return obj


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of `tensors`, complete when this returns (the caller may change the originals after). A CUDA
    tensor is copied into pinned host memory (torch's caching host allocator, which reuses a block once its tensor
    is freed: no new pinning per checkpoint) without blocking, then each device is synchronised once: the copies
    run at the link's speed one after another on the device, none staged through pageable memory. A CPU tensor is
    cloned. Not run here (no GPU): the CUDA branch is the documented torch idiom, checked on a GPU host by
    bench/gpu_check.py (docs/benchmarks.md "Not run here: the CUDA paths")."""
    copies: list[torch.Tensor] = []
    devices: set[torch.device] = set()
    for t in tensors:
        t = t.detach()
        if t.is_cuda:
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            devices.add(t.device)
            copies.append(host)
        else:
            copies.append(t.to("cpu", copy=True))
    for device in devices:
        torch.cuda.synchronize(device)
    return copies


_PLAIN = frozenset({str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size})
_CONTAINERS = (dict, list, tuple, collections.OrderedDict)


def first_unloadable(obj: Any, where: tuple[Any, ...] = ()) -> tuple[tuple[Any, ...], str] | None:
    """The first value in `obj` (walked through dicts, lists and tuples) that ``torch.load(weights_only=True)``
    would refuse, as (its path of keys, its type's name); None if everything loads. Why: toolkit reads states only
    that way (from peers, from checkpoints), and e.g. a numpy scalar in an LR scheduler's state saves fine and then
    cannot be read back: better refused when the loop starts than at the first recovery."""
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:  # exact types: numpy.float64 is a float subclass
        return None
    if isinstance(obj, (dict, list, tuple)):
        for key, value in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            found = first_unloadable(value, (*where, key))
            if found is not None:
                return found
        if type(obj) in _CONTAINERS:
            return None
    buf = io.BytesIO()  # anything else (a set, a namedtuple, a type registered as safe): ask torch itself
    try:
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - whatever torch refuses it for, the answer is the same
        return where, f"{type(obj).__module__}.{type(obj).__qualname__}"
    return None


# ----------------------------------------------------------------------------------------------------------
# Errors of writes


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def write_error(e: OSError, directory: Path, what: str, size: int | None = None) -> CheckpointError:
    """One line for a failed write: where, why, what to do; and that the older files were left alone."""
    reason, fix = _REASONS.get(e.errno or 0, (e.strerror or str(e), "check the directory"))
    detail = ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT) and size is not None:
        free = _free_bytes(directory)
        detail = f" (needs {size / 1e6:.1f} MB" + (f", {free / 1e6:.1f} MB free)" if free is not None else ")")
    return CheckpointError(
        f"cannot write {what} in {directory}: {reason}{detail}; {fix}; the previous checkpoints are untouched"
    )


def write_atomic(path: Path, data: bytes | memoryview, what: str | None = None) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either its old content or all of ``data``, durably
    (toolkit.atomicfile, Durability.DURABLE). On failure nothing else is touched; the error is a
    ``CheckpointError`` that says where, why and what to do."""
    try:
        atomicfile.write(path, data, mode=0o600, durability=Durability.DURABLE)
    except OSError as e:
        raise write_error(e, path.parent, what or path.name, len(data)) from None


# ----------------------------------------------------------------------------------------------------------
# The restart agreement: pure decision over the table every rank contributed a row to


def choose(rows: list[list[int]]) -> Choice | None:
    """Each row, one per rank in rank order: ``[host key, local rank, local world, steps...]`` (steps this rank
    verified its share of, -1 padding). The newest step complete on some host (every local rank of that host
    vouched for it), read by that host's lowest rank; None when no host has a complete copy (a fresh start).
    CheckpointError when the ranks of a host do not number themselves 0..L-1 alike (the per-host split would
    then never complete a copy)."""
    hosts: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        hosts.setdefault(row[0], []).append(r)
    best: Choice | None = None
    for ranks in hosts.values():
        local = sorted(rows[r][1] for r in ranks)
        worlds = {rows[r][2] for r in ranks}
        if len(worlds) != 1 or local != list(range(len(ranks))) or worlds != {len(ranks)}:
            raise CheckpointError(
                f"ranks {ranks} share a host but say they are local ranks {local} of {sorted(worlds)}: "
                f"{envvars.LOCAL_RANK} and {envvars.LOCAL_WORLD_SIZE} must number a host's ranks 0..L-1, and "
                f"{envvars.TOOLKIT_HOST} (else the hostname) must tell the hosts apart")
        common = set.intersection(*(set(s for s in rows[r][3:] if s >= 0) for r in ranks))
        if common:
            candidate = Choice(max(common), min(ranks))
            if best is None or (candidate.step, -candidate.source) > (best.step, -best.source):
                best = candidate
    return best


def _gather(row: list[int], group: Any, device: torch.device | None, fence: Any = None) -> list[list[int]]:
    """Every rank's row (all of the same length), in rank order, as int64 tensors: nothing unpickled. `fence`
    (toolkit.train.fence.Fence, optional): waited on through it, so that a new generation ends the wait."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [row]
    mine = torch.tensor(row, dtype=torch.int64, device=device or torch.device("cpu"))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(every, mine, group=group, async_op=True)
    if fence is None:
        work.wait()
    else:
        fence.wait(work, "the agreement on the newest checkpoint", group)
    return [[int(v) for v in t.tolist()] for t in every]


# ----------------------------------------------------------------------------------------------------------
# The manager


@dataclass
class _Job:
    """One rank's part of one checkpoint on its way to disk: staged tensors (None: the writer copies it)."""

    name: PartName
    cut: ckptparts.Split
    ordinals: list[int]
    staged: list[torch.Tensor | None]
    size: int = field(default=0)

    @property
    def step(self) -> int:
        return self.name.step

    def stage(self) -> None:
        """Copy the tensors `save` left to the writer (the training loop may change them once this returns)."""
        left = [k for k, t in enumerate(self.staged) if t is None]
        for k, copy in zip(left, host_copies([self.cut.tensors[self.ordinals[k]] for k in left]), strict=True):
            self.staged[k] = copy


class CheckpointManager:
    """One rank's view of its host's checkpoint copies: save every N steps (sync or async), scan, load, agree on
    the restart step, prune. See the module docstring.

    ``placement`` says which host's copy this rank shares and which part it writes (default: from the
    environment, Placement.from_env); ``key`` the MAC key (default: the job's, from ``TOOLKIT_TOKEN_FILE``, else
    the project's: toolkit.contracts.ckptkey.default_key). Construction checks that ``directory`` (the checkpoint root,
    CKPT_DIR) is private (owned by this user, written by nobody else, nor anything above it: toolkit.privatedir),
    writable and this key's (its ``key-id``, toolkit.train.ckpt.hostdir: another job's or project's directory is
    refused, nothing in it touched), and removes temporary files a previous incarnation of this rank left;
    CheckpointError says what is wrong.

    Use it as a context manager (or call ``close()``) so that an asynchronous write in flight is finished before
    the process exits; an ``atexit`` hook does the same for a process that forgets.

    ``on_commit(step)`` is called once this rank's part of ``step`` is durable (the rename and the directory
    fsync): on the caller's thread for a synchronous save, on the writer thread for an asynchronous one. Why a
    hook: ``save`` returning is not the commit in async mode, and the job's record of the newest durable step
    (``Runtime.committed``, the lowest over the ranks: then every part of every host is durable) must never run
    ahead of the disk. An exception from the hook is logged, never turned into a failed checkpoint.
    """

    def __init__(self, directory: str | Path, keep_max: int = 2, *, placement: Placement | None = None,
                 key: bytes | None = None, async_write: bool = False, write_timeout: float = DEFAULT_WRITE_TIMEOUT,
                 on_commit: Callable[[int], None] | None = None) -> None:
        if keep_max < MIN_KEEP:
            raise ValueError(
                f"keep_max must be >= {MIN_KEEP}, got {keep_max}: with one checkpoint a damaged newest file "
                "leaves nothing to fall back to"
            )
        if write_timeout <= 0:
            raise ValueError(f"write_timeout must be > 0 seconds, got {write_timeout}")
        try:
            self.placement = placement or Placement.from_env(os.environ)
            key = key if key is not None else ckptkey.default_key(os.environ)
        except (ValueError, ckptkey.KeyFileError) as e:
            raise CheckpointError(str(e)) from None
        self.root = Path(directory)
        self.keep_max = keep_max
        self.async_write = async_write
        self.write_timeout = write_timeout
        self.on_commit = on_commit
        try:
            self.dir = HostDir(self.root, self.placement.dirname, key)
        except DirectoryError as e:
            raise CheckpointError(str(e)) from None
        self.directory = self.dir.path
        try:  # fail at start, not at the first save hours later (root passes os.access on a read-only mount)
            self.dir.probe()
        except OSError as e:
            self.dir.close()
            raise write_error(e, self.directory, "checkpoints") from None
        self.dir.remove_temps(self._writes)
        legacy = sorted(p.name for p in self.root.glob("rank_*") if p.is_dir())
        if legacy and self.placement.local_rank == 0:
            log.warning("%s holds checkpoints of an older toolkit (%s/): they are not authenticated, so they are not "
                        "read; move them away once this job has checkpointed", self.root, legacy[0])
        self.last_bytes = 0  # bytes of this rank's part of the newest checkpoint saved (for the heartbeat)
        self._written: set[PartName] = set()  # parts this manager wrote (known authentic: pruned without a read)
        self.skipped = 0  # checkpoints skipped in a row for a full disk (or quota), 0 once one is written
        self.skip_why = ""  # the line that said why the first of them was skipped (heartbeat: fleet status, ledger)
        self.copies_later = async_write  # `stable` tensors are copied by the writer (RankCheckpoints)
        self._writer: SlotWriter[_Job] | None = None  # the background writer (toolkit.train.ckpt.writer), if async
        if async_write:
            self._writer = SlotWriter(self._write, self._committed, what="checkpoint", directory=self.directory,
                                      timeout=write_timeout)

    # --- listing and reading ---

    def path_for(self, step: int) -> Path:
        """Where this rank's part of ``step``'s copy is, or would be."""
        return self.directory / PartName(step, self.placement.local_rank, self.placement.local_world).name

    def steps_on_disk(self) -> list[int]:
        """Steps whose copy on this host has every part of some layout, ascending (by name: not verified)."""
        listing = self.dir.listing()
        return sorted(s for s in listing if complete(listing, s, self.placement.local_world) is not None)

    def verify(self, step: int) -> str | None:
        """None if every part of ``step``'s copy on this host is there and authentic, else why not (naming the
        file). Reads the whole copy: for one process alone; ranks of a group use ``agree``."""
        bad = _first_bad(self.dir, step, self.placement.local_world)
        return None if bad is None else f"{bad[0]}: {bad[1]}"

    def scan(self) -> Scan:
        """Verify every complete copy on this host (for one process alone); damaged ones are logged and skipped.
        Copies with a part missing (being written, or their writer died) are neither."""
        intact, damaged = [], []
        for step in self.steps_on_disk():
            bad = _first_bad(self.dir, step, self.placement.local_world)
            if bad is None:
                intact.append(step)
            else:
                damaged.append(Damaged(*bad))
                log.warning("checkpoint %s (step %d) is not usable: %s", bad[0], step, bad[1])
        return Scan(tuple(intact), tuple(damaged))

    def load(self, step: int) -> dict[str, Any]:
        """The state of ``step`` from this host's copy, every part verified, tensors on CPU. ``CheckpointError``
        if it is missing or unreadable, ``CorruptCheckpoint`` (naming the file) if a part fails verification or
        the parts do not fit; nothing falls back here (``load_latest`` and ``agree`` do)."""
        names = complete(self.dir.listing(), step, self.placement.local_world)
        if names is None:
            raise CheckpointError(f"no complete copy of step {step} in {self.directory}")
        payloads = []
        for name in names:
            path = self.directory / name.name
            try:
                payloads.append(self.dir.read(name))
            except BadPart as e:
                raise CorruptCheckpoint(f"{path}: {e}") from None
            except OSError as e:
                raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        try:
            return ckptparts.merge(payloads)
        except ValueError as e:
            raise CorruptCheckpoint(f"{self.directory}: the parts of step {step} do not fit together ({e})") from None

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest copy on this host that verifies, falling back past damaged ones; None for a fresh start.
        For one process alone; the ranks of a group use ``agree`` so that they agree."""
        for step in reversed(self.steps_on_disk()):
            try:
                return step, self.load(step)
            except CorruptCheckpoint as e:
                log.warning("%s; falling back to the previous checkpoint", e)
        return None

    def agree(self, group: Any = None, device: torch.device | None = None, fence: Any = None) -> Choice | None:
        """Collective over ``group`` (every rank calls it; the default group, or none for one process): the newest
        step whose copy is complete and authentic on some host, and the rank that reads it (module docstring).
        ``fence``: the group's toolkit.train.fence.Fence, if any (a new generation then ends the wait).
        Each rank verifies its share of its host's files; files that fail are moved to ``refused/`` and parts
        newer than the choice are removed, each named in a log line. None: no host has a copy (a fresh start)."""
        listing = self.dir.listing()
        vouched, failed = self.dir.verify_share(listing, self.placement.local_world, self._writes)
        steps = sorted(vouched, reverse=True)[:MAX_CANDIDATES]
        p = self.placement
        row = [p.key, p.local_rank, p.local_world, *steps, *[-1] * (MAX_CANDIDATES - len(steps))]
        choice = choose(_gather(row, group, device, fence))
        self.dir.tidy(listing, failed, None if choice is None else choice.step, self._writes)
        return choice

    # --- writing ---

    def save(self, step: int, state: dict[str, Any], stable: frozenset[int] = frozenset()) -> None:
        """Make ``state`` (the same on every rank of the host) the checkpoint of ``step``: this rank writes its part.
        Synchronous: returns once the part is durable. Async: returns once the part is staged or handed to the
        writer; a failed background write is raised by the next ``save``/``flush``/``close``. A full disk is not
        raised: the checkpoint is skipped (module docstring; ``skipped`` counts them). ``stable``: storage
        addresses (``untyped_storage().data_ptr()``) of tensors that will not change before ``wait_staged()``:
        the writer copies those (when it is idle), the rest are copied here."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._writer is not None:
            self._writer.raise_pending()
        cut = ckptparts.split(state, self.placement.local_world)
        mine = cut.ordinals(self.placement.local_rank)
        name = PartName(step, self.placement.local_rank, self.placement.local_world)
        job = _Job(name, cut, mine, [None] * len(mine), sum(cut.tensors[i].nbytes for i in mine))
        self.last_bytes = job.size
        if self._writer is None:
            if self._write(job):
                self._committed(step)
            return
        in_flight = self._writer.slot()  # waits (bounded) for the slot: always called
        defer = bool(stable) and not in_flight
        now = [k for k, i in enumerate(mine) if not (defer and cut.tensors[i].untyped_storage().data_ptr() in stable)]
        for k, copy in zip(now, host_copies([cut.tensors[mine[k]] for k in now]), strict=True):
            job.staged[k] = copy
        self._writer.put(job, staging=any(t is None for t in job.staged))

    def wait_staged(self, timeout: float | None = None) -> float:
        """Block (bounded) until the writer has copied every tensor ``save`` left to it, so the caller may change
        them again; returns the seconds waited (part of the checkpoint's stall)."""
        return 0.0 if self._writer is None else self._writer.wait_staged(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait (bounded) until every queued write is durable; raise a background write's error."""
        if self._writer is not None:
            self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush and stop the writer thread (reading goes on working)."""
        if self._writer is not None:
            self._writer.close(timeout)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prune(self, newest: int | None = None) -> list[int]:
        """Keep the ``keep_max`` newest complete copies at or below ``newest`` (default: all) and remove this rank's
        share (``_writes``) of every older step, complete or not. Only what is this key's is removed: a file this
        manager wrote, or one that authenticates (read once, for a file of an earlier incarnation); any other is
        refused (moved aside, named in a log line), never deleted. Returns the steps pruned.

        Why each rank its own share: deleting a peer's part would need reading it first (this rank did not write
        it), a copy's worth of reads per checkpoint. Every rank prunes before and after each of its writes, so the
        host holds what it did before (``keep_max`` copies, and the one being written), except that between two
        checkpoints a rank whose write did not complete a step still holds its part of the step that step made
        prunable."""
        listing = self.dir.listing()
        complete_steps = sorted(s for s in listing if (newest is None or s <= newest)
                                and complete(listing, s, self.placement.local_world))
        if len(complete_steps) < self.keep_max:
            return []
        oldest_kept = complete_steps[-self.keep_max]
        removed = sorted(s for s in listing if s < oldest_kept)
        for name in (PartName(s, part, parts) for s in removed for parts, present in listing[s].items()
                     for part in sorted(present)):
            if not self._writes(name):
                continue
            reason = None if name in self._written else self.dir.check(name)
            if reason is not None:
                log.warning("checkpoint %s: %s; not pruned, %s", self.directory / name.name, reason,
                            self.dir.refuse(name))
                continue
            try:
                self.dir.remove(name)
            except OSError as e:
                log.warning("could not prune %s: %s", self.directory / name.name, e.strerror)
            self._written.discard(name)
        return removed

    # --- internals ---

    def _writes(self, name: PartName) -> bool:
        """Whether this rank writes (and may clean up after) the file `name`."""
        return name.part % self.placement.local_world == self.placement.local_rank

    def _write(self, job: _Job) -> bool:
        """Write the job's part and prune; False if the disk was full. A full disk (or quota) costs this checkpoint,
        never the job: the write left nothing behind (its temporary file is removed), the older copies stay,
        training goes on and the next checkpoint tries again; said once per run of skipped checkpoints."""
        tensors = [t if t is not None else job.cut.tensors[i] for t, i in zip(job.staged, job.ordinals, strict=True)]
        self.prune(job.name.step)  # what became prunable since this rank's last write (its peers completed a step)
        try:
            self.dir.write(job.name, job.cut.payload(self.placement.local_rank, tensors))
        except OSError as e:
            error = write_error(e, self.directory, f"checkpoint of step {job.name.step}", job.size)
            if e.errno not in FULL:
                raise error from None
            self.skipped += 1
            if self.skipped == 1:
                self.skip_why = str(error)
                log.warning("%s; checkpoint of step %d skipped: training goes on and the next checkpoint tries "
                            "again (this is said once until one is written)", error, job.name.step)
            return False
        self._written.add(job.name)
        if self.skipped:
            log.warning("checkpoint of step %d written in %s: checkpoints are saved again (%d skipped for lack of "
                        "space)", job.name.step, self.directory, self.skipped)
            self.skipped = 0
        self.prune(job.name.step)
        return True

    def _committed(self, step: int) -> None:
        if self.on_commit is None:
            return
        try:
            self.on_commit(step)
        except Exception as e:  # noqa: BLE001 - the user's hook: a failure of it is logged, the commit stands
            log.error("on_commit hook for step %d in %s failed: %r", step, self.directory, e)


def _first_bad(directory: HostDir, step: int, prefer: int) -> tuple[Path, str] | None:
    """The first file of `step`'s copy in `directory` that is missing or fails verification, and why; None if the
    copy is complete and every part authentic."""
    names = complete(directory.listing(), step, prefer)
    if names is None:
        return directory.path, f"no complete copy of step {step} (a part is missing)"
    for name in names:
        reason = directory.check(name)
        if reason is not None:
            return directory.path / name.name, reason
    return None
