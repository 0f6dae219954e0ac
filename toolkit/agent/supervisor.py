"""The per-host supervisor: it starts this host's processes (the scheduler if it lives here, and the workers)
from host.json, each in its own session with its env file and log file, and keeps them alive. A child's death is an
event on its pidfd, reported to the scheduler at once (so the others recover without waiting for a heartbeat to
expire) and followed by what toolkit.agent.policy decides: a relaunch with the same environment and rank (from the
warm spare when one is ready; one still importing is held while a worker restarts cold: warmspare.py), a backoff,
or giving up. One thread, one selector loop: children's pidfds, the control socket, the progress socket, the
scheduler link, signals (through the wakeup fd) and timers.

This module applies decisions and does the I/O; what to do is decided in policy.py. The sockets' conversations are
kept bounded in control.py and progressinbox.py; agent.json (toolkit.agentdoc) is rewritten by docwriter.py, at
once on every change of state and at most once per PROGRESS_WRITE_INTERVAL for progress.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from toolkit import atomicfile, netif, procs
from toolkit import envvars as E
from toolkit import protocol as P
from toolkit.agent import causes, openfiles, policy
from toolkit.agent.control import ControlServer
from toolkit.agent.docwriter import DocWriter
from toolkit.agent.link import SchedulerLink
from toolkit.agent.log import AgentLog, iso, log_tail
from toolkit.agent.progressinbox import ProgressInbox, Report
from toolkit.agent.slots import EXIT_HISTORY, Slot, cold_launches, cpu_sets, running
from toolkit.agent.spare import WarmSpare
from toolkit.agent.timers import Timer, Timers
from toolkit.agentdoc import ControlOp, recorded_groups
from toolkit.hostspec import HostSpec
from toolkit.procs import Child, ExitStatus, LaunchSpec

REPORT_FLUSH_TIMEOUT = 3.0  # s to deliver the last reports (gave_up) before exiting
IDLE_WAKE = 30.0  # s: the loop wakes at least this often (nothing depends on it; it bounds every select)
GAVE_UP_TAIL_BYTES = 8 << 10  # of the log tail sent with gave_up (a message is at most protocol.MAX_LINE)
AGENT_DOC_VERSION = 1  # agent.json's "version"

EXIT_OK = 0
EXIT_FAILED = 1  # a process passed max_restarts here, or the scheduler stopped the job
EXIT_USAGE = 2  # bad host.json or command line (UserError)
EXIT_STOPPED = 3  # stopped by the operator (SIGTERM, stop)


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
        self.failure: dict[str, Any] | None = None
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
        self.warm = WarmSpare(spec, self.sel, self.timers, log, self.base_env,
                              template=lambda: next(s.spec for s in self.slots.values() if s.spec.is_worker),
                              cold=lambda: cold_launches(self.slots.values()), closing=lambda: self.closing,
                              changed=lambda: self.writer.write())
        self.writer = DocWriter(spec.agent_json, self.timers, self.document)
        self.took_over: list[dict[str, Any]] = []  # a spare's takeovers: {host, node_ids, seq, at}
        self.nofile = 0  # the workers' open-file limit (run raises it to the hard limit)
        self.link = SchedulerLink(spec, self.sel, self.timers, log, self._on_scheduler, self._changed,
                                  self._hello_fields, lambda: {"running": running(self.slots.values())})
        self._stop_after: Timer | None = None
        self._wake_r: socket.socket | None = None
        self.control = ControlServer(spec.control_socket, self.sel, self.timers, self._control_request)
        self.progress = ProgressInbox(spec.progress_socket, self.sel, self._on_progress)

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
                          f"warm spare {'on' if self.warm.enabled else 'off'}"
                          f"{', bind_core' if self.spec.bind_core else ''}, open files {self.nofile}"
                          f"{f' (raised from {before})' if self.nofile > before else ''})")
        for slot in sorted(self.slots.values(), key=lambda s: s.spec.is_worker):
            self._launch(slot, "first start")
        if self.state == "starting":
            self.state = "running"
        self.writer.write()
        self.link.start()
        self.warm.arm()
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

        self.control.open()

        self.progress.open()

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
        self.warm.cancel()
        live = [s for s in self.slots.values() if s.child is not None]
        for slot in live:
            self.sel.unregister(slot.child)  # reaped below, outside the loop
        final_state = self.state
        if live or self.warm.spare:
            self.state = "stopping"
            self.writer.write()
        delivered = not self.link.closed
        if (self.link.queue or self.link.wbuf) and not self.link.closed:
            delivered = self.link.flush(REPORT_FLUSH_TIMEOUT)
            if not delivered:
                self.log("agent", "could not deliver the last reports to the scheduler")
        self.link.close()
        self.warm.stop()
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
        self.writer.write()
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
        self.control.close()
        self.progress.close()
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
        the place when it can (WarmSpare.take), else procs.spawn starts it cold. A spawn that fails (OSError,
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
        child = self.warm.take(slot.spec, slot.cpus, env, marker)
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
        self.writer.write()
        if not slot.warm:
            self.warm.hold()

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
        self.warm.hold()  # a worker starting cold may be gone

    def _record_exit(self, slot: Slot, status: ExitStatus, pid: int | None = None,
                     step: int | None = None) -> dict[str, Any]:
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
        rec = {**status.as_dict(), "pid": pid, "at": iso(time.time()), "ran_for": round(ran, 3), "step": step,
               "cause": causes.first_cause(status, message, slot.fenced)}
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
        cause = record["cause"]
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
            reached=record["step"], failed_at=slot.failed_at)
        how = causes.describe(status, cause)
        reaction = policy.on_exit(self.spec.policy, facts, how)
        slot.manual = False
        slot.judged(reaction, record)
        node = slot.spec.node_id
        if isinstance(reaction, policy.Settle):
            slot.state = reaction.state
            self.log(node, f"pid {pid} exited ({how})")
            self.writer.write()
            if reaction.finish:
                self._finish_now()
        elif isinstance(reaction, policy.Succeeded):
            slot.state = "succeeded"
            self.log(node, f"pid {pid} finished (exit code 0 after {ran:.1f} s)")
            self.writer.write()
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
                self.writer.write()

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
        self.failure = {
            "host": self.spec.host, "node_id": spec.node_id, "rank": spec.rank, "pid": pid,
            "code": status.code, "signal": status.signal_name, "status": status.describe() + files,
            "cause": how + files, "restarts": n, "log_file": spec.log_file, "log_tail": tail, "at": iso(time.time()),
        }
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
            self.writer.write()
        if not self.closing:
            self.timers.after(openfiles.SAMPLE_INTERVAL, self._count_open_files)

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
                self.writer.write()
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
        self.took_over.append({"host": reaction.host, "node_ids": list(reaction.node_ids), "seq": seq,
                               "at": iso(time.time())})
        for node_id in reaction.node_ids:
            slot = Slot(standby[node_id], None, self.spec.step_file(node_id))
            self.slots[node_id] = slot
            self._launch(slot, f"takeover of {reaction.host}")
        self.warm.took_over()
        self.writer.write()

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

    def _control_request(self, req: Any) -> tuple[dict, Callable[[], None] | None]:
        """One control request -> (reply, action to run once the reply is sent, or None). The ops are
        agentdoc.ControlOp: `status` returns the agent.json document, `stop` replies ok and defers `_finish("stopped",
        EXIT_STOPPED)`, `restart` is `_manual_restart`; anything else, a request that is not an object included, gets an
        error naming the known ops."""
        op = req.get("op") if isinstance(req, dict) else None
        if op == ControlOp.STATUS:
            return self.document(), None
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
            self.writer.write()
        return {"ok": True, "node_id": node_id, "was_pid": child.pid, "pid": None}

    def _on_progress(self, reports: list[Report]) -> None:
        """ProgressInbox's callback, once per wake-up: record the workers' progress (Slot.note_progress; a report
        naming no process here is ignored); agent.json is rewritten for it at most once per
        docwriter.PROGRESS_WRITE_INTERVAL. Once every running worker has progressed, a spare still waiting out
        SPARE_DELAY is started at once: the job is past its start, so building one no longer competes with it."""
        changed = False
        for report in reports:
            slot = self.slots.get(report.node_id)
            if slot is not None and slot.note_progress(report, time.time()):
                changed = True
        if changed:
            self.writer.progressed()
        running = [s for s in self.slots.values() if s.spec.is_worker and s.state == "running"]
        self.warm.progressed([s.progressed for s in running])

    # -- agent.json

    def _changed(self) -> None:
        """SchedulerLink's callback when the link's state changes: rewrite agent.json while the loop runs (after it,
        `_shutdown` writes the final document)."""
        if self.exit_code is None:
            self.writer.write()

    def document(self) -> dict[str, Any]:
        """The agent.json document, also the control socket's `status` reply. No I/O; its fields are those of
        docs/architecture.md and toolkit.agentdoc (commands.status adds `alive`)."""
        return {
            "version": AGENT_DOC_VERSION, "job": self.spec.job, "host": self.spec.host,
            "job_dir": str(self.spec.job_dir), "job_id": self.spec.job_id,
            "agent": {"pid": self.pid, "start_ticks": self.ticks, "started_at": iso(self.started),
                      "python": sys.executable},
            "state": self.state, "reason": self.reason, "exit_code": self.exit_code, "updated_at": iso(time.time()),
            "scheduler": {"address": f"{self.spec.sched_host}:{self.spec.sched_port}", "link": self.link.state,
                          "since": iso(self.link.since)},
            "warm_spare": self.warm.document(),
            "bind_core": self.spec.bind_core,
            "spare": self.spec.spare, "took_over": self.took_over,
            "processes": [s.document(self.spec.policy) for s in self.slots.values()],
            "failure": self.failure,
        }
