"""The per-host supervisor with real processes and real signals; the scheduler is a small fake server (the point
here is the agent's behaviour on its side of the protocol)."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from toolkit import agent as A
from toolkit import procs
from toolkit.agent.agentlog import LOG_TAIL_LINES
from toolkit.agent.commands import read_pid_file as running_agent_record
from toolkit.contracts import protocol as P
from toolkit.errors import UserError
from toolkit.freeports import free_port
from toolkit.testing.events import Events

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).parent / "scripts" / "agent_worker.py")
PY = sys.executable
EVENT_WAIT = 30.0
AGENT_WAIT = 60.0
POLL = 0.05  # s between looks at agent.json where no event says when it changed
TOKEN = "s3cret-token"


# --- fixtures ---------------------------------------------------------------------------------------------


class FakeScheduler:
    """Accepts agent connections on 127.0.0.1, answers their hello as the scheduler does (challenge, proof) and
    records their messages (a hello gets "proven": whether it proved the token); can send kill/stop/finished."""

    def __init__(self, port: int = 0) -> None:
        self.srv = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.port = self.srv.getsockname()[1]
        self.messages: queue.Queue = queue.Queue()
        self.conns: list[socket.socket] = []
        self.welcome: dict = {}  # more fields of the welcome (e.g. the agent's heartbeat interval, `beat`)
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        lines = P.LineBuffer()
        nonce = P.new_nonce()
        try:
            conn.sendall(P.encode(P.CHALLENGE, nonce=nonce))
        except OSError:
            return
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                self.messages.put({"op": "<eof>"})
                return
            for msg in lines.feed(data):
                if msg["op"] == P.AGENT_HELLO:
                    msg["proven"] = P.check_client(TOKEN, nonce, msg)
                    conn.sendall(P.encode(P.WELCOME, proof=P.server_proof(TOKEN, nonce, msg["nonce"]), **self.welcome))
                self.messages.put(msg)

    def next(self, op: str, timeout: float = EVENT_WAIT) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            msg = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            if msg["op"] == op:
                return msg

    def send(self, op: str, **fields) -> None:
        self.conns[-1].sendall(P.encode(op, **fields))

    def close(self) -> None:
        self._stop = True
        self.srv.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def events(tmp_path: Path):
    ev = Events(tmp_path / "ev.sock")
    yield ev
    ev.sock.close()


@pytest.fixture
def sched():
    s = FakeScheduler()
    yield s
    s.close()


class Job:
    """A job directory as render.py lays it out, and the agents a test started on it (stopped at teardown)."""

    def __init__(self, root: Path, events: Events, port: int, workers: list[list[str]], sched_argv=None,
                 **opts) -> None:
        self.dir = root / "job"
        self.events = events
        (self.dir / "env").mkdir(parents=True)
        (self.dir / "logs").mkdir()
        (self.dir / "project").mkdir()
        (self.dir / "token").write_text(TOKEN + "\n")
        procs_ = []
        if sched_argv is not None:
            procs_.append(self._proc("sched", "MS_SCHED", None, None, sched_argv, "scheduler.log"))
        for rank, flags in enumerate(workers):
            argv = [PY, WORKER, "--events", events.path, *flags]
            procs_.append(self._proc(f"worker_{rank}", "MS_WORKER", rank, rank, argv, f"worker_{rank}.log"))
        doc = {"version": 1, "job": "tjob", "host": "hostA", "scheduler": {"host": "127.0.0.1", "port": port},
               "token_file": "token", "max_restarts": 3, "backoff_base": 0.05, "backoff_max": 0.2,
               "healthy_reset": 300.0, "grace": 1.0, "bind_core": False, "warm_spare": False,
               "processes": procs_, **opts}
        (self.dir / "host.json").write_text(json.dumps(doc, indent=1))
        self.agents: list[subprocess.Popen] = []
        self.spec = A.load_spec(self.dir)

    def _proc(self, node_id, role, rank, local_rank, argv, log) -> dict:
        env = {"MS_ROLE": role, "MS_NODE_ID": node_id, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "TOOLKIT_AGENT_SOCKET": str(self.dir / "state" / "progress.sock")}
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=str(local_rank))
        self.write_env(node_id, env)
        return {"node_id": node_id, "role": role, "rank": rank, "local_rank": local_rank, "argv": argv,
                "cwd": "project", "env_file": f"env/{node_id}.env", "log_file": f"logs/{log}"}

    def write_env(self, node_id: str, env: dict) -> None:
        text = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
        (self.dir / "env" / f"{node_id}.env").write_text(text)

    def run_agent(self) -> subprocess.Popen:
        """The agent in the foreground, as a child of the test."""
        p = subprocess.Popen([PY, "-m", "toolkit.agent", "--job-dir", str(self.dir)], cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.agents.append(p)
        return p

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "toolkit.agent", args[0], "--job-dir", str(self.dir), *args[1:]],
                              cwd=ROOT, capture_output=True, text=True, timeout=AGENT_WAIT)

    def doc(self) -> dict:
        return json.loads((self.dir / "state" / "agent.json").read_text())

    def proc_doc(self, node_id: str) -> dict:
        return next(p for p in self.doc()["processes"] if p["node_id"] == node_id)

    def wait_doc(self, pred, timeout: float = EVENT_WAIT) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                doc = self.doc()
                if pred(doc):
                    return doc
            except (OSError, ValueError):
                pass
            assert time.monotonic() < deadline, "agent.json never reached the expected state"
            time.sleep(POLL)

    def agent_log(self) -> str:
        return (self.dir / "logs" / "agent.log").read_text()

    def cleanup(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                p.kill()
                p.wait(AGENT_WAIT)
        if self.spec.pid_file.exists():
            A.stop(self.spec, timeout=5.0)


@pytest.fixture
def make_job(tmp_path, events):
    jobs = []

    def make(workers, port=None, **opts) -> Job:
        job = Job(tmp_path, events, port if port is not None else free_port(), workers, **opts)
        jobs.append(job)
        return job

    make.root = tmp_path
    yield make
    for job in jobs:
        job.cleanup()


def assert_all_gone(pids) -> None:
    for pid in pids:
        assert procs.wait_gone(pid, None, EVENT_WAIT), f"pid {pid} still running"
        assert not procs.is_running(pid)


# --- the restart policy (pure) ------------------------------------------------------------------------------


def test_backoff_first_restart_immediate_then_doubling_and_capped():
    policy = A.RestartPolicy(max_restarts=10, backoff_base=1.0, backoff_max=5.0, healthy_reset=60.0)
    delays, counted = [], 0
    for _ in range(6):
        d = policy.after_failure(counted, ran_for=1.0)
        delays.append(d.delay)
        counted = d.counted
    assert delays == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_max_restarts_then_give_up_and_the_refill_rule_time_refills_after_a_healthy_run():
    policy = A.RestartPolicy(max_restarts=2, backoff_base=1.0, backoff_max=30.0, healthy_reset=60.0, refill="time")
    assert policy.after_failure(2, ran_for=1.0).give_up
    assert policy.after_failure(1, ran_for=1.0) == A.RestartDecision(False, 1.0, 2)
    assert policy.after_failure(2, ran_for=60.0) == A.RestartDecision(False, 0.0, 1, None,
                                                                      "it ran 60.0 s (restart_refill 60 s)")
    assert A.RestartPolicy(max_restarts=0).after_failure(0, 1.0).give_up
    assert A.RestartPolicy(max_restarts=2, healthy_reset=60.0).after_failure(2, ran_for=1e6).give_up  # progress


def test_a_process_that_trained_before_it_died_is_relaunched_at_once_but_still_counted():
    policy = A.RestartPolicy(max_restarts=3, backoff_base=1.0, backoff_max=30.0, healthy_reset=300.0)
    assert policy.after_failure(2, ran_for=5.0, progressed=True) == A.RestartDecision(False, 0.0, 3)
    assert policy.after_failure(2, ran_for=5.0, progressed=False) == A.RestartDecision(False, 2.0, 3)
    assert policy.after_failure(3, ran_for=5.0, progressed=True).give_up


@given(st.integers(0, 200), st.floats(0, 100), st.floats(0, 1000))
def test_backoff_is_monotonic_and_bounded(counted, base, cap):
    policy = A.RestartPolicy(max_restarts=1000, backoff_base=base, backoff_max=cap)
    assert 0.0 <= policy.backoff(counted) <= max(cap, 0.0)
    assert policy.backoff(counted) <= policy.backoff(counted + 1)


def test_cpu_sets_are_disjoint_and_say_when_there_are_too_few():
    sets = A.cpu_sets({0, 1, 2, 3, 4}, 2)
    assert sets == [frozenset({0, 1}), frozenset({2, 3})]
    with pytest.raises(UserError, match="3 workers share 2 usable CPUs"):
        A.cpu_sets({0, 1}, 3, "node1")


# --- bad input ----------------------------------------------------------------------------------------------


def test_bad_host_json_is_one_line_and_starts_nothing(make_job):
    job = make_job([["--block"]])
    doc = json.loads((job.dir / "host.json").read_text())
    doc["processes"][0]["argv"] = []
    (job.dir / "host.json").write_text(json.dumps(doc))
    out = job.cli("start")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: {job.dir / 'host.json'}: processes[0].argv=[]: a non-empty list of strings"]
    assert "Traceback" not in out.stderr and not job.spec.pid_file.exists()
    (job.dir / "host.json").write_text("{\n  \"version\": 1,\n")
    out = job.cli("status")
    assert out.returncode == 2 and "line 3: not valid JSON" in out.stderr


def test_bind_core_with_too_few_cpus_fails_at_start_with_one_line(make_job):
    n = len(os.sched_getaffinity(0)) + 1
    job = make_job([["--block"]] * n, bind_core=True)
    out = job.cli("start")
    assert out.returncode != 0
    assert f"bind_core needs one CPU per worker, but {n} workers share" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not job.events.seen


# --- supervision --------------------------------------------------------------------------------------------


def test_kill_9_worker_is_relaunched_with_same_env_and_rank_and_job_completes(make_job, sched):
    job = make_job([["--block-until-restart", "1"], ["--block-until-restart", "0"]], port=sched.port)
    agent = job.run_agent()
    first = job.events.started(2)
    hello = sched.next(P.AGENT_HELLO)
    assert hello["proven"] is True and hello["host"] == "hostA" and hello["node_ids"] == ["worker_0", "worker_1"]
    victim = first["worker_0"]
    os.kill(victim["pid"], signal.SIGKILL)
    again = job.events.next()
    assert again["env"]["MS_NODE_ID"] == "worker_0" and again["pid"] != victim["pid"]
    assert again["env"]["RANK"] == victim["env"]["RANK"] == "0"
    per_incarnation = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE")
    assert {k: v for k, v in again["env"].items() if k not in per_incarnation} == \
           {k: v for k, v in victim["env"].items() if k not in per_incarnation}
    assert (victim["env"]["TORCHELASTIC_RESTART_COUNT"], again["env"]["TORCHELASTIC_RESTART_COUNT"]) == ("0", "1")
    assert (victim["env"]["TORCHELASTIC_ERROR_FILE"], again["env"]["TORCHELASTIC_ERROR_FILE"]) == \
        (str(job.dir / "state" / "errors" / "worker_0.0.json"), str(job.dir / "state" / "errors" / "worker_0.1.json"))
    assert victim["env"]["GLOO_ENABLE_STORE_V2_API"] == victim["env"]["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] == "1"
    assert victim["env"]["THP_MEM_ALLOC_ENABLE"] == "1"  # torch's huge pages: a killed worker's memory goes back sooner
    assert again["argv"] == victim["argv"] and again["cwd"] == str(job.dir / "project")
    exited = sched.next(P.EXITED)
    while exited["pid"] != victim["pid"]:
        exited = sched.next(P.EXITED)  # worker_1 finished first, or not
    assert exited == {"op": "exited", "node_id": "worker_0", "pid": victim["pid"], "code": None,
                      "signal": "SIGKILL", "cause": None}  # a signal from outside: the signal says it all
    assert agent.wait(AGENT_WAIT) == 0
    doc = job.doc()
    assert doc["state"] == "succeeded" and doc["exit_code"] == 0
    w0 = job.proc_doc("worker_0")
    assert w0["state"] == "succeeded" and w0["restarts"] == 1 and w0["counted_restarts"] == 1
    assert [e["signal"] for e in w0["exits"]] == ["SIGKILL", None] and w0["exits"][1]["code"] == 0
    log = (job.dir / "logs" / "worker_0.log").read_text()
    assert log.count("--- toolkit agent hostA: start worker_0") == 2
    assert_all_gone([victim["pid"], again["pid"], first["worker_1"]["pid"]])


def test_crash_loop_fails_the_job_with_status_and_log_tail_and_leaves_nothing(make_job, sched):
    job = make_job([["--block", "--grandchild"], ["--exit", "3", "--print-lines", "30"]], port=sched.port,
                   max_restarts=2)
    agent = job.run_agent()
    assert agent.wait(AGENT_WAIT) == A.EXIT_FAILED
    gave_up = sched.next(P.GAVE_UP)
    assert gave_up["node_id"] == "worker_1" and gave_up["code"] == 3 and gave_up["signal"] is None
    tail = gave_up["log_tail"].splitlines()
    assert tail[-1] == "exiting with 3" and tail[-2] == "worker_1 line 29" and len(tail) == LOG_TAIL_LINES
    doc = job.doc()
    assert doc["state"] == "failed" and doc["exit_code"] == A.EXIT_FAILED
    failure = doc["failure"]
    assert (failure["host"], failure["node_id"], failure["rank"], failure["code"]) == ("hostA", "worker_1", 1, 3)
    assert failure["log_file"] == str(job.dir / "logs" / "worker_1.log") and failure["log_tail"] == tail
    assert failure["pid"] in [e["pid"] for e in job.events.drain()]
    assert job.proc_doc("worker_0")["state"] == "stopped"
    log = job.agent_log()
    assert "hostA:worker_1: GAVE UP: rank 1, pid" in log and "exit code 3" in log
    assert "hostA:worker_1: | worker_1 line 29" in log
    assert "restarting now (restart 1 of 2)" in log and "restarting in 0.05 s (restart 2 of 2)" in log
    starts = [e for e in job.events.seen if e["env"]["MS_NODE_ID"] == "worker_1"]
    assert len(starts) == 3  # first start + max_restarts
    everything = [e["pid"] for e in job.events.seen] + [e["grandchild"] for e in job.events.seen if e["grandchild"]]
    assert_all_gone(everything)


def test_the_error_file_is_the_first_cause_and_every_incarnation_has_its_own(make_job, sched):
    # TORCHELASTIC_ERROR_FILE per incarnation (as torchrun's agent sets it for @record): what the script wrote
    # there is the cause in agent.json, the agent's log, `exited` and `gave_up`; the file is read once and removed.
    job = make_job([["--exit", "1", "--error", "RuntimeError: boom at step 5\nmore"]], port=sched.port,
                   max_restarts=1)
    agent = job.run_agent()
    assert agent.wait(AGENT_WAIT) == A.EXIT_FAILED
    starts = [e for e in job.events.drain() if e["env"]["MS_NODE_ID"] == "worker_0"]
    assert [e["env"]["TORCHELASTIC_ERROR_FILE"] for e in starts] == \
        [str(job.dir / "state" / "errors" / f"worker_0.{n}.json") for n in range(2)]
    cause = "RuntimeError: boom at step 5 (exit code 1)"
    assert sched.next(P.EXITED)["cause"] == cause
    gave_up = sched.next(P.GAVE_UP)
    assert gave_up["cause"] == cause and gave_up["code"] == 1
    doc = job.doc()
    assert [e["cause"] for e in job.proc_doc("worker_0")["exits"]] == [cause, cause]
    assert doc["failure"]["cause"] == cause and doc["failure"]["status"] == "exit code 1"
    assert f"pid {starts[0]['pid']} {cause} after" in job.agent_log()
    assert f"GAVE UP: rank 0, pid {starts[1]['pid']} {cause}" in job.agent_log()
    assert not list((job.dir / "state" / "errors").iterdir())


def test_heartbeats_vouch_for_running_children_not_for_a_stopped_one(make_job, sched):
    # A worker whose own heartbeats stop (a call holding its GIL) is still seen running by its agent, which says so
    # in its heartbeats; a SIGSTOPped one is left out, so the scheduler's silence rule still finds it.
    job = make_job([["--block"], ["--block"]], port=sched.port)
    job.run_agent()
    first = job.events.started(2)
    pids = {n: e["pid"] for n, e in first.items()}
    deadline = time.monotonic() + EVENT_WAIT
    while sched.next(P.HEARTBEAT).get("running") != pids:
        assert time.monotonic() < deadline, "no heartbeat vouched for both workers"
    os.kill(pids["worker_1"], signal.SIGSTOP)
    try:
        while sched.next(P.HEARTBEAT).get("running") != {"worker_0": pids["worker_0"]}:
            assert time.monotonic() < deadline + EVENT_WAIT, "the stopped worker was still vouched for"
    finally:
        os.kill(pids["worker_1"], signal.SIGCONT)


def test_the_agent_beats_at_the_interval_its_welcome_gives(make_job, sched):
    # At thousands of ranks the scheduler stretches the agents' heartbeats (welcome {beat}); the agent's own default
    # is 1 s, so a second heartbeat within `quiet` s would mean the welcome was ignored.
    quiet = 3.0
    sched.welcome = {"beat": 30.0}
    job = make_job([["--block"]], port=sched.port)
    job.run_agent()
    sched.next(P.HEARTBEAT)  # the first, at once when the link is up
    deadline = time.monotonic() + quiet
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = sched.messages.get(timeout=left)
        except queue.Empty:
            break
        assert msg["op"] != P.HEARTBEAT, "a second heartbeat within 3 s: the welcome's beat (30 s) was ignored"


def test_a_late_crash_loop_at_the_same_step_gives_up_at_the_budget(make_job, sched):
    """Every incarnation reports steps 1 to 5 and fails after running longer than healthy_reset (1 s here): the
    budget used to refill after healthy_reset and restart it forever; now a failure at the same step counts, however
    long the run, and the agent says which step and how."""
    job = make_job([["--progress", "5", "--linger", "1.5", "--exit", "1"]], port=sched.port, max_restarts=2,
                   healthy_reset=1.0)
    agent = job.run_agent()
    assert agent.wait(AGENT_WAIT) == A.EXIT_FAILED
    assert sched.next(P.GAVE_UP)["node_id"] == "worker_0"
    assert len([e for e in job.events.drain() if e["env"]["MS_NODE_ID"] == "worker_0"]) == 3  # first + 2 restarts
    proc = job.proc_doc("worker_0")
    assert [e["ran_for"] > 1.0 and e["step"] for e in proc["exits"]] == [5, 5, 5]  # each ran past healthy_reset
    assert proc["same_failure"] == {"times": 3, "step": 5, "code": 1, "signal": None, "cause": None} and \
        proc["failed_at"] == 5
    assert "starts again" not in job.agent_log()


@pytest.mark.parametrize("code", [P.EXIT_FENCED, P.EXIT_REJOIN])
def test_fenced_or_rejoining_exits_are_relaunched_outside_the_budget(make_job, sched, code):
    job = make_job([["--exit", str(code), "--exit-until-restart", "3"]], port=sched.port, max_restarts=1)
    agent = job.run_agent()
    assert agent.wait(AGENT_WAIT) == A.EXIT_OK
    starts = [e for e in job.events.drain() if e["env"]["MS_NODE_ID"] == "worker_0"]
    assert len(starts) == 4  # three told-to relaunches, though max_restarts is 1
    assert "told to by the scheduler" in job.agent_log()


def test_sigterm_reaches_children_first_then_sigkill_after_grace(make_job):
    words = make_job.root / "last-words"
    job = make_job([["--block", "--on-term", str(words)],
                    ["--block", "--on-term", str(words), "--term-stays"]], grace=1.0)
    agent = job.run_agent()
    pids = {k: v["pid"] for k, v in job.events.started(2).items()}
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(AGENT_WAIT) == A.EXIT_STOPPED
    lines = words.read_text().splitlines()
    got = {line.split()[2]: float(line.split()[3]) for line in lines}
    assert set(got) == {"worker_0", "worker_1"}  # both were asked politely first
    doc = job.doc()
    assert doc["state"] == "stopped" and doc["reason"] == "stopped by SIGTERM"
    w0, w1 = job.proc_doc("worker_0"), job.proc_doc("worker_1")
    assert w0["last_exit"]["code"] == 0  # saved its last words and left
    assert w1["last_exit"]["signal"] == "SIGKILL"  # stayed: killed after the grace period
    killed_at = time.mktime(time.strptime(w1["last_exit"]["at"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    killed_at += int(w1["last_exit"]["at"][20:23]) / 1000
    assert killed_at - got["worker_1"] >= 1.0 * 0.9
    assert f"pid {pids['worker_1']} still running after 1 s: SIGKILL" in job.agent_log()
    assert_all_gone(pids.values())


def test_kill_9_of_the_agent_leaves_no_worker_and_launch_again_recovers(make_job, sched):
    job = make_job([["--block", "--grandchild"], ["--block"]], port=sched.port)
    out = job.cli("start")
    assert out.returncode == 0 and "agent started (pid" in out.stdout
    first = job.events.started(2)
    sched.next(P.AGENT_HELLO)
    pid, ticks = running_agent_record(job.spec)
    assert procs.is_running(pid, ticks)
    again = job.cli("start")  # launch.sh is idempotent
    assert again.returncode == 0 and f"already running (pid {pid})" in again.stdout

    os.kill(pid, signal.SIGKILL)
    assert procs.wait_gone(pid, ticks, EVENT_WAIT)
    assert_all_gone([e["pid"] for e in first.values()])  # parent-death signal: no unsupervised worker
    status = json.loads(job.cli("status").stdout)
    assert status["alive"] is False and status["state"] == "gone"

    out = job.cli("start")
    assert out.returncode == 0, out.stderr
    second = job.events.started(2)
    hello = sched.next(P.AGENT_HELLO)  # rejoins the scheduler
    assert hello["node_ids"] == ["worker_0", "worker_1"]
    assert {k: v["env"]["RANK"] for k, v in second.items()} == {"worker_0": "0", "worker_1": "1"}
    assert_all_gone([first["worker_0"]["grandchild"]])  # the new agent reclaimed the old worker's child
    status = json.loads(job.cli("status").stdout)
    assert status["alive"] is True and status["state"] == "running"
    assert {p["pid"] for p in status["processes"]} == {e["pid"] for e in second.values()}

    out = job.cli("stop")
    assert out.returncode == 0 and "no process of the job is left" in out.stdout
    assert_all_gone([e["pid"] for e in second.values()] + [second["worker_0"]["grandchild"], pid])
    assert json.loads(job.cli("status").stdout)["state"] == "stopped"


def test_agent_json_always_parses_while_restarts_churn(make_job):
    job = make_job([["--exit", "1"]], max_restarts=10_000, backoff_base=0.0, backoff_max=0.0)
    stop = threading.Event()
    reads, failures = [0], []

    def reader():
        path = job.dir / "state" / "agent.json"
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
                reads[0] += 1
            except ValueError as e:
                failures.append((str(e), text[:200]))

    t = threading.Thread(target=reader)
    agent = job.run_agent()
    job.events.next()
    t.start()
    try:
        for _ in range(25):
            job.events.next()
    finally:
        stop.set()
        t.join(EVENT_WAIT)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(AGENT_WAIT) == A.EXIT_STOPPED
    assert failures == [] and reads[0] > 25
    assert job.proc_doc("worker_0")["restarts"] >= 25


def test_manual_restart_goes_through_the_agent_and_is_not_counted(make_job):
    job = make_job([["--block"]])
    agent = job.run_agent()
    first = job.events.next()
    job.write_env("worker_0", {"MS_NODE_ID": "worker_0", "RANK": "0", "EXTRA": "edited by the operator",
                               "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "0"})
    out = job.cli("restart", "worker_0")
    assert out.returncode == 0 and f"restarting worker_0 (pid {first['pid']} gets SIGTERM" in out.stdout
    second = job.events.next()
    assert second["pid"] != first["pid"] and second["env"]["EXTRA"] == "edited by the operator"
    assert first["env"]["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] == "1"  # the agent's default ...
    assert second["env"]["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] == "0"  # ... and the operator's word wins over it
    doc = job.wait_doc(lambda d: d["processes"][0]["pid"] == second["pid"])
    w0 = doc["processes"][0]
    assert (w0["restarts"], w0["counted_restarts"], w0["state"]) == (1, 0, "running")
    os.kill(second["pid"], signal.SIGKILL)  # still supervised after a manual restart
    third = job.events.next()
    assert third["env"]["TORCHELASTIC_RESTART_COUNT"] == "2"
    w0 = job.wait_doc(lambda d: d["processes"][0]["pid"] == third["pid"])["processes"][0]
    assert w0["counted_restarts"] == 1
    bad = job.cli("restart", "worker_9")
    assert bad.returncode != 0 and bad.stderr.strip() == \
        "error: hostA: no process 'worker_9' in this job here; this host runs worker_0"
    assert A.request(job.spec, {"op": "stop"}) == {"ok": True}
    assert agent.wait(AGENT_WAIT) == A.EXIT_STOPPED
    assert_all_gone([first["pid"], second["pid"], third["pid"]])


def test_recover_starts_the_agent_when_it_is_gone(make_job):
    job = make_job([["--block"]])
    out = job.cli("restart", "worker_0")
    assert out.returncode == 0 and "the agent was not running; starting it" in out.stdout
    ev = job.events.next()
    assert ev["env"]["MS_NODE_ID"] == "worker_0"
    assert job.cli("stop").returncode == 0
    assert_all_gone([ev["pid"]])


def test_scheduler_fences_a_stopped_worker_then_stops_the_job(make_job, sched):
    job = make_job([["--block"], ["--block"]], port=sched.port)
    agent = job.run_agent()
    first = job.events.started(2)
    sched.next(P.AGENT_HELLO)
    frozen = first["worker_1"]["pid"]
    os.kill(frozen, signal.SIGSTOP)
    sched.send(P.KILL, node_id="worker_1", pid=frozen, cause="heartbeat silence")
    relaunched = job.events.next()
    assert relaunched["env"]["MS_NODE_ID"] == "worker_1" and relaunched["pid"] != frozen
    assert sched.next(P.EXITED) == {"op": "exited", "node_id": "worker_1", "pid": frozen, "code": None,
                                    "signal": "SIGKILL",
                                    "cause": "heartbeat silence: fenced by the scheduler (killed by SIGKILL)"}
    assert job.proc_doc("worker_1")["exits"][0]["cause"] == \
        "heartbeat silence: fenced by the scheduler (killed by SIGKILL)"
    sched.send(P.KILL, node_id="worker_1", pid=frozen)  # stale: names the old incarnation, harms nothing
    sched.send(P.STOP, reason="worker_5 on hostB failed")
    assert agent.wait(AGENT_WAIT) == A.EXIT_FAILED
    doc = job.doc()
    assert doc["state"] == "failed" and doc["reason"] == "stopped by the scheduler: worker_5 on hostB failed"
    assert job.proc_doc("worker_1")["restarts"] == 1
    assert_all_gone([first["worker_0"]["pid"], frozen, relaunched["pid"]])


def test_finished_from_the_scheduler_ends_the_agent_with_success(make_job, sched):
    job = make_job([["--block"]], port=sched.port, grace=0.3)
    agent = job.run_agent()
    ev = job.events.next()
    sched.next(P.AGENT_HELLO)
    sched.send(P.FINISHED)
    assert agent.wait(AGENT_WAIT) == 0
    assert job.doc()["state"] == "succeeded"
    assert_all_gone([ev["pid"]])


def test_supervision_goes_on_without_a_scheduler_and_reports_wait_coalesced(make_job):
    port = free_port()
    job = make_job([["--block-until-restart", "2"], ["--block"]], port=port)
    agent = job.run_agent()
    first = job.events.started(2)
    os.kill(first["worker_0"]["pid"], signal.SIGKILL)
    second = job.events.next()
    os.kill(second["pid"], signal.SIGKILL)
    third = job.events.next()
    assert third["restart"] == 2 and third["env"]["RANK"] == "0"
    doc = job.wait_doc(lambda d: d["processes"][0]["state"] == "succeeded")
    assert doc["scheduler"]["link"] != "up"
    late = FakeScheduler(port)  # the scheduler comes (back) up
    try:
        hello = late.next(P.AGENT_HELLO, timeout=EVENT_WAIT)
        assert hello["proven"] is True and "token" not in hello  # the token itself never travels
        got = [late.next(P.EXITED)]
        # one report per node, the latest: worker_0 exited 0 last
        assert got[0]["node_id"] == "worker_0" and got[0]["pid"] == third["pid"] and got[0]["code"] == 0
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(AGENT_WAIT) == A.EXIT_STOPPED
        rest = []
        while not late.messages.empty():
            rest.append(late.messages.get_nowait())
        assert not [m for m in rest if m["op"] == P.EXITED and m["node_id"] == "worker_0"]
    finally:
        late.close()


def test_bind_core_pins_workers_to_disjoint_cpus(make_job):
    cpus = os.sched_getaffinity(0)
    n = min(2, len(cpus))
    job = make_job([["--block"]] * n, bind_core=True)
    agent = job.run_agent()
    started = job.events.started(n)
    sets = [set(e["affinity"]) for e in started.values()]
    assert all(s and s <= cpus for s in sets)
    assert sum(len(s) for s in sets) == len(set().union(*sets))  # disjoint
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(AGENT_WAIT) == A.EXIT_STOPPED


def test_progress_reports_reach_agent_json(make_job):
    job = make_job([["--block", "--progress", "5"]])
    agent = job.run_agent()
    job.events.next()
    doc = job.wait_doc(lambda d: d["processes"][0]["step"] == 5)
    assert doc["processes"][0]["epoch"] == 0
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(AGENT_WAIT) == A.EXIT_STOPPED
    assert job.proc_doc("worker_0")["step"] == 5  # kept after the process is gone


def test_scheduler_process_is_supervised_too(make_job):
    sched_argv = [PY, WORKER, "--events", "EV", "--block-until-restart", "1"]
    job = make_job([["--block-until-restart", "0"]], sched_argv=sched_argv)
    doc = json.loads((job.dir / "host.json").read_text())
    doc["processes"][0]["argv"][3] = job.events.path
    (job.dir / "host.json").write_text(json.dumps(doc))
    agent = job.run_agent()
    started = job.events.started(2)
    os.kill(started["sched"]["pid"], signal.SIGKILL)
    again = job.events.next()
    assert again["env"]["MS_ROLE"] == "MS_SCHED" and again["restart"] == 1
    assert agent.wait(AGENT_WAIT) == 0  # the worker and then the scheduler exited 0


# --- the warm spare -------------------------------------------------------------------------------------------


def test_warm_spare_takes_a_dead_workers_place(make_job):
    job = make_job([["--block-until-restart", "1", "--progress", "1"], ["--block", "--progress", "1"]],
                   warm_spare=True)
    agent = job.run_agent()
    first = job.events.started(2)
    assert not first["worker_0"]["warm"]
    doc = job.wait_doc(lambda d: d["warm_spare"]["ready"], timeout=120)  # it imports torch: seconds
    spare = doc["warm_spare"]["pid"]
    assert os.sched_getscheduler(spare) == os.SCHED_IDLE  # waiting, it takes only CPU the workers leave
    # told the memory of the largest running worker, which it faults in ahead beyond its own (none here: the workers
    # hold less than the spare's imports)
    held = re.search(rf"warm spare pid {spare} starting \(.*; a worker holds (\d+) MB of private memory\)",
                     job.agent_log())
    assert held and int(held.group(1)) >= 1
    os.kill(first["worker_0"]["pid"], signal.SIGKILL)
    again = job.events.next()
    assert again["pid"] == spare and again["warm"]  # the spare, with torch and DDP's imports done
    assert again["policies"] == first["worker_1"]["policies"] == [os.SCHED_OTHER]  # every thread, once a worker
    assert again["env"]["RANK"] == "0" and again["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert again["argv"] == first["worker_0"]["argv"] and again["cwd"] == first["worker_0"]["cwd"]
    assert again["pgid"] == spare and again["sid"] == spare
    w0 = job.wait_doc(lambda d: d["processes"][0]["state"] == "succeeded")["processes"][0]
    assert w0["exits"][-1]["code"] == 0 and w0["exits"][-1]["pid"] == spare
    log = (job.dir / "logs" / "worker_0.log").read_text()
    assert "start worker_0 #2" in log and log.rstrip().endswith("exiting with 0")
    # every worker made progress since: the next spare is built at once; it dies with the agent, like workers
    doc = job.wait_doc(lambda d: d["warm_spare"]["pid"] not in (None, spare))
    next_spare = doc["warm_spare"]["pid"]
    agent.kill()
    agent.wait(AGENT_WAIT)
    assert_all_gone([spare, first["worker_1"]["pid"], next_spare])


def test_a_worker_started_cold_holds_the_importing_spare_until_it_progresses(make_job):
    """Issue 26: a fault that lands while the warm spare still imports. The replacement starts cold at once (it never
    waits for the spare), and the spare is held (SIGSTOP) so that its imports do not slow that start down; once the
    replacement reports progress the spare goes on from where it was and becomes ready."""
    job = make_job([["--block", "--progress-on-usr1"], ["--block", "--progress", "1"]], warm_spare=True)
    job.run_agent()
    w0 = job.events.started(2)["worker_0"]
    for _ in range(3):  # the spare's imports take seconds; if one was ready before the kill, use it and try again
        os.kill(w0["pid"], signal.SIGUSR1)  # every worker has progressed: the spare starts at once
        doc = job.wait_doc(lambda d, worker=w0["pid"]: d["warm_spare"]["pid"] not in (None, worker))
        spare = doc["warm_spare"]["pid"]
        os.kill(w0["pid"], signal.SIGKILL)
        w0 = job.events.next()
        if w0["pid"] != spare:
            break
    assert w0["pid"] != spare and not w0["warm"], "the spare was ready before every kill"
    held = job.wait_doc(lambda d: d["warm_spare"]["held"])
    assert held["warm_spare"]["pid"] == spare and not held["warm_spare"]["ready"]
    assert procs_state(spare) == "T"  # stopped, not importing beside the cold start
    assert f"warm spare pid {spare} held: a worker restarts cold" in job.agent_log()
    os.kill(w0["pid"], signal.SIGUSR1)  # the replacement got as far as its group
    ready = job.wait_doc(lambda d: d["warm_spare"]["ready"], timeout=120)
    assert ready["warm_spare"]["pid"] == spare and not ready["warm_spare"]["held"]
    assert f"warm spare pid {spare} goes on importing" in job.agent_log()


def procs_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, T, Z, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_standby_eligibility():
    from toolkit import standby
    assert standby.eligible(["python3", "train.py", "--x"], "python3")
    assert standby.eligible(["python3", "-m", "pkg.mod"], "python3")
    assert not standby.eligible(["python3", "-u", "train.py"], "python3")
    assert not standby.eligible(["/other/python", "train.py"], "python3")
    assert not standby.eligible(["python3", "-m"], "python3")


def test_command_line_overrides_host_json(make_job):
    job = make_job([["--exit", "3"]], max_restarts=5)
    out = job.cli("start", "--max-restarts", "0", "--grace", "0.5")
    assert out.returncode == 0, out.stderr
    pid, ticks = running_agent_record(job.spec)
    assert procs.wait_gone(pid, ticks, AGENT_WAIT)
    doc = json.loads(job.cli("status").stdout)
    assert doc["state"] == "failed" and doc["alive"] is False
    assert doc["failure"]["restarts"] == 0 and doc["processes"][0]["max_restarts"] == 0
    assert len(job.events.drain()) == 1
    bad = job.cli("start", "--max-restarts", "-1")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --max-restarts -1: give 0 or more"


def test_stop_verifies_the_last_incarnations_are_gone(make_job):
    job = make_job([["--block", "--grandchild"]])
    assert job.cli("start").returncode == 0
    ev = job.events.next()
    out = job.cli("stop")
    assert out.returncode == 0 and out.stdout.startswith("hostA: stopped (agent pid")
    w0 = json.loads(job.cli("status").stdout)["processes"][0]
    assert w0["pid"] is None and w0["last_pid"] == ev["pid"] and w0["state"] == "stopped"
    assert_all_gone([ev["pid"], ev["grandchild"]])
    assert job.cli("stop").stdout.strip() == "hostA: agent was not running; no process of the job is left"


def test_stop_never_signals_what_it_cannot_prove_is_the_jobs(make_job):
    """A pid file without the agent's start time, and an agent.json whose group has no leader start time, name
    processes that are not the job's (pids are reused): stop leaves them alone."""
    job = make_job([["--block"]])
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # its own group: pgid == pid
    try:
        job.spec.state_dir.mkdir(parents=True, exist_ok=True)
        job.spec.pid_file.write_text(f"{stranger.pid}\n")
        job.spec.agent_json.write_text(json.dumps({"processes": [
            {"node_id": "worker_0", "pgid": stranger.pid},
            {"node_id": "worker_1", "last_pid": stranger.pid, "last_start_ticks": None}]}))
        out = job.cli("stop")
        assert out.returncode == 0, out.stderr
        assert stranger.poll() is None and procs.is_running(stranger.pid), "stop signalled an unrelated process"
    finally:
        stranger.kill()
        stranger.wait(10)


