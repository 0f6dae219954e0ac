"""What the tasks print: tables on stdout (as wide as they need off a terminal), notes on stderr, and small formats."""

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
    stamp = time.strftime("%H:%M:%S")
    sys.stdout.write(f"{stamp} {text}\n")
    sys.stdout.flush()


def table_console() -> Console:
    """A terminal's width on a terminal; elsewhere (a pipe, a file, a test) the table's own width, so that
    no host name or state is cut short to fit 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=1000)


def say(text: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(text, markup=False)


def dash(value: Any) -> str:
    return "-" if value is None else str(value)


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def human_size(n: int) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n:.1f} GB"


def relative(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)
@contextlib.contextmanager
def interrupt_sets(event: threading.Event) -> Iterator[None]:
    """Ctrl-C (SIGINT) sets `event` instead of raising in the middle of a fan-out, so every thread can end its
    remote command cleanly. Only the main thread can install a handler; elsewhere the event is all there is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
