"""The worker's own lines: the Trainer's ("rank 0: resumed from step 19 ...") on stdout and the runtime's
timestamped ones on stderr, both in the worker's log that the agent keeps.

Why not `logging`: the runtime must not depend on how the script configured logging (a script may silence the root
logger, or send it elsewhere), and these lines are what an operator reads after a fault.

Why one write per line: stdout and stderr are the same log file, written by the training thread and the control
thread at once. `print` writes the text and its newline in two calls, which with unbuffered streams
(PYTHONUNBUFFERED=1, common in containers and set on this project's machines) are two writes: another thread's line
then lands between them ("...2 connection(s) shut down)rank 0: stopped by SIGTERM at step 19, checkpoint saved" and
an empty line), and a reader looking for a line (an operator's grep, the tests) misses it. One write of a whole line
to a file opened for appending lands whole."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import TextIO


def line(text: str, stream: TextIO | None = None) -> None:
    """Write `text` and its newline to `stream` (default stdout) in one write, flushed at once (the process may end
    with os._exit right after)."""
    out = sys.stdout if stream is None else stream
    out.write(text + "\n")
    out.flush()


def say(node_id: str, message: str) -> None:
    """Write `message` as one line on stderr, stamped with the local time and `node_id`."""
    stamp = datetime.now().strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
    line(f"{stamp} {node_id} toolkit: {message}", sys.stderr)


def whole_lines() -> None:
    """Have the training script's prints land as whole lines: unbuffered standard streams (PYTHONUNBUFFERED=1, `-u`)
    are switched to line buffering, which writes each line, text and newline, in one write as soon as it ends. Output
    still appears line by line; only text without a newline waits for one (or for a flush, as `print(...,
    flush=True)` and progress bars do)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a script's replacement stream may have none
        if getattr(stream, "write_through", False) and callable(reconfigure):
            reconfigure(write_through=False, line_buffering=True)
