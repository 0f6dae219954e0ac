"""Process ownership: every process toolkit starts is the leader of its own session and process group, dies
with its parent (PR_SET_PDEATHSIG), and is waited on through a pidfd, so its death is an event in a selector
rather than something found by polling. Stopping is always the same three steps: SIGTERM to the group, a
bounded wait, SIGKILL to the group. Processes are only ever found by the pid/pgid we recorded, never by name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping, Sequence

PR_SET_PDEATHSIG = 1

# Sources the env file with `set -a` so that every assignment is exported, then execs the real program, which
# keeps this pid (and the parent-death signal set before exec). Reading the file at each start is what makes
# an operator's edit apply at the next restart. A missing file must not start the program without its env.
ENV_SHIM = 'set -a; . "$1" || exit 125; set +a; shift; exec "$@"'
ENV_SHIM_NAME = "toolkit-env"

# Signals whose Python handlers (the agent's) must not run in a child between fork and exec: they would write
# into the parent's wakeup fd and the agent would think it was signalled itself.
_PARENT_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD)


def env_argv(env_file: str, argv: Sequence[str]) -> list[str]:
    """argv that runs `argv` with `env_file` applied on top of the given environment."""
    return ["bash", "-c", ENV_SHIM, ENV_SHIM_NAME, env_file, *argv]


def resolve_env(env_file: str, base: Mapping[str, str], cwd: str, timeout: float = 10.0) -> dict[str, str]:
    """The environment a program started through env_argv would see, for a process that is not exec'd (the
    warm spare): the same shell reads the same file, so both paths agree on quoting and expansion."""
    script = 'set -a; . "$1" || exit 125; set +a; exec env -0'
    out = subprocess.run(
        ["bash", "-c", script, ENV_SHIM_NAME, env_file],  # noqa: S607 - the same bash env_argv runs, from PATH
        env=dict(base), cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False,
    )
    if out.returncode != 0:
        err = out.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(f"{env_file}: cannot be read by bash ({err[-1] if err else f'exit code {out.returncode}'})")
    env = {}
    for item in out.stdout.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[name.decode(errors="surrogateescape")] = value.decode(errors="surrogateescape")
    env.pop("_", None)
    return env


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: an exit code, or the signal that killed it."""

    code: int | None
    signal: int | None

    @classmethod
    def from_returncode(cls, returncode: int) -> "ExitStatus":
        """From a Popen returncode: a negative one is the signal that killed it."""
        return cls(None, -returncode) if returncode < 0 else cls(returncode, None)

    @property
    def ok(self) -> bool:
        """Exited with code 0; a death by signal is never ok."""
        return self.code == 0

    @property
    def signal_name(self) -> str | None:
        """The signal's name ("SIGKILL"), or "signal N" for a number without one; None when the process exited."""
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def describe(self) -> str:
        """How it ended, for logs and reasons: "exit code N" or "killed by SIGNAME"."""
        return f"exit code {self.code}" if self.signal is None else f"killed by {self.signal_name}"

    def as_dict(self) -> dict[str, object]:
        """{"code", "signal"} (the signal by name), as agent.json and the `exited` report carry them."""
        return {"code": self.code, "signal": self.signal_name}


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a child needs; `env` is its complete environment (the parent's own is never changed)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(hash=False)
    cwd: str
    log_file: str | None = None  # stdout and stderr, appended; None: /dev/null
    cpus: frozenset[int] | None = None
    pass_fds: tuple[int, ...] = ()
    marker: str | None = None  # a line appended to the log before the child starts


class Child:
    """A process we started and own until it is reaped. `fileno()` is its pidfd: readable once it exited. Made by
    `spawn` only. Until `reap`, its zombie pins the pid and the group id, so signalling the group cannot reach someone
    else's processes; not thread-safe."""

    def __init__(self, popen: subprocess.Popen, pidfd: int, argv: Sequence[str]) -> None:
        self._popen = popen
        self._pidfd = pidfd
        self.argv = tuple(argv)
        self.pid = popen.pid
        self.pgid = popen.pid  # session leader of its own session
        self.started_mono = time.monotonic()
        self.started_wall = time.time()
        self.start_ticks = start_ticks(self.pid)
        self.status: ExitStatus | None = None

    def fileno(self) -> int:
        """The pidfd (-1 once reaped), so that a Child can be registered in a selector."""
        return self._pidfd

    @property
    def alive(self) -> bool:
        """Not reaped yet: a child that exited but was not reaped is still `alive`."""
        return self.status is None

    def signal_group(self, sig: int) -> bool:
        """Signal the whole group. Safe from pid reuse: until we reap the leader its pid and pgid stay ours."""
        if self.status is not None:
            return False
        try:
            os.killpg(self.pgid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            # the leader is a zombie and every other member is gone
            return False

    def signal_leader(self, sig: int) -> bool:
        """Signal the leader alone (through its pidfd: never someone else's process), not the rest of its group: a
        training process is asked to stop while its helpers (DataLoader workers) keep serving its last steps; the
        group goes when the leader is reaped (`reap`) or with SIGKILL after the grace period."""
        if self.status is not None:
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
            return True
        except ProcessLookupError:
            return False

    def reap(self) -> ExitStatus | None:
        """Collect the exit status if the leader has exited; SIGKILL what is left of its group first, while the
        zombie leader still pins the group id (a dead worker's helpers must not run on unsupervised)."""
        if self.status is not None:
            return self.status
        try:
            info = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = True  # reaped elsewhere: let Popen report what it knows
        if info is None:
            return None
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        returncode = self._popen.poll()
        if returncode is None:  # cannot happen after WNOWAIT said it exited; stay consistent
            returncode = self._popen.wait(timeout=5)
        self.status = ExitStatus.from_returncode(returncode)
        os.close(self._pidfd)
        self._pidfd = -1
        return self.status

    def wait(self, timeout: float) -> ExitStatus | None:
        """Bounded wait for the exit, on the pidfd: returns the status (see `reap`), or None if it still runs after
        `timeout` s; it is not signalled."""
        if self.status is None:
            with selectors.DefaultSelector() as sel:
                sel.register(self._pidfd, selectors.EVENT_READ)
                sel.select(max(0.0, timeout))
        return self.reap()

    def __repr__(self) -> str:
        return f"Child(pid={self.pid}, status={self.status})"


def spawn(spec: LaunchSpec) -> Child:
    """Start `spec` as the leader of a new session whose parent-death signal is SIGKILL.

    Call it from the main thread only: the parent-death signal fires when the thread that forked exits.

    The log file (None: /dev/null) is opened for appending (0600) and `marker` written to it before the start; stdin is
    /dev/null. The signals the agent handles are blocked across the fork and reset to their defaults in the child, so
    the child never writes into the agent's wakeup fd; a child whose parent died before the death signal was armed kills
    itself. Raises OSError or SubprocessError when the log cannot be opened or the program cannot be executed. Run
    through env_argv the program is bash, so a missing program shows as exit code 127 and an unreadable env file as 125,
    not as an exception."""
    log_fd = -1
    if spec.log_file is not None:
        log_fd = os.open(spec.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if spec.marker:
            os.write(log_fd, (spec.marker.rstrip("\n") + "\n").encode(errors="replace"))
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    cpus = spec.cpus
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _PARENT_HANDLED)

    def child_setup() -> None:  # runs in the child between fork and exec
        for sig in _PARENT_HANDLED:
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the death signal was armed
            os.kill(os.getpid(), signal.SIGKILL)
        if cpus:
            os.sched_setaffinity(0, cpus)

    try:
        popen = subprocess.Popen(
            list(spec.argv),
            env=dict(spec.env),
            cwd=spec.cwd,
            stdin=subprocess.DEVNULL,
            stdout=log_fd if log_fd >= 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=spec.pass_fds,
            preexec_fn=child_setup,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if log_fd >= 0:
            os.close(log_fd)
    return Child(popen, os.pidfd_open(popen.pid), spec.argv)


def stop_all(children: Iterable[Child], grace: float,
             on_kill: Callable[[Child], None] | None = None, leaders: Collection[int] = ()) -> dict[int, ExitStatus]:
    """SIGTERM every child's group (only the leader for the pids in `leaders`: Child.signal_leader), wait up to
    `grace` seconds for all of them, SIGKILL the groups still there, reap. Returns the exit status by pid.
    `on_kill(child)` is told of each child that needed SIGKILL. Bounded by about `grace` plus KILL_WAIT; a child
    still not gone after that (stuck in the kernel) is missing from the result."""
    live = [c for c in children if c.alive]
    for c in live:
        if c.pid in leaders:
            c.signal_leader(signal.SIGTERM)
        else:
            c.signal_group(signal.SIGTERM)
    _wait_exits(live, grace)
    for c in live:
        if c.reap() is None:
            if on_kill is not None:
                on_kill(c)
            c.signal_group(signal.SIGKILL)
    _wait_exits(live, KILL_WAIT)
    out = {}
    for c in live:
        status = c.reap()
        if status is not None:
            out[c.pid] = status
    return out


KILL_WAIT = 10.0  # seconds for SIGKILLed processes to be gone; longer means the kernel is stuck (D state)


def _wait_exits(children: Sequence[Child], timeout: float) -> None:
    """Wait until every child has exited and is reaped, or `timeout` s have passed."""
    deadline = time.monotonic() + timeout
    pending = [c for c in children if c.reap() is None]
    if not pending:
        return
    with selectors.DefaultSelector() as sel:
        for c in pending:
            sel.register(c.fileno(), selectors.EVENT_READ, c)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for key, _ in sel.select(left):
                child = key.data
                if child.reap() is not None:
                    sel.unregister(key.fileobj)
                    pending.remove(child)


# --- facts about any process, from /proc -------------------------------------------------------------------


@dataclass(frozen=True)
class ProcInfo:
    """One process as /proc/<pid>/stat shows it: state letter, parent, process group, session, and start time in clock
    ticks since boot."""

    pid: int
    state: str
    ppid: int
    pgid: int
    sid: int
    start_ticks: int


def proc_info(pid: int) -> ProcInfo | None:
    """`pid`'s /proc/<pid>/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name may hold spaces and parentheses: the fields start after the last ')'
    fields = data[data.rindex(b")") + 2:].split()
    return ProcInfo(pid, fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def start_ticks(pid: int) -> int | None:
    """Start time in clock ticks since boot: with the pid, it names one process for good (pids are reused)."""
    info = proc_info(pid)
    return info.start_ticks if info else None


def is_running(pid: int, ticks: int | None = None) -> bool:
    """The process exists, is not a zombie, and (given `ticks`) is the same one that was recorded."""
    info = proc_info(pid)
    return info is not None and info.state not in ("Z", "X") and (ticks is None or info.start_ticks == ticks)


def group_members(pgid: int) -> list[ProcInfo]:
    """Live (non-zombie) processes of the process group `pgid`."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = proc_info(int(name))
            if info is not None and info.pgid == pgid and info.state not in ("Z", "X"):
                out.append(info)
    return out


def owned_group_members(pgid: int, leader_ticks: int | None) -> list[ProcInfo]:
    """Live processes of a group we once led (recorded as pgid + the leader's start ticks): members of that
    group and session that started no earlier than the leader, unless the number now belongs to another
    process, so a reused pid never leads us to someone else's processes."""
    leader = proc_info(pgid)
    if leader is not None and leader_ticks is not None and leader.start_ticks != leader_ticks:
        return []
    return [info for info in group_members(pgid)
            if info.sid == pgid and (leader_ticks is None or info.start_ticks >= leader_ticks)]


def reclaim_group(pgid: int, leader_ticks: int | None) -> list[int]:
    """SIGKILL what is left of a group we once led (e.g. after our agent was SIGKILLed: the leader died of its
    parent-death signal, its own children did not). Returns the pids signalled."""
    killed = []
    for info in owned_group_members(pgid, leader_ticks):
        if kill_quietly(info.pid, signal.SIGKILL):
            killed.append(info.pid)
    return killed


def wait_gone(pid: int, ticks: int | None, timeout: float) -> bool:
    """Bounded wait for a process that is not our child to end (a pidfd works for any process)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if not is_running(pid, ticks):
            return True
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return not is_running(pid, ticks)
                if sel.select(left):
                    return True
    finally:
        os.close(fd)


def kill_quietly(pid: int, sig: int) -> bool:
    """Send `sig` to `pid`; True if sent, False if the process is gone or is not ours to signal (EPERM). Other OSErrors
    raise. By pid alone: the caller must have checked that the pid still names the process it means (start ticks, see
    is_running)."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except OSError as e:
        if e.errno == errno.EPERM:
            return False
        raise


def raise_open_files() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it); returns (before, after).

    The scheduler holds two connections per worker and the agent's workers hold one descriptor per gloo connection
    (some of them strangers'); the soft limit is often 1024 where the hard one is far higher."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft, soft
    return soft, max(soft, hard)
