"""The worker's own log lines: one timestamped line on stderr, the worker's log that the agent keeps.

Why not `logging`: the runtime must not depend on how the script configured logging (a script may silence the root
logger, or send it elsewhere), and these lines are what an operator reads after a fault."""

from __future__ import annotations

import sys
from datetime import datetime


def say(node_id: str, message: str) -> None:
    """Write `message` as one line on stderr, stamped with the local time and `node_id`, flushed at once (the
    process may end with os._exit right after)."""
    stamp = datetime.now().strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
    print(f"{stamp} {node_id} toolkit: {message}", file=sys.stderr, flush=True)
