"""A worker whose open files climb: what a stranger who keeps connecting to its gloo port looks like.

gloo accepts every TCP connection to a worker's port and keeps a descriptor for each one that never completes its
handshake, for good; at the process's limit gloo aborts ("accept: Too many open files", SIGABRT). toolkit cannot
change gloo, so the agent raises its workers' soft limit to the hard one (procs.raise_open_files), samples each
worker's count every SAMPLE_INTERVAL (`count`), and judges the trend here (`Trend`, pure): a count that doubles from
its low since the worker joined its group (and by CLIMB_MIN at least) is named in the agent's log, in agent.json, and
in the cause of the worker's death if it dies (docs/security.md, "Gloo's port")."""

from __future__ import annotations

import os

SAMPLE_INTERVAL = 10.0  # s between two counts of a worker's open files (nothing tells when they change)
CLIMB_MIN = 256  # a count this far above its low (and at least twice it) is climbing


def count(pid: int) -> int | None:
    """How many descriptors process `pid` holds (its /proc fd directory), or None if it cannot be read (gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class Trend:
    """The open-file counts of one incarnation of a worker. Pure: `sample` takes each count and says when to warn.

    Counts move while a worker builds its group, so the low is taken from the samples after it joined (`trained`).
    The first warning comes when a count reaches twice the low and CLIMB_MIN above it; each later one when the count
    has doubled again since the last warning, so a steady climb costs a handful of lines."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.low: int | None = None
        self.last: int | None = None
        self.warned = 0  # the count at the last warning (0: none yet)

    def sample(self, n: int, trained: bool) -> str | None:
        """Take count `n`; a warning's text when it passes the next alarm level, else None."""
        self.last = n
        if not trained:
            return None
        if self.low is None or n < self.low:
            self.low = n
        level = 2 * self.warned if self.warned else max(2 * self.low, self.low + CLIMB_MIN)
        if n < level:
            return None
        self.warned = n
        return (f"holds {n} open files, up from {self.low} once it had joined its group (limit {self.limit}): "
                "connections that never close, e.g. to its gloo port from outside the job? (docs/security.md, "
                "'Gloo's port')")

    @property
    def climbing(self) -> bool:
        """Whether it has been warned of."""
        return self.warned > 0

    def cause(self) -> str:
        """What to add to the cause of its death when it was climbing ("" when not)."""
        if not self.climbing:
            return ""
        return (f"; its open files had climbed from {self.low} to {self.last} (limit {self.limit}): connections "
                "to its gloo port from outside the job? (docs/security.md, 'Gloo's port')")

    def document(self) -> dict[str, int | bool | None]:
        """Its entry in agent.json's process document."""
        return {"count": self.last, "low": self.low, "limit": self.limit, "climbing": self.climbing}
