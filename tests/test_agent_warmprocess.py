"""The warm spare's life (toolkit.agent.warmprocess) and its pure decisions (toolkit.agent.warmspare), on a fake clock:
when a spare is wanted, the first one SPARE_DELAY after the start or at once when every worker progressed, spares off
after SPARE_MAX_FAILURES deaths, and none while closing. The spares here are real processes that die at once (their
interpreter does not exist), as a broken environment's would; one test runs a real standby interpreter."""

from __future__ import annotations

import os
import select
import selectors
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from toolkit import procs
from toolkit.agent import warmspare
from toolkit.agent.agentlog import AgentLog
from toolkit.agent.timers import Timers
from toolkit.agent.warmprocess import WarmSpare
from toolkit.agent.warmspare import SPARE_DELAY, SPARE_MAX_FAILURES, Step, early_start, next_step
from toolkit.contracts import envvars as E
from toolkit.contracts import messages as wire
from toolkit.contracts.agentdoc import AgentState, WarmSpareDoc
from toolkit.contracts.hostspec import HostSpec, ProcSpec, RestartPolicy
from toolkit.standby import OOM_FIRST, prefault_size, private_bytes
from toolkit.testing.clock import FakeClock

BOUND = 30.0  # s of real time a spare may take to die on a loaded machine
IDLE = 1e6  # a select cap no timer reaches
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def test_next_step_wants_a_spare_only_while_on_absent_and_not_closing() -> None:
    assert next_step(True, 0, False, False) is Step.ARM
    assert next_step(True, 0, False, True) is Step.WAIT  # one exists
    assert next_step(True, 0, True, False) is Step.WAIT  # never while closing
    assert next_step(False, 0, False, False) is Step.OFF
    assert next_step(True, SPARE_MAX_FAILURES - 1, False, False) is Step.ARM
    assert next_step(True, SPARE_MAX_FAILURES, False, False) is Step.OFF  # that many died with no handoff between
    assert next_step(True, 0, False, False, max_failures=0) is Step.OFF


def test_a_spare_is_topped_up_once_the_largest_worker_grew_past_what_it_was_told() -> None:
    mb = 1 << 20
    assert warmspare.topup(800 * mb, 1500 * mb) == 1500 * mb
    assert warmspare.topup(800 * mb, 860 * mb) is None  # under a tenth more, and under TOPUP_MIN
    assert warmspare.topup(0, warmspare.TOPUP_MIN) == warmspare.TOPUP_MIN  # told 0 at its start
    assert warmspare.topup(0, warmspare.TOPUP_MIN - 1) is None
    assert warmspare.topup(8000 * mb, 8700 * mb) is None  # 700 MB is under a tenth of 8 GB
    assert warmspare.topup(1500 * mb, 900 * mb) is None  # workers that shrank: the spare keeps what it holds


def test_early_start_needs_every_running_worker_progressed_and_one_at_least() -> None:
    assert early_start([True, True])
    assert not early_start([True, False])
    assert not early_start([])  # nothing runs: the job is not past its start


