"""The warm spare: an interpreter that has already paid for `import torch` (and for the lazy imports DDP does on
first use, torch._dynamo and sympy, ~1.5-2 s more) and waits for the agent to hand it a dead worker's place.

Rebuilding Python processes is ~94% of torchrun's recovery time here; a spare turns the restart of a worker into
a pipe read and a `runpy` call. The agent starts it as a child of its own (own session, parent-death signal),
passes one end of a socketpair, and on a worker's death sends one JSON line with the worker's argv, environment,
working directory, log file and CPUs. The spare then becomes that worker: same environment, same sys.argv, same
`__main__` semantics as `python script.py` / `python -m module`, and its exit status is the script's. It stays
the agent's child (same pid), so the agent supervises it like any other process.

The spare also pays ahead for the memory its replacement will allocate. A replacement builds its model, receives
the optimizer state and fills new gradient buckets: about 0.9 GB for a 670 MB state, all new pages, and the kernel
faults a new page in at about 0.3 s/GB here, on the recovery's critical path. So, where the C library is glibc, the
spare keeps what it frees (one heap for every thread, no allocation served by its own mapping, no trimming:
`mallopt`), and once its imports are done it faults in as much memory as the largest worker of its host held
privately when the spare was started (`--memory`, counted beyond the spare's own; at most half of the host's
available memory, and at most half of the headroom of its memory cgroup, limit minus usage, where the job runs under
a limit: toolkit.memcgroup; nothing when that half is below MIN_PREFAULT), then frees it into that heap. The
replacement's allocations take those pages without a fault; the policy stays with the process for its life as a
worker (it keeps its peak, as a training process does anyway).

Workers grow after a spare started (their first steps, a replica check's copy): while it waits, the agent tells it so
in a line of its own, `{"memory": BYTES}` (toolkit.agent.warmspare.topup), and the spare faults in the difference, in
FAULT_CHUNK parts, stopping early once the handoff is there. Where torch backs its tensors with huge pages
(THP_MEM_ALLOC_ENABLE=1, which the agent sets unless the job sets it), the heap is faulted in as huge pages too.

While it waits, the spare is the OOM killer's first choice (oom_score_adj OOM_FIRST; its own value again at the
handoff): workers that grow after the spare started must never be the ones killed for the memory it holds.

    python -m toolkit.standby --fd N [--memory BYTES]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import platform
import resource
import runpy
import select
import socket
import sys
from typing import Any, Callable

from toolkit import memcgroup

# Imported before the spare is offered. torch._dynamo is what DistributedDataParallel imports lazily on
# construction (with sympy); without it here a replacement still spends ~1.8 s in its first DDP wrap. toolkit.train
# is what every script that recovers in place imports (~40 ms here, a sixth of such a recovery).
WARM_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "toolkit.train")
TASKS = "/proc/self/task"
READY = b"ready\n"
MAX_SPEC = 4 << 20
AVAILABLE_SHARE = 0.5  # of the host's available memory (and of the cgroup's headroom), at most, faulted in ahead
MIN_PREFAULT = 64 << 20  # bytes: below this much room, nothing is faulted in ahead (a cgroup near its limit)
OOM_SCORE_ADJ = "/proc/self/oom_score_adj"
OOM_FIRST = 1000  # oom_score_adj while waiting: killed before any worker (any process may raise its own)
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NO_TRIM = -1  # M_TRIM_THRESHOLD's value that turns trimming off
HUGE_PAGE = 2 << 20  # bytes: a transparent huge page (x86-64 and arm64 with 4 KiB pages), torch's THP alignment
MADV_HUGEPAGE = 14  # madvise(2)
TORCH_THP = "THP_MEM_ALLOC_ENABLE"  # torch's own switch for huge pages, "1" on (c10/core/alloc_cpu.cpp), as torch
#                                     reads it; the agent sets it (toolkit.contracts.envvars, a floor above this one)
FAULT_CHUNK = 64 << 20  # bytes faulted in between two looks for a handoff (a top-up never delays one by more)
TOPUP = "memory"  # the key of the agent's top-up line: a worker's private memory now (toolkit.agent.warmspare.topup)


class HandoffError(Exception):
    """The agent sent something this spare cannot run."""


def eligible(argv: list[str] | tuple[str, ...], interpreter: str) -> bool:
    """Whether a spare started as `interpreter -m toolkit.standby` can stand in for `argv`: the same
    interpreter, running a script or a module with no interpreter options the spare did not start with."""
    if len(argv) < 2 or argv[0] != interpreter:
        return False
    if argv[1] == "-m":
        return len(argv) >= 3 and not argv[2].startswith("-")
    return not argv[1].startswith("-")


def main(argv: list[str] | None = None) -> int:
    """`python -m toolkit.standby --fd N`: warm up, wait for the handoff, become the worker. Imports WARM_MODULES (a
    module that fails is reported on stderr and skipped), sends READY, then waits for the spec (faulting in more
    heap at each top-up line before it). Returns 0 when dismissed (the agent closed its end) or when the script
    returns; otherwise it ends as the script does (an exception, SystemExit included, propagates). Raises
    HandoffError for a line over MAX_SPEC."""
    ap = argparse.ArgumentParser(prog="python -m toolkit.standby", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fd", type=int, required=True, help="this end of the agent's socketpair")
    ap.add_argument("--memory", type=int, default=0, metavar="BYTES",
                    help="private memory of the largest worker: the heap to fault in ahead (beyond this process's own)")
    args = ap.parse_args(argv)
    link = socket.socket(fileno=args.fd)
    own_adj = _set_oom_score_adj(str(OOM_FIRST))
    libc = _keep_freed_memory()  # before any thread has an arena of its own
    idle = _idle_while_waiting()
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a spare without one module is still worth having
            print(f"standby: could not pre-import {name}: {e}", file=sys.stderr, flush=True)
    heap = Heap(libc, private_bytes("self")) if libc is not None else None
    if heap is not None:
        heap.fault_in(args.memory)
    link.sendall(READY)
    pending = bytearray()
    while True:
        data = _read_line(link, pending)
        if not data:
            link.close()
            return 0  # dismissed: the agent closed its end (or is gone)
        spec = json.loads(data)
        if TOPUP not in spec:
            break
        if heap is not None:  # the workers grew since this spare started: the rest, unless the handoff comes first
            heap.fault_in(int(spec[TOPUP]), lambda: bool(pending) or _readable(link))
    link.close()
    if idle:
        _normal_priority()
    if own_adj is not None:
        _set_oom_score_adj(own_adj)
    become(spec)
    return 0


def _idle_while_waiting() -> bool:
    """The spare imports torch while the workers train: at SCHED_IDLE it only takes CPU they leave. Only where
    the normal policy can be had back at handoff (root, or RLIMIT_NICE allowing nice 0); True if applied."""
    if os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_NICE)[0] < 20:
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    return True


def _normal_priority() -> None:
    """Every thread back to SCHED_OTHER (threads started during the imports inherited SCHED_IDLE)."""
    for tid in os.listdir(TASKS):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            continue


def prefault_size(worker: int, own: int, available: int, headroom: int | None = None,
                  share: float = AVAILABLE_SHARE) -> int:
    """Bytes of heap to fault in ahead: what a worker holds privately (`worker`) beyond what this process already
    does (`own`: the imports), at most `share` of the host's `available` memory and `share` of the memory cgroup's
    `headroom` (limit minus usage; None: no limit), so that a spare never pushes its host or its job's cgroup toward
    the OOM killer; 0 if any figure is unknown (negative) or if the room left is below MIN_PREFAULT."""
    if worker <= 0 or own < 0 or available <= 0:
        return 0
    room = int(available * share) if headroom is None else min(int(available * share), int(headroom * share))
    if room < MIN_PREFAULT:
        return 0
    return max(0, min(worker - own, room))


def _set_oom_score_adj(value: str) -> str | None:
    """Write this process's oom_score_adj; returns the value it had, None if it cannot be read or written."""
    try:
        with open(OOM_SCORE_ADJ, "r+") as f:
            before = f.read().strip()
            f.seek(0)
            f.write(value)
        return before
    except OSError:
        return None


