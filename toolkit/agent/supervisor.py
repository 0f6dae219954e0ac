"""The per-host supervisor: it starts this host's processes (the scheduler if it lives here, and the workers)
from host.json, each in its own session with its env file and log file, and keeps them alive. A child's death is an
event on its pidfd, reported to the scheduler at once (so the others recover without waiting for a heartbeat to
expire) and followed by what toolkit.agent.policy decides: a relaunch with the same environment and rank (from the
warm spare when one is ready; one still importing is held while a worker restarts cold: warmspare.py), a backoff,
or giving up. One thread, one selector loop: children's pidfds, the control socket, the progress socket, the
scheduler link, signals (through the wakeup fd) and timers.

This module is the loop, the agent's life (setup, signals, the first `finish`, the shutdown order) and the
dispatch of the scheduler's messages and the control requests. Each concern lives in its own module: the processes'
launches, exits and relaunches in processes.py (what to do is decided in policy.py), the warm spare in warmprocess.py,
the sockets' conversations in control.py and progressinbox.py, and when agent.json (toolkit.contracts.agentdoc) is
rewritten in docwriter.py: at once on every change of state, at most once per PROGRESS_WRITE_INTERVAL for progress.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable

from toolkit import atomicfile, netif, procs
from toolkit.agent import openfiles, policy
from toolkit.agent.agentlog import AgentLog, iso
from toolkit.agent.control import ControlServer
from toolkit.agent.docwriter import DocWriter
from toolkit.agent.link import SchedulerLink
from toolkit.agent.processes import Processes
from toolkit.agent.progressinbox import ProgressInbox, Report
from toolkit.agent.slots import running
from toolkit.agent.timers import Timer, Timers
from toolkit.contracts import agentdoc, envvars, protocol
from toolkit.contracts import messages as wire
from toolkit.contracts.agentdoc import AgentDoc, AgentState, ControlOp, ProcState, Takeover, recorded_groups
from toolkit.contracts.hostspec import HostSpec

REPORT_FLUSH_TIMEOUT = 3.0  # s to deliver the last reports (gave_up) before exiting
IDLE_WAKE = 30.0  # s: the loop wakes at least this often (nothing depends on it; it bounds every select)
STOP_BY_MAX = 80  # characters of a stop request's `by` kept in the reason (it comes from the control socket)

EXIT_OK = 0
EXIT_FAILED = 1  # a process passed max_restarts here, or the scheduler stopped the job
EXIT_USAGE = 2  # bad host.json or command line (UserError)
EXIT_STOPPED = 3  # stopped by the operator (SIGTERM, stop)
EXIT_CODES = {AgentState.SUCCEEDED: EXIT_OK, AgentState.FAILED: EXIT_FAILED,  # by the agent's final state
              AgentState.STOPPED: EXIT_STOPPED}


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

    Invariants: while the loop runs, a slot has a `child` exactly when that child's pidfd is registered in the selector
    (kept by Processes); once `closing` is set nothing is launched or relaunched; the first `finish` fixes the exit
    code, state and reason; agent.json is rewritten after every change of state (for progress alone, at most once per
    PROGRESS_WRITE_INTERVAL). `state` goes starting -> running -> [finishing ->] [stopping ->] succeeded, failed or
    stopped, with exit code EXIT_OK, EXIT_FAILED or EXIT_STOPPED (EXIT_CODES)."""

    def __init__(self, spec: HostSpec, log: AgentLog) -> None:
        """Prepare the slots; no file, socket or process yet (`run` makes those). Raises UserError when bind_core asks
        for more CPUs than this process may use. The agent's own environment is read once: children get a copy
        (`base_env`), plus GLOO_SOCKET_IFNAME naming the interface of the route toward the scheduler unless it is set
        already (a route lookup that may resolve the scheduler's name), and GLOO_ENABLE_STORE_V2_API=1 and
        GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1 unless set (gloo's bootstrap in about N/128 store requests per rank)."""
        self.spec, self.log = spec, log
        self.sel = selectors.DefaultSelector()
        self.timers = Timers()
        self.state: AgentState = AgentState.STARTING
        self.reason: str | None = None
        self.exit_code: int | None = None
        self.closing = False  # finishing or stopping: nothing is relaunched any more
        self.pid = os.getpid()
        self.ticks = procs.start_ticks(self.pid)
        self.started = time.time()
        self.base_env = dict(os.environ)  # a copy: the agent's own environment is never written
        self.base_env.pop(envvars.TOOLKIT_INJECT_CORRUPTION, None)  # the fault injector: from the env file only
        if envvars.GLOO_SOCKET_IFNAME not in self.base_env:  # gloo's own choice is loopback where the hostname misleads
            interface = netif.interface_toward(spec.sched_host, spec.sched_port)
            if interface is not None:
                self.base_env[envvars.GLOO_SOCKET_IFNAME] = interface
        # gloo's bootstrap in O(N/128) requests
        for name in (envvars.GLOO_ENABLE_STORE_V2_API, envvars.GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER):
            self.base_env.setdefault(name, "1")
        # huge pages for the workers' tensors: a dead worker's memory goes back in a sixth of the time
        self.base_env.setdefault(envvars.THP_MEM_ALLOC_ENABLE, "1")
        self.writer = DocWriter(spec.agent_json, self.timers, self.document)
        self.took_over: list[Takeover] = []  # a spare's takeovers
        # the processes and their warm spare talk to this agent through toolkit.agent.port.AgentPort (its methods
        # below); they run only once the loop does, when the link exists too
        self.processes = Processes(spec, self.sel, self.timers, log, self.base_env, self)
        self.warm = self.processes.warm
        slots = self.processes.slots
        self.link = SchedulerLink(spec, self.sel, self.timers, log, self._on_scheduler, self._changed,
                                  self._hello, lambda: wire.Heartbeat(running=running(slots.values())))
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
        `finish`; `_shutdown` then stops what is left and its exit code is returned. An exception out of a callback (a
        bug, or agent.json unwritable) fails the agent: it is logged, `_shutdown` still stops every child (within its
        bound), and the exception propagates."""
        try:
            self._setup()
        except BaseException:
            self._close_sockets()
            raise
        before, self.processes.nofile = procs.raise_open_files()  # gloo: a descriptor per connection to its port
        what = f"supervising {', '.join(self.processes.slots)}" if self.processes.slots else \
            f"standing by as a spare for {len(self.spec.standby)} worker(s)"
        self.log("agent", f"agent pid {self.pid} {what} of job {self.spec.job} "
                          f"(max_restarts {self.spec.policy.max_restarts}, grace {self.spec.grace:g} s, "
                          f"warm spare {'on' if self.warm.enabled else 'off'}"
                          f"{', bind_core' if self.spec.bind_core else ''}, open files {self.processes.nofile}"
                          f"{f' (raised from {before})' if self.processes.nofile > before else ''})")
        self.processes.start()
        if self.state is AgentState.STARTING:
            self.state = AgentState.RUNNING
        self.writer.write()
        self.link.start()
        self.warm.arm()
        self.timers.after(openfiles.SAMPLE_INTERVAL, self.processes.count_open_files)
        if ready is not None:
            ready(f"ready {self.pid}")
        try:
            while self.exit_code is None:
                events = self.sel.select(self.timers.timeout(IDLE_WAKE))
                events.sort(key=lambda e: not self.progress.owns(e[0].fileobj))  # a `done` before its exit
                for key, mask in events:
                    if self.sel.get_map().get(key.fd) is not key:
                        continue  # unregistered by an earlier event of this batch
                    key.data(mask)
                    if self.exit_code is not None:
                        break
                self.timers.run_due()
        except BaseException as e:
            self.log("agent", f"internal error, stopping everything: {type(e).__name__}: {e}")
            self.finish(AgentState.FAILED, f"agent error: {type(e).__name__}: {e}")
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

    # -- the port the processes and the warm spare talk through (toolkit.agent.port.AgentPort)

    def finish(self, state: AgentState, reason: str | None) -> None:
        """Leave the loop; _shutdown does the stopping. Returns at once. Only the first call counts: it fixes `state`,
        the exit code (EXIT_CODES) and `reason` (a SIGTERM during a give-up changes nothing). Sets `closing`, so no
        exit from now on is relaunched."""
        if self.exit_code is None:
            self.state, self.exit_code, self.reason = state, EXIT_CODES[state], reason
            self.closing = True

    def report(self, message: wire.Message, coalesce: str | None = None) -> None:
        """A message for the scheduler, through the link (SchedulerLink.report: never blocks, never raises)."""
        self.link.report(message, coalesce)

    def write_doc(self) -> None:
        """Rewrite agent.json now (a process's or the spare's state changed)."""
        self.writer.write()

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
        live = self.processes.quiesce()  # reaped below, outside the loop
        self.warm.cancel()
        final_state = self.state
        if live or self.warm.spare:
            self.state = AgentState.STOPPING
            self.writer.write()
        delivered = not self.link.closed
        if (self.link.queue or self.link.wbuf) and not self.link.closed:
            delivered = self.link.flush(REPORT_FLUSH_TIMEOUT)
            if not delivered:
                self.log("agent", "could not deliver the last reports to the scheduler")
        self.link.close()
        self.warm.stop()
        # a scheduler here has the failure
        self.processes.stop(live, told=final_state is AgentState.FAILED and delivered,
                            why=self._stopped_why(final_state))
        self.state = final_state
        self.writer.write()
        self.log("agent", f"agent exits: {self.state}" + (f" ({self.reason})" if self.reason else "")
                 + f", exit status {self.exit_code}")
        self._close_sockets()
        return self.exit_code

    def _stopped_why(self, state: AgentState) -> str:
        """The cause of the exits `_shutdown` brings about for an agent ending in `state`: the operator's stop as
        the agent's reason says it ("stopped by fleet stop", "stopped by SIGTERM"), else that the job failed or had
        finished."""
        if state is AgentState.STOPPED:
            return self.reason or "stopped"
        if state is AgentState.FAILED:
            return "stopped: the job failed"
        return "stopped: still running after the job finished"

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

    # -- the scheduler's messages

    def _on_scheduler(self, msg: wire.Message) -> None:
        """Apply policy.on_scheduler to one message from the scheduler. SchedulerLink calls it only once the link is up
        (the scheduler has proved the job token).

        `kill`: SIGKILL the node's group (fencing: an incarnation declared dead, e.g. SIGSTOPped, must lose its
        sockets; a stuck one first writes its stacks); its death then goes through `_on_child` like any other.
        `stop`: finish `failed` with EXIT_FAILED.
        `finished`: close the link (the scheduler exits), cancel pending restarts, state `finishing`, and finish with
        EXIT_OK once nothing runs, or after `grace` s (`_shutdown` stops the rest). Anything else is logged and ignored.
        Raises RuntimeError only if the policy names a node without a child (a bug)."""
        running = {s.spec.node_id: s.child.pid for s in self.processes.slots.values() if s.child is not None}
        reaction = policy.on_scheduler(msg, running, self.closing, [p.node_id for p in self.spec.standby],
                                       list(self.processes.slots))
        if isinstance(reaction, policy.TakeOver):
            self._take_over(reaction, msg.seq if isinstance(msg, wire.TakeOver) else None)
        elif isinstance(reaction, policy.Kill):
            self.processes.fence(reaction.node_id, reaction.cause, reaction.dump)
        elif isinstance(reaction, policy.StopJob):
            self.log("agent", f"the scheduler stopped the job: {reaction.reason}")
            self.finish(AgentState.FAILED, f"stopped by the scheduler: {reaction.reason}")
        elif isinstance(reaction, policy.FinishJob):
            self.log("agent", "the scheduler says the job finished")
            self.link.close()  # it exits now; nothing more to tell it
            self.closing = True
            self.state = AgentState.FINISHING
            self.processes.cancel_pending()
            if not self.processes.any_running():
                self.finish_now()
            else:
                self._stop_after = self.timers.after(self.spec.grace, self.finish_now)
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
        self.took_over.append(Takeover(host=reaction.host, node_ids=tuple(reaction.node_ids), seq=seq,
                                       at=iso(time.time())))
        for node_id in reaction.node_ids:
            self.processes.add(standby[node_id], f"takeover of {reaction.host}")
        self.warm.took_over()
        self.writer.write()

    def _hello(self) -> wire.AgentHello:
        """What the agent's hello says: its host, the node ids it supervises now (a spare's grow with each takeover),
        and whether it is a spare host's agent (the scheduler may hand it a lost host's ranks)."""
        return wire.AgentHello(self.spec.host, tuple(self.processes.slots), self.spec.spare)

    def finish_now(self) -> None:
        """End a finishing agent: called when its last child has exited or when the grace period after `finished`
        runs out; cancels that grace timer. Success (EXIT_OK) unless a process of this host exited non-zero after
        the end (Processes.failure): then `failed` (EXIT_FAILED), that exit its cause."""
        if self._stop_after:
            self._stop_after.cancel()
        bad = self.processes.failure
        if bad is not None:
            self.finish(AgentState.FAILED, f"{bad.node_id} {bad.cause}; the job has failed")
            return
        self.finish(AgentState.SUCCEEDED, "the scheduler said the job finished")

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
            self.finish(AgentState.STOPPED, f"stopped by {name}")

    def _control_request(self, req: Any) -> tuple[dict, Callable[[], None] | None]:
        """One control request -> (reply, action to run once the reply is sent, or None). The ops are
        agentdoc.ControlOp: `status` returns the agent.json document, `stop` replies ok and defers
        `finish(AgentState.STOPPED)` (its reason "stopped by BY" when the request names who, `by`:
        `fleet stop`), `restart` is `_manual_restart`; anything else, a request that is
        not an object included, gets an error naming the known ops."""
        op = req.get("op") if isinstance(req, dict) else None
        if op == ControlOp.STATUS:
            return self.document().to_dict(), None
        if op == ControlOp.STOP:
            by = req.get("by")
            reason = f"stopped by {protocol.one_line(by)[:STOP_BY_MAX]}" if isinstance(by, str) and by.strip() \
                else "stop requested"
            self.log("agent", f"stop requested on the control socket ({reason})")
            return {"ok": True}, lambda: self.finish(AgentState.STOPPED, reason)
        if op == ControlOp.RESTART:
            return self.processes.manual_restart(str(req.get("node_id"))[:256]), None
        known = ", ".join(o.value for o in ControlOp)
        return {"ok": False, "error": f"unknown op {str(op)[:40]!r}; one of {known}"}, None

    def _on_progress(self, reports: list[Report]) -> None:
        """ProgressInbox's callback, once per wake-up: record the workers' progress (Slot.note_progress; a report
        naming no process here is ignored); agent.json is rewritten for it at most once per
        docwriter.PROGRESS_WRITE_INTERVAL. Once every running worker has progressed, a spare still waiting out
        SPARE_DELAY is started at once: the job is past its start, so building one no longer competes with it."""
        changed = False
        for report in reports:
            slot = self.processes.slots.get(report.node_id)
            if slot is not None and slot.note_progress(report, time.time()):
                changed = True
        if changed:
            self.writer.progressed()
        running = [s for s in self.processes.slots.values() if s.spec.is_worker and s.state is ProcState.RUNNING]
        self.warm.progressed([s.progressed for s in running])

    # -- agent.json

    def _changed(self) -> None:
        """SchedulerLink's callback when the link's state changes: rewrite agent.json while the loop runs (after it,
        `_shutdown` writes the final document)."""
        if self.exit_code is None:
            self.writer.write()

    def document(self) -> AgentDoc:
        """The agent.json document, also the control socket's `status` reply (as its to_dict). No I/O; its fields are
        toolkit.contracts.agentdoc.AgentDoc's (commands.status adds `alive`)."""
        return AgentDoc(
            version=agentdoc.VERSION, job=self.spec.job, host=self.spec.host,
            job_dir=str(self.spec.job_dir), job_id=self.spec.job_id,
            agent=agentdoc.AgentInfo(pid=self.pid, start_ticks=self.ticks, started_at=iso(self.started),
                                     python=sys.executable),
            state=self.state, reason=self.reason, exit_code=self.exit_code,
            updated_at=iso(time.time()),
            scheduler=agentdoc.LinkDoc(address=f"{self.spec.sched_host}:{self.spec.sched_port}",
                                       link=self.link.state, since=iso(self.link.since)),
            warm_spare=self.warm.document(),
            bind_core=self.spec.bind_core,
            spare=self.spec.spare, took_over=tuple(self.took_over),
            processes=tuple(s.document(self.spec.policy) for s in self.processes.slots.values()),
            failure=self.processes.failure,
        )
