"""toolkit.train.runtime with real processes and real gloo: the three modes (toolkit, torchrun, alone), recovery
from a worker's kill -9 through GenerationChanged/reform with bitwise-equal results, registration failures,
and the progress datagrams to the host agent."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch.distributed as dist
from runtime_harness import FakeAgent, Job, Proc, expected_weights, job_factory, read_result

from toolkit.contracts import envvars as E
from toolkit.contracts import protocol as P
from toolkit.contracts import stepfile
from toolkit.freeports import free_port_pair
from toolkit.testing.localjob import clean_env
from toolkit.train import faults
from toolkit.train import runtime as R

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    with job_factory(tmp_path) as make:
        yield make


def bare_env(job: Job) -> dict[str, str]:
    """No MS_* and no torchrun variables: what `python train.py` sees on a laptop."""
    env = job.common()
    for name in list(env):
        if name.startswith(("MS_", "TOOLKIT_")) or name in (E.MASTER_ADDR, E.MASTER_PORT, E.WORLD_SIZE,
                                                             E.RANK_SIZE):
            del env[name]
    return env


def test_alone_it_is_a_world_of_one(make_job) -> None:
    job = make_job(1)
    out = job.root / "out"
    proc = job.worker(0, args=["--steps", "5", "--out", str(out)], env={**bare_env(job), E.CKPT_DIR: str(job.ckpt)})
    assert proc.wait(60) == 0, proc.text()
    result = read_result(out / "rank_0.json")
    assert (result["mode"], result["world_size"], result["generation"]) == ("single", 1, 0)
    assert result["w"] == expected_weights(1, 5)


def test_under_torchrun_variables_it_uses_env_init(make_job) -> None:
    job = make_job(2)
    out = job.root / "out"
    procs = []
    for r in range(2):
        env = {**bare_env(job), E.RANK: str(r), E.WORLD_SIZE: "2", E.LOCAL_RANK: str(r), E.MASTER_ADDR: "127.0.0.1",
               E.MASTER_PORT: str(job.port + 1), E.CKPT_DIR: str(job.ckpt)}
        procs.append(job.worker(r, args=["--steps", "5", "--out", str(out)], env=env))
    for proc in procs:
        assert proc.wait(60) == 0, proc.text()
    for r in range(2):
        result = read_result(out / f"rank_{r}.json")
        assert (result["mode"], result["world_size"]) == ("torchrun", 2)
        assert result["w"] == expected_weights(2, 5)


def test_kill9_of_a_worker_rolls_everyone_back_and_ends_bitwise_equal(make_job) -> None:
    job = make_job(3, node_timeout=6.0)
    sched = job.scheduler()
    job.wait_serving(sched)
    out = job.root / "out"
    args = ["--steps", "40", "--out", str(out), "--delay", "0.05"]
    workers = {r: job.worker(r, args=args) for r in range(3)}
    relaunched: dict[int, Proc] = {}
    agent = FakeAgent(job, "localhost", [P.worker_node_id(r) for r in range(3)])
    agent.start()

    workers[2].wait_for(r"rank 2 step 12\b", 120)
    killed = time.monotonic()
    workers[2].kill()  # kill -9: the kernel closes its sockets, the scheduler sees it at once
    agent.exited("worker_2", workers[2].pid, code=None, sig="SIGKILL")
    relaunched[2] = job.worker(2, args=args)
    for r in (0, 1):
        workers[r].wait_for(rf"rank {r}: generation changed from 0 to 1", 30)
        # the lifecycle (toolkit.train.lifecycle) in the line: the survivors re-formed, their first group joined
        workers[r].wait_for(r"generation 1: process group of 3 ready in .*; re-forming -> formed", 120)
        assert workers[r].count(r"generation 0: process group of 3 ready in .*; joining -> formed") == 1
    print(f"\nkill -9 -> survivors in generation 1: {time.monotonic() - killed:.2f} s (includes the replacement's "
          "python + torch start)")
    for proc in (workers[0], workers[1], relaunched[2]):
        assert proc.wait(120) == 0, proc.text()
    assert sched.wait(30) == 0, sched.text()
    sched.wait_for(r"worker_2 \(pid \d+ on .*\) is dead: connection closed; generation 1 begins", 30)
    want = expected_weights(3, 40)
    for r in range(3):
        result = read_result(out / f"rank_{r}.json")
        assert result["w"] == want, f"rank {r} diverged"
        assert result["generation"] == 1
    for r in (0, 1):
        assert "Traceback" not in workers[r].text()


LEAVE_AFTER_FAILED_BUILD = """
import datetime, sys
import torch.distributed as dist
from toolkit.train.runtime import leave_group
port, rank = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, None, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
if rank == 0:
    try:  # a generation whose peer never comes: the build fails
        dist.init_process_group("gloo", store=dist.PrefixStore("gen1/", store), rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=1))
    except Exception:
        print("build of gen1 failed", flush=True)
    leave_group()
