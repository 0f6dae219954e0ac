"""The memory cgroup a process runs in (v1 or v2): how much more it may charge before the kernel's OOM killer acts,
and how many OOM kills it has seen.

Why: a job under a memory limit (a batch system's allocation, a container) is killed at its cgroup's limit however
much memory the host has free. So what the warm spare may fault in ahead (toolkit.standby) is bounded by the
cgroup's headroom, not only by the host's MemAvailable, and a worker killed by SIGKILL is named an OOM kill when the
cgroup's own counter says so (toolkit.agent.causes).

The cgroup is found the way the kernel states it: /proc/<pid>/cgroup names the path in each hierarchy, and
/proc/<pid>/mountinfo where that hierarchy is mounted (and which of its directories is the mount's root, as in a
container). Every level from the process's cgroup up to the mount counts: the tightest limit wins. Pure over the
texts of those two files and a file reader, so tests run it over a fake tree; `of_process` reads the real one.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

UNLIMITED_V1 = 1 << 62  # cgroup v1 says "no limit" with a number near 2^63 rounded to pages
V2, V1 = "v2", "v1"
LIMIT_FILE = {V2: "memory.max", V1: "memory.limit_in_bytes"}
USAGE_FILE = {V2: "memory.current", V1: "memory.usage_in_bytes"}
OOM_FILE = {V2: "memory.events", V1: "memory.oom_control"}  # both carry an `oom_kill N` line (v1: Linux 4.13+)

Reader = Callable[[str], str | None]  # the text of a file, None if it cannot be read


@dataclass(frozen=True)
class MemCgroup:
    """The directories of a process's memory cgroup, its own first, up to the hierarchy's mount; `version` V1 or V2."""

    version: str
    dirs: tuple[str, ...]

    def headroom(self, read: Reader) -> int | None:
        """Bytes the cgroup may still charge before its tightest limit (limit minus usage at each limited level, the
        least of them; never below 0), None when no level has a limit or none can be read."""
        room = None
        for d in self.dirs:
            limit = _number(read(posixpath.join(d, LIMIT_FILE[self.version])))
            usage = _number(read(posixpath.join(d, USAGE_FILE[self.version])))
            if limit is None or usage is None or limit >= UNLIMITED_V1:
                continue
            room = max(0, limit - usage) if room is None else min(room, max(0, limit - usage))
        return room

    def limit(self, read: Reader) -> int | None:
        """The tightest limit of its levels in bytes, None if none."""
        limits = [n for d in self.dirs if (n := _number(read(posixpath.join(d, LIMIT_FILE[self.version])))) is not None
                  and n < UNLIMITED_V1]
        return min(limits, default=None)

    def oom_kills(self, read: Reader) -> int | None:
        """The `oom_kill` count of the process's own cgroup (the kernel's verdict: processes it killed for want of
        memory there), None if the kernel does not say."""
        text = read(posixpath.join(self.dirs[0], OOM_FILE[self.version])) if self.dirs else None
        for line in (text or "").splitlines():
            words = line.split()
            if len(words) == 2 and words[0] == "oom_kill" and words[1].isdigit():
                return int(words[1])
        return None


def find(cgroup_text: str, mountinfo_text: str) -> MemCgroup | None:
    """The memory cgroup named by a /proc/<pid>/cgroup text, located through a /proc/<pid>/mountinfo text: the v1
    `memory` controller's hierarchy if it is mounted, else the v2 unified one; None if neither is found."""
    paths: dict[str, str] = {}
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths.setdefault(V2, path)
        elif "memory" in controllers.split(","):
            paths[V1] = path
    mounts = _mounts(mountinfo_text)
    for version in (V1, V2):
        if version in paths and version in mounts:
            root, point = mounts[version]
            rel = posixpath.relpath(paths[version], root) if paths[version].startswith(root) else None
            if rel is None or rel.startswith(".."):
                continue  # the process's cgroup is outside what is mounted here
            dirs = []
            here = posixpath.normpath(posixpath.join(point, rel))
            while True:
                dirs.append(here)
                if here == point or len(here) <= len(point):
                    break
                here = posixpath.dirname(here)
            return MemCgroup(version, tuple(dirs))
    return None


def _mounts(mountinfo_text: str) -> dict[str, tuple[str, str]]:
    """{version: (root within the hierarchy, mount point)} of the memory hierarchies in a mountinfo text."""
    out: dict[str, tuple[str, str]] = {}
    for line in mountinfo_text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3], fields[4]
        if tail[0] == "cgroup2":
            out.setdefault(V2, (root, point))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            out[V1] = (root, point)
    return out


def _number(text: str | None) -> int | None:
    """A limit or usage file's number; None for "max" (v2's no limit) or anything else."""
    word = (text or "").strip()
    return int(word) if word.isdigit() else None


def read_text(path: str) -> str | None:
    """The text of a small kernel file, None if it cannot be read."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def of_process(pid: int | str = "self") -> MemCgroup | None:
    """The memory cgroup of process `pid` on this machine, None if it cannot be told."""
    cgroup, mountinfo = read_text(f"/proc/{pid}/cgroup"), read_text(f"/proc/{pid}/mountinfo")
    return find(cgroup, mountinfo) if cgroup is not None and mountinfo is not None else None
