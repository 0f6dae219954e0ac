"""Checkpoints of sharded state (FSDP2, HSDP): every rank writes its own shard, authenticated, in the background,
and a whole-job restart on the same mesh reads them back; a restart on another world size or mesh is refused.

Why per rank and not per host (toolkit.train.ckpt.manager): with `fully_shard` no rank holds the whole state, and the
shards of a host's ranks are different bytes, so each rank writes exactly what it owns (its parameters' and optimizer
state's local shards, and the small replicated rest: the step, extra state): bytes written per host per checkpoint
are the host's share of the state, once.

- ``<CKPT_DIR>/host_<host>/step_<012d>.s<rank>of<world>.ckpt``: the host's directory of the replicated checkpoints
  (toolkit.train.ckpt.hostdir: private, claimed by the job's key), so `fleet train --fresh` and the key-id check treat
  both alike. The file format is toolkit.train.ckpt.partfile's (MAC over payload and header, which binds the step, the
  rank and the world size), under a key derived from the job's for shards only (`shard_key`): a shard renamed to
  a replicated part's name, or the reverse, fails authentication instead of being merged into the wrong state.
- The manifest is in every file, authenticated with it: the world size (also in the name and header) and the mesh
  shape the state was sharded on. A restart reads it before anything else: a different world size is refused in
  one line at the agreement (every rank raises the same line), a different mesh shape at the load. The elastic
  layer (logical ranks) does not map sharded state: a shard is cut for its mesh, and re-cutting it is
  torch.distributed.checkpoint's resharding, not a toolkit restart (the line says to restart on the old size or
  move the directory aside).
- Asynchronous: `save` copies the rank's tensors to host memory (toolkit.train.ckpt.manager.host_copies), except those
  the caller says change only in optimizer.step() (`stable`, as for the replicated checkpoints: the Trainer's
  parameters' and optimizer state's local shards), which the writer copies while the next forward and backward run
  (`wait_staged`: the Trainer's optimizer pre-hook waits for that copy), then takes the digest and writes the file
  (toolkit.train.ckpt.writer, the replicated checkpoints' writer too: one write in flight, one queued; a `save`
  waits, bounded, while one is queued). Each durable shard is told to `on_commit` (the Trainer's
  Runtime.committed, as for replicated checkpoints). A full disk (ENOSPC, EDQUOT) skips that checkpoint with one
  line, as the replicated checkpoints do; any other write error is raised by the next `save`, `flush` or `close`.
- The state's digest (toolkit.train.digest, of the copy) is recorded in the file and checked at the load: what was
  written is what was copied.
- Each rank keeps its own ``keep_max`` newest shards and prunes its older ones (only its own name, and only files
  that authenticate: anything else is moved into ``refused/``).
- The restart agreement (`agree`, a collective): each rank authenticates its own shards in its host's directory,
  the ranks exchange the steps as one int64 tensor each, and all resume from the newest step whose shard every
  rank found. Each rank reads its shard from its own host's directory: the restart is on the same hosts in the same
  rank order (what the scheduler does for a whole-job restart), or on a CKPT_DIR every host shares.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from toolkit import atomicfile
from toolkit.train.ckpt import partfile
from toolkit.train.ckpt.hostdir import HostDir
from toolkit.train.ckpt.manager import (
    DEFAULT_WRITE_TIMEOUT,
    FULL,
    MIN_KEEP,
    Placement,
    host_copies,
    write_error,
)
from toolkit.train.ckpt.partfile import PartName
from toolkit.train.ckpt.writer import SlotWriter
from toolkit.train.digest import Digester
from toolkit.train.faults import BadPart, CheckpointError, CorruptCheckpoint, DirectoryError

log = logging.getLogger("toolkit.train.ckpt.manager")

SHARD_INFO = b"toolkit sharded checkpoint key v1"
SHARD_RE = re.compile(r"^step_(\d{12})\.s(\d{1,6})of(\d{1,6})\.ckpt$")
SHARD_TEMP_RE = re.compile(r"^" + re.escape(atomicfile.TMP_PREFIX)
                           + r"(step_\d{12}\.s\d{1,6}of\d{1,6}\.ckpt)\.[0-9a-f]+$")
MAX_STEPS = 64  # steps each rank reports in the restart agreement (its newest authentic ones)
LAYOUT, STATE, DIGEST = "layout", "state", "digest"


def shard_key(key: bytes) -> bytes:
    """The key shards are authenticated under: derived from the job's checkpoint key, for shards only."""
    return hmac.new(key, SHARD_INFO, hashlib.sha256).digest()