dist.init_process_group("gloo", store=dist.PrefixStore("gen2/", store), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))
print("gen2 formed", flush=True)
"""


def test_after_a_failed_group_build_a_fresh_peer_is_met(tmp_path: Path) -> None:
    """torch names a group's store keys by a per-process counter that a failed build leaves advanced; a survivor
    whose build failed must still meet a freshly started replacement in the next generation."""
    port = free_port_pair()
    argv = [sys.executable, "-c", LEAVE_AFTER_FAILED_BUILD, str(port)]
    survivor = subprocess.Popen([*argv, "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in survivor.stdout:  # type: ignore[union-attr]  # ends by itself: every wait in it is bounded
            seen.append(line)
            if line.strip() == "build of gen1 failed":
                break
        else:
            raise AssertionError("".join(seen))
        fresh = subprocess.run([*argv, "1"], capture_output=True, text=True, timeout=60)
        assert fresh.returncode == 0 and "gen2 formed" in fresh.stdout, fresh.stdout + fresh.stderr
        out, _ = survivor.communicate(timeout=60)
        assert survivor.returncode == 0 and "gen2 formed" in out, out
    finally:
        survivor.kill()
        survivor.wait()


def test_a_duplicate_process_is_refused_with_the_reason(make_job) -> None:
    job = make_job(2, node_timeout=1.0)
    sched = job.scheduler()
    job.wait_serving(sched)
    out = job.root / "out"
    first = job.worker(0, args=["--steps", "400", "--out", str(out), "--delay", "0.05"])
    sched.wait_for(r"registered worker_0", 60)
    second = job.worker(0, args=["--steps", "1", "--out", str(out)])
    assert second.wait(60) != 0
    second.wait_for(r"RegistrationError: worker_0: the scheduler at 127\.0\.0\.1:\d+ rejected it: worker_0 is held "
                    rf"by a live process \(pid {first.pid} on ", 1)
    sched.wait_for(rf"rejected worker_0 from pid {second.pid} on \S+, 127\.0\.0\.1:\d+", 30)
    assert first.popen.poll() is None  # the holder is untouched


def test_a_formation_timeout_reaches_the_waiting_workers(make_job) -> None:
    """The scheduler's 4 s formation bound runs from its start: the lonely worker is at the door first (torch
    imported, its own bound long; it retries until the scheduler listens), so a slow import on a loaded machine
    cannot make it miss the formation it is to be told about."""
    job = make_job(2, topo_timeout=4.0)
    lonely = job.worker(0, args=["--steps", "1", "--out", str(job.root / "out"), "--say-init"],
                        env={**job.worker_env(0), E.MS_TOPO_TIMEOUT: "120"})
    lonely.wait_for(r"^init$", 120)
    sched = job.scheduler()
    assert lonely.wait(120) != 0
    lonely.wait_for(r"JobStopped: cluster formation timed out after 4 s .* 1 of 2 workers never registered: "
                    r"worker_1", 30)
    assert sched.wait(60) == 3


def test_progress_datagrams_reach_the_agent_socket_and_the_step_file_holds_the_last_step(make_job,
                                                                                         tmp_path: Path) -> None:
    """The datagrams come at most once a second; the step file (what the agent's restart budget reads after a
    death) holds the last step exactly."""
    job = make_job(1)
    path = tmp_path / "progress.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(path))
    sink.settimeout(60)
    out = job.root / "out"
    steps_file = tmp_path / "worker_0.step"
    stepfile.reset(steps_file)  # as the agent does before a launch
    assert stepfile.read(steps_file) is None
    env = {**bare_env(job), E.TOOLKIT_AGENT_SOCKET: str(path), E.CKPT_DIR: str(job.ckpt),
           E.TOOLKIT_STEP_FILE: str(steps_file)}
    proc = job.worker(0, args=["--steps", "4", "--out", str(out)], env=env)
    steps = []
    while not steps or steps[-1] != 3:
        msg = json.loads(sink.recv(4096))
        assert set(msg) == {"node_id", "step", "epoch", "recovery"}
        steps.append(msg["step"])
    assert steps == sorted(steps) and steps[-1] == 3
    assert proc.wait(60) == 0
    assert stepfile.read(steps_file) == 3
    sink.close()


def test_an_absent_agent_socket_does_not_disturb_training(make_job, tmp_path: Path) -> None:
    job = make_job(1)
    out = job.root / "out"
    env = {**bare_env(job), E.TOOLKIT_AGENT_SOCKET: str(tmp_path / "nobody-here.sock"), E.CKPT_DIR: str(job.ckpt)}
    proc = job.worker(0, args=["--steps", "3", "--out", str(out)], env=env)
    assert proc.wait(60) == 0, proc.text()
    assert read_result(out / "rank_0.json")["w"] == expected_weights(1, 3)


# ------------------------------------------------------------------ environment parsing (pure)


def test_the_environment_chooses_the_mode(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("tok\n")
    assert R.WorkerEnv.from_env({}).mode == R.MODE_SINGLE
    tr = R.WorkerEnv.from_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (tr.mode, tr.rank, tr.world_size) == (R.MODE_TORCHRUN, 1, 2)
    tk = R.WorkerEnv.from_env({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "RANK_ID": "3", "MS_SCHED_PORT": "9000",
                               "TOOLKIT_TOKEN_FILE": str(token), "MS_NODE_ID": "worker_3"})
    assert (tk.mode, tk.rank, tk.world_size, tk.node_id, tk.store_port) == (R.MODE_TOOLKIT, 3, 4, "worker_3", 9001)
    assert tk.token == "tok" and "tok" not in repr(tk)


@pytest.mark.parametrize("env, message", [
    ({"MS_ROLE": "MS_SCHED"}, "MS_ROLE=MS_SCHED: a training script runs where MS_ROLE=MS_WORKER"),
    ({"MS_ROLE": "MS_WORKER"}, "MS_WORKER_NUM is not set"),
    ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "RANK_ID": "2"}, "RANK_ID='2': need a rank from 0 to 1"),
    ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "RANK_ID": "0", "TOOLKIT_HEARTBEAT_INTERVAL": "9"},
     "TOOLKIT_HEARTBEAT_INTERVAL=9 must be positive and shorter than MS_NODE_TIMEOUT=6"),
    ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "RANK_ID": "0", "TOOLKIT_TOKEN_FILE": "/nonexistent/token"},
     "TOOLKIT_TOKEN_FILE=/nonexistent/token: cannot read the job token"),
])
def test_a_bad_environment_is_one_clear_line(env: dict, message: str) -> None:
    with pytest.raises(R.RuntimeConfigError) as info:
        R.WorkerEnv.from_env(env)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_only_collective_failures_wait_for_a_generation_change() -> None:
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4023")
    assert faults.looks_collective(gloo)
    assert not faults.looks_collective(ValueError("bad batch"))
    assert not faults.looks_collective(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_report_outside_toolkit_does_nothing_and_a_bad_step_is_one_clear_error(tmp_path: Path) -> None:
    """toolkit.train.report from a script run alone (or under torchrun): importing it and calling it start nothing
    (no thread, no socket) and send nothing; a step that is not a whole number is refused on any launcher."""
    program = ("import socket, threading\n"
               "sent = []\n"
               "real = socket.socket.sendto\n"
               "socket.socket.sendto = lambda self, *a: sent.append(a) or real(self, *a)\n"
               "from toolkit.train import report\n"
               "report(5, loss=0.25)\n"
               "report(10, checkpoint=True)\n"
               "print(threading.active_count(), len(sent))\n"
               "for bad in (-1, True, 2.5, '3'):\n"
               "    try:\n"
               "        report(bad)\n"
               "    except ValueError as e:\n"
               "        print(e)\n")
    env = clean_env()
    env[E.TOOLKIT_AGENT_SOCKET] = str(tmp_path / "nobody.sock")  # even with an agent socket named: alone, no send
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "1 0"
    assert lines[1:] == [f"toolkit.train.report(step={b!r}): give the step as a whole number >= 0"
                         for b in (-1, True, 2.5, "3")]


def test_a_build_waits_until_every_rank_arrived_and_a_missing_one_ends_the_wait_at_its_bound() -> None:
    """Runtime._arrive, the wait before gloo connects its pairs (whose own timeout is short): nobody goes on before
    the last rank of the group arrived; a rank that never comes ends the wait with the store's timeout error."""
    store = dist.HashStore()
    gone: list[int] = []
    threads = [threading.Thread(target=lambda r=r: (R._arrive(store, 3, timedelta(seconds=120)), gone.append(r)))
               for r in range(2)]
    for t in threads:
        t.start()
    threads[0].join(0.5)
    assert gone == [], "went on before the third rank arrived"
    R._arrive(store, 3, timedelta(seconds=120))  # the last one: sets the key the others wait on
    for t in threads:
        t.join(120)
    assert sorted(gone) == [0, 1]
    alone = dist.HashStore()
    began = time.monotonic()
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        R._arrive(alone, 2, timedelta(seconds=0.3))
    assert time.monotonic() - began < 60


