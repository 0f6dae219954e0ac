"""Directories that only this user (and root) can change: checked before toolkit trusts what it finds in them.

Why: another local user who can write a directory can plant files in it (a checkpoint the job would resume), and
one who can write a directory above it can rename it away and put their own in its place. So a private directory
is one that, resolved through any links,

- belongs to this user and may be written by nobody else (no group or other write bit), and
- has above it only directories that belong to this user or root and that nobody else may write, unless they
  carry the sticky bit (as /tmp does: there others cannot rename or remove what is not theirs).

This is OpenSSH's StrictModes rule for ~/.ssh, applied to the whole path. The job directory gets the same owner
and mode check from deploy (toolkit.launcher.jobhosts.scripts.LAYOUT_SCRIPT); checkpoint directories get this one, from
deploy (`python -m toolkit.privatedir DIR` on each host, standard library only: no torch import) and from every worker's
CheckpointManager at construction.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
EXIT_NOT_PRIVATE = 2


class NotPrivate(Exception):
    """The directory, or one above it, can be changed by another user. One line: which, why, what to do."""


def problem(path: str | Path, what: str = "directory", fix: str = "choose a directory of your own") -> str | None:
    """None if `path` (an existing directory) is private as the module docstring defines it, else one line that
    names the directory at fault, its owner or mode, and `fix`."""
    me = os.geteuid()
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except OSError as e:
        return f"{what} {path}: cannot be read ({e.strerror}); {fix}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {path} is not a directory; {fix}"
    if st.st_uid != me:
        return (f"{what} {real} belongs to uid {st.st_uid}, not to you (uid {me}): its owner could plant or replace "
                f"files in it; {fix}")
    if st.st_mode & OTHERS_WRITE:
        return (f"{what} {real} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): they could plant "
                f"or replace files in it; run `chmod go-w {real}` or {fix}")
    for above in real.parents:
        try:
            up = os.stat(above)
        except OSError as e:
            return f"{what} {real}: {above} above it cannot be read ({e.strerror}); {fix}"
        if up.st_uid not in (me, 0):
            return (f"{what} {real}: {above} above it belongs to uid {up.st_uid}, who could rename it away and put "
                    f"another in its place; {fix} under directories only you or root can change")
        if up.st_mode & OTHERS_WRITE and not up.st_mode & stat.S_ISVTX:
            return (f"{what} {real}: {above} above it is writable by other users (mode "
                    f"{stat.S_IMODE(up.st_mode):o}, no sticky bit), who could rename it away and put another in its "
                    f"place; {fix} under directories only you or root can change")
    return None


def ensure(path: str | Path, what: str = "directory", fix: str = "choose a directory of your own") -> Path:
    """Create `path` (and any missing parent) with mode 0700, then check it (`problem`). Returns it resolved;
    raises NotPrivate with the one line, or OSError when it cannot be made."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    found = problem(path, what, fix)
    if found is not None:
        raise NotPrivate(found)
    return Path(os.path.realpath(path))


def open_private(path: str | Path, what: str = "directory", fix: str = "choose a directory of your own") -> int:
    """`ensure` `path`, then open what was checked: the resolved path, one component at a time from /, each opened
    relative to the one above with O_NOFOLLOW and held to the rule (module docstring) by fstat of what was opened.
    So a link swapped in the path after the check, or a component replaced by another directory, is never followed:
    NotPrivate says the path changed while it was checked. Returns an O_DIRECTORY fd (the caller closes it)."""
    real = ensure(path, what, fix)
    me = os.geteuid()
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = real.parts[1:]
        for i, name in enumerate(names):
            try:
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                raise NotPrivate(f"{what} {real} changed while it was checked ({name}: {e.strerror}); {fix}") from None
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            last = i == len(names) - 1
            owner_ok = st.st_uid == me if last else st.st_uid in (me, 0)
            write_ok = not st.st_mode & OTHERS_WRITE or not last and st.st_mode & stat.S_ISVTX
            if not (owner_ok and write_ok):
                raise NotPrivate(f"{what} {real} changed while it was checked ({name} is now uid {st.st_uid}, mode "
                                 f"{stat.S_IMODE(st.st_mode):o}); {fix}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def main(argv: list[str]) -> int:
    """`python -m toolkit.privatedir DIR WHAT FIX`: make DIR if missing and check it; on a problem print its one line
    on stdout and exit 2 (what deploy runs on every host for --ckpt-dir)."""
    if len(argv) != 3:
        print("usage: python -m toolkit.privatedir DIR WHAT FIX", file=sys.stderr)
        return EXIT_NOT_PRIVATE
    try:
        ensure(*argv)
    except NotPrivate as e:
        print(e, flush=True)
        return EXIT_NOT_PRIVATE
    except OSError as e:
        print(f"{argv[1]} {argv[0]} cannot be made: {e.strerror}; {argv[2]}", flush=True)
        return EXIT_NOT_PRIVATE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
