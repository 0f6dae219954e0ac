"""A command run as a user types it in a terminal: under a pseudo-terminal that is its controlling terminal, so
that Ctrl-C (the byte 0x03 typed) reaches its process group as SIGINT from the terminal driver, as it does at a
shell prompt, and its output is what a terminal shows (rich's progress lines included).

The command is started through util-linux's `setsid --ctty` (its own session, the pty made its controlling
terminal), with no fork-time Python code in a threaded test process; a reader thread keeps the output."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
import termios
import threading
from pathlib import Path
from typing import Mapping

from toolkit.testing.waits import wait_for

CTRL_C = b"\x03"
READ_SIZE = 65536
COLUMNS = 200  # wide enough that no line of ours wraps; a test that checks a narrow terminal gives its own


class Terminal:
    """One command under a pty. `output` is everything it printed so far (stdout and stderr, as a terminal shows
    them: carriage returns and escape sequences included). Use as a context manager: leaving it kills the command's
    process group if it still runs (a failed test leaves nothing behind)."""

    def __init__(self, argv: list[str], cwd: Path, env: Mapping[str, str] | None = None,
                 columns: int = COLUMNS) -> None:
        primary, secondary = os.openpty()
        os.set_inheritable(secondary, True)
        environ = {**os.environ, **(env or {}), "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm"}
        self._set_size(secondary, columns)
        self.proc = subprocess.Popen(["setsid", "--ctty", *argv], cwd=cwd, env=environ, stdin=secondary,
                                     stdout=secondary, stderr=secondary, close_fds=True)
        os.close(secondary)
        self._primary = primary
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="pty-reader", daemon=True)
        self._reader.start()

    @staticmethod
    def _set_size(fd: int, columns: int) -> None:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._primary, READ_SIZE)
            except OSError:  # EIO: every holder of the secondary side closed it
                return
            if not data:
                return
            with self._lock:
                self._chunks.append(data)

    @property
    def output(self) -> str:
        """What the command printed so far, decoded (bad bytes replaced)."""
        with self._lock:
            return b"".join(self._chunks).decode(errors="replace")

    def wait_for_text(self, text: str, bound: float) -> str:
        """Wait (at most `bound` s) until `text` was printed; returns the output then. AssertionError with the
        output otherwise, or at once if the command exited without printing it."""
        return wait_for(f"{text!r} on the terminal", lambda: self.output if text in self.output else "", bound,
                        evidence=lambda: self.output[-4000:],
                        ended=lambda: None if self.proc.poll() is None or text in self.output
                        else f"exited {self.proc.returncode}")

    def ctrl_c(self) -> None:
        """Type Ctrl-C."""
        os.write(self._primary, CTRL_C)

    def wait(self, bound: float) -> int:
        """The command's exit code, waiting at most `bound` s (subprocess.TimeoutExpired otherwise); its output is
        read to the end first."""
        code = self.proc.wait(timeout=bound)
        self._reader.join(timeout=bound)
        return code

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self._reader.join(timeout=5)
        os.close(self._primary)