def test_under_torchrun_a_survivor_blocked_when_a_peer_dies_leaves_at_the_launchers_sigterm(tmp_path: Path) -> None:
    """The real torchrun, a Trainer script (tests/scripts/torchrun_blocked.py): rank 1 is killed (-9) inside a step
    while ranks 0 and 2 wait on each other there, a wait gloo never ends (their peer is alive). torchrun then
    SIGTERMs them and SIGKILLs them 30 s later if they are still there; the Trainer must instead abandon the group
    at the SIGTERM (a connection's peer hung up) and leave for the restart with its one line and exit 1. Before
    that, torchrun's 30 s and SIGKILL were every such survivor's end (measured on bench/transformer.py: the restart
    took 37 s instead of 7)."""
    argv = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "3", "--max-restarts", "0",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port_pair()}", "--log-dir",
            str(tmp_path / "logs"), "--redirects", "3", str(Path(__file__).resolve().parents[1] / "scripts" /
                                                              "torchrun_blocked.py")]
    proc = subprocess.run(argv, cwd=tmp_path, env={**clean_env(), E.CKPT_DIR: str(tmp_path / "ckpt"),
                                                   "OMP_NUM_THREADS": "1"},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=150)
    launcher = proc.stdout + proc.stderr
    logs = {int(p.parent.name): (p.read_text(), (p.parent / "stderr.log").read_text())
            for p in (tmp_path / "logs").glob("*/attempt_0/*/stdout.log")}
    evidence = f"torchrun exit {proc.returncode}:\n{launcher[-3000:]}\n" + "\n".join(
        f"--- rank {r}\n{out[-800:]}\n{err[-1500:]}" for r, (out, err) in sorted(logs.items()))
    assert proc.returncode != 0 and "exitcode: -9" in launcher and "local_rank: 1" in launcher, evidence
    for r in (0, 2):
        out, err = logs[r]
        assert f"rank {r}: waiting on rank {2 - r}" in out, evidence  # it was in the wait when rank 1 died
        assert f"rank {r}: a collective failed, a peer is gone" in err and "exiting for a restart" in err, evidence
    # The first survivor to abandon the group shuts its connection to the other, which may end that one's wait first.
    assert any("SIGTERM from the launcher with a peer's connection closed: the peer is gone, the group is abandoned"
               in logs[r][1] for r in (0, 2)), evidence
    assert "forcefully exiting via 9" not in launcher, evidence  # torchrun never had to SIGKILL a survivor
