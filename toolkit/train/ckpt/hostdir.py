"""One host's checkpoint directory (``<CKPT_DIR>/host_<name>/``): its files, read and written through one fd.

Why one directory fd: every open, rename and unlink is relative to the directory checked at construction, so a
path component swapped for a link later changes nothing; with O_NOFOLLOW on every file, no link planted in the
directory is ever followed. The directory and the root above it are checked private (toolkit.privatedir) before
anything in them is trusted.

The root is one key's (one job's, or alone one project's): its ``key-id`` file names the key's public id
(toolkit.contracts.ckptkey), written by the first run that uses it. A run under another key is refused at once, with one
line, and touches nothing there: without this, a second job given the same directory moved the first's files into
``refused/`` (they do not authenticate under its key) and pruned its authentic copies.

A step's copy on the host is complete when every part of one layout (``p<i>of<L>``) is there; the files that must
not be used (they fail authentication or are damaged) are moved into ``refused/`` (never deleted: they may be
someone's evidence, or this user's own files under another key; a name already there gets a numbered one).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from toolkit import atomicfile, privatedir
from toolkit.contracts import ckptkey
from toolkit.train.ckpt import partfile
from toolkit.train.ckpt.partfile import PartName
from toolkit.train.faults import DirectoryError

log = logging.getLogger("toolkit.train.ckpt.manager")

REFUSED = "refused"
KEY_ID_FILE = "key-id"  # in the checkpoint root: the public id of the key its checkpoints are under
MAX_ID_BYTES = 128
MAX_REFUSED_NAMES = 1000  # refused files of one name kept apart (<name>, <name>.1, ...)
PRIVATE_FIX = "point --ckpt-dir (CKPT_DIR) at a directory of your own"
Listing = dict[int, dict[int, set[int]]]  # {step: {parts: {part indices present}}}


def complete(listing: Listing, step: int, prefer: int) -> list[PartName] | None:
    """The names of a complete copy of `step` in `listing` (every part of one layout; the layout of `prefer`
    parts if it is complete, else the one with most parts), None if there is none."""
    layouts = listing.get(step, {})
    full = [parts for parts, present in layouts.items() if present == set(range(parts))]
    if not full:
        return None
    parts = prefer if prefer in full else max(full)
    return [PartName(step, i, parts) for i in range(parts)]


class HostDir:
    """A host's checkpoint directory under a private root. Not thread-safe for one file, safe across files: the
    ranks of a host share the directory, each writing its own parts."""

    def __init__(self, root: Path, name: str, key: bytes) -> None:
        self.root = Path(root)
        self.path = self.root / name
        self.key = key
        try:
            root_fd = privatedir.open_private(self.root, "checkpoint directory", PRIVATE_FIX)  # what was checked
            try:
                claim(root_fd, self.root, ckptkey.key_id(key))
            finally:
                os.close(root_fd)
            self.fd = privatedir.open_private(self.path, "checkpoint directory", PRIVATE_FIX)  # what was checked
        except privatedir.NotPrivate as e:
            raise DirectoryError(str(e)) from None
        except OSError as e:
            raise DirectoryError(_os_reason(e, self.path)) from None
        self._closer = weakref.finalize(self, os.close, self.fd)  # with the object: readers may outlive a close()

    def close(self) -> None:
        """Close the directory fd now (else it closes when the object goes)."""
        self._closer()

    def listing(self) -> Listing:
        """What the directory holds, by name only: {step: {parts: {part indices present}}}."""
        found: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
        for entry in os.listdir(self.fd):
            name = PartName.parse(entry)
            if name is not None:
                found[name.step][name.parts].add(name.part)
        return {s: dict(layouts) for s, layouts in found.items()}

    def write(self, name: PartName, obj: Any) -> int:
        """Write one part (ckptfile.write_part); OSError on failure. Returns its size."""
        return partfile.write_part(self.fd, name, obj, self.key)

    def probe(self) -> None:
        """Create and remove a temporary file: a directory we cannot write fails now, not at the first save."""
        fd, tmp = atomicfile.create_temp("probe", 0o600, dir_fd=self.fd)
        os.close(fd)
        os.unlink(tmp, dir_fd=self.fd)

    def read(self, name: PartName) -> Any:
        """The verified, unpickled content of one part. ckptfile.BadPart (why) if it must not be used, OSError if
        it cannot be read."""
        with partfile.open_part(self.fd, name, self.key) as payload:
            try:
                return partfile.decode(payload)
            except Exception as e:  # noqa: BLE001 - it verified, so this is a file of ours that torch cannot read
                raise partfile.BadPart(f"authentic but does not load ({str(e).splitlines()[0][:200]})") from None

    def check(self, name: PartName) -> str | None:
        """None if the file `name` is authentic (its MAC checks; not unpickled), else why not."""
        try:
            partfile.check_part(self.fd, name, self.key)
        except partfile.BadPart as e:
            return str(e)
        except OSError as e:
            return f"unreadable ({e.strerror})"
        return None

    def verify_share(self, listing: Listing, prefer: int,
                     writes: Callable[[PartName], bool]) -> tuple[set[int], list[tuple[PartName, str]]]:
        """For the restart agreement: the steps whose complete copy here has every file `writes` selects (this
        rank's share) authentic, and the files of the share that are not, with why."""
        vouched: set[int] = set()
        failed: list[tuple[PartName, str]] = []
        for step in listing:
            names = complete(listing, step, prefer)
            if names is None:
                continue
            bad = [(name, reason) for name in filter(writes, names) if (reason := self.check(name)) is not None]
            failed += bad
            if not bad:
                vouched.add(step)
        return vouched, failed

    def tidy(self, listing: Listing, failed: list[tuple[PartName, str]], chosen: int | None,
             writes: Callable[[PartName], bool]) -> None:
        """After the restart agreement, for the files `writes` selects: refuse those that failed, remove the parts
        of steps newer than `chosen` (None: every step) after checking them (one that fails is refused instead:
        it may not be ours to delete), and remove stale temporary files. One log line per file."""
        refused = {name for name, _ in failed}
        for name, reason in failed:
            log.warning("checkpoint %s: %s; not used, %s", self.path / name.name, reason, self.refuse(name))
        after = "a fresh start" if chosen is None else f"step {chosen}"
        for step in sorted(s for s in listing if chosen is None or s > chosen):
            for parts, present in listing[step].items():
                for name in (PartName(step, i, parts) for i in sorted(present)):
                    if name in refused or not writes(name):
                        continue
                    reason = self.check(name)
                    if reason is not None:
                        log.warning("checkpoint %s: %s; not used, %s", self.path / name.name, reason,
                                    self.refuse(name))
                        continue
                    self.remove(name)
                    log.warning("checkpoint %s: removed: the job resumes from %s and this newer copy is not whole "
                                "on this host (a part missing or refused; a later write of the step must never "
                                "complete it)", self.path / name.name, after)
        self.remove_temps(writes)

    def remove(self, name: PartName) -> None:
        """Delete one part, if it is there."""
        try:
            os.unlink(name.name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def refuse(self, name: PartName) -> str:
        """Move a part that must not be used into ``refused/`` (kept, out of every listing), under a name nothing
        there has yet (``<name>``, else ``<name>.1``, ...: a file refused earlier is never overwritten). Returns
        where it went (or why it stayed)."""
        try:
            os.mkdir(REFUSED, 0o700, dir_fd=self.fd)
        except FileExistsError:
            pass
        try:
            st = os.stat(REFUSED, dir_fd=self.fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                return f"left in place ({REFUSED} is not a directory)"
            for n in range(MAX_REFUSED_NAMES):
                target = f"{REFUSED}/{name.name}" + (f".{n}" if n else "")
                try:  # a link never replaces what is there (a rename would), then the name is dropped
                    os.link(name.name, target, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
                except FileExistsError:
                    continue
                os.unlink(name.name, dir_fd=self.fd)
                return f"moved to {self.path / target}"
        except OSError as e:
            return f"left in place ({e.strerror})"
        return f"left in place ({REFUSED} already holds {MAX_REFUSED_NAMES} files of that name)"

    def remove_temps(self, mine: Callable[[PartName], bool]) -> None:
        """Delete the temporary files whose final name `mine(PartName)` says are this writer's: left by an
        incarnation that died mid-write, never committed."""
        for entry in os.listdir(self.fd):
            m = partfile.TEMP_RE.fullmatch(entry)
            final = PartName.parse(m.group(1)) if m else None
            if final is not None and mine(final):
                try:
                    os.unlink(entry, dir_fd=self.fd)
                except OSError:
                    pass

    def free_bytes(self) -> int | None:
        """Free space where the directory is, None if unknown."""
        try:
            return shutil.disk_usage(self.path).free
        except OSError:
            return None


def claim(fd: int, root: Path, mine: str) -> None:
    """Make the checkpoint root `root` (open as `fd`) this key's, or find it is: its KEY_ID_FILE says `mine` (written
    here if it is not there yet, without ever replacing one). DirectoryError (one line: whose it is, what to do;
    nothing in it touched) when it names another key: another job's or project's checkpoints are there, and would
    otherwise be moved aside as not authentic, or pruned."""
    found = _read_id(fd)
    if found is None:
        tmp_fd, tmp = atomicfile.create_temp(KEY_ID_FILE, 0o600, dir_fd=fd)
        try:
            try:
                os.write(tmp_fd, f"{mine}\n".encode())
                os.fsync(tmp_fd)
            finally:
                os.close(tmp_fd)
            try:  # a link never replaces: of two first users at once, one names the directory
                os.link(tmp, KEY_ID_FILE, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp, dir_fd=fd)
        found = _read_id(fd)
    if found != mine:
        raise DirectoryError(
            f"checkpoint directory {root} holds another job's checkpoints ({root / KEY_ID_FILE} names key "
            f"{(found or '?')[:12]}..., this run's is {mine[:12]}...: another project, script or job wrote them); "
            "nothing in it was used or changed: give this job a directory of its own (CKPT_DIR, --ckpt-dir), or move "
            f"{root} away to start this one afresh")


def _read_id(dir_fd: int) -> str | None:
    """What KEY_ID_FILE in `dir_fd` says (a regular file, not followed, at most MAX_ID_BYTES), None if it is not
    there; "" for one that says nothing sensible (another key's, as far as anyone can tell)."""
    try:
        fd = os.open(KEY_ID_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        raw = os.read(fd, MAX_ID_BYTES)
    finally:
        os.close(fd)
    return raw.decode("ascii", "replace").strip()


def _os_reason(e: OSError, path: Path) -> str:
    reasons = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
               errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on device",
               errno.ELOOP: "it is a symbolic link"}
    reason = reasons.get(e.errno or 0, e.strerror or str(e))
    return f"checkpoint directory {path} cannot be used: {reason}; {PRIVATE_FIX}"
