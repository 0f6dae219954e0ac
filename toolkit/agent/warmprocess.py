"""The warm spare's life in the agent: a standby interpreter (toolkit.standby) with torch imported, which takes a dead
worker's place at its relaunch instead of a cold start. This module starts it, watches it (its socket says when it is
ready, its pidfd when it dies), holds it (SIGSTOP) beside a worker restarting cold, hands it a worker's place, and
kills it at the end; what it decides is in toolkit.agent.warmspare (pure).

Invariants: the spare's socket and pidfd are registered in the loop's selector exactly while `spare` is set (its
socket is unregistered early once it says it goes away); SPARE_MAX_FAILURES spares dying with no handoff between
turn spares off; a handoff resets that count. Runs on the agent's loop thread, through its selector and timers.
"""

from __future__ import annotations

import json
import selectors
import signal
import socket
import subprocess
import time

from toolkit import procs, standby
from toolkit.agent import warmspare
from toolkit.agent.agentlog import AgentLog, iso, log_tail
from toolkit.agent.control import CLIENT_TIMEOUT
from toolkit.agent.port import AgentPort, Workers
from toolkit.agent.timers import Timer, Timers
from toolkit.agent.warmspare import SPARE_DELAY, SPARE_MAX_FAILURES, Step
from toolkit.contracts.agentdoc import WarmSpareDoc
from toolkit.contracts.hostspec import HostSpec, ProcSpec
from toolkit.procs import Child, LaunchSpec


class Spare:
    """A warm interpreter waiting on `sock` (see toolkit.standby). `child` is the standby process, `sock` the agent's
    end of their socketpair, and `interpreter` the argv[0] it was started with: only a worker run by that same
    interpreter can be handed to it (standby.eligible). `ready` turns True when it sent standby.READY (its imports are
    done); only a ready spare takes a handoff. `told`: the private memory of a worker it was last told to fault in
    ahead (at its start, then at each top-up: warmspare.topup)."""

    def __init__(self, child: Child, sock: socket.socket, interpreter: str, started: float, told: int) -> None:
        self.child, self.sock, self.interpreter = child, sock, interpreter
        self.ready = False
        self.started = started
        self.told = told
        self.held = False  # SIGSTOPped while a worker restarts cold (toolkit.agent.warmspare)
        self.hold_timer: Timer | None = None
        self.topup_timer: Timer | None = None  # the next look at the workers' memory, while it is ready


