"""A progress bar for fan-outs, on a terminal only; one line per host as each finishes, everywhere."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from toolkit.launcher.remote.results import HostResult


@contextlib.contextmanager
def rich_progress(
    description: str, total: int, line: Callable[[HostResult[Any]], str | None] | None = None
) -> Iterator[Callable[[HostResult[Any]], None]]:
    """A progress callback for run_on_all that draws a rich progress bar (on stderr) while hosts finish, and
    prints `line(result)` above the bar for each host that finishes (a line per host: what it did, or why not).

    Pass the yielded callback as run_on_all's `progress`: it is safe to call from the fan-out's threads (one lock
    around the bar and the printing). The bar counts finished hosts out of `total` and adds "(N failed)"; it is
    transient (gone when the block ends) and only drawn on a terminal, while the lines (also on stderr) always
    print. `line` returning None or "" prints nothing for that host."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    failures = 0
    console = Console(stderr=True)
    # Not on a terminal (a pipe, a log file, CI) there is no bar to redraw: only the lines.
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        lock = threading.Lock()

        def update(result: HostResult[Any]) -> None:
            nonlocal failures
            with lock:
                failures += 0 if result.ok else 1
                suffix = f" ({failures} failed)" if failures else ""
                bar.update(task, advance=1, description=description + suffix)
                text = line(result) if line is not None else None
                if text:
                    bar.console.print(text, markup=False, highlight=False)

        yield update
