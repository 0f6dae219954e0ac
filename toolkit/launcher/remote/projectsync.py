"""Copying a project to a host: incremental (one listing, then only what differs in size, mtime or mode), atomic
per file, and never following a symlink out of the project (a link to ~/.ssh/id_rsa must not reach every host).

Reached through `Host.sync_dir` (deploy's project upload). Works the same over SshHost and LocalHost: it uses only
Host.run, mkdir and put_file (`SyncTarget`), so every step has the transport's bounds. The host needs GNU find
(-printf)."""

from __future__ import annotations

import fnmatch
import os
import shlex
import stat
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from toolkit.errors import UserError
from toolkit.launcher.remote.paths import home_relative
from toolkit.launcher.remote.results import CommandFailed, CommandResult, ConnectionLost, SyncStats


class SyncTarget(Protocol):
    """What the sync needs of a host (toolkit.launcher.remote.Host has it): its name, a bounded command, and the
    transport's own directory creation and atomic file copy."""

    name: str

    def run(self, command: Sequence[str] | str, timeout: float | None = None, cwd: str | None = None,
            env: Mapping[str, str] | None = None, check: bool = False) -> CommandResult: ...

    def mkdir(self, remote: str) -> None: ...

    def put_file(self, local: Path, remote: str, mode: int, mtime: int | None = None) -> None: ...


def sync_dir(host: SyncTarget, local_dir: Path, remote_dir: str, exclude: Sequence[str], delete: bool) -> SyncStats:
    """Make remote_dir on `host` hold local_dir's files (see the module docstring).

    One `find` lists the remote side (creating remote_dir if needed); a file is sent only if its size, mtime
    (whole seconds) or mode differ, and is sent with the local mtime, so the next sync finds it unchanged.
    Remote entries of the wrong kind (a directory where a file belongs, or the reverse) are removed first; with
    `delete`, so are remote entries that are not local and not excluded (excluded names are never touched).
    Returns SyncStats. Raises UserError if local_dir is not a directory, ConnectionLost or CommandFailed if the
    listing or a removal fails, and what Host.put_file and mkdir raise for a transfer."""
    if not local_dir.is_dir():
        raise UserError(f"{local_dir}: not a directory; nothing to copy to {host.name}")
    remote_dir = home_relative(remote_dir)
    local_files, local_dirs, outside = _scan(local_dir, exclude)
    listing = host.run(
        f"mkdir -p -- {shlex.quote(remote_dir)} && find {shlex.quote(remote_dir)} -mindepth 1 "
        "-printf '%y %s %T@ %m %P\\0'"
    )
    if not listing.ok:
        raise (ConnectionLost if listing.connection_lost else CommandFailed)(
            host.name, f"cannot list {remote_dir}: {listing.describe()}")
    remote: dict[str, tuple[str, int, int, int]] = {}
    for entry in listing.stdout.split("\0"):
        if entry:
            kind, size, mtime, mode, rel = entry.split(" ", 4)
            remote[rel] = (kind, int(size), int(float(mtime)), int(mode, 8))

    def excluded(rel: str) -> bool:
        """Whether any component of a relative path matches an exclude pattern."""
        return any(fnmatch.fnmatch(part, pat) for part in rel.split("/") for pat in exclude)

    stale = [rel for rel, info in remote.items()
             if (rel in local_files and info[0] != "f") or (rel in local_dirs and info[0] != "d")]
    if delete:
        stale += [rel for rel in remote if rel not in local_files and rel not in local_dirs and not excluded(rel)]
    # One rm for the lot; entries under a removed directory need no separate mention.
    stale = [rel for rel in stale if not any(rel.startswith(s + "/") for s in stale if s != rel)]
    if stale:
        host.run(["rm", "-rf", "--", *(f"{remote_dir}/{rel}" for rel in stale)], check=True)
    for rel in stale:
        remote.pop(rel, None)
    dirs_created = 0
    for rel in sorted(local_dirs):
        if rel not in remote or remote[rel][0] != "d":
            host.mkdir(f"{remote_dir}/{rel}")
            dirs_created += 1
    sent = unchanged = nbytes = 0
    for rel, (size, mtime, mode) in sorted(local_files.items()):
        if remote.get(rel) == ("f", size, mtime, mode):
            unchanged += 1
            continue
        host.put_file(local_dir / rel, f"{remote_dir}/{rel}", mode, mtime)
        sent += 1
        nbytes += size
    return SyncStats(files_sent=sent, bytes_sent=nbytes, files_unchanged=unchanged,
                     dirs_created=dirs_created, removed=len(stale), outside=tuple(outside))


def _scan(root: Path, exclude: Sequence[str]) -> tuple[dict[str, tuple[int, int, int]], set[str], list[str]]:
    """The files (size, mtime, mode) and directories under `root`, and the symlinks that point out of it. A
    symlink is followed only to something inside `root`: a link to ~/.ssh/id_rsa in a project must never be
    uploaded to every host.

    Paths are relative to `root` with "/" separators. Excluded names (fnmatch on each name) are neither listed
    nor descended into; only regular files are listed (sockets, fifos, dangling links are skipped). A symlink to
    a file inside `root` is listed as that file; a symlinked directory inside `root` is not descended into (its
    files are not sent); a link leading out is reported in the third value for the caller to mention."""
    files: dict[str, tuple[int, int, int]] = {}
    dirs: set[str] = set()
    outside: list[str] = []
    top = os.path.realpath(root)

    def inside(path: str) -> bool:
        return os.path.commonpath([top, os.path.realpath(path)]) == top

    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)

        prefix = "" if rel_dir == "." else f"{rel_dir}/"

        kept = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            if any(fnmatch.fnmatch(d, p) for p in exclude):
                continue
            if os.path.islink(full):  # os.walk does not descend into linked directories; say those that lead out
                if not inside(full):
                    outside.append(prefix + d)
                continue
            kept.append(d)
        dirnames[:] = kept
        for d in dirnames:
            dirs.add(prefix + d)
        for name in filenames:
            if any(fnmatch.fnmatch(name, p) for p in exclude):
                continue
            full = os.path.join(dirpath, name)
            if os.path.islink(full) and not inside(full):
                outside.append(prefix + name)
                continue
            try:
                st = os.stat(full)
            except OSError:
                continue  # a dangling symlink
            if stat.S_ISREG(st.st_mode):
                files[prefix + name] = (st.st_size, int(st.st_mtime), stat.S_IMODE(st.st_mode))
    return files, dirs, outside