def private_bytes(pid: int | str) -> int:
    """A process's private resident memory (RssAnon of /proc/PID/status; "self" for this one) in bytes; -1 if it
    cannot be read (the process is gone, or /proc says something else)."""
    return _proc_kb(f"/proc/{pid}/status", b"RssAnon")


def available_bytes() -> int:
    """The host's available memory (MemAvailable of /proc/meminfo) in bytes; -1 if unknown."""
    return _proc_kb("/proc/meminfo", b"MemAvailable")


def _proc_kb(path: str, name: bytes) -> int:
    """The `name:  N kB` line of a /proc file, in bytes; -1 if the file or the line cannot be read."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(name + b":"):
                    value, unit = line.split()[1:3]
                    return int(value) * 1024 if unit == b"kB" else -1
    except (OSError, ValueError):
        return -1
    return -1


def _keep_freed_memory() -> ctypes.CDLL | None:
    """Where the C library is glibc: one arena for every thread, no allocation served by a mapping of its own, no
    trimming, so that memory this process frees stays mapped for its next allocations (see the module's docstring).
    Returns the library, or None where it is not glibc or refuses (nothing is then faulted in ahead)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    if not all(libc.mallopt(param, value) == 1
               for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NO_TRIM))):
        print("standby: glibc refused the heap policy; nothing is faulted in ahead", file=sys.stderr, flush=True)
        return None
    return libc


