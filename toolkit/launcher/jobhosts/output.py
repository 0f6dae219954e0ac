"""What the tasks print: tables on stdout (as wide as they need off a terminal), notes on stderr, and small formats.

stdout carries what a script may parse (tables, JSON, log lines, --join's event lines); stderr the notes and
progress meant for a person."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console


def emit(text: str) -> None:
    """One event line on stdout, stamped with the local time (HH:MM:SS) and flushed at once (`train --join`)."""
    stamp = time.strftime("%H:%M:%S")
    sys.stdout.write(f"{stamp} {text}\n")
    sys.stdout.flush()


def table_console() -> Console:
    """A terminal's width on a terminal; elsewhere (a pipe, a file, a test) the table's own width, so that
    no host name or state is cut short to fit 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=1000)


def say(text: str) -> None:
    """A note for the user on stderr, printed as is (no rich markup or highlighting: host names and paths may
    hold brackets); long lines wrap softly instead of being cut."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(text, markup=False)


def dash(value: Any) -> str:
    """"-" for None (no rank, no pid), else the value as text."""
    return "-" if value is None else str(value)


def human_age(seconds: float | None) -> str:
    """An age in whole seconds, minutes, or hours to a tenth ("42s", "7m", "1.5h"); "-" for None."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def human_size(n: int) -> str:
    """A byte count in decimal units ("512 B", "1.4 MB", "2.0 GB")."""
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n:.1f} GB"


def relative(path: Path) -> str:
    """`path` relative to the current directory if it is under it (shorter to read), else as given."""
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


@contextlib.contextmanager
def interrupt_sets(*events: threading.Event) -> Iterator[None]:
    """Ctrl-C (SIGINT) sets `events` instead of raising in the middle of a fan-out, so every thread can end its
    remote command cleanly. Only the main thread can install a handler; elsewhere the events are all there is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: [e.set() for e in events])
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
