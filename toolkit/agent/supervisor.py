"""The per-host supervisor: it starts this host's processes (the scheduler if it lives here, and the workers)
from host.json, each in its own session with its env file and log file, and keeps them alive. A child's death is an
event on its pidfd, reported to the scheduler at once (so the others recover without waiting for a heartbeat to
expire) and followed by what toolkit.agent.policy decides: a relaunch with the same environment and rank (from the
warm spare when one is ready; one still importing is held while a worker restarts cold: warmspare.py), a backoff,
or giving up. One thread, one selector loop: children's pidfds, the control socket, the progress socket, the
scheduler link, signals (through the wakeup fd) and timers.

This module applies decisions and does the I/O; what to do is decided in policy.py. agent.json (toolkit.agentdoc)
is rewritten atomically on every change of state and at most once per PROGRESS_WRITE_INTERVAL for progress.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

from toolkit import agentdoc, atomicfile, netif, procs, standby, stepfile
from toolkit import envvars as E
from toolkit import protocol as P
from toolkit.agent import causes, openfiles, policy, warmspare
from toolkit.agent.link import SchedulerLink
from toolkit.agent.log import AgentLog, iso, log_tail
from toolkit.agent.timers import Timer, Timers
from toolkit.agentdoc import AgentDoc, ControlOp, ExitRecord, Failure, ProcDoc, Takeover, recorded_groups
from toolkit.errors import UserError
from toolkit.hostspec import HostSpec, ProcSpec, RestartPolicy
from toolkit.procs import Child, ExitStatus, LaunchSpec

REPORT_FLUSH_TIMEOUT = 3.0  # s to deliver the last reports (gave_up) before exiting
PROGRESS_WRITE_INTERVAL = 1.0  # s: agent.json is rewritten for progress at most this often
SPARE_DELAY = 10.0  # s after a launch before the warm spare is (re)built, unless every worker already made progress
SPARE_MAX_FAILURES = 3  # spares that die on their own before the agent stops making them
IDLE_WAKE = 30.0  # s: the loop wakes at least this often (nothing depends on it; it bounds every select)
CLIENT_TIMEOUT = 5.0  # s for one control-socket conversation, either side
MAX_CONTROL_LINE = 64 << 10  # bytes of one control request; a longer one is answered as not a JSON object line
MAX_CONTROL_CLIENTS = 16  # control connections open at once (the socket is the operator's own: 0600)
GAVE_UP_TAIL_BYTES = 8 << 10  # of the log tail sent with gave_up (a message is at most protocol.MAX_LINE)
EXIT_HISTORY = 10  # exits (and pids) kept per process for agent.json

EXIT_OK = 0
EXIT_FAILED = 1  # a process passed max_restarts here, or the scheduler stopped the job
EXIT_USAGE = 2  # bad host.json or command line (UserError)
EXIT_STOPPED = 3  # stopped by the operator (SIGTERM, stop)


def cpu_sets(cpus: set[int] | frozenset[int], n: int, host: str = "this host") -> list[frozenset[int]]:
    """`n` disjoint CPU sets of equal size from `cpus`, in order (msrun's --bind_core: each worker its own). Pure. The
    CPUs left over by the division go to no worker; `n` 0 gives no sets. Raises UserError, naming `host`, when there are
    fewer CPUs than workers."""
    if n == 0:
        return []
    ordered = sorted(cpus)
    if len(ordered) < n:
        raise UserError(f"{host}: bind_core needs one CPU per worker, but {n} workers share {len(ordered)} usable "
                        f"CPUs ({','.join(map(str, ordered))}); run fewer workers there or turn bind_core off")
    size = len(ordered) // n
    return [frozenset(ordered[i * size:(i + 1) * size]) for i in range(n)]


def running(slots: Iterable[Slot]) -> dict[str, int]:
    """node_id -> pid of every child alive and not stopped (/proc state other than T, t, Z, X): what the agent vouches
    for in its heartbeats. A worker busy in a call that holds its GIL sends no heartbeat of its own, but it runs: the
    scheduler does not take it for a hung one. A SIGSTOPped one is left out, so its silence stays a death."""
    out = {}
    for slot in slots:
        child = slot.child
        info = procs.proc_info(child.pid) if child is not None else None
        if child is not None and info is not None and info.state not in ("T", "t", "Z", "X"):
            out[slot.spec.node_id] = child.pid
    return out


# --- runtime state of one process


class Slot:
    """What the agent knows of one process across its incarnations.

    `child` is the running incarnation (None between incarnations). `launches` counts every start (its restarts are
    `launches - 1`, and the value before a start is that start's TORCHELASTIC_RESTART_COUNT); `counted` counts only the
    restarts charged against max_restarts, as policy.on_exit decides. `state` is pending, running, backoff (a relaunch
    timer is armed), restarting (the operator's restart: SIGTERM sent), succeeded, failed or stopped. `progressed` (a
    step or the group joined since the latest launch) spares the next relaunch its backoff. Read and written by the
    Agent's loop thread only."""

    def __init__(self, spec: ProcSpec, cpus: frozenset[int] | None, step_file: Path | None = None) -> None:
        self.spec = spec
        self.cpus = cpus
        self.step_file = step_file if spec.is_worker else None  # toolkit.stepfile: the step of a death, exactly
        self.child: Child | None = None
        self.state = "pending"  # running, backoff, restarting, succeeded, failed, stopped
        self.launches = 0
        self.counted = 0
        self.started_mono = 0.0
        self.started_wall: float | None = None
        self.warm = False
        self.last_exit: ExitRecord | None = None
        self.exits: list[ExitRecord] = []
        self.step: int | None = None
        self.epoch: int | None = None
        self.step_at: float | None = None
        self.progressed = False  # progress reported since the latest launch
        self.timer: Timer | None = None
        self.next_start: float | None = None
        self.manual = False  # the operator asked for a restart: the coming death is expected and not counted
        self.kill_timer: Timer | None = None
        self.pids: list[int] = []
        self.last_pid: int | None = None  # the latest incarnation (running or not): what `stop` verifies
        self.last_ticks: int | None = None
        self.seen_dead: float | None = None  # monotonic time the latest death was seen, until the relaunch
        self.recovery: str | None = None  # how the worker said it recovers (protocol.RECOVERY_*), once it did
        self.error_file: Path | None = None  # the running incarnation's TORCHELASTIC_ERROR_FILE
        self.fenced: str | None = None  # the scheduler's cause, once it had the running incarnation killed
        self.files: openfiles.Trend | None = None  # the running incarnation's open files (workers)
        self.reached: int | None = None  # the highest step the running incarnation reported (datagrams)
        self.failed_at: int | None = None  # the furthest step this count's failures reached (the restart budget)
        self.same_failure: dict[str, Any] | None = None  # policy.repeated_failure of `exits`

    def fresh_steps(self) -> str | None:
        """Before a launch: make the step file hold no step (and forget the steps reported). Returns why it could
        not be made (then the restart budget has the progress datagrams only), or None."""
        self.reached = None
        if self.step_file is None:
            return None
        try:
            stepfile.reset(self.step_file)
        except OSError as e:
            self.step_file = None
            return f"cannot make its step file ({e}): the restart budget knows its steps from its progress reports"
        return None

    def reached_step(self) -> int | None:
        """After an exit: the last step the incarnation completed, from its step file (exact, whatever the death) or
        the highest step it reported by datagram (a lower bound); None if neither says one."""
        steps = [s for s in (stepfile.read(self.step_file) if self.step_file else None, self.reached) if s is not None]
        return max(steps) if steps else None

    def judged(self, reaction: Any, record: ExitRecord) -> None:
        """After an exit: if the restart budget judged it (a counted relaunch or the give-up), mark its record (the
        latest) a failure, keep the count's furthest step, and see whether it keeps failing the same way."""
        if not (isinstance(reaction, policy.GiveUp) or isinstance(reaction, policy.Relaunch) and reaction.failure):
            return
        self.last_exit = replace(record, failure=True)
        self.exits = [e if e is not record else self.last_exit for e in self.exits]
        self.failed_at = reaction.failed_at
        self.same_failure = policy.repeated_failure([e.to_dict() for e in self.exits])

    def document(self, policy: RestartPolicy) -> ProcDoc:
        """This process's entry in agent.json's `processes`; no I/O. `pid`, `pgid` and `start_ticks` name the running
        incarnation (None between incarnations), `last_pid` and `last_start_ticks` the latest one, running or not:
        `stop` and the next agent find leftover groups from these (toolkit.agentdoc.recorded_groups), so a group is
        always recorded with its leader's start time."""
        c = self.child
        return ProcDoc(
            node_id=self.spec.node_id, role=self.spec.role, rank=self.spec.rank,
            local_rank=self.spec.local_rank, state=agentdoc.ProcState(self.state),
            pid=c.pid if c else None, pgid=c.pgid if c else None, start_ticks=c.start_ticks if c else None,
            last_pid=self.last_pid, last_start_ticks=self.last_ticks,
            started_at=iso(self.started_wall), warm=self.warm if c else None,
            restarts=max(0, self.launches - 1), counted_restarts=self.counted,
            max_restarts=policy.max_restarts, next_start_at=iso(self.next_start),
            last_exit=self.last_exit, exits=tuple(self.exits),
            step=self.step, epoch=self.epoch, step_at=iso(self.step_at), recovery=self.recovery,
            cpus=tuple(sorted(self.cpus)) if self.cpus else None,
            open_files=self.files.document() if self.files else None,
            failed_at=self.failed_at, same_failure=self.same_failure,
            log_file=self.spec.log_file, argv=tuple(self.spec.argv),
        )


class Spare:
    """A warm interpreter waiting on `sock` (see toolkit.standby). `child` is the standby process, `sock` the agent's
    end of their socketpair, and `interpreter` the argv[0] it was started with: only a worker run by that same
    interpreter can be handed to it (standby.eligible). `ready` turns True when it sent standby.READY (its imports are
    done); only a ready spare takes a handoff."""

    def __init__(self, child: Child, sock: socket.socket, interpreter: str) -> None:
        self.child, self.sock, self.interpreter = child, sock, interpreter
        self.ready = False
        self.started = time.monotonic()
        self.held = False  # SIGSTOPped while a worker restarts cold (toolkit.agent.warmspare)
        self.hold_timer: Timer | None = None


def cold_launches(slots: Iterable[Slot]) -> list[float]:
    """When each worker relaunched cold that has not progressed since was launched (monotonic s): what holds the
    warm spare back (toolkit.agent.warmspare). A first start is not a recovery: SPARE_DELAY paces the spare then."""
    return [s.started_mono for s in slots if s.spec.is_worker and s.child is not None and not s.warm
            and not s.progressed and s.launches > 1]


# --- the supervisor


class Agent:
    """The supervisor of one host's processes of one job. toolkit.agent.commands.run builds and runs one per agent
    process while it holds state/agent.lock.

    Threading: everything runs on the thread that calls `run`, which must be the main thread (signal.set_wakeup_fd, and
    procs.spawn's parent-death signal, which fires when the forking thread ends); nothing here is thread-safe. The
    selector's callbacks (`_on_*`) and the timers must not stall the loop: their waits on other processes are bounded (a
    control reply and a spare handoff by CLIENT_TIMEOUT, reading an env file for the spare by procs.resolve_env's
    timeout); besides local file I/O, only the resolution of the scheduler's name in a link attempt has no bound of
    ours. Everything that waits longer (stopping children, the last reports) happens in `_shutdown`, after the loop.

    Invariants: while the loop runs, a slot has a `child` exactly when that child's pidfd is registered in the selector;
    once `closing` is set nothing is launched or relaunched; the first `_finish` fixes the exit code, state and reason;
    agent.json is rewritten after every change of state (for progress alone, at most once per PROGRESS_WRITE_INTERVAL).
    `state` goes starting -> running -> [finishing ->] [stopping ->] succeeded, failed or stopped, with exit code
    EXIT_OK, EXIT_FAILED or EXIT_STOPPED."""

    def __init__(self, spec: HostSpec, log: AgentLog) -> None:
        """Prepare the slots; no file, socket or process yet (`run` makes those). Raises UserError when bind_core asks
        for more CPUs than this process may use. The agent's own environment is read once: children get a copy
        (`base_env`), plus GLOO_SOCKET_IFNAME naming the interface of the route toward the scheduler unless it is set
        already (a route lookup that may resolve the scheduler's name), and GLOO_ENABLE_STORE_V2_API=1 and
        GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1 unless set (gloo's bootstrap in about N/128 store requests per rank)."""
        self.spec, self.log = spec, log
        self.sel = selectors.DefaultSelector()
        self.timers = Timers()
        workers = [p for p in spec.processes if p.is_worker]
        sets = cpu_sets(os.sched_getaffinity(0), len(workers), spec.host) if spec.bind_core else []
        by_node = dict(zip((p.node_id for p in workers), sets, strict=False))  # no sets without bind_core
        self.slots = {p.node_id: Slot(p, by_node.get(p.node_id), spec.step_file(p.node_id)) for p in spec.processes}
        self.state = "starting"
        self.reason: str | None = None
        self.exit_code: int | None = None
        self.failure: Failure | None = None
        self.closing = False  # finishing or stopping: nothing is relaunched any more
        self.pid = os.getpid()
        self.ticks = procs.start_ticks(self.pid)
        self.started = time.time()
        self.base_env = dict(os.environ)  # a copy: the agent's own environment is never written
        if E.GLOO_SOCKET_IFNAME not in self.base_env:  # gloo's own choice is loopback where the hostname misleads
            interface = netif.interface_toward(spec.sched_host, spec.sched_port)
            if interface is not None:
                self.base_env[E.GLOO_SOCKET_IFNAME] = interface
        for name in (E.GLOO_ENABLE_STORE_V2_API, E.GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER):  # bootstrap: O(N/128) requests
            self.base_env.setdefault(name, "1")
        self.spare: Spare | None = None
        self.spare_timer: Timer | None = None
        self.spare_failures = 0
        self.spare_enabled = spec.warm_spare and bool(workers)
        self.progress_dirty = False
        self.progress_timer: Timer | None = None
        self.last_write = 0.0
        self.took_over: list[Takeover] = []  # a spare's takeovers
        self.nofile = 0  # the workers' open-file limit (run raises it to the hard limit)
        self.link = SchedulerLink(spec, self.sel, self.timers, log, self._on_scheduler, self._changed,
                                  self._hello_fields, lambda: {"running": running(self.slots.values())})
        self._stop_after: Timer | None = None
        self._wake_r: socket.socket | None = None
        self._control: socket.socket | None = None
        self._clients: set[socket.socket] = set()  # control connections open now (at most MAX_CONTROL_CLIENTS)
        self._progress: socket.socket | None = None

    # -- life cycle

    def run(self, ready: Callable[[str], None] | None = None) -> int:
        """Supervise until the job ends here; returns the agent's exit code (EXIT_OK, EXIT_FAILED or EXIT_STOPPED).

        `_setup` makes the state files and sockets (on failure they are closed and the error propagates); then the
        scheduler, if it lives here, is started before the workers, agent.json is written, the scheduler link starts,
        the warm spare is armed, and `ready("ready <pid>")` is called once (commands.start waits for that line). The
        loop dispatches selector events and due timers, waking at least every IDLE_WAKE s, until a callback calls
        `_finish`; `_shutdown` then stops what is left and its exit code is returned. An exception out of a callback (a
        bug, or agent.json unwritable) fails the agent: it is logged, `_shutdown` still stops every child (within its
        bound), and the exception propagates."""
        try:
            self._setup()
        except BaseException:
            self._close_sockets()
            raise
        before, self.nofile = procs.raise_open_files()  # gloo keeps a descriptor for every connection to its port
        what = f"supervising {', '.join(self.slots)}" if self.slots else \
            f"standing by as a spare for {len(self.spec.standby)} worker(s)"
        self.log("agent", f"agent pid {self.pid} {what} of job {self.spec.job} "
                          f"(max_restarts {self.spec.policy.max_restarts}, grace {self.spec.grace:g} s, "
                          f"warm spare {'on' if self.spare_enabled else 'off'}"
                          f"{', bind_core' if self.spec.bind_core else ''}, open files {self.nofile}"
                          f"{f' (raised from {before})' if self.nofile > before else ''})")
        for slot in sorted(self.slots.values(), key=lambda s: s.spec.is_worker):
            self._launch(slot, "first start")
        if self.state == "starting":
            self.state = "running"
        self._write()
        self.link.start()
        if self.spare_enabled:
            self.spare_timer = self.timers.after(SPARE_DELAY, self._start_spare)
        self.timers.after(openfiles.SAMPLE_INTERVAL, self._count_open_files)
        if ready is not None:
            ready(f"ready {self.pid}")
        try:
            while self.exit_code is None:
                for key, mask in self.sel.select(self.timers.timeout(IDLE_WAKE)):
                    if self.sel.get_map().get(key.fd) is not key:
                        continue  # unregistered by an earlier event of this batch
                    key.data(mask)
                    if self.exit_code is not None:
                        break
                self.timers.run_due()
        except BaseException as e:
            self.log("agent", f"internal error, stopping everything: {type(e).__name__}: {e}")
            self._finish("failed", EXIT_FAILED, f"agent error: {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                self._shutdown()
            raise
        return self._shutdown()

    def _setup(self) -> None:
        """Create the agent's files and sockets, before anything is launched. In order: state/ (0700); the reclaim of a
        previous agent's leftovers; agent.pid ("<pid> <start ticks>"); the signal wakeup socketpair (the SIGTERM, SIGINT
        and SIGHUP handlers do nothing themselves: the numbers reach `_on_signal` through the selector); the control
        socket (stream, 0600: whoever can connect can stop the job) and the progress socket (datagram, 0600). Stale
        socket files are unlinked first, which is safe because the lock says no other agent of the job runs. Raises
        OSError on failure."""
        spec = self.spec
        spec.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        spec.errors_dir.mkdir(exist_ok=True, mode=0o700)
        self._reclaim_previous()
        atomicfile.write(spec.pid_file, f"{self.pid} {self.ticks}\n")
        self._wake_r, wake_w = socket.socketpair()
        self._wake_w = wake_w
        for s in (self._wake_r, wake_w):
            s.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # the number arrives through the wakeup fd
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._on_signal)

        spec.control_socket.unlink(missing_ok=True)
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control.bind(str(spec.control_socket))
        os.chmod(spec.control_socket, 0o600)  # whoever can talk to it can stop the job
        self._control.listen(16)
        self._control.setblocking(False)
        self.sel.register(self._control, selectors.EVENT_READ, self._on_accept)

        spec.progress_socket.unlink(missing_ok=True)
        self._progress = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._progress.bind(str(spec.progress_socket))
        os.chmod(spec.progress_socket, 0o600)
        self._progress.setblocking(False)
        self.sel.register(self._progress, selectors.EVENT_READ, self._on_progress)

    def _reclaim_previous(self) -> None:
        """A previous agent of this job was killed (we hold the lock, so it is not running): whatever is left of the
        process groups it recorded must not run on unsupervised. Runs before this agent launches anything (agent.json is
        still the previous agent's); only groups recorded with their leader's start time are touched
        (procs.reclaim_group)."""
        try:
            recorded = recorded_groups(self.spec.agent_json.read_text(encoding="utf-8"))
        except OSError:
            recorded = []
        for node_id, pgid, ticks in recorded:
            killed = procs.reclaim_group(pgid, ticks)
            if killed:
                self.log(node_id, f"killed {len(killed)} process(es) left running by the previous agent in "
                                  f"group {pgid}: {killed}")

    def _finish(self, state: str, code: int, reason: str | None) -> None:
        """Leave the loop; _shutdown does the stopping. Returns at once. Only the first call counts: it fixes `state`,
        the exit code and `reason` (a SIGTERM during a give-up changes nothing). Sets `closing`, so no exit from now on
        is relaunched."""
        if self.exit_code is None:
            self.state, self.exit_code, self.reason = state, code, reason
            self.closing = True

    def _shutdown(self) -> int:
        """After the loop: stop everything this agent started and return the exit code.

        Blocking but bounded, by about REPORT_FLUSH_TIMEOUT (pending reports such as gave_up, over a fresh connection if
        the link is down) + procs.KILL_WAIT (the spare gets SIGKILL at once: it holds no state) + grace +
        procs.KILL_WAIT (each child's group gets SIGTERM, and SIGKILL if still there after `grace`), and `grace` more
        when a failing agent lets the scheduler it runs end on its own (below). Pending restarts
        and timers are cancelled first. Deaths seen here are recorded but neither reported (the link is closed by then)
        nor relaunched. When this agent failed and its reports reached the scheduler, a scheduler it runs is given
        grace to exit on its own once the workers are stopped: it has the failure to record (a SIGTERM could come
        first and leave the job "stopped" with no cause). agent.json says `stopping` while anything is being
        stopped, then the final state; slots not already succeeded or failed end `stopped`. The sockets are closed
        and unlinked last."""
        for slot in self.slots.values():
            for t in (slot.timer, slot.kill_timer):
                if t:
                    t.cancel()
            slot.next_start = None
        if self.spare_timer:
            self.spare_timer.cancel()
        live = [s for s in self.slots.values() if s.child is not None]
        for slot in live:
            self.sel.unregister(slot.child)  # reaped below, outside the loop
        final_state = self.state
        if live or self.spare:
            self.state = "stopping"
            self._write()
        delivered = not self.link.closed
        if (self.link.queue or self.link.wbuf) and not self.link.closed:
            delivered = self.link.flush(REPORT_FLUSH_TIMEOUT)
            if not delivered:
                self.log("agent", "could not deliver the last reports to the scheduler")
        self.link.close()
        if self.spare is not None:
            for obj in (self.spare.child, self.spare.sock):
                if obj in (k.fileobj for k in self.sel.get_map().values()):
                    self.sel.unregister(obj)
            self.spare.child.signal_group(signal.SIGKILL)  # holds no state worth a grace period
            self.spare.child.wait(procs.KILL_WAIT)
            self.spare.sock.close()
            self.spare = None
        told = final_state == "failed" and delivered  # a scheduler here has the failure, and ends on it
        workers = [s for s in live if s.spec.is_worker or not told]
        self._stop_children(workers)
        for slot in (s for s in live if s not in workers):
            status = slot.child.wait(self.spec.grace)
            if status is None:
                self._stop_children([slot])
            else:
                self._record_exit(slot, status)
                self.log(slot.spec.node_id, f"pid {slot.child.pid} exited ({status.describe()})")
        for slot in live:
            slot.child = None
            if slot.state not in ("succeeded", "failed"):
                slot.state = "stopped"
        for slot in self.slots.values():
            if slot.state in ("backoff", "pending", "restarting", "running"):
                slot.state = "stopped"
        self.state = final_state
        self._write()
        self.log("agent", f"agent exits: {self.state}" + (f" ({self.reason})" if self.reason else "")
                 + f", exit status {self.exit_code}")
        self._close_sockets()
        return self.exit_code

    def _stop_children(self, slots: list[Slot]) -> None:
        """SIGTERM the groups of `slots`' children, SIGKILL what is left after grace (procs.stop_all), and record how
        each ended. Blocking, bounded by about grace + procs.KILL_WAIT."""
        if not slots:
            return
        names = {s.child.pid: s for s in slots}
        self.log("agent", f"stopping {', '.join(s.spec.node_id for s in slots)}: SIGTERM, "
                          f"then SIGKILL after {self.spec.grace:g} s")
        out = procs.stop_all(
            [s.child for s in slots], self.spec.grace,
            on_kill=lambda c: self.log(names[c.pid].spec.node_id,
                                       f"pid {c.pid} still running after {self.spec.grace:g} s: SIGKILL"))
        for pid, status in out.items():
            slot = names[pid]
            self._record_exit(slot, status)
            self.log(slot.spec.node_id, f"pid {pid} stopped ({status.describe()})")

    def _close_sockets(self) -> None:
        """Close what `_setup` opened; safe after a partial `_setup` (what was never made is skipped). Signals no longer
        reach the wakeup fd, the control and progress sockets are closed and their files unlinked, and the selector is
        closed."""
        signal.set_wakeup_fd(-1)
        for sock, path in ((self._control, self.spec.control_socket), (self._progress, self.spec.progress_socket)):
            if sock is not None:
                sock.close()
                path.unlink(missing_ok=True)
        for s in (self._wake_r, getattr(self, "_wake_w", None)):
            if s is not None:
                s.close()
        self.sel.close()

    # -- launching

    def _launch(self, slot: Slot, why: str) -> None:
        """Start `slot`'s next incarnation; a no-op once the agent is closing. `why` goes to the agent's log and to the
        marker line written to the process's log before it starts.

        The environment is `base_env` plus TORCHELASTIC_RESTART_COUNT (the launches so far) and TORCHELASTIC_ERROR_FILE
        (this incarnation's own, removed first if an earlier agent left it: causes.error_file); the process's env file
        is applied on top by a shell (procs.env_argv), or for a handoff by procs.resolve_env. The ready warm spare takes
        the place when it can (`_handoff`), else procs.spawn starts it cold. A spawn that fails (OSError,
        SubprocessError) never raises: it counts as a launch and, one timer tick later, as an exit with code 127 (like a
        command not found), so the restart policy applies to it as to any crash; no `exited` report goes out for it
        (there was no pid). On success the child's pidfd is registered (-> `_on_child`), `progressed` is reset, and
        agent.json is rewritten."""
        slot.timer, slot.next_start = None, None
        if self.closing:
            return
        n = slot.launches
        env = dict(self.base_env)
        env[E.TORCHELASTIC_RESTART_COUNT] = str(n)
        slot.error_file, slot.fenced = causes.error_file(self.spec.errors_dir, slot.spec.node_id, n), None
        with contextlib.suppress(OSError):
            slot.error_file.unlink(missing_ok=True)
        env[E.TORCHELASTIC_ERROR_FILE] = str(slot.error_file)
        trouble = slot.fresh_steps()
        if trouble:
            self.log(slot.spec.node_id, trouble)
        if slot.step_file is not None:
            env[E.TOOLKIT_STEP_FILE] = str(slot.step_file)
        marker = (f"--- toolkit agent {self.spec.host}: start {slot.spec.node_id} #{n + 1} ({why}) "
                  f"at {iso(time.time())} ---")
        child = self._handoff(slot, env, marker)
        slot.warm = child is not None
        if child is None:
            try:
                child = procs.spawn(LaunchSpec(
                    argv=tuple(procs.env_argv(slot.spec.env_file, slot.spec.argv)), env=env, cwd=slot.spec.cwd,
                    log_file=slot.spec.log_file, cpus=slot.cpus, marker=marker))
            except (OSError, subprocess.SubprocessError) as e:
                self.log(slot.spec.node_id, f"could not start {' '.join(slot.spec.argv)}: {e}")
                try:
                    with open(slot.spec.log_file, "a", encoding="utf-8") as f:
                        f.write(f"{marker}\ntoolkit agent: could not start: {e}\n")
                except OSError:
                    pass
                slot.launches += 1
                slot.started_mono, slot.started_wall = time.monotonic(), time.time()
                slot.state = "running"
                # as if it had died at once with "command not found": the normal policy applies
                self.timers.after(0, lambda: self._after_exit(slot, None, ExitStatus(127, None)))
                return
        slot.child = child
        slot.last_pid, slot.last_ticks = child.pid, child.start_ticks
        slot.launches += 1
        slot.pids = (slot.pids + [child.pid])[-EXIT_HISTORY:]
        slot.started_mono, slot.started_wall = time.monotonic(), time.time()
        slot.state = "running"
        slot.progressed = False
        slot.files = openfiles.Trend(self.nofile) if slot.spec.is_worker else None
        self.sel.register(child, selectors.EVENT_READ, lambda _m, s=slot, c=child: self._on_child(s, c))
        since = ""
        if slot.seen_dead is not None:
            since = f", {1000 * (time.monotonic() - slot.seen_dead):.1f} ms after its exit was seen"
            slot.seen_dead = None
        self.log(slot.spec.node_id, f"started pid {child.pid} ({why}{', warm spare' if slot.warm else ''}"
                                    f"{', restart count ' + str(n) if n else ''}{since})")
        self._write()
        if not slot.warm:
            self._hold_spare()

    def _on_child(self, slot: Slot, child: Child) -> None:
        """Selector callback: `child`'s pidfd is readable, so it exited. The pidfd is unregistered before `reap` closes
        it; reaping also SIGKILLs whatever is left of the child's group. `slot.child` is cleared and the status goes to
        `_after_exit`. `seen_dead` starts the clock the relaunch's log line reports (from the death seen to the new
        pid)."""
        self.sel.unregister(child)  # before reaping closes the pidfd
        slot.seen_dead = time.monotonic()
        status = child.reap()
        if status is None:  # a pidfd is readable only once the process exited; stay safe anyway
            self.sel.register(child, selectors.EVENT_READ, lambda _m: self._on_child(slot, child))
            return
        slot.child = None
        self._after_exit(slot, child, status)
        self._hold_spare()  # a worker starting cold may be gone

    def _record_exit(self, slot: Slot, status: ExitStatus, pid: int | None = None,
                     step: int | None = None) -> ExitRecord:
        """Record an exit as `slot.last_exit` and in its history (the last EXIT_HISTORY), with the `step` the
        incarnation had reached; returns the record. In memory only: the caller writes agent.json. Its `cause` is the
        first cause (toolkit.agent.causes: the incarnation's error file, read and removed here, or the scheduler's
        cause when the agent killed it for fencing), None when the code or signal says it all."""
        ran = time.monotonic() - slot.started_mono
        message = None
        if slot.error_file is not None:
            if not status.ok:
                message = causes.read_error_file(slot.error_file)
            with contextlib.suppress(OSError):
                slot.error_file.unlink(missing_ok=True)
            slot.error_file = None
        rec = ExitRecord(**status.as_dict(), pid=pid, at=iso(time.time()), ran_for=round(ran, 3), step=step,
                         cause=causes.first_cause(status, message, slot.fenced))
        slot.last_exit = rec
        slot.exits = (slot.exits + [rec])[-EXIT_HISTORY:]
        return rec

    def _after_exit(self, slot: Slot, child: Child | None, status: ExitStatus) -> None:
        """Record the exit, tell the scheduler at once, and apply what policy.on_exit decides. Runs on the loop thread,
        from `_on_child` or, for a failed spawn (`child` None: nothing is reported), a timer.

        The `exited` report is coalesced per node: while the scheduler is unreachable only a node's latest death waits
        to be sent. A pending SIGKILL of the operator's restart is cancelled and the `manual` flag consumed. Reactions:
        Settle (closing: the final state; a finishing agent finishes once nothing runs), Succeeded (exit 0; the agent
        finishes with EXIT_OK once every process of the host has), GiveUp (`_give_up`), Relaunch (now, or in state
        `backoff` with a timer; `slot.counted` takes the policy's count)."""
        pid = child.pid if child else None
        ran = time.monotonic() - slot.started_mono
        record = self._record_exit(slot, status, pid, slot.reached_step())
        cause = record.cause
        if slot.kill_timer:
            slot.kill_timer.cancel()
            slot.kill_timer = None
        if pid is not None:
            self.link.report(P.EXITED, coalesce=slot.spec.node_id, node_id=slot.spec.node_id, pid=pid,
                             code=status.code, signal=status.signal_name, cause=cause)
        others = [s for s in self.slots.values() if s is not slot]
        facts = policy.Exited(
            code=status.code if status.signal is None else None, ran_for=ran, progressed=slot.progressed,
            counted=slot.counted, manual=slot.manual, closing=self.closing, finishing=self.state == "finishing",
            others_running=any(s.child for s in others), others_succeeded=all(s.state == "succeeded" for s in others),
            reached=record.step, failed_at=slot.failed_at)
        how = causes.describe(status, cause)
        reaction = policy.on_exit(self.spec.policy, facts, how)
        slot.manual = False
        slot.judged(reaction, record)
        node = slot.spec.node_id
        if isinstance(reaction, policy.Settle):
            slot.state = reaction.state
            self.log(node, f"pid {pid} exited ({how})")
            self._write()
            if reaction.finish:
                self._finish_now()
        elif isinstance(reaction, policy.Succeeded):
            slot.state = "succeeded"
            self.log(node, f"pid {pid} finished (exit code 0 after {ran:.1f} s)")
            self._write()
            if reaction.all_done:
                self._finish("succeeded", EXIT_OK, "every process of this host exited 0")
        elif isinstance(reaction, policy.GiveUp):
            self._give_up(slot, pid, status, ran, cause)
        else:
            slot.counted = reaction.counted
            if facts.manual:
                self.log(node, f"pid {pid} ended ({how}) for the requested restart")
            elif status.code in (P.EXIT_FENCED, P.EXIT_REJOIN):
                self.log(node, f"pid {pid} {how} (told to by the scheduler); relaunching now")
            else:
                budget = f"restart {reaction.counted} of {self.spec.policy.max_restarts}"
                when = "now" if reaction.delay <= 0 else f"in {reaction.delay:g} s"
                self.log(node, f"pid {pid} {how} after {ran:.1f} s{slot.files.cause() if slot.files else ''}; "
                               f"restarting {when} ({budget})")
            if reaction.delay <= 0:
                self._launch(slot, reaction.why)
            else:
                slot.state = "backoff"
                slot.next_start = time.time() + reaction.delay
                slot.timer = self.timers.after(reaction.delay, lambda: self._launch(slot, reaction.why))
                self._write()

    def _give_up(self, slot: Slot, pid: int | None, status: ExitStatus, ran: float, cause: str | None) -> None:
        """The job has failed here: `slot` died with its restarts used up (`cause`: its first cause, or None when its
        status says it all). Sets `failure` for agent.json (with the last lines of the process's log, also copied to
        the agent's log), reports `gave_up` to the scheduler (the tail cut to GAVE_UP_TAIL_BYTES so the message fits
        protocol.MAX_LINE), and finishes `failed` with EXIT_FAILED; `_shutdown` then stops the other processes and
        gives the report REPORT_FLUSH_TIMEOUT to reach the scheduler."""
        spec = slot.spec
        tail = log_tail(spec.log_file)
        n = slot.counted
        files = slot.files.cause() if slot.files else ""
        how = causes.describe(status, cause)
        self.failure = Failure(
            host=self.spec.host, node_id=spec.node_id, rank=spec.rank, pid=pid,
            code=status.code, signal=status.signal_name, status=status.describe() + files,
            cause=how + files, restarts=n, log_file=spec.log_file, log_tail=tuple(tail), at=iso(time.time()),
        )
        slot.state = "failed"
        reason = f"{spec.node_id} {how}{files} after {n} restart{'s' if n != 1 else ''} " \
                 f"(max_restarts {self.spec.policy.max_restarts}); the job has failed"
        where = f"rank {spec.rank}, " if spec.rank is not None else ""
        self.log(spec.node_id, f"GAVE UP: {where}pid {pid} {how} after {ran:.1f} s, and its "
                               f"{n} allowed restart(s) are used up; last {len(tail)} lines of {spec.log_file}:")
        for line in tail:
            self.log(spec.node_id, f"| {line}")
        self.link.report(P.GAVE_UP, node_id=spec.node_id, code=status.code, signal=status.signal_name, cause=cause,
                         log_tail="\n".join(tail)[-GAVE_UP_TAIL_BYTES:])
        self._finish("failed", EXIT_FAILED, reason)

    def _count_open_files(self) -> None:
        """Timer callback, every openfiles.SAMPLE_INTERVAL: count each running worker's open files and warn (agent
        log, agent.json) when they climb (openfiles.Trend); re-arms itself unless the agent is closing."""
        changed = False
        for slot in self.slots.values():
            if slot.child is None or slot.files is None:
                continue
            n = openfiles.count(slot.child.pid)
            if n is None:
                continue
            warning = slot.files.sample(n, slot.progressed)
            if warning:
                self.log(slot.spec.node_id, f"pid {slot.child.pid} {warning}")
            changed = changed or bool(warning)
        if changed:
            self._write()
        if not self.closing:
            self.timers.after(openfiles.SAMPLE_INTERVAL, self._count_open_files)

    # -- warm spare

    def _start_spare(self) -> None:
        """Timer callback: start a warm spare, unless the agent is closing, a spare exists, or spares are off. The spare
        is `<interpreter> -m toolkit.standby` with the first worker's interpreter and env file (so it imports the same
        torch), run in the job directory with its output in logs/standby.log and one end of a socketpair; it gets no
        CPUs of its own (it takes the worker's at handoff). A spare that cannot be spawned turns spares off for good:
        workers then restart cold."""
        self.spare_timer = None
        if self.closing or self.spare is not None or not self.spare_enabled:
            return
        plan = warmspare.spare_plan(False, cold_launches(self.slots.values()), time.monotonic())
        if not plan.run and plan.until is not None:  # a worker restarts cold: importing now would slow it down
            self.spare_timer = self.timers.after(plan.until - time.monotonic(), self._start_spare)
            return
        template = next(s.spec for s in self.slots.values() if s.spec.is_worker)
        interpreter = template.argv[0]
        mine, theirs = socket.socketpair()
        argv = [interpreter, "-m", "toolkit.standby", "--fd", str(theirs.fileno())]
        try:
            child = procs.spawn(LaunchSpec(
                argv=tuple(procs.env_argv(template.env_file, argv)), env=self.base_env, cwd=str(self.spec.job_dir),
                log_file=str(self.spec.standby_log), pass_fds=(theirs.fileno(),),
                marker=f"--- toolkit agent {self.spec.host}: warm spare at {iso(time.time())} ---"))
        except (OSError, subprocess.SubprocessError) as e:
            mine.close()
            self.log("agent", f"could not start a warm spare: {e}; workers restart cold")
            self.spare_enabled = False
            return
        finally:
            theirs.close()
        mine.setblocking(False)
        self.spare = Spare(child, mine, interpreter)
        self.log("agent", f"warm spare pid {child.pid} starting (importing {', '.join(standby.WARM_MODULES)})")
        self.sel.register(mine, selectors.EVENT_READ, lambda _m: self._on_spare_sock())
        self.sel.register(child, selectors.EVENT_READ, lambda _m: self._on_spare_exit())
        self._write()

    def _hold_spare(self) -> None:
        """Hold the warm spare (SIGSTOP to its group) while it imports and a worker relaunched cold starts beside it,
        let it go on (SIGCONT) once none does (toolkit.agent.warmspare); a timer decides again when the hold's bound
        passes. A ready spare is idle and never held."""
        sp = self.spare
        if sp is None or sp.ready:
            return
        now = time.monotonic()
        plan = warmspare.spare_plan(False, cold_launches(self.slots.values()), now)
        if sp.hold_timer is not None:
            sp.hold_timer.cancel()
            sp.hold_timer = None
        if plan.run == sp.held:
            sp.held = not plan.run
            sp.child.signal_group(signal.SIGSTOP if sp.held else signal.SIGCONT)
            self.log("agent", f"warm spare pid {sp.child.pid} " + (
                "held: a worker restarts cold, and the spare's imports would slow it down" if sp.held
                else "goes on importing"))
            self._write()
        if plan.until is not None:
            sp.hold_timer = self.timers.after(plan.until - now, self._hold_spare)

    def _on_spare_sock(self) -> None:
        """Selector callback on the spare's socket: standby.READY marks the spare ready (its imports are done). Anything
        else (EOF, an error) means it is going away: the socket is unregistered, and its pidfd (`_on_spare_exit`)
        handles the rest."""
        sp = self.spare
        try:
            data = sp.sock.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == standby.READY:
            sp.ready = True
            self.log("agent", f"warm spare pid {sp.child.pid} ready after {time.monotonic() - sp.started:.1f} s")
            self._write()
        else:
            self.sel.unregister(sp.sock)  # it went away: its pidfd tells the rest

    def _on_spare_exit(self) -> None:
        """Selector callback: the spare died before any handoff. Its socket is closed and the failure counted; a new
        spare is built after SPARE_DELAY, unless SPARE_MAX_FAILURES spares died with no handoff in between, which turns
        spares off for the rest of this agent's life."""
        sp = self.spare
        self.sel.unregister(sp.child)
        status = sp.child.reap()
        if status is None:
            self.sel.register(sp.child, selectors.EVENT_READ, lambda _m: self._on_spare_exit())
            return
        try:
            self.sel.unregister(sp.sock)
        except (KeyError, ValueError):
            pass
        sp.sock.close()
        self.spare = None
        self.spare_failures += 1
        tail = log_tail(self.spec.standby_log, 3)
        self.log("agent", f"warm spare pid {sp.child.pid} {status.describe()}"
                          + (f": {tail[-1]}" if tail else "") + f" (see {self.spec.standby_log})")
        if self.spare_failures >= SPARE_MAX_FAILURES:
            self.spare_enabled = False
            self.log("agent", f"{self.spare_failures} warm spares died: no more spares, workers restart cold")
        elif not self.closing:
            self.spare_timer = self.timers.after(SPARE_DELAY, self._start_spare)
        self._write()

    def _handoff(self, slot: Slot, env: dict[str, str], marker: str) -> Child | None:
        """Give `slot`'s place to the ready spare; None (and a cold start) if there is none or it cannot.

        Needs a ready spare and a worker argv it can run (standby.eligible). The worker's complete environment is
        computed here (procs.resolve_env: bash reads the env file, blocking the loop up to that function's timeout), and
        sent as one JSON line with argv, cwd, log file and CPUs after `marker` is appended to the worker's log; the send
        is bounded by CLIENT_TIMEOUT. On success the spare's process becomes the worker (the returned Child, same pid,
        which `_launch` registers), the count of failed spares is reset, and a new spare is scheduled. On failure the
        spare is left as it is (if it died, its pidfd says so)."""
        sp = self.spare
        if sp is None or not sp.ready or not standby.eligible(slot.spec.argv, sp.interpreter):
            return None
        try:
            full = procs.resolve_env(slot.spec.env_file, env, slot.spec.cwd)
        except (OSError, subprocess.SubprocessError) as e:
            self.log(slot.spec.node_id, f"warm spare not used: {e}")
            return None
        payload = json.dumps({"argv": list(slot.spec.argv), "env": full, "cwd": slot.spec.cwd,
                              "log_file": slot.spec.log_file,
                              "cpus": sorted(slot.cpus) if slot.cpus else None}) + "\n"
        try:
            with open(slot.spec.log_file, "a", encoding="utf-8") as f:
                f.write(marker + "\n")
            sp.sock.settimeout(CLIENT_TIMEOUT)
            sp.sock.sendall(payload.encode())
        except OSError as e:
            self.log(slot.spec.node_id, f"warm spare pid {sp.child.pid} did not take the handoff ({e})")
            return None
        self.sel.unregister(sp.sock)
        self.sel.unregister(sp.child)
        sp.sock.close()
        self.spare = None
        self.spare_failures = 0
        self._schedule_spare()
        return sp.child

    def _schedule_spare(self) -> None:
        """(Re)arm the spare timer for SPARE_DELAY from now if a spare is wanted and none exists: spares on, the agent
        not closing. A timer already armed is replaced. Called after a handoff, so the next spare's imports do not
        compete with the replacement's start."""
        if self.spare_enabled and not self.closing and self.spare is None:
            if self.spare_timer:
                self.spare_timer.cancel()
            self.spare_timer = self.timers.after(SPARE_DELAY, self._start_spare)

    # -- the scheduler's messages

    def _on_scheduler(self, msg: dict[str, Any]) -> None:
        """Apply policy.on_scheduler to one message from the scheduler. SchedulerLink calls it only once the link is up
        (the scheduler has proved the job token).

        `kill`: SIGKILL the node's group (fencing: an incarnation declared dead, e.g. SIGSTOPped, must lose its
        sockets); its death then goes through `_on_child` like any other. `stop`: finish `failed` with EXIT_FAILED.
        `finished`: close the link (the scheduler exits), cancel pending restarts, state `finishing`, and finish with
        EXIT_OK once nothing runs, or after `grace` s (`_shutdown` stops the rest). Anything else is logged and ignored.
        Raises RuntimeError only if the policy names a node without a child (a bug)."""
        running = {s.spec.node_id: s.child.pid for s in self.slots.values() if s.child is not None}
        reaction = policy.on_scheduler(msg, running, self.closing, [p.node_id for p in self.spec.standby],
                                       list(self.slots))
        if isinstance(reaction, policy.TakeOver):
            self._take_over(reaction, P.whole(msg, "seq"))
        elif isinstance(reaction, policy.Kill):
            slot = self.slots[reaction.node_id]
            if slot.child is None:  # policy.Kill names only running node ids
                raise RuntimeError(f"kill for {reaction.node_id}, which has no child")
            slot.fenced = reaction.cause
            self.log(slot.spec.node_id, f"the scheduler declared pid {slot.child.pid} dead ({reaction.cause}): SIGKILL "
                                        "(fencing)")
            slot.child.signal_group(signal.SIGKILL)
        elif isinstance(reaction, policy.StopJob):
            self.log("agent", f"the scheduler stopped the job: {reaction.reason}")
            self._finish("failed", EXIT_FAILED, f"stopped by the scheduler: {reaction.reason}")
        elif isinstance(reaction, policy.FinishJob):
            self.log("agent", "the scheduler says the job finished")
            self.link.close()  # it exits now; nothing more to tell it
            self.closing = True
            self.state = "finishing"
            for slot in self.slots.values():
                if slot.timer:
                    slot.timer.cancel()
                    slot.timer, slot.next_start, slot.state = None, None, "stopped"
            if not any(s.child for s in self.slots.values()):
                self._finish_now()
            else:
                self._stop_after = self.timers.after(self.spec.grace, self._finish_now)
                self._write()
        elif reaction.why != "already closing":
            self.log("agent", reaction.why)

    def _take_over(self, reaction: policy.TakeOver, seq: int | None) -> None:
        """This spare host takes the lost host's processes: a slot each, from host.json's standby list (their env files
        were rendered for this host at deploy), started at once; the warm spare is armed as on any worker host. The
        takeover is recorded in agent.json (`took_over`, with the scheduler's sequence number `seq`), where `fleet
        status` reads the job's new layout, and the next hello names the new node ids."""
        standby = {p.node_id: p for p in self.spec.standby}
        self.log("agent", f"taking over {reaction.host}: starting {', '.join(reaction.node_ids)} (the scheduler "
                          f"replaced {reaction.host} by this spare host)")
        self.took_over.append(Takeover(host=reaction.host, node_ids=tuple(reaction.node_ids), seq=seq,
                                       at=iso(time.time())))
        for node_id in reaction.node_ids:
            slot = Slot(standby[node_id], None, self.spec.step_file(node_id))
            self.slots[node_id] = slot
            self._launch(slot, f"takeover of {reaction.host}")
        self.spare_enabled = self.spec.warm_spare and self.spare_failures < SPARE_MAX_FAILURES
        self._schedule_spare()
        self._write()

    def _hello_fields(self) -> dict[str, Any]:
        """What the agent's hello says: its host, the node ids it supervises now (a spare's grow with each takeover),
        and whether it is a spare host's agent (the scheduler may hand it a lost host's ranks)."""
        return {"host": self.spec.host, "node_ids": list(self.slots), "spare": self.spec.spare}

    def _finish_now(self) -> None:
        """End a finishing agent with success (EXIT_OK): called when its last child has exited or when the grace period
        after `finished` runs out; cancels that grace timer."""
        if self._stop_after:
            self._stop_after.cancel()
        self._finish("succeeded", EXIT_OK, "the scheduler said the job finished")

    # -- signals, control socket, progress

    def _on_signal(self, _mask: int) -> None:
        """Selector callback on the wakeup socket: each byte is a signal number (signal.set_wakeup_fd). SIGHUP is
        ignored (the agent outlives the SSH session that started it); SIGTERM (stop.sh) and SIGINT finish `stopped` with
        EXIT_STOPPED."""
        try:
            data = self._wake_r.recv(64)
        except BlockingIOError:
            return
        for signum in data:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                self.log("agent", "SIGHUP ignored (the agent outlives the session that started it)")
                continue
            self.log("agent", f"{name} received: stopping")
            self._finish("stopped", EXIT_STOPPED, f"stopped by {name}")

    def _on_accept(self, _mask: int) -> None:
        """Selector callback on the control socket: accept one connection, without blocking. It has CLIENT_TIMEOUT to
        send its request. Beyond MAX_CONTROL_CLIENTS open at once a connection is closed unanswered; when accept fails
        (e.g. out of descriptors) the client stays in the backlog, bounded by its own timeout."""
        try:
            conn, _ = self._control.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # out of descriptors: the client waits in the backlog, its own timeout bounds it
            return
        if len(self._clients) >= MAX_CONTROL_CLIENTS:
            conn.close()
            return
        conn.setblocking(False)
        self._clients.add(conn)
        state = {"buf": b""}
        deadline = self.timers.after(CLIENT_TIMEOUT, lambda: self._close_conn(conn))
        self.sel.register(conn, selectors.EVENT_READ, lambda _m: self._on_conn(conn, state, deadline))

    def _close_conn(self, conn: socket.socket) -> None:
        """Forget and close a control connection; idempotent (the reply path and the deadline may both call it)."""
        self._clients.discard(conn)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _on_conn(self, conn: socket.socket, state: dict, deadline: Timer) -> None:
        """Selector callback on a control connection: read one request, answer it, close. Input is buffered until a
        newline, EOF or MAX_CONTROL_LINE bytes; the first line is answered (`_control_request`) with one JSON line, and
        the connection closed: one request per connection. A line that is not a JSON object is answered `{"ok": false,
        "error": ...}`; an empty one gets no answer. Sending the reply blocks for at most CLIENT_TIMEOUT. A deferred
        action (stop) runs after the reply, so the client hears `ok` before the agent stops."""
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        state["buf"] += data
        if not data or b"\n" in state["buf"] or len(state["buf"]) > MAX_CONTROL_LINE:
            deadline.cancel()
            line = state["buf"].split(b"\n", 1)[0]
            if line.strip():
                try:
                    reply, after = self._control_request(json.loads(line))
                except (ValueError, TypeError, AttributeError, RecursionError):
                    reply, after = {"ok": False, "error": "not a JSON object line"}, None
                try:
                    conn.settimeout(CLIENT_TIMEOUT)
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass
            else:
                after = None
            self._close_conn(conn)
            if after is not None:
                after()

    def _control_request(self, req: Any) -> tuple[dict, Callable[[], None] | None]:
        """One control request -> (reply, action to run once the reply is sent, or None). The ops are
        agentdoc.ControlOp: `status` returns the agent.json document, `stop` replies ok and defers `_finish("stopped",
        EXIT_STOPPED)`, `restart` is `_manual_restart`; anything else, a request that is not an object included, gets an
        error naming the known ops."""
        op = req.get("op") if isinstance(req, dict) else None
        if op == ControlOp.STATUS:
            return self.document().to_dict(), None
        if op == ControlOp.STOP:
            self.log("agent", "stop requested on the control socket")
            return {"ok": True}, lambda: self._finish("stopped", EXIT_STOPPED, "stop requested")
        if op == ControlOp.RESTART:
            return self._manual_restart(str(req.get("node_id"))[:256]), None
        known = ", ".join(o.value for o in ControlOp)
        return {"ok": False, "error": f"unknown op {str(op)[:40]!r}; one of {known}"}, None

    def _manual_restart(self, node_id: str) -> dict:
        """The operator's restart of `node_id` (recover.sh); returns the control reply. It is never counted against
        max_restarts.

        Refused (`ok` false) for a node this host does not run, or once the agent is closing. A process not running (in
        backoff, or exited 0 while others run) is launched now, its pending restart cancelled, and the reply has the new
        pid (None if the spawn failed). A running one is marked `manual`, its group gets SIGTERM and, after `grace` s,
        SIGKILL; `_after_exit` relaunches it at once, and the reply has `was_pid` and no new pid yet. Another request
        while that restart is pending signals nothing more."""
        slot = self.slots.get(node_id)
        if slot is None:
            return {"ok": False, "error": f"no process {node_id} on {self.spec.host}; this host runs "
                                          f"{', '.join(self.slots)}"}
        if self.closing:
            return {"ok": False, "error": f"the agent on {self.spec.host} is {self.state}; nothing is restarted"}
        self.log(node_id, "restart requested by the operator (not counted against max_restarts)")
        if slot.child is None:
            if slot.timer:
                slot.timer.cancel()
            self._launch(slot, "restart requested by the operator")
            return {"ok": True, "node_id": node_id, "was_pid": None,
                    "pid": slot.child.pid if slot.child else None}
        child = slot.child
        if not slot.manual:
            slot.manual = True
            slot.state = "restarting"
            child.signal_group(signal.SIGTERM)
            slot.kill_timer = self.timers.after(self.spec.grace, lambda: child.signal_group(signal.SIGKILL))
            self._write()
        return {"ok": True, "node_id": node_id, "was_pid": child.pid, "pid": None}

    def _on_progress(self, _mask: int) -> None:
        """Selector callback on the progress socket: record the workers' progress. At most 256 datagrams are read per
        wake-up (the rest wait for the next); any that is not JSON or names no process here is ignored.

        A `recovery` field (the worker joined its group) or an integer `step` marks the process `progressed` since its
        launch, which spares its next failure the backoff (hostspec.RestartPolicy.after_failure). agent.json is
        rewritten for progress at most once per PROGRESS_WRITE_INTERVAL. Once every running worker has progressed, a
        spare still waiting out SPARE_DELAY is started at once: the job is past its start, so building one no longer
        competes with it."""
        for _ in range(256):  # bounded per wake-up; the rest is read at the next one
            try:
                data = self._progress.recv(4096)
            except BlockingIOError:
                break
            try:
                msg = json.loads(data)
                slot = self.slots[msg["node_id"]]
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
            recovery = msg.get("recovery")
            if recovery in (P.RECOVERY_IN_PLACE, P.RECOVERY_RESTART):
                slot.progressed = True  # it got as far as its process group: not a crash loop
                if recovery != slot.recovery:
                    slot.recovery = recovery
                    self.progress_dirty = True
            step = msg.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            slot.step, slot.step_at, slot.progressed = step, time.time(), True
            slot.reached = step if slot.reached is None else max(slot.reached, step)
            epoch = msg.get("epoch")
            if isinstance(epoch, int):
                slot.epoch = epoch
            self.progress_dirty = True
        if self.progress_dirty and self.progress_timer is None:
            delay = self.last_write + PROGRESS_WRITE_INTERVAL - time.monotonic()
            self.progress_timer = self.timers.after(delay, self._write_progress)
        running = [s for s in self.slots.values() if s.spec.is_worker and s.state == "running"]
        if (self.spare_enabled and self.spare is None and self.spare_timer is not None and running
                and all(s.progressed for s in running)):
            self.spare_timer.cancel()
            self._start_spare()  # the job is running: building a spare no longer competes with its start
        self._hold_spare()  # a worker started cold may have got as far as its group: the spare goes on

    def _write_progress(self) -> None:
        """Timer callback of the progress rate limit: rewrite agent.json, unless a write since has already carried the
        progress."""
        self.progress_timer = None
        if self.progress_dirty:
            self._write()

    # -- agent.json

    def _changed(self) -> None:
        """SchedulerLink's callback when the link's state changes: rewrite agent.json while the loop runs (after it,
        `_shutdown` writes the final document)."""
        if self.exit_code is None:
            self._write()

    def document(self) -> AgentDoc:
        """The agent.json document, also the control socket's `status` reply. No I/O; its fields are
        toolkit.agentdoc.AgentDoc's (commands.status adds `alive`)."""
        sp = self.spare
        return AgentDoc(
            version=agentdoc.VERSION, job=self.spec.job, host=self.spec.host,
            job_dir=str(self.spec.job_dir), job_id=self.spec.job_id,
            agent=agentdoc.AgentInfo(pid=self.pid, start_ticks=self.ticks, started_at=iso(self.started),
                                     python=sys.executable),
            state=agentdoc.AgentState(self.state), reason=self.reason, exit_code=self.exit_code,
            updated_at=iso(time.time()),
            scheduler=agentdoc.LinkDoc(address=f"{self.spec.sched_host}:{self.spec.sched_port}",
                                       link=agentdoc.LinkState(self.link.state), since=iso(self.link.since)),
            warm_spare=agentdoc.WarmSpareDoc(enabled=self.spare_enabled, pid=sp.child.pid if sp else None,
                                             ready=bool(sp and sp.ready), held=bool(sp and sp.held)),
            bind_core=self.spec.bind_core,
            spare=self.spec.spare, took_over=tuple(self.took_over),
            processes=tuple(s.document(self.spec.policy) for s in self.slots.values()),
            failure=self.failure,
        )

    def _write(self) -> None:
        """Rewrite agent.json atomically and note the time for the progress rate limit. atomicfile.write with VISIBLE
        durability: a reader sees the old or the new document, never a mix. Raises OSError if it cannot be written."""
        self.progress_dirty = False
        self.last_write = time.monotonic()
        atomicfile.write(self.spec.agent_json, self.document().to_json())