class Rig:
    def __init__(self, tmp_path: Path, closing: bool = False,
                 argv: tuple[str, ...] = ("/nonexistent/python", "x"), env: dict[str, str] | None = None) -> None:
        (tmp_path / "logs").mkdir(exist_ok=True)
        worker = ProcSpec(node_id="worker_0", role=E.ROLE_WORKER, rank=0, local_rank=0,
                          argv=argv, cwd=str(tmp_path), env_file=str(tmp_path / "env"),
                          log_file=str(tmp_path / "w.log"))
        (tmp_path / "env").write_text("")
        self.spec = HostSpec(job="j", host="h", job_dir=tmp_path, sched_host="127.0.0.1", sched_port=1,
                             token_file=tmp_path / "token", policy=RestartPolicy(), grace=1.0, bind_core=False,
                             warm_spare=True, processes=(worker,))
        self.sel = selectors.DefaultSelector()
        self.clock = FakeClock()
        self.timers = Timers(self.clock)
        self.closing = closing
        self.cold: list[float] = []  # launch times of workers started cold that have not progressed
        self.memory = 0  # bytes of private memory the largest worker holds
        self.writes = 0
        log = AgentLog(tmp_path / "logs" / "agent.log", "h")
        self.worker, self.state = worker, AgentState.RUNNING
        # the rig is both ports (toolkit.agent.port): the workers the spare reads, and the agent
        self.warm = WarmSpare(self.spec, self.sel, self.timers, log, {"PATH": "/usr/bin:/bin", **(env or {})}, self,
                              self)

    # -- port.Workers

    def template(self) -> ProcSpec:
        return self.worker

    def cold_launches(self) -> list[float]:
        return self.cold

    def largest_memory(self) -> int:
        return self.memory

    # -- port.AgentPort (the spare asks only `closing` and `write_doc`)

    def write_doc(self) -> None:
        self.writes += 1

    def report(self, message: wire.Message, coalesce: str | None = None) -> None:
        raise AssertionError("the warm spare reports nothing to the scheduler")

    def finish(self, state: AgentState, reason: str | None) -> None:
        raise AssertionError("the warm spare never ends the agent")

    def finish_now(self) -> None:
        raise AssertionError("the warm spare never ends the agent")

    def wait_death(self) -> None:
        """Run the loop until the spare is gone (its pidfd fired)."""
        deadline = time.monotonic() + BOUND
        while self.warm.spare is not None:
            assert time.monotonic() < deadline, "the spare did not die"
            for key, mask in self.sel.select(0.1):
                key.data(mask)