@dataclass(frozen=True)
class ShardName(PartName):
    """A shard file: the step, the rank that wrote it (``part``) and the world size (``parts``)."""

    @property
    def name(self) -> str:
        """``step_<012d>.s<rank>of<world>.ckpt``."""
        return f"step_{self.step:012d}.s{self.part}of{self.parts}.ckpt"

    @classmethod
    def parse(cls, name: str) -> ShardName | None:
        """The ShardName of a shard file name, None for any other name (or a rank outside the world)."""
        m = SHARD_RE.fullmatch(name)
        if m is None:
            return None
        step, rank, world = int(m.group(1)), int(m.group(2)), int(m.group(3))
        return cls(step, rank, world) if 0 <= rank < world else None


@dataclass
class _ShardJob:
    """One shard on its way to disk (toolkit.train.ckpt.writer's job): the state as `save` got it, its tensors in
    order, and their host copies (None: the writer copies it in `stage`)."""

    name: ShardName
    state: Any
    tensors: list[torch.Tensor]
    staged: list[torch.Tensor | None]

    @property
    def step(self) -> int:
        return self.name.step

    def stage(self) -> None:
        """Copy the tensors `save` left to the writer (the training loop may change them once this returns)."""
        left = [i for i, t in enumerate(self.staged) if t is None]
        for i, copy in zip(left, host_copies([self.tensors[i] for i in left]), strict=True):
            self.staged[i] = copy

    def payload(self, layout: Manifest) -> dict[str, Any]:
        """What the file holds: the manifest, the staged state and its digest."""
        copies = iter(self.staged)
        state = _replaced(self.state, lambda _: next(copies))
        return {LAYOUT: {"world": layout.world, "mesh": list(layout.mesh)}, STATE: state,
                DIGEST: Digester().state(state)}


@dataclass(frozen=True)
class Manifest:
    """What a sharded state is cut for, in every shard file: the world size and the mesh shape. A restart must match
    it. (Not toolkit.train.shardmodel.Layout, which says how a live model is sharded.)"""

    world: int
    mesh: tuple[int, ...]

    def __post_init__(self) -> None:
        product = 1
        for n in self.mesh:
            product *= n
        if self.world < 1 or not self.mesh or product != self.world:
            raise ValueError(f"mesh {self.mesh} does not cover a world of {self.world}")

    def describe(self) -> str:
        return f"a world of {self.world} on a {tuple(self.mesh)} mesh"


def refusal(found: int, found_step: int, layout: Manifest, where: str) -> str:
    """The one line for a sharded checkpoint of another world size."""
    return (f"{where} holds the sharded checkpoint of step {found_step} of a world of {found}; this run is "
            f"{layout.describe()}: a shard is cut for its mesh and is not re-cut on a restart (the elastic layer maps "
            f"only replicated state): restart with {found} workers, or move the checkpoint directory aside to start "
            "afresh")


