"""The agent's processes: each one's launches (cold, or handed to the warm spare), its exits and what
toolkit.agent.policy decides of them (a relaunch now or after a backoff, giving up, settling), the operator's
restart, the scheduler's fencing kill, a spare host's takeover, and the stopping at the end. What the agent knows of
each is a Slot (slots.py).

Invariants, kept here and nowhere else: while the loop runs, a slot has a `child` exactly when that child's pidfd is
registered in the selector (`launch` registers, `_on_child` unregisters before reaping, `quiesce` unregisters the
rest for the final stop); once the agent is closing, nothing is launched or relaunched. Runs on the agent's loop
thread, through its selector and timers; what it needs of the agent it asks through toolkit.agent.port.AgentPort.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time

from toolkit import memcgroup, procs
from toolkit.agent import causes, openfiles, policy
from toolkit.agent.agentlog import AgentLog, iso, log_tail
from toolkit.agent.port import AgentPort
from toolkit.agent.slots import EXIT_HISTORY, Slot, WorkersOf, cpu_sets
from toolkit.agent.timers import Timers
from toolkit.agent.warmprocess import WarmSpare
from toolkit.contracts import envvars, protocol
from toolkit.contracts import messages as wire
from toolkit.contracts.agentdoc import AgentState, ExitRecord, Failure, ProcState
from toolkit.contracts.hostspec import HostSpec, ProcSpec
from toolkit.procs import Child, ExitStatus, LaunchSpec

DUMP_WAIT = 1.0  # s from a stuck worker's STACKS_SIGNAL to its SIGKILL: faulthandler writes in the handler itself
GAVE_UP_TAIL_BYTES = 8 << 10  # of the log tail sent with gave_up (a message is at most protocol.MAX_LINE)


class Processes:
    """This host's processes of one job, by node id (`slots`, in host.json's order; a takeover adds more).

    `base_env` is the children's environment; `agent` the Agent (its state, reports to the scheduler, agent.json,
    the end of the loop). It builds its warm spare (`warm`, which may take a relaunch), which reads the workers
    from the slots (slots.WorkersOf). `failure` is set when a process gives up (agent.json's `failure`). Raises
    UserError when bind_core asks for more CPUs than this process may use."""

    def __init__(self, spec: HostSpec, sel: selectors.BaseSelector, timers: Timers, log: AgentLog,
                 base_env: dict[str, str], agent: AgentPort) -> None:
        self.spec, self.sel, self.timers, self.log, self.base_env = spec, sel, timers, log, base_env
        self.agent = agent
        workers = [p for p in spec.processes if p.is_worker]
        sets = cpu_sets(os.sched_getaffinity(0), len(workers), spec.host) if spec.bind_core else []
        by_node = dict(zip((p.node_id for p in workers), sets, strict=False))  # no sets without bind_core
        self.slots = {p.node_id: Slot(p, by_node.get(p.node_id), spec.step_file(p.node_id)) for p in spec.processes}
        self.failure: Failure | None = None
        self.nofile = 0  # the workers' open-file limit (the agent raises it to the hard limit before the start)
        self.cgroup = memcgroup.of_process()  # the agent's memory cgroup, which its children share
        self.oom_kills = self._oom_kills()  # the cgroup's OOM kills as of the last exit recorded
        self.warm = WarmSpare(spec, sel, timers, log, base_env, WorkersOf(self.slots), agent)

    def start(self) -> None:
        """The first start: the scheduler, if it lives here, before the workers."""
        for slot in sorted(self.slots.values(), key=lambda s: s.spec.is_worker):
            self.launch(slot, "first start")

    def add(self, proc: ProcSpec, why: str) -> None:
        """A new process (a lost host's, taken over): a slot, launched at once."""
        slot = Slot(proc, None, self.spec.step_file(proc.node_id))
        self.slots[proc.node_id] = slot
        self.launch(slot, why)

    def any_running(self) -> bool:
        """Whether any process has a child now."""
        return any(s.child for s in self.slots.values())

    def fence(self, node_id: str, cause: str, dump: bool = False) -> None:
        """The scheduler declared `node_id`'s incarnation dead (`cause`): SIGKILL its group (an incarnation declared
        dead, e.g. SIGSTOPped, must lose its sockets); its death then goes through `_on_child` like any other, with
        `cause` as its first cause. With `dump` (a stuck rank) the process first gets protocol.STACKS_SIGNAL, on
        which it writes every thread's Python stack to its log (faulthandler: in the signal handler, without the
        GIL, so also when a call holding the GIL is what is stuck), and the SIGKILL follows DUMP_WAIT later. Raises
        RuntimeError if the node has no child (policy.Kill names only running ones: a bug)."""
        slot = self.slots[node_id]
        child = slot.child
        if child is None:
            raise RuntimeError(f"kill for {node_id}, which has no child")
        slot.fenced = cause
        if dump and slot.kill_timer is None and child.signal_leader(protocol.STACKS_SIGNAL):
            self.log(node_id, f"the scheduler declared pid {child.pid} dead ({cause}): its stacks to its log "
                              f"({protocol.STACKS_SIGNAL.name}), SIGKILL (fencing) in {DUMP_WAIT:g} s")
            slot.kill_timer = self.timers.after(DUMP_WAIT, lambda: child.signal_group(signal.SIGKILL))
            return
        self.log(node_id, f"the scheduler declared pid {child.pid} dead ({cause}): SIGKILL (fencing)")
        child.signal_group(signal.SIGKILL)

    def cancel_pending(self) -> None:
        """The job finished: pending relaunches are cancelled, and their processes end `stopped`."""
        for slot in self.slots.values():
            if slot.timer:
                slot.timer.cancel()
                slot.timer, slot.next_start, slot.state = None, None, ProcState.STOPPED

    def quiesce(self) -> list[Slot]:
        """After the loop: cancel every pending relaunch and kill timer, and take the live children's pidfds out of
        the selector (they are reaped by `stop`, outside the loop). Returns the slots with a child."""
        for slot in self.slots.values():
            for t in (slot.timer, slot.kill_timer):
                if t:
                    t.cancel()
            slot.next_start = None
        live = [s for s in self.slots.values() if s.child is not None]
        for slot in live:
            self.sel.unregister(slot.child)
        return live

    def stop(self, live: list[Slot], told: bool, why: str) -> None:
        """Stop the children of `live` (from `quiesce`) and record how each ended; blocking, bounded by about grace +
        procs.KILL_WAIT, twice when `told`. `told`: the agent failed and the scheduler has its reports, so a
        scheduler running here is given grace to exit on its own once the workers are stopped (it has the failure
        to record; a SIGTERM could come first and leave the job "stopped" with no cause). Processes not already
        succeeded or failed end `stopped`. `why`: what the agent stops them for (its reason: "stopped by fleet
        stop"), the cause of each exit it brings about."""
        workers = [s for s in live if s.spec.is_worker or not told]
        self.stop_children(workers, why)
        for slot in (s for s in live if s not in workers):
            status = slot.child.wait(self.spec.grace)
            if status is None:
                self.stop_children([slot], why)
            else:
                self.record_exit(slot, status)
                self.log(slot.spec.node_id, f"pid {slot.child.pid} exited ({status.describe()})")
        for slot in live:
            slot.child = None
            if slot.state not in (ProcState.SUCCEEDED, ProcState.FAILED):
                slot.state = ProcState.STOPPED
        for slot in self.slots.values():
            if slot.state in (ProcState.BACKOFF, ProcState.PENDING, ProcState.RESTARTING, ProcState.RUNNING):
                slot.state = ProcState.STOPPED

    def launch(self, slot: Slot, why: str) -> None:
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
        if self.agent.closing:
            return
        n = slot.launches
        env = dict(self.base_env)
        env[envvars.TORCHELASTIC_RESTART_COUNT] = str(n)
        slot.error_file, slot.fenced = causes.error_file(self.spec.errors_dir, slot.spec.node_id, n), None
        with contextlib.suppress(OSError):
            slot.error_file.unlink(missing_ok=True)
        env[envvars.TORCHELASTIC_ERROR_FILE] = str(slot.error_file)
        trouble = slot.fresh_steps()
        if trouble:
            self.log(slot.spec.node_id, trouble)
        if slot.step_file is not None:
            env[envvars.TOOLKIT_STEP_FILE] = str(slot.step_file)
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
                self._spawn_failed(slot, marker, e)
                return
        slot.child = child
        slot.last_pid, slot.last_ticks = child.pid, child.start_ticks
        slot.launches += 1
        slot.pids = (slot.pids + [child.pid])[-EXIT_HISTORY:]
        slot.started_mono, slot.started_wall = time.monotonic(), time.time()
        slot.state = ProcState.RUNNING
        slot.progressed = slot.said_done = False
        slot.files = openfiles.Trend(self.nofile) if slot.spec.is_worker else None
        self.sel.register(child, selectors.EVENT_READ, lambda _m, s=slot, c=child: self._on_child(s, c))
        since = ""
        if slot.seen_dead is not None:
            since = f", {1000 * (time.monotonic() - slot.seen_dead):.1f} ms after its exit was seen"
            slot.seen_dead = None
        self.log(slot.spec.node_id, f"started pid {child.pid} ({why}{', warm spare' if slot.warm else ''}"
                                    f"{', restart count ' + str(n) if n else ''}{since})")
        self.agent.write_doc()
        if not slot.warm:
            self.warm.hold()

    def _spawn_failed(self, slot: Slot, marker: str, e: Exception) -> None:
        """A spawn that failed (`e`): said in the agent's log and, after `marker`, in the process's; it counts as a
        launch and, one timer tick later, as an exit with code 127 (like a command not found), so that the restart
        policy applies to it as to any crash."""
        self.log(slot.spec.node_id, f"could not start {' '.join(slot.spec.argv)}: {e}")
        try:
            with open(slot.spec.log_file, "a", encoding="utf-8") as f:
                f.write(f"{marker}\ntoolkit agent: could not start: {e}\n")
        except OSError:
            pass
        slot.launches += 1
        slot.started_mono, slot.started_wall = time.monotonic(), time.time()
        slot.state = ProcState.RUNNING
        self.timers.after(0, lambda: self._after_exit(slot, None, ExitStatus(127, None)))

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

    def record_exit(self, slot: Slot, status: ExitStatus, pid: int | None = None,
                     step: int | None = None, operator: str | None = None) -> ExitRecord:
        """Record an exit as `slot.last_exit` and in its history (the last EXIT_HISTORY), with the `step` the
        incarnation had reached; returns the record. In memory only: the caller writes agent.json. Its `cause` is the
        first cause (toolkit.agent.causes: `operator`, the stop or restart the agent was asked for, when it ended
        the process; else the incarnation's error file, read and removed here, or for a set-up error (EXIT_SETUP)
        without one the line it ended its log with, or the scheduler's cause when the agent killed it for
        fencing), None when the code or signal says it all."""
        ran = time.monotonic() - slot.started_mono
        message = None
        if slot.error_file is not None:
            if not status.ok and operator is None:
                message = causes.read_error_file(slot.error_file)
            with contextlib.suppress(OSError):
                slot.error_file.unlink(missing_ok=True)
            slot.error_file = None
        if message is None and status.code == policy.EXIT_SETUP and operator is None:
            message = causes.last_word(log_tail(slot.spec.log_file, causes.LAST_WORD_LINES))
        before, self.oom_kills = self.oom_kills, self._oom_kills()
        oom = causes.oom_verdict(before, self.oom_kills, self.cgroup.dirs[0] if self.cgroup else "",
                                 self.cgroup.limit(memcgroup.read_text) if self.cgroup else None)
        rec = ExitRecord(**status.as_dict(), pid=pid, at=iso(time.time()), ran_for=round(ran, 3), step=step,
                         cause=causes.operator_cause(status, operator) or causes.first_cause(status, message,
                                                                                             slot.fenced, oom))
        slot.last_exit = rec
        slot.exits = (slot.exits + [rec])[-EXIT_HISTORY:]
        return rec

    def _oom_kills(self) -> int | None:
        return self.cgroup.oom_kills(memcgroup.read_text) if self.cgroup is not None else None

    def _after_exit(self, slot: Slot, child: Child | None, status: ExitStatus) -> None:
        """Record the exit, tell the scheduler at once, and apply what policy.on_exit decides. Runs on the loop thread,
        from `_on_child` or, for a failed spawn (`child` None: nothing is reported), a timer.

        The `exited` report is coalesced per node: while the scheduler is unreachable only a node's latest death waits
        to be sent. A pending SIGKILL of the operator's restart is cancelled and the `manual` flag consumed. Reactions:
        Settle (closing: the final state; a finishing agent finishes once nothing runs), Succeeded (exit 0; the agent
        finishes `succeeded` once every process of the host has), GiveUp (`_give_up`), Relaunch (`_relaunch`)."""
        pid = child.pid if child else None
        ran = time.monotonic() - slot.started_mono
        record = self.record_exit(slot, status, pid, slot.reached_step(),
                                  causes.RESTARTED_BY_OPERATOR if slot.manual else None)
        cause = record.cause
        if slot.kill_timer:
            slot.kill_timer.cancel()
            slot.kill_timer = None
        if pid is not None:
            self.agent.report(wire.Exited(slot.spec.node_id, pid, status.code, status.signal_name, cause),
                              coalesce=slot.spec.node_id)
        others = [s for s in self.slots.values() if s is not slot]
        facts = policy.Exited(
            code=status.code if status.signal is None else None, ran_for=ran, progressed=slot.progressed,
            counted=slot.counted, manual=slot.manual, closing=self.agent.closing,
            finishing=self.agent.state is AgentState.FINISHING,
            others_running=any(s.child for s in others),
            others_succeeded=all(s.state is ProcState.SUCCEEDED for s in others),
            reached=record.step, failed_at=slot.failed_at, said_done=slot.said_done)
        how = causes.describe(status, cause)
        reaction = policy.on_exit(self.spec.policy, facts, how)
        slot.manual = False
        slot.judged(reaction, record)
        node = slot.spec.node_id
        if isinstance(reaction, policy.Settle):
            slot.state = reaction.state
            if reaction.state is ProcState.FAILED:
                self._failed_after_end(slot, pid, status, how)
            else:
                self.log(node, f"pid {pid} exited ({how})")
            self.agent.write_doc()
            if reaction.finish:
                self.agent.finish_now()
        elif isinstance(reaction, policy.Succeeded):
            slot.state = ProcState.SUCCEEDED
            self.log(node, f"pid {pid} finished (exit code 0 after {ran:.1f} s)")
            self.agent.write_doc()
            if reaction.all_done:
                self.agent.finish(AgentState.SUCCEEDED, "every process of this host exited 0")
        elif isinstance(reaction, policy.GiveUp):
            self._give_up(slot, pid, status, ran, cause)
        else:
            self._relaunch(slot, reaction, facts.manual, status, pid, how, ran)

    def _relaunch(self, slot: Slot, reaction: policy.Relaunch, manual: bool, status: ExitStatus, pid: int | None,
                  how: str, ran: float) -> None:
        """Apply a Relaunch of `slot` (its incarnation `pid` ended `how` after `ran` s; `manual`: the operator's
        restart): `slot.counted` takes the policy's count, the agent's log says why, and the next incarnation
        starts now or, in state `backoff`, on a timer."""
        node = slot.spec.node_id
        slot.counted = reaction.counted
        if manual:
            self.log(node, f"pid {pid} ended ({how}) for the requested restart")
        elif status.code in (protocol.EXIT_FENCED, protocol.EXIT_REJOIN):
            slot.relaunched += 1  # the job's restart, not a fault of this process: `fleet status` counts it apart
            self.log(node, f"pid {pid} {how} (told to by the scheduler); relaunching now")
        else:
            budget = f"restart {reaction.counted} of {self.spec.policy.max_restarts}"
            when = "now" if reaction.delay <= 0 else f"in {reaction.delay:g} s"
            self.log(node, f"pid {pid} {how} after {ran:.1f} s{slot.files.cause() if slot.files else ''}; "
                           f"restarting {when} ({budget})")
        if reaction.delay <= 0:
            self.launch(slot, reaction.why)
        else:
            slot.state = ProcState.BACKOFF
            slot.next_start = time.time() + reaction.delay
            slot.timer = self.timers.after(reaction.delay, lambda: self.launch(slot, reaction.why))
            self.agent.write_doc()

    def _failed_after_end(self, slot: Slot, pid: int | None, status: ExitStatus, how: str) -> None:
        """`slot` exited non-zero (`how`) after it finished training (it said `done`, or the job had finished): not
        restarted (the scheduler counts its rank finished), but the job has failed, whatever its training did. The
        first such exit is the host's `failure` (cause, log tail); the agent ends `failed` once it is done."""
        tail = log_tail(slot.spec.log_file)
        cause = f"{how} at the end of the job"
        self.log(slot.spec.node_id, f"pid {pid} {cause}: the job has failed (a worker must exit 0); last "
                                    f"{len(tail)} lines of {slot.spec.log_file}:")
        for line in tail:
            self.log(slot.spec.node_id, f"| {line}")
        if self.failure is None:
            self.failure = Failure(
                host=self.spec.host, node_id=slot.spec.node_id, rank=slot.spec.rank, pid=pid, code=status.code,
                signal=status.signal_name, status=status.describe(), cause=cause, restarts=slot.counted,
                log_file=slot.spec.log_file, log_tail=tuple(tail), at=iso(time.time()))

    def _give_up(self, slot: Slot, pid: int | None, status: ExitStatus, ran: float, cause: str | None) -> None:
        """The job has failed here: `slot` died with its restarts used up (`cause`: its first cause, or None when its
        status says it all). Sets `failure` for agent.json (with the last lines of the process's log, also copied to
        the agent's log), reports `gave_up` to the scheduler (the tail cut to GAVE_UP_TAIL_BYTES so the message fits
        protocol.MAX_LINE), and finishes `failed`; the agent's shutdown then stops the other processes and
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
        slot.state = ProcState.FAILED
        reason = f"{spec.node_id} {how}{files} after {n} restart{'s' if n != 1 else ''} " \
                 f"(max_restarts {self.spec.policy.max_restarts}); the job has failed"
        where = f"rank {spec.rank}, " if spec.rank is not None else ""
        self.log(spec.node_id, f"GAVE UP: {where}pid {pid} {how} after {ran:.1f} s, and its "
                               f"{n} allowed restart(s) are used up; last {len(tail)} lines of {spec.log_file}:")
        for line in tail:
            self.log(spec.node_id, f"| {line}")
        self.agent.report(wire.GaveUp(spec.node_id, status.code, status.signal_name, cause,
                                      "\n".join(tail)[-GAVE_UP_TAIL_BYTES:]))
        self.agent.finish(AgentState.FAILED, reason)

    def count_open_files(self) -> None:
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
            self.agent.write_doc()
        if not self.agent.closing:
            self.timers.after(openfiles.SAMPLE_INTERVAL, self.count_open_files)

    def stop_children(self, slots: list[Slot], why: str) -> None:
        """SIGTERM `slots`' children (a worker alone, its helpers such as DataLoader workers left to serve its last
        words; the scheduler with its group), SIGKILL the groups still there after grace (procs.stop_all), and record
        how each ended, `why` its cause. Blocking, bounded by about grace + procs.KILL_WAIT."""
        if not slots:
            return
        names = {s.child.pid: s for s in slots}
        self.log("agent", f"stopping {', '.join(s.spec.node_id for s in slots)}: SIGTERM, "
                          f"then SIGKILL after {self.spec.grace:g} s")
        out = procs.stop_all(
            [s.child for s in slots], self.spec.grace,
            on_kill=lambda c: self.log(names[c.pid].spec.node_id,
                                       f"pid {c.pid} still running after {self.spec.grace:g} s: SIGKILL"),
            leaders=[s.child.pid for s in slots if s.spec.is_worker])
        for pid, status in out.items():
            slot = names[pid]
            self.record_exit(slot, status, operator=why)
            self.log(slot.spec.node_id, f"pid {pid} stopped ({status.describe()})")

    def manual_restart(self, node_id: str) -> dict:
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
        if self.agent.closing:
            return {"ok": False,
                    "error": f"the agent on {self.spec.host} is {self.agent.state}; nothing is restarted"}
        self.log(node_id, "restart requested by the operator (not counted against max_restarts)")
        if slot.child is None:
            if slot.timer:
                slot.timer.cancel()
            self.launch(slot, "restart requested by the operator")
            return {"ok": True, "node_id": node_id, "was_pid": None,
                    "pid": slot.child.pid if slot.child else None}
        child = slot.child
        if not slot.manual:
            slot.manual = True
            slot.state = ProcState.RESTARTING
            if slot.spec.is_worker:
                child.signal_leader(signal.SIGTERM)  # its DataLoader workers serve its last words
            else:
                child.signal_group(signal.SIGTERM)
            slot.kill_timer = self.timers.after(self.spec.grace, lambda: child.signal_group(signal.SIGKILL))
            self.agent.write_doc()
        return {"ok": True, "node_id": node_id, "was_pid": child.pid, "pid": None}
