"""What the progress watchdog (toolkit.scheduler.watchdog) needs of a worker: where its training thread is, and its
stacks when it is found stuck.

- `sample(thread)`: whether the thread's Python stack is inside a collective wait now, or in a phase that may
  legitimately take long (a `torch.save` or `torch.load`: a checkpoint of the script's own), sampled by the control
  thread at each heartbeat. A frame anywhere on the stack in torch.distributed (dist.all_reduce, barrier, ...),
  torch.autograd (a backward, where DDP's gradient allreduce is waited for), torch.nn.parallel (DDP's forward, which
  may broadcast buffers) or toolkit's own waits (the fence, the scheduler's word, the rank-ordered allreduce) counts
  as waiting; anything else (the script's own code, a DataLoader, a sleep, a lock, a call into C) does not. A
  heuristic by design, erring on the side of "waiting": a rank seen waiting is never blamed, so a wrong guess can
  miss a hang (a custom autograd function that blocks forever) but not blame a healthy rank. A thread holding its
  GIL cannot be sampled: its heartbeats stop, which the watchdog reads as its own sign.
- `collectives()`: how many collectives the process has entered in its default process group (torch's sequence
  number of the group, which every collective increments when it is issued: a script's `dist.*` calls and DDP's
  gradient allreduces alike, on gloo and NCCL). Sent with each heartbeat, it is the progress the watchdog judges a
  script by when it reports no step: a rank stuck in its own code stays at its count while its peers, waiting for
  it in the next collective, are past it. Read from the control thread, without the training thread's help.
- `dump_on_signal()`: every thread's Python stack to stderr (the worker's log) on protocol.STACKS_SIGNAL, the
  signal the agent sends a stuck worker before it kills it. faulthandler writes in the signal handler itself,
  without the GIL, so a thread stuck in C holding the GIL is dumped too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from types import FrameType
from typing import Any, Iterator

import torch.distributed as dist

from toolkit.contracts import protocol

# Where a training thread waits for its peers (path fragments, '/' separated; matched against each frame's file)
WAIT_PLACES = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/", "/toolkit/train/fence.py",
               "/toolkit/train/channel.py", "/toolkit/train/determinism.py")
# Where a training thread is busy with work of its own that may take much longer than a step (the watchdog blames
# nobody meanwhile): the place, and what the heartbeat's `long` says
LONG_PLACES = (("/torch/serialization.py", "a torch.save or torch.load"),)
MAX_DEPTH = 200  # frames looked at from the innermost (a deeper stack is the script's own recursion)


def sample(thread_id: int | None) -> tuple[bool, str | None]:
    """(whether the thread `thread_id` waits in a collective now, the long phase it is in or None); see the module
    docstring. None is the main thread; a thread that is gone is (False, None). The innermost place found counts."""
    ident = thread_id if thread_id is not None else threading.main_thread().ident
    frame: FrameType | None = sys._current_frames().get(ident or 0)
    depth = 0
    while frame is not None and depth < MAX_DEPTH:
        name = frame.f_code.co_filename
        if os.sep != "/":
            name = name.replace(os.sep, "/")
        for place, what in LONG_PLACES:
            if place in name:
                return False, what
        if any(place in name for place in WAIT_PLACES):
            return True, None
        frame, depth = frame.f_back, depth + 1
    return False, None


def collectives() -> int | None:
    """The number of collectives this process entered in its default process group (see the module docstring), or
    None when it has none (not formed yet, destroyed) or this torch cannot say."""
    try:
        if not dist.is_initialized():
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a group being torn down, a backend without a count: the count is unknown
        return None


def dump_on_signal() -> None:
    """Have faulthandler write every thread's Python stack to stderr (fd 2: the worker's log) on
    protocol.STACKS_SIGNAL. A script that installs its own handler for that signal replaces this one."""
    faulthandler.register(protocol.STACKS_SIGNAL, file=2, all_threads=True, chain=False)


@contextlib.contextmanager
def long_phase(channel: Any, what: str) -> Iterator[None]:
    """While in the block, `channel`'s heartbeats (a toolkit.train.channel.Channel; None: no scheduler, nothing to
    do) say the training thread is in a legitimately long phase `what` (toolkit.train.progress.long_phase)."""
    if channel is None:
        yield
        return
    before, channel.long = channel.long, what
    try:
        yield
    finally:
        channel.long = before
