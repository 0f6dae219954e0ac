"""When the agent rewrites agent.json (toolkit.contracts.agentdoc): at once on every change of state, and for progress
alone at most once per PROGRESS_WRITE_INTERVAL (workers may report many steps a second; a reader polling the file needs
at most one version a second). A write for a change of state carries the pending progress with it.

Each write is atomicfile.write with VISIBLE durability: a reader sees the old or the new document, never a mix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from toolkit import atomicfile
from toolkit.agent.timers import Timer, Timers
from toolkit.contracts.agentdoc import AgentDoc

PROGRESS_WRITE_INTERVAL = 1.0  # s: agent.json is rewritten for progress at most this often


class DocWriter:
    """Writes `build()` (the document, a toolkit.contracts.agentdoc.AgentDoc, as its to_json) to `path`, on the loop's
    `timers` and their clock. Loop thread only."""

    def __init__(self, path: Path, timers: Timers, build: Callable[[], AgentDoc],
                 interval: float = PROGRESS_WRITE_INTERVAL) -> None:
        self.path, self.timers, self.build, self.interval = path, timers, build, interval
        self.dirty = False  # progress not written yet
        self.last_write = float("-inf")  # clock time of the latest write
        self._timer: Timer | None = None

    def write(self) -> None:
        """Rewrite the document now (a change of state), with whatever progress is pending. Raises OSError if it
        cannot be written."""
        self.dirty = False
        self.last_write = self.timers.now()
        atomicfile.write(self.path, self.build().to_json())

    def progressed(self) -> None:
        """Progress changed the document: write it once PROGRESS_WRITE_INTERVAL has passed since the latest write
        (at once if it has), unless a write for a change of state carries it first."""
        self.dirty = True
        if self._timer is None:
            self._timer = self.timers.after(self.last_write + self.interval - self.timers.now(), self._flush)

    def _flush(self) -> None:
        """Timer callback of the rate limit: write, unless a write since has already carried the progress."""
        self._timer = None
        if self.dirty:
            self.write()
