"""Run a training script with the scheduler's word of a new generation held back until the worker asks for it.

usage: late_word.py SCRIPT [ARGS...]   (as the script a toolkit worker runs, or after the wrapper's own main)

The order this forces is the one a loaded host produces at random: a peer dies, the survivor's collective fails
(its connections reset), and only then does the scheduler's `generation` message reach the survivor. Here the
survivor's control thread holds that message until the worker waits for the scheduler's word (Channel.wait_change,
what a worker does once a collective failed), at most HOLD seconds. A worker that never asks (it takes the failure
for its own) never hears it in time. Each hold is said on stderr.
"""

from __future__ import annotations

import runpy
import sys
import threading
from typing import Any

from toolkit.contracts import protocol as P
from toolkit.train.channel import Channel

HOLD = 120.0  # s at most a `generation` message is held back

asked = threading.Event()
handle, wait_change = Channel._handle, Channel.wait_change


def late(self: Channel, msg: dict[str, Any]) -> None:
    if msg["op"] == P.GENERATION and self.view.held is not None:
        held = not asked.is_set()
        asked.wait(HOLD)
        print(f"late_word: the scheduler's word of generation {msg['generation']} reaches the worker "
              f"({'held back until it asked' if held else 'it had asked already'})", file=sys.stderr, flush=True)
    handle(self, msg)


def asking(self: Channel, current: int | None, bound: float) -> int | None:
    if not asked.is_set():
        print("late_word: the worker asks for the scheduler's word", file=sys.stderr, flush=True)
        asked.set()
    return wait_change(self, current, bound)


Channel._handle = late
Channel.wait_change = asking
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