class ShardCheckpoints:
    """One rank's sharded checkpoints (module docstring). `root`: the checkpoint root (CKPT_DIR); `rank`: this
    rank; `layout`: the world and mesh this run shards on; `placement`: the host whose directory holds the shard
    (default: from the environment); `key`: the job's checkpoint key (toolkit.contracts.ckptkey). CheckpointError,
    one line, for a directory that cannot be used."""

    def __init__(self, root: str | Path, rank: int, layout: Manifest, *, key: bytes,
                 placement: Placement | None = None, keep_max: int = 2, async_write: bool = True,
                 write_timeout: float = DEFAULT_WRITE_TIMEOUT, on_commit: Callable[[int], None] | None = None) -> None:
        if keep_max < MIN_KEEP:
            raise ValueError(f"keep_max must be >= {MIN_KEEP}, got {keep_max}")
        if not 0 <= rank < layout.world:
            raise ValueError(f"rank {rank} is not in a world of {layout.world}")
        self.rank = rank
        self.layout = layout
        self.keep_max = keep_max
        self.write_timeout = write_timeout
        self._key = shard_key(key)
        try:
            self.placement = placement or Placement.from_env(os.environ)
            self.dir = HostDir(Path(root), self.placement.dirname, key)
        except (ValueError, DirectoryError) as e:
            raise CheckpointError(str(e)) from None
        self.directory = self.dir.path
        self._remove_temps()
        self.on_commit = on_commit
        self.skipped = 0  # checkpoints skipped in a row for a full disk (or quota), 0 once one is written
        self.skip_why = ""  # the line that said why the first of them was skipped
        self.last_bytes = 0  # bytes of this rank's newest shard saved (for the heartbeat)
        self.copies_later = async_write  # `stable` tensors are copied by the writer (the Trainer's RankCheckpoints)
        self._writer: SlotWriter[_ShardJob] | None = None  # the background writer (toolkit.train.ckpt.writer)
        if async_write:
            self._writer = SlotWriter(self._write, self._committed, what="sharded checkpoint",
                                      directory=self.directory, timeout=write_timeout)

    # --- writing

    def save(self, step: int, state: dict[str, Any], stable: frozenset[int] = frozenset()) -> None:
        """Make `state` (this rank's shard: nested dicts, lists and tensors, e.g. local shards of DTensors) the
        checkpoint of `step`, written in the background (async) or before this returns (sync). `stable`: storage
        addresses (``untyped_storage().data_ptr()``) of tensors that will not change before `wait_staged()` (the
        parameters' local shards and the optimizer state: only optimizer.step() changes them): the writer copies
        those while the loop runs the next forward and backward, when it is idle; every other tensor is copied
        here. The digest of the copy is taken by the writer."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        defer = False
        if self._writer is not None:
            self._writer.raise_pending()
            in_flight = self._writer.slot()  # waits (bounded) for the slot: always called
            defer = bool(stable) and not in_flight
        tensors = tensors_in(state)
        later = [defer and t.untyped_storage().data_ptr() in stable for t in tensors]
        staged: list[torch.Tensor | None] = [None] * len(tensors)
        now = [i for i, deferred in enumerate(later) if not deferred]
        for i, copy in zip(now, host_copies([tensors[i] for i in now]), strict=True):
            staged[i] = copy
        self.last_bytes = sum(t.nbytes for t in tensors)
        # the structure (containers, plain values) taken now, as the tensors are: the writer only fills it in
        job = _ShardJob(ShardName(step, self.rank, self.layout.world), _replaced(state, lambda t: t), tensors, staged)
        if self._writer is None:
            if self._write(job):
                self._committed(step)
            return
        self._writer.put(job, staging=any(later))

    def wait_staged(self, timeout: float | None = None) -> float:
        """Block (bounded) until the writer has copied every tensor `save` left to it, so the caller may change
        them again; returns the seconds waited (part of the checkpoint's stall)."""
        return 0.0 if self._writer is None else self._writer.wait_staged(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait (bounded) until the write in flight is durable; raise a background write's error."""
        if self._writer is not None:
            self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the writer thread."""
        if self._writer is not None:
            self._writer.close(timeout)

    # --- reading

    def own_steps(self) -> tuple[list[int], tuple[int, int] | None]:
        """This rank's authentic shards of this world (newest first), and the newest authentic shard of another
        world size if it is newer than all of them ((world, step), else None). Files that fail authentication are
        moved into ``refused/``, each named in one line."""
        mine: list[int] = []
        other: tuple[int, int] | None = None
        names = sorted((n for n in map(ShardName.parse, os.listdir(self.dir.fd)) if n is not None),
                       key=lambda n: (-n.step, n.parts != self.layout.world))
        for name in names:
            ours = name.parts == self.layout.world
            if (ours and name.part != self.rank) or (not ours and (other is not None or mine)):
                continue  # a peer's shard; or another world's older than what is already found
            reason = self._check(name)
            if reason is not None:
                log.warning("checkpoint %s: %s; not used, %s", self.directory / name.name, reason,
                            self.dir.refuse(name))
            elif ours:
                mine.append(name.step)
            else:
                other = (name.parts, name.step)
        return mine[:MAX_STEPS], other

    def agree(self, group: Any = None, fence: Any = None) -> int | None:
        """Collective (every rank of the world calls it): the newest step whose shard every rank holds; None for
        a fresh start (no rank holds one). CheckpointError, the same one line on every rank, when the newest
        shards are of another world size, or when some ranks hold shards but no step is common to all."""
        mine, other = self.own_steps()
        row = [other[0] if other else 0, other[1] if other else -1, *mine, *[-1] * (MAX_STEPS - len(mine))]
        rows = _gather(row, group, fence)
        return decide(rows, self.layout, str(self.directory.parent))

    def load(self, step: int) -> dict[str, Any]:
        """This rank's shard of `step`, authenticated, its manifest matched against this run's layout and its
        digest against the one recorded at the save. CheckpointError / CorruptCheckpoint in one line."""
        name = ShardName(step, self.rank, self.layout.world)
        path = self.directory / name.name
        try:
            with partfile.open_part(self.dir.fd, name, self._key) as f:
                payload = partfile.decode(f)
        except BadPart as e:
            raise CorruptCheckpoint(f"{path}: {e}") from None
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no shard of step {step} for rank {self.rank}") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        except Exception as e:  # noqa: BLE001 - authentic but torch cannot read it
            raise CorruptCheckpoint(f"{path}: authentic but does not load ({str(e).splitlines()[0][:200]})") from None
        try:
            saved = Manifest(int(payload[LAYOUT]["world"]), tuple(int(n) for n in payload[LAYOUT]["mesh"]))
            state, recorded = payload[STATE], payload[DIGEST]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(f"{path}: not a sharded checkpoint ({e!r})") from None
        if saved != self.layout:
            raise CheckpointError(f"{path}: sharded on {saved.describe()}, this run is {self.layout.describe()}: "
                                  "restart on the mesh it was saved on, or move the checkpoint directory aside")
        if Digester().state(state) != recorded:
            raise CorruptCheckpoint(f"{path}: its state does not match the digest recorded when it was saved: "
                                    "refused; move it aside to resume from the previous checkpoint")
        return state

    # --- internals

    def _check(self, name: ShardName) -> str | None:
        try:
            partfile.check_part(self.dir.fd, name, self._key)
        except BadPart as e:
            return str(e)
        except OSError as e:
            return f"unreadable ({e.strerror})"
        return None

    def _write(self, job: _ShardJob) -> bool:
        """Write the shard, then prune; False if the disk was full (the checkpoint skipped, said once per run)."""
        name = job.name
        try:
            partfile.write_part(self.dir.fd, name, job.payload(self.layout), self._key)
        except OSError as e:
            error = write_error(e, self.directory, f"sharded checkpoint of step {name.step}", self.last_bytes)
            if e.errno not in FULL:
                raise error from None
            self.skipped += 1
            if self.skipped == 1:
                self.skip_why = str(error)
                log.warning("%s; sharded checkpoint of step %d skipped: training goes on and the next checkpoint "
                            "tries again (said once until one is written)", error, name.step)
            return False
        self.skipped = 0
        self._prune()
        return True

    def _committed(self, step: int) -> None:
        if self.on_commit is None:
            return
        try:
            self.on_commit(step)
        except Exception as e:  # noqa: BLE001 - the hook's failure is logged, the commit stands
            log.error("on_commit hook for step %d in %s failed: %r", step, self.directory, e)

    def _prune(self) -> None:
        """Keep this rank's `keep_max` newest shards of this world; older ones of its own name are removed if they
        authenticate, else refused."""
        own = sorted((n for n in map(ShardName.parse, os.listdir(self.dir.fd))
                      if n is not None and n.part == self.rank and n.parts == self.layout.world),
                     key=lambda n: -n.step)
        for name in own[self.keep_max:]:
            reason = self._check(name)
            if reason is None:
                self.dir.remove(name)
            else:
                log.warning("checkpoint %s: %s; not pruned, %s", self.directory / name.name, reason,
                            self.dir.refuse(name))

    def _remove_temps(self) -> None:
        """Temporary files of this rank's shards, left by an incarnation that died mid-write."""
        for entry in os.listdir(self.dir.fd):
            m = SHARD_TEMP_RE.fullmatch(entry)
            name = ShardName.parse(m.group(1)) if m else None
            if name is not None and name.part == self.rank:
                try:
                    os.unlink(entry, dir_fd=self.dir.fd)
                except OSError:
                    pass


def decide(rows: list[list[int]], layout: Manifest, where: str) -> int | None:
    """The restart step from every rank's row ``[other world or 0, its step or -1, own steps..., -1...]`` (pure).
    A rank that found a newer shard of another world refuses for all; else the newest step every rank holds; None
    when no rank holds any; CheckpointError when some do but no step is common to all."""
    for row in rows:
        if row[0]:
            raise CheckpointError(refusal(row[0], row[1], layout, where))
    held = [{s for s in row[2:] if s >= 0} for row in rows]
    if not any(held):
        return None
    common = set.intersection(*held)
    if common:
        return max(common)
    lacking = [r for r, steps in enumerate(held) if not steps]
    newest = max(max(steps) for steps in held if steps)
    who = f"rank(s) {lacking} hold none" if lacking else "their shards are of different steps"
    raise CheckpointError(f"no step of the sharded checkpoints in {where} has every rank's shard (newest: step "
                          f"{newest}; {who}): each rank reads its shard from its own host's directory, so restart on "
                          "the same hosts in the same order, or move the checkpoint directory aside to start afresh")


def _gather(row: list[int], group: Any, fence: Any) -> list[list[int]]:
    """Every rank's row, in rank order, as int64 tensors (nothing unpickled from a peer)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [row]
    mine = torch.tensor(row, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(every, mine, group=group, async_op=True)
    if fence is None:
        work.wait()
    else:
        fence.wait(work, "the agreement on the newest sharded checkpoint", group)
    return [[int(v) for v in t.tolist()] for t in every]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in `obj` (nested dicts, lists, tuples), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def _replaced(obj: Any, new: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with every tensor replaced by `new(tensor)`, in `tensors_in`'s order; the rest as it is."""
    if isinstance(obj, torch.Tensor):
        return new(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _replaced(v, new)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_replaced(v, new) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_replaced(v, new) for v in obj)
    return obj