class Heap:
    """This process's heap, faulted in ahead for a worker (glibc's `libc`, under `_keep_freed_memory`'s policy).
    `own`: this process's private memory before any of it (its imports), which a worker's figure is counted beyond.
    `held`: the bytes faulted in so far, which stay in the heap (freed, never trimmed)."""

    def __init__(self, libc: ctypes.CDLL, own: int) -> None:
        self.libc, self.own, self.held = libc, own, 0
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def fault_in(self, worker: int, stop: Callable[[], bool] | None = None) -> None:
        """Hold as much heap as a worker holding `worker` bytes privately needs beyond this process's own (within
        prefault_size's bounds; what is held already counts), and say so on stderr. `stop`: asked between two
        FAULT_CHUNK-sized parts; True ends the work early (a handoff is waiting: what is faulted in stays)."""
        if worker <= 0:
            return
        cgroup = memcgroup.of_process()
        headroom = cgroup.headroom(memcgroup.read_text) if cgroup is not None else None
        size = prefault_size(worker, self.own, available_bytes() + self.held,
                             headroom + self.held if headroom is not None else None)
        if size <= self.held:
            if headroom is not None and not size:
                print(f"standby: nothing faulted in ahead: the memory cgroup has {headroom >> 20} MB left before its "
                      "limit", file=sys.stderr, flush=True)
            return
        block = self.libc.malloc(size)  # the heap's top: what is held already, and more
        if not block:
            print(f"standby: could not allocate {size >> 20} MB to fault in ahead", file=sys.stderr, flush=True)
            return
        if os.environ.get(TORCH_THP) == "1":
            start, end = -(-block // HUGE_PAGE) * HUGE_PAGE, (block + size) // HUGE_PAGE * HUGE_PAGE
            if end > start and self.libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
                print("standby: the kernel refused huge pages for the heap; faulting it in with small ones",
                      file=sys.stderr, flush=True)
        done = 0
        while done < size and not (stop is not None and stop()):
            part = min(FAULT_CHUNK, size - done)
            ctypes.memset(block + done, 0, part)
            done += part
        self.libc.free(block)
        self.held = max(self.held, done)
        print(f"standby: {self.held >> 20} MB of heap faulted in ahead (a worker holds {worker >> 20} MB)"
              + ("; a handoff came first" if done < size else ""), file=sys.stderr, flush=True)


def _readable(link: socket.socket) -> bool:
    return bool(select.select([link], [], [], 0)[0])


def _read_line(link: socket.socket, pending: bytearray) -> bytes:
    """The agent's next line (a top-up or the spec), b"" once it closes its end; what came after the line stays in
    `pending`. Blocks until then; the agent's death closes its end too (and the parent-death signal ends this
    process anyway), so the wait is bounded by the agent's lifetime. HandoffError for a line over MAX_SPEC."""
    while b"\n" not in pending:
        if len(pending) > MAX_SPEC:
            raise HandoffError(f"handoff spec over {MAX_SPEC} bytes")
        chunk = link.recv(65536)
        if not chunk:
            return b""
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    if len(line) > MAX_SPEC:
        raise HandoffError(f"handoff spec over {MAX_SPEC} bytes")
    pending[:] = rest
    return line


def become(spec: dict[str, Any]) -> None:
    """Turn this process into the worker described by `spec` and run it; returns only if the script does. stdout and
    stderr are appended to its log file, stdin is /dev/null, the working directory is `cwd`, the environment is replaced
    by exactly `env`, the CPUs are set, and torch's thread count follows OMP_NUM_THREADS (which torch read at its
    import). The script or module then runs as `__main__`, as `python script.py` or `python -m module` would run it; its
    exceptions propagate."""
    argv = list(spec["argv"])
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(spec["log_file"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(spec["cwd"])
    os.environ.clear()  # this process is the worker now: its environment is the worker's, exactly
    os.environ.update(spec["env"])
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    threads = spec["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))  # read by torch at import; the spare imported early
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    sys.exit(main())
