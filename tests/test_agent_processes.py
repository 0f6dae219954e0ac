"""The agent's processes (toolkit.agent.processes) with real short processes, a real selector and timers on a fake
clock: crashes through the restart policy to the give-up, a spawn that fails, the operator's restart, a clean exit.
After every event the first invariant holds: a slot has a child exactly when that child's pidfd is registered."""

from __future__ import annotations

import selectors
import signal
import time
from pathlib import Path
from typing import Any

from toolkit.agent.agentlog import AgentLog
from toolkit.agent.port import AgentPort, Workers
from toolkit.agent.processes import Processes
from toolkit.agent.slots import WorkersOf
from toolkit.agent.supervisor import Agent
from toolkit.agent.timers import Timers
from toolkit.contracts import envvars as E
from toolkit.contracts import messages as wire
from toolkit.contracts import protocol as P
from toolkit.contracts.agentdoc import AgentState
from toolkit.contracts.hostspec import HostSpec, ProcSpec, RestartPolicy
from toolkit.testing.clock import FakeClock

BOUND = 30.0  # s of real time a short process may take on a loaded machine
IDLE = 1e6  # a select cap no timer reaches


class Rig:
    """Processes as the agent drives them; the rig is its AgentPort (toolkit.agent.port) and records what is asked."""

    def __init__(self, tmp_path: Path, argvs: dict[str, tuple[str, ...]], cwd: str | None = None) -> None:
        procs = tuple(ProcSpec(node_id=n, role=E.ROLE_WORKER, rank=i, local_rank=i, argv=argv,
                               cwd=cwd or str(tmp_path), env_file=str(tmp_path / "env"),
                               log_file=str(tmp_path / f"{n}.log")) for i, (n, argv) in enumerate(argvs.items()))
        (tmp_path / "env").write_text("")
        self.spec = HostSpec(job="j", host="h", job_dir=tmp_path, sched_host="127.0.0.1", sched_port=1,
                             token_file=tmp_path / "token", grace=5.0, bind_core=False, warm_spare=False,
                             policy=RestartPolicy(max_restarts=2, backoff_base=1.0, backoff_max=30.0),
                             processes=procs)
        self.spec.errors_dir.mkdir(parents=True)
        self.sel = selectors.DefaultSelector()
        self.clock = FakeClock()
        self.timers = Timers(self.clock)
        log = AgentLog(tmp_path / "logs" / "agent.log", "h")
        self.reports: list[tuple[str, dict[str, Any]]] = []
        self.finished: list[tuple[str, str | None]] = []
        self.writes, self.closing, self.state = 0, False, AgentState.RUNNING
        self.p = Processes(self.spec, self.sel, self.timers, log, {"PATH": "/usr/bin:/bin"}, self)

    def report(self, message: wire.Message, coalesce: str | None = None) -> None:
        self.reports.append((message.OP, message.encode()))

    def write_doc(self) -> None:
        self.writes += 1

    def finish(self, state: AgentState, reason: str | None) -> None:
        self.finished.append((state, reason))

    def finish_now(self) -> None:
        """Only a finishing agent's processes call it; these tests run none."""

    def check(self) -> None:
        """Invariant 1: the slots with a child are exactly the registered pidfds."""
        children = {id(s.child) for s in self.p.slots.values() if s.child is not None}
        assert children == {id(k.fileobj) for k in self.sel.get_map().values()}

    def until(self, cond: Any) -> None:
        """Dispatch events and due timers, checking the invariant after each, until `cond()` (bounded)."""
        deadline = time.monotonic() + BOUND
        self.check()
        while not cond():
            assert time.monotonic() < deadline, "the processes did not get there"
            for key, mask in self.sel.select(0.05):
                if self.sel.get_map().get(key.fd) is key:
                    key.data(mask)
                    self.check()
            self.timers.run_due()
            self.check()

    def end(self) -> None:
        self.p.stop(self.p.quiesce(), told=False, why="stopped by the test")
        self.check()
        self.sel.close()