def test_spares_start_after_the_delay_or_once_all_progressed_and_stop_after_repeated_deaths(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    w = rig.warm
    assert w.enabled and w.spare is None
    w.arm()
    assert rig.timers.timeout(IDLE) == SPARE_DELAY  # the first spare waits out the start
    w.progressed([True, False])
    w.progressed([])
    assert w.spare is None  # not every worker progressed yet
    w.progressed([True, True])
    assert w.spare is not None and w.document().pid == w.spare.child.pid  # at once, and in agent.json
    assert rig.timers.timeout(IDLE) == IDLE  # its timer is gone
    for died in range(1, SPARE_MAX_FAILURES + 1):
        rig.wait_death()
        assert w.failures == died
        if died < SPARE_MAX_FAILURES:
            assert rig.timers.timeout(IDLE) == SPARE_DELAY  # re-armed
            rig.clock.advance(SPARE_DELAY)
            rig.timers.run_due()
            assert w.spare is not None
    assert not w.enabled and w.document() == WarmSpareDoc(enabled=False, pid=None, ready=False, held=False)
    assert rig.timers.timeout(IDLE) == IDLE  # spares are off: nothing armed
    w.arm()
    assert rig.timers.timeout(IDLE) == IDLE
    w.took_over()  # a takeover does not turn them on again after that many deaths
    assert not w.enabled
    assert w.take(rig.spec.processes[0], None, {}, "marker") is None  # no spare: the worker starts cold
    rig.sel.close()


def test_no_spare_while_closing_and_stop_kills_one(tmp_path: Path) -> None:
    rig = Rig(tmp_path, closing=True)
    rig.warm.arm()
    assert rig.timers.timeout(IDLE) == IDLE
    rig.closing = False
    rig.warm.arm()
    rig.closing = True
    rig.clock.advance(SPARE_DELAY)
    rig.timers.run_due()  # the agent began closing since it was armed: nothing is started
    assert rig.warm.spare is None
    rig.closing = False
    rig.warm.progressed([True])  # no timer pending: progress alone starts nothing
    assert rig.warm.spare is None
    rig.warm.arm()
    rig.clock.advance(SPARE_DELAY)
    rig.timers.run_due()
    spare = rig.warm.spare
    assert spare is not None
    rig.warm.stop()
    assert rig.warm.spare is None and spare.child.wait(0) is not None  # killed and reaped
    assert not rig.sel.get_map()  # its socket and pidfd left the selector
    rig.sel.close()


def test_a_spare_held_as_it_turned_ready_goes_on_and_runs_the_handoff(tmp_path: Path) -> None:
    """The race of CI 2026-11-26: a worker restarted cold while the spare was sending READY. The agent held the spare
    (SIGSTOP: it did not know it ready yet), then read READY, and a ready spare was never released; the next death
    handed the worker's place to a stopped process, which never registered (the job timed out re-forming). A spare
    that turns out ready while held goes on at once, and a handoff to it runs the script. While it waits, the spare
    is the OOM killer's first choice; the worker it becomes has the agent's oom_score_adj again."""
    script = tmp_path / "train.py"
    ran = tmp_path / "ran"
    script.write_text(f"open({str(ran)!r}, 'w').write(open('/proc/self/oom_score_adj').read().strip())\n")
    ours = Path("/proc/self/oom_score_adj").read_text().strip()
    rig = Rig(tmp_path, argv=(sys.executable, str(script)))
    w = rig.warm
    w.arm()
    w.progressed([True])  # the job is past its start: the spare starts at once
    sp = w.spare
    assert sp is not None
    try:
        deadline = time.monotonic() + 120  # its imports (torch) take seconds on a loaded machine
        while not select.select([sp.sock], [], [], 0.5)[0]:  # READY (or its death) is on the way, not yet read
            assert time.monotonic() < deadline and sp.child.wait(0) is None, "the spare never said it was ready"
        rig.cold = [rig.timers.now()]  # a worker restarts cold now: the spare, not known ready, is held
        w.hold()
        assert w.document().held and wait_state(sp.child.pid, lambda st: st == "T")
        for key, mask in rig.sel.select(0):  # the agent reads READY
            key.data(mask)
        assert w.document().ready and not w.document().held
        assert Path(f"/proc/{sp.child.pid}/oom_score_adj").read_text().strip() == str(OOM_FIRST)
        assert wait_state(sp.child.pid, lambda st: st != "T"), "a ready spare was left stopped"
        child = w.take(rig.spec.processes[0], None, {"PATH": "/usr/bin:/bin"}, "--- marker ---")
        assert child is sp.child
        status = child.wait(BOUND)
        assert status is not None and status.describe() == "exit code 0" and ran.read_text() == ours
    finally:
        if sp.child.wait(0) is None:  # left stopped (the bug): not left behind
            sp.child.signal_group(signal.SIGKILL)
            sp.child.wait(BOUND)
        rig.sel.close()


def huge_heap(pid: int) -> int:
    """Bytes of `pid`'s mappings madvised for transparent huge pages (the "hg" flag of /proc/PID/smaps)."""
    total, size = 0, 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line.startswith("Size:"):
            size = int(line.split()[1]) * 1024
        elif line.startswith("VmFlags:") and "hg" in line.split()[1:]:
            total += size
    return total


def wait_state(pid: int, want: Callable[[str], bool]) -> bool:
    """Whether the state letter of /proc/PID/stat (R, S, T, ...) satisfies `want` within BOUND s (a signal's effect
    is not synchronous with its sending)."""
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        info = procs.proc_info(pid)
        if info is not None and want(info.state):
            return True
        time.sleep(0.05)
    return False


def test_prefault_size_is_a_workers_memory_beyond_the_spares_own_within_half_of_what_is_available() -> None:
    mb = 1 << 20
    assert prefault_size(900 * mb, 200 * mb, 16000 * mb) == 700 * mb
    assert prefault_size(900 * mb, 200 * mb, 1000 * mb) == 500 * mb  # at most half of the available memory
    assert prefault_size(150 * mb, 200 * mb, 16000 * mb) == 0  # a worker smaller than the spare's imports
    assert prefault_size(0, 200 * mb, 16000 * mb) == 0  # no worker running
    assert prefault_size(900 * mb, -1, 16000 * mb) == prefault_size(900 * mb, 200 * mb, -1) == 0  # unknown: none
    assert private_bytes("self") > 0 and private_bytes(2**22 + 1) == -1  # pid_max is at most 2**22


FAULTS_SCRIPT = """\
import resource, sys, torch
def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
block = torch.empty({size}, dtype=torch.uint8)
block.fill_(1)
open(sys.argv[1], "w").write(str(faults() - before))
"""


def test_a_spare_faults_in_a_workers_memory_ahead_so_that_its_replacement_allocates_without_page_faults(
        tmp_path: Path) -> None:
    """The replacement's first allocations (its model, the optimizer state it receives, its gradient buckets) take
    pages the spare faulted in while it waited: a 64 MB tensor written after the handoff costs almost no page fault.
    Beside it, a spare told no worker holds memory (the same heap policy, nothing faulted in ahead) takes a fault per
    page for the same tensor: what the test measures is the spare's doing. A third spare, started before any worker
    held memory, is told once ready that one grew to 1 GB (the agent's top-up, TOPUP_EVERY later on its clock), and
    its replacement allocates without faults too."""
    size = 64 << 20
    pages = size // os.sysconf("SC_PAGE_SIZE")
    rigs = {}
    for name, memory in (("ahead", 1 << 30), ("none", 0), ("grown", 0)):
        root = tmp_path / name
        root.mkdir()
        script = root / "train.py"
        script.write_text(FAULTS_SCRIPT.format(size=size))
        huge = {E.THP_MEM_ALLOC_ENABLE: "1"} if name == "grown" else {}  # as the agent sets it (torch's huge pages)
        rigs[name] = Rig(root, argv=(sys.executable, str(script), str(root / "faults")), env=huge)
        rigs[name].memory = memory
        rigs[name].warm.arm()
        rigs[name].warm.progressed([True])  # the job is past its start: the spare starts at once
    try:
        deadline = time.monotonic() + 180  # two spares import torch side by side on a loaded machine
        for rig in rigs.values():
            while not rig.warm.document().ready:
                assert time.monotonic() < deadline and rig.warm.spare is not None, "a spare never said it was ready"
                for key, mask in rig.sel.select(0.5):
                    key.data(mask)
        grown = rigs["grown"]
        grown.memory = 1 << 30
        grown.clock.advance(warmspare.TOPUP_EVERY)
        grown.timers.run_due()  # the agent's look at the workers: the spare is told
        grown_log = tmp_path / "grown" / "logs" / "standby.log"
        while "faulted in ahead" not in grown_log.read_text():
            assert time.monotonic() < deadline and grown.warm.spare.child.wait(0) is None, "no top-up was faulted in"
            time.sleep(0.1)
        told = (tmp_path / "grown" / "logs" / "agent.log").read_text()
        assert "a worker holds 1024 MB now (it was told 0 MB)" in told
        if Path(THP_MODE).exists():  # a kernel with huge pages: the heap asked for them (madvise: VmFlags "hg"),
            # whether or not a busy host had them free just then
            assert huge_heap(grown.warm.spare.child.pid) >= 512 << 20
        children = {name: rig.warm.take(rig.spec.processes[0], None, {"PATH": "/usr/bin:/bin"}, "--- marker ---")
                    for name, rig in rigs.items()}
        for name, child in children.items():
            status = child.wait(BOUND * 4)
            assert status is not None and status.describe() == "exit code 0", (name, status)
        faults = {name: int((tmp_path / name / "faults").read_text()) for name in rigs}
        assert faults["ahead"] < pages // 4 and faults["grown"] < pages // 4, faults
        assert faults["none"] > pages * 9 // 10, faults  # without the spare's doing, a fault per page
        standby_log = (tmp_path / "ahead" / "logs" / "standby.log").read_text()
        assert "MB of heap faulted in ahead (a worker holds 1024 MB)" in standby_log
        assert "faulted in ahead" not in (tmp_path / "none" / "logs" / "standby.log").read_text()
        assert "MB of heap faulted in ahead (a worker holds 1024 MB)\n" in grown_log.read_text()  # all of it
    finally:
        for rig in rigs.values():
            rig.warm.stop()
            rig.sel.close()
