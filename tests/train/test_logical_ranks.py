"""Logical ranks end to end (issue 42 item 1), through the real agent, scheduler and workers: 2 workers serving 4
logical ranks (`--logical-ranks 4`) end with parameters bitwise equal to those of 4 workers under the real torchrun;
and so does such a job whose worker is killed with SIGKILL mid-run (each process serving 2 logical ranks), the
survivor going on in place and the replacement taking its state from it. The processes there run the step body
once per logical rank: each worker's log has every step twice. And a real worker told a wrong assignment in an
authenticated `formed` stops with one line instead of training on it.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from runtime_harness import Job

from toolkit.contracts import protocol as P
from toolkit.testing.localjob import EXAMPLES, STEP_LINE, LocalJob, clean_env
from toolkit.testing.ports import free_port_pair

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
ARGS = ["--epochs", "2", "--ckpt-interval", "4", "--keep-max", "3", "--timeout", "30"]
STEPS = 2 * 12  # 1440 samples over 4 logical ranks, 360 each, in batches of 32: 12 a epoch
JOB_TIMEOUT = 240.0  # s for one job on a loaded 2-core machine; normally ~20 s
SPARE_TIMEOUT = 60.0  # s for the agent's warm spare to import torch
POLL = 0.02  # s between looks at a log: no event tells that a line was appended
FINAL = re.compile(r"^final parameters: (\S+) sha256 ([0-9a-f]{64})$", re.M)
RESUMED = re.compile(r"^rank (\d+): resumed from step (\d+) .*out of rank \d+'s memory.*: (\d+) step\(s\) recomputed$",
                     re.M)

pytestmark = pytest.mark.timeout(600)


def until(what: str, predicate: Callable[[], Any], timeout: float, evidence: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{evidence()}")
        time.sleep(POLL)


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory) -> tuple[Path, str]:
    """The final parameters of 4 workers under the real torchrun (one logical rank each, as any torchrun job)."""
    d = tmp_path_factory.mktemp("torchrun4")
    argv = [TORCHRUN, "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{free_port_pair()}", "--log-dir", str(d / "logs"), "--redirects", "3",
            str(EXAMPLES / "train.py"), *ARGS]
    proc = subprocess.Popen(argv, cwd=d, env={**clean_env(), "CKPT_DIR": str(d / "ckpt"), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the reference run did not finish in {JOB_TIMEOUT} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]
    (log,) = [p.read_text() for p in (d / "logs").glob("*/attempt_0/0/stdout.log")]
    assert len(STEP_LINE.findall(log)) == STEPS, log[-2000:]
    (m,) = FINAL.finditer(log)
    return Path(m.group(1)), m.group(2)


def assert_bitwise_equal(a: Path, b: Path) -> None:
    pa, pb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert pa[k].numpy().tobytes() == pb[k].numpy().tobytes(), f"{k} differs"


def steps_seen(log: str) -> Counter:
    """How many times each step's line was printed (once per logical rank the process served at that step)."""
    return Counter(int(step) for _, step in STEP_LINE.findall(log))


def test_two_workers_serving_four_logical_ranks_end_bitwise_equal_to_four_workers(tmp_path, four_workers) -> None:
    job = LocalJob(tmp_path, 2, ARGS, job="lr", node_timeout=3, cluster_time_out=120, grace=20, logical_ranks=4,
                   warm_spare=False)
    try:
        job.start()
        assert job.finish(JOB_TIMEOUT) == 0, job.evidence()
    finally:
        job.cleanup()
    assert "generation 0 formed: 2 workers, serving 4 logical ranks" in job.log("scheduler.log"), job.evidence()
    for r in range(2):
        assert steps_seen(job.log(f"worker_{r}.log")) == {s: 2 for s in range(1, STEPS + 1)}, job.evidence()
    (final,) = FINAL.findall(job.log("worker_0.log"))
    assert final[1] == four_workers[1], "2 workers serving 4 logical ranks differ from 4 workers"
    assert_bitwise_equal(Path(final[0]), four_workers[0])


def test_a_kill9_of_a_worker_serving_two_logical_ranks_recovers_in_place_bitwise(tmp_path, four_workers) -> None:
    seed = random.SystemRandom().randrange(2**32)
    target = random.Random(seed).randint(6, STEPS - 8)
    why = f"(seed {seed}: kill worker_1 at step {target} of {STEPS})"
    job = LocalJob(tmp_path, 2, [*ARGS, "--step-delay", "0.1"], job="lrk", node_timeout=3, cluster_time_out=120,
                   grace=20, logical_ranks=4)
    try:
        job.start()
        until("the warm spare to be ready", lambda: (job.doc().get("warm_spare") or {}).get("ready"), SPARE_TIMEOUT,
              job.evidence)
        until(f"worker_1 at step {target}", lambda: job.last_step(1) >= target, JOB_TIMEOUT, job.evidence)
        pids = {r: job.procs()[f"worker_{r}"]["pid"] for r in range(2)}
        os.kill(pids[1], signal.SIGKILL)
        assert job.finish(JOB_TIMEOUT) == 0, f"{why}\n{job.evidence()}"
    finally:
        job.cleanup()
    after = job.procs()
    assert (after["worker_0"]["restarts"], after["worker_0"]["last_pid"]) == (0, pids[0]), f"survivor restarted {why}"
    assert after["worker_1"]["restarts"] == 1 and after["worker_1"]["exits"][0]["signal"] == "SIGKILL", why
    survivor = job.log("worker_0.log")
    (m,) = RESUMED.finditer(survivor)
    assert m.group(3) == "0", f"steps recomputed {why}: {m.group(0)}"
    assert set(steps_seen(survivor)) == set(range(1, STEPS + 1)), why  # every step, none lost
    (final,) = FINAL.findall(survivor)
    assert final[1] == four_workers[1], f"final parameters differ from 4 workers' {why}"
    assert_bitwise_equal(Path(final[0]), four_workers[0])


def test_a_worker_told_a_wrong_assignment_stops_with_one_line_and_never_trains(tmp_path) -> None:
    """A scheduler that proves the job token (a bug or another toolkit version, not noise) sends a `formed` whose
    assignment leaves logical rank 1 to nobody: the real worker exits 77 with one line, before any step."""
    job = Job(tmp_path, 2)
    server = socket.create_server(("127.0.0.1", job.port))
    worker = job.worker(0, args=["--steps", "3", "--out", str(tmp_path / "out")])
    try:
        server.settimeout(120)
        conn, _ = server.accept()
        conn.settimeout(60)
        nonce = P.new_nonce()
        conn.sendall(P.encode(P.CHALLENGE, nonce=nonce))
        lines = P.LineBuffer(P.MAX_LINE)
        got: list = []
        while not got:
            got = lines.feed(conn.recv(65536))
        hello = got[0]
        assert hello["op"] == P.REGISTER and P.check_client(job.token, nonce, hello)
        conn.sendall(P.encode(P.WELCOME, proof=P.server_proof(job.token, nonce, hello["nonce"]), rank=0,
                              world_size=2, generation=0, job=job.name))
        conn.sendall(P.encode(P.FORMED, generation=0, prefix="x/", logical_world=4, logical=[[0, 2, 3], [2]]))
        assert worker.wait(120) == P.EXIT_FATAL, worker.text()
        conn.close()
    finally:
        server.close()
        job.cleanup()
    text = worker.text()
    assert "the scheduler's formed message of generation 0 is wrong: the assignment does not cover each of the 4 " \
           "logical ranks exactly once; stopping rather than training on it (exit 77)" in text, text
    assert "Traceback" not in text and "rank 0 step" not in text and "starts at step" not in text, text