def test_crashes_relaunch_through_the_backoff_and_give_up_past_max_restarts(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"worker_0": ("sh", "-c", "exit 3")})
    slot = rig.p.slots["worker_0"]
    rig.p.start()
    first = slot.child.pid
    rig.until(lambda: slot.launches == 2)  # the first crash: relaunched at once, counted
    assert slot.counted == 1 and slot.last_pid != first
    rig.until(lambda: slot.state == "backoff")  # the second: a backoff on the loop's timers
    assert slot.child is None and rig.timers.timeout(IDLE) == rig.spec.policy.backoff_base
    rig.clock.advance(rig.spec.policy.backoff_base)
    rig.until(lambda: bool(rig.finished))  # the third: its restarts are used up
    assert slot.launches == 3 and slot.state == "failed"
    assert [op for op, _ in rig.reports] == [P.EXITED] * 3 + [P.GAVE_UP]
    assert all(f["code"] == 3 for _, f in rig.reports)
    assert rig.finished[0][0] == "failed" and "after 2 restarts" in rig.finished[0][1]
    assert rig.p.failure.code == 3 and rig.p.failure.restarts == 2
    rig.end()


def test_a_spawn_that_fails_is_an_exit_127_through_the_policy(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"worker_0": ("true",)}, cwd=str(tmp_path / "nonexistent"))
    slot = rig.p.slots["worker_0"]
    rig.p.start()
    assert slot.child is None and slot.launches == 1  # counted as a launch, no child
    rig.until(lambda: slot.state == "backoff")  # relaunched at once, failed again: now a backoff
    assert [(e.code, e.pid) for e in slot.exits] == [(127, None), (127, None)] and slot.counted == 2
    assert rig.timers.timeout(IDLE) == rig.spec.policy.backoff_base
    assert not [r for r in rig.reports if r[0] == P.EXITED]  # no pid: nothing to report
    rig.end()


def test_the_operators_restart_is_not_counted_and_its_kill_timer_is_cancelled_by_the_exit(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"worker_0": ("sleep", "60"), "worker_1": ("true",)})
    slot, other = rig.p.slots["worker_0"], rig.p.slots["worker_1"]
    rig.p.start()
    rig.until(lambda: other.state == "succeeded")  # exit 0 while another runs: not the host's end yet
    assert rig.finished == []
    was = slot.child.pid
    reply = rig.p.manual_restart("worker_0")
    assert reply == {"ok": True, "node_id": "worker_0", "was_pid": was, "pid": None}
    assert slot.state == "restarting" and slot.kill_timer is not None
    assert rig.p.manual_restart("worker_0")["was_pid"] == was  # a second request signals nothing more
    rig.until(lambda: slot.child is not None and slot.child.pid != was)
    assert slot.exits[-1].signal == signal.SIGTERM.name and slot.counted == 0
    assert slot.exits[-1].cause == "restarted by fleet restart --node (killed by SIGTERM)"  # the operator's act
    assert slot.kill_timer is None and rig.timers.timeout(IDLE) == IDLE  # the SIGKILL will not come
    assert rig.p.manual_restart("nope")["ok"] is False
    rig.closing = True
    assert "nothing is restarted" in rig.p.manual_restart("worker_0")["error"]
    rig.end()
    assert slot.state == "stopped" and slot.child is None


def test_every_process_exiting_0_finishes_the_host(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"worker_0": ("true",), "worker_1": ("true",)})
    rig.p.start()
    rig.until(lambda: bool(rig.finished))
    assert rig.finished == [("succeeded", "every process of this host exited 0")]
    assert all(s.state == "succeeded" for s in rig.p.slots.values())
    rig.end()


def test_the_agent_is_the_port_its_parts_talk_through() -> None:
    """Every call of the AgentPort is a method of the Agent (`state` and `closing` are its attributes, set when it is
    made): an attribute call that nothing type-checks at run time must not fail only once a job finishes."""
    calls = [n for n, v in vars(AgentPort).items() if callable(v) and not n.startswith("_")]
    assert sorted(calls) == ["finish", "finish_now", "report", "write_doc"]
    assert all(callable(getattr(Agent, n, None)) for n in calls), [n for n in calls if not hasattr(Agent, n)]
    assert all(callable(getattr(WorkersOf, n, None)) for n, v in vars(Workers).items()
               if callable(v) and not n.startswith("_"))