def test_the_agents_sockets_survive_arbitrary_bytes(make_job):
    """The control socket (stream) and the progress socket (datagrams) fed random bytes, deep nesting, huge
    numbers and wrong shapes: the agent answers `status` afterwards and its worker was never disturbed."""
    import random

    job = make_job([["--block"]])
    agent = job.run_agent()
    first = job.events.started(1)
    rng = random.Random(11)
    payloads = [b"[" * 100_000, b'{"op": "restart", "node_id": ' + b"9" * 5000 + b"}\n", b"\xff\xfe\n", b"null\n",
                b'{"op": ["status"]}\n', b'{"op": "restart", "node_id": {"a": 1}}\n', b"x" * 200_000]
    payloads += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000))) for _ in range(60)]
    for payload in payloads:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(job.spec.control_socket))
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except (BrokenPipeError, ConnectionResetError):
                pass
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as d:
        for payload in payloads:
            try:
                d.sendto(payload[:4000], str(job.spec.progress_socket))
            except OSError:
                pass
        d.sendto(json.dumps({"node_id": "worker_0", "step": True, "recovery": [1]}).encode(),
                 str(job.spec.progress_socket))
    assert agent.poll() is None
    doc = json.loads(job.cli("status").stdout)
    assert doc["alive"] is True and doc["processes"][0]["pid"] == first["worker_0"]["pid"]
    assert doc["processes"][0]["restarts"] == 0