class WarmSpare:
    """The agent's warm spare, on its selector `sel` and `timers`. `base_env` is the children's environment;
    `workers` what it reads of the workers (port.Workers: the template worker, the cold launches that hold it back,
    the memory to fault in ahead, toolkit.standby); `agent` whether the agent is closing, and agent.json's rewrite
    (port.AgentPort). Loop thread only."""

    def __init__(self, spec: HostSpec, sel: selectors.BaseSelector, timers: Timers, log: AgentLog,
                 base_env: dict[str, str], workers: Workers, agent: AgentPort) -> None:
        self.spec, self.sel, self.timers, self.log, self.base_env = spec, sel, timers, log, base_env
        self.workers, self.agent = workers, agent
        self.spare: Spare | None = None
        self.timer: Timer | None = None
        self.failures = 0  # spares that died on their own since the latest handoff
        self.enabled = spec.warm_spare and any(p.is_worker for p in spec.processes)

    def _step(self) -> Step:
        return warmspare.next_step(self.enabled, self.failures, self.agent.closing, self.spare is not None)

    def arm(self) -> None:
        """(Re)arm the spare timer for SPARE_DELAY from now if a spare is wanted (warmspare.next_step). A timer already
        armed is replaced. Called at the first start, after a handoff (so the next spare's imports do not compete with
        the replacement's start), and after a takeover."""
        if self._step() is Step.ARM:
            if self.timer:
                self.timer.cancel()
            self.timer = self.timers.after(SPARE_DELAY, self._start)

    def took_over(self) -> None:
        """A spare host took a lost host's workers: spares are on if the host spec says so and fewer than
        SPARE_MAX_FAILURES died, and one is armed."""
        self.enabled = self.spec.warm_spare and self.failures < SPARE_MAX_FAILURES
        self.arm()

    def progressed(self, running_progressed: list[bool]) -> None:
        """Workers reported progress (`running_progressed`: whether each running worker has, since its launch): a spare
        still waiting out SPARE_DELAY is started at once when they all have (warmspare.early_start); then the hold is
        decided again (a worker started cold may have got as far as its group)."""
        if (self.enabled and self.spare is None and self.timer is not None
                and warmspare.early_start(running_progressed)):
            self.timer.cancel()
            self._start()  # the job is running: building a spare no longer competes with its start
        self.hold()

    def _start(self) -> None:
        """Timer callback: start a warm spare, if one is wanted (warmspare.next_step). The spare is `<interpreter> -m
        toolkit.standby` with the template worker's interpreter and env file (so it imports the same torch), run in
        the job directory with its output in logs/standby.log and one end of a socketpair, told how much memory the
        largest worker holds now (it faults in as much ahead); it gets no CPUs of its own (it takes the worker's at
        handoff). While a worker restarts cold it is not started (warmspare.spare_plan) and
        the timer decides again later. A spare that cannot be spawned turns spares off for good: workers then restart
        cold."""
        self.timer = None
        if self._step() is not Step.ARM:
            return
        plan = warmspare.spare_plan(False, self.workers.cold_launches(), self.timers.now())
        if not plan.run and plan.until is not None:  # a worker restarts cold: importing now would slow it down
            self.timer = self.timers.after(plan.until - self.timers.now(), self._start)
            return
        template = self.workers.template()
        interpreter = template.argv[0]
        mine, theirs = socket.socketpair()
        memory = self.workers.largest_memory()
        argv = [interpreter, "-m", "toolkit.standby", "--fd", str(theirs.fileno()), "--memory", str(memory)]
        try:
            child = procs.spawn(LaunchSpec(
                argv=tuple(procs.env_argv(template.env_file, argv)), env=self.base_env, cwd=str(self.spec.job_dir),
                log_file=str(self.spec.standby_log), pass_fds=(theirs.fileno(),),
                marker=f"--- toolkit agent {self.spec.host}: warm spare at {iso(time.time())} ---"))
        except (OSError, subprocess.SubprocessError) as e:
            mine.close()
            self.log("agent", f"could not start a warm spare: {e}; workers restart cold")
            self.enabled = False
            return
        finally:
            theirs.close()
        mine.setblocking(False)
        self.spare = Spare(child, mine, interpreter, self.timers.now(), memory)
        self.log("agent", f"warm spare pid {child.pid} starting (importing {', '.join(standby.WARM_MODULES)}; "
                          f"a worker holds {memory >> 20} MB of private memory)")
        self.sel.register(mine, selectors.EVENT_READ, lambda _m: self._on_sock())
        self.sel.register(child, selectors.EVENT_READ, lambda _m: self._on_exit())
        self.agent.write_doc()

    def hold(self) -> None:
        """Hold the warm spare (SIGSTOP to its group) while it imports and a worker relaunched cold starts beside it,
        let it go on (SIGCONT) once none does (warmspare.spare_plan); a timer decides again when the hold's bound
        passes. A ready spare is idle and never held: one whose READY crossed the SIGSTOP (it was held before its
        READY was read) goes on as soon as it is read, else a handoff would go to a stopped process."""
        sp = self.spare
        if sp is None:
            return
        now = self.timers.now()
        plan = warmspare.spare_plan(sp.ready, self.workers.cold_launches(), now)
        if sp.hold_timer is not None:
            sp.hold_timer.cancel()
            sp.hold_timer = None
        if plan.run == sp.held:
            sp.held = not plan.run
            sp.child.signal_group(signal.SIGSTOP if sp.held else signal.SIGCONT)
            self.log("agent", f"warm spare pid {sp.child.pid} " + (
                "held: a worker restarts cold, and the spare's imports would slow it down" if sp.held
                else "goes on importing" if not sp.ready else "goes on: it was ready as it was held"))
            self.agent.write_doc()
        if plan.until is not None:
            sp.hold_timer = self.timers.after(plan.until - now, self.hold)

    def _on_sock(self) -> None:
        """Selector callback on the spare's socket: standby.READY marks the spare ready (its imports are done). Anything
        else (EOF, an error) means it is going away: the socket is unregistered, and its pidfd (`_on_exit`) handles
        the rest."""
        sp = self.spare
        try:
            data = sp.sock.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == standby.READY:
            sp.ready = True
            self.log("agent", f"warm spare pid {sp.child.pid} ready after {self.timers.now() - sp.started:.1f} s")
            self.agent.write_doc()
            self.hold()  # held while its READY was on the way: it must go on
            self._topup()  # the workers may have grown while it imported
        else:
            self.sel.unregister(sp.sock)  # it went away: its pidfd tells the rest

    def _topup(self) -> None:
        """At READY, then on a timer while a spare is ready: tell it the largest worker's memory once that has grown
        past what it was told (warmspare.topup), as one JSON line (toolkit.standby faults in the difference); look again
        TOPUP_EVERY later. A spare that cannot be told (gone, or its socket full for CLIENT_TIMEOUT) is left as it is:
        its pidfd tells a death."""
        sp = self.spare
        if sp is None or not sp.ready:
            return
        sp.topup_timer = self.timers.after(warmspare.TOPUP_EVERY, self._topup)
        memory = warmspare.topup(sp.told, self.workers.largest_memory())
        if memory is None:
            return
        try:
            sp.sock.settimeout(CLIENT_TIMEOUT)
            sp.sock.sendall(json.dumps({standby.TOPUP: memory}).encode() + b"\n")
        except OSError as e:
            self.log("agent", f"warm spare pid {sp.child.pid} could not be told the workers grew ({e})")
            return
        finally:
            sp.sock.setblocking(False)
        self.log("agent", f"warm spare pid {sp.child.pid}: a worker holds {memory >> 20} MB now (it was told "
                          f"{sp.told >> 20} MB): it faults in the rest ahead")
        sp.told = memory

    @staticmethod
    def _quiet(sp: Spare) -> None:
        """The spare's timers cancelled: it is gone or taken."""
        for timer in (sp.hold_timer, sp.topup_timer):
            if timer is not None:
                timer.cancel()
        sp.hold_timer = sp.topup_timer = None

    def _on_exit(self) -> None:
        """Selector callback: the spare died before any handoff. Its socket is closed and the failure counted; a new
        spare is built after SPARE_DELAY, unless SPARE_MAX_FAILURES spares died with no handoff in between, which turns
        spares off for the rest of this agent's life."""
        sp = self.spare
        self.sel.unregister(sp.child)
        status = sp.child.reap()
        if status is None:
            self.sel.register(sp.child, selectors.EVENT_READ, lambda _m: self._on_exit())
            return
        try:
            self.sel.unregister(sp.sock)
        except (KeyError, ValueError):
            pass
        sp.sock.close()
        self._quiet(sp)
        self.spare = None
        self.failures += 1
        tail = log_tail(self.spec.standby_log, 3)
        self.log("agent", f"warm spare pid {sp.child.pid} {status.describe()}"
                          + (f": {tail[-1]}" if tail else "") + f" (see {self.spec.standby_log})")
        step = self._step()
        if step is Step.OFF:
            self.enabled = False
            self.log("agent", f"{self.failures} warm spares died: no more spares, workers restart cold")
        elif step is Step.ARM:
            self.timer = self.timers.after(SPARE_DELAY, self._start)
        self.agent.write_doc()

    def take(self, worker: ProcSpec, cpus: frozenset[int] | None, env: dict[str, str], marker: str) -> Child | None:
        """Give `worker`'s place (bound to `cpus`) to the ready spare; None (and a cold start) if there is none or it
        cannot.

        Needs a ready spare and a worker argv it can run (standby.eligible). The worker's complete environment is
        computed here (procs.resolve_env: bash reads the env file, blocking the loop up to that function's timeout), and
        sent as one JSON line with argv, cwd, log file and CPUs after `marker` is appended to the worker's log; the send
        is bounded by CLIENT_TIMEOUT. On success the spare's process becomes the worker (the returned Child, same pid,
        which the caller registers), the count of failed spares is reset, and a new spare is armed. On failure the
        spare is left as it is (if it died, its pidfd says so)."""
        sp = self.spare
        if sp is None or not sp.ready or not standby.eligible(worker.argv, sp.interpreter):
            return None
        try:
            full = procs.resolve_env(worker.env_file, env, worker.cwd)
        except (OSError, subprocess.SubprocessError) as e:
            self.log(worker.node_id, f"warm spare not used: {e}")
            return None
        payload = json.dumps({"argv": list(worker.argv), "env": full, "cwd": worker.cwd,
                              "log_file": worker.log_file, "cpus": sorted(cpus) if cpus else None}) + "\n"
        try:
            with open(worker.log_file, "a", encoding="utf-8") as f:
                f.write(marker + "\n")
            sp.sock.settimeout(CLIENT_TIMEOUT)
            sp.sock.sendall(payload.encode())
        except OSError as e:
            self.log(worker.node_id, f"warm spare pid {sp.child.pid} did not take the handoff ({e})")
            return None
        self.sel.unregister(sp.sock)
        self.sel.unregister(sp.child)
        sp.sock.close()
        self._quiet(sp)
        self.spare = None
        self.failures = 0
        self.arm()
        return sp.child

    def cancel(self) -> None:
        """Build no more spares (the agent is shutting down): the pending start is cancelled."""
        if self.timer:
            self.timer.cancel()

    def stop(self) -> None:
        """Kill the spare, if there is one: SIGKILL to its group at once (it holds no state worth a grace period),
        waited for up to procs.KILL_WAIT; its socket and pidfd leave the selector."""
        if self.spare is None:
            return
        sp, self.spare = self.spare, None
        self._quiet(sp)
        for obj in (sp.child, sp.sock):
            if obj in (k.fileobj for k in self.sel.get_map().values()):
                self.sel.unregister(obj)
        sp.child.signal_group(signal.SIGKILL)
        sp.child.wait(procs.KILL_WAIT)
        sp.sock.close()

    def document(self) -> WarmSpareDoc:
        """agent.json's `warm_spare`: whether spares are on, and the spare's pid, readiness and hold (no I/O)."""
        sp = self.spare
        return WarmSpareDoc(enabled=self.enabled, pid=sp.child.pid if sp else None,
                            ready=bool(sp and sp.ready), held=bool(sp and sp.held))
