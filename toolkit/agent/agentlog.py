"""The agent's own log (logs/agent.log, lines `time host:who: message`) and the reading of its children's logs."""

from __future__ import annotations

import os
import time
from pathlib import Path

LOG_TAIL_LINES = 20
TAIL_WINDOW = 64 << 10  # bytes read from a log's end for its last lines (logs grow without bound)


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of a log, read from its end (logs grow without bound). Reads at most TAIL_WINDOW bytes, so a very
    long last line comes back cut; never raises: a missing or unreadable log gives []."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_WINDOW))
            data = f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]


def iso(t: float | None) -> str | None:
    """`t` (a time.time() value) in UTC ISO 8601 with milliseconds, e.g. "2024-05-01T12:00:00.123Z"; None stays None."""
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


class AgentLog:
    """Lines `time host:who: message` appended to logs/agent.log, and to stderr when that is somewhere else. The
    constructor makes the directory (0700) and opens the file (0600, append). stderr is mirrored when the agent runs in
    the foreground; a detached agent's stderr is agent.log itself, so it is not."""

    def __init__(self, path: Path, host: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.host = host
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        mine = os.fstat(self._fd)
        try:
            err = os.fstat(2)
            self._mirror = (err.st_dev, err.st_ino) != (mine.st_dev, mine.st_ino)
        except OSError:
            self._mirror = False

    def __call__(self, who: str, message: str) -> None:
        """Append `message` under `who` (a node id or "agent"): every line of it prefixed with the time and the host,
        all in one write. An error writing agent.log raises OSError; one writing the stderr mirror ends the mirror."""
        stamp = iso(time.time())
        text = "".join(f"{stamp} {self.host}:{who}: {line}\n" for line in message.splitlines() or [""])
        data = text.encode(errors="replace")
        os.write(self._fd, data)
        if self._mirror:
            try:
                os.write(2, data)
            except OSError:
                self._mirror = False

    def close(self) -> None:
        """Close agent.log; the log must not be called afterwards."""
        os.close(self._fd)
