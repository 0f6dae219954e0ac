"""The scheduler's listeners under hostile input, as a real `python -m toolkit.scheduler` process attacked from
other processes on loopback: one hostile line must not stop the job, nobody without the token can read or write
the job's store, and neither descriptors nor memory can be exhausted from outside. Each case also checks that a
legitimate worker is served afterwards (the scheduler kept serving)."""

from __future__ import annotations

import base64
import errno
import os
import random
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from runtime_harness import PYTHON, Client, Job, Proc, job_factory

from toolkit.contracts import protocol as P
from toolkit.scheduler import transport
from toolkit.testing import waits

pytestmark = pytest.mark.timeout(300)
CLK_TCK = os.sysconf("SC_CLK_TCK")


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    with job_factory(tmp_path) as make:
        yield make


def started(job: Job, **popen: object) -> Proc:
    sched = job.scheduler()
    job.wait_serving(sched)
    return sched


def still_serving(job: Job, rank: int = 0) -> None:
    """A legitimate worker still registers and is welcomed (the scheduler survived and kept serving)."""
    ok = Client(job.port)
    ok.register(job, rank)
    msg = ok.recv()
    assert msg is not None and msg["op"] == P.WELCOME and ok.proven(job, msg), msg
    ok.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


CORPUS = [
    b'{"op": "register", "rank": ' + b"9" * 5000 + b"}\n",  # killed the scheduler before (int-digit limit)
    b"[" * 200_000 + b"\n",  # so did this (RecursionError)
    b"\xff\xfe\x00garbage\n",
    b'{"op": "register"}\n',
    b'{"op": "register", "nonce": 5, "proof": [], "node_id": {}, "rank": true}\n',
    b'{"op": "store_hello", "nonce": "' + b"a" * 40 + b'", "proof": "x"}\n',
    b'{"op": 1}\n',
    b"null\n",
    b"x" * 100_000,  # no newline at all
]


def test_hostile_lines_do_not_stop_the_scheduler(make_job) -> None:
    """Every line of the corpus and random bytes, before authentication, on both ports; then, authenticated,
    malformed fields in every message a worker may send. The scheduler drops the offenders and serves on."""
    job = make_job(2, node_timeout=30.0, topo_timeout=600.0)
    sched = started(job)
    rng = random.Random(7)
    corpus = CORPUS + [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000))) for _ in range(40)]
    for port in (job.port, job.port + 1):
        for payload in corpus:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                try:
                    s.sendall(payload)
                    s.shutdown(socket.SHUT_WR)  # all we had to say (a payload without a newline ends here)
                    while s.recv(65536):  # the scheduler answers (reject) or drops; it does not hang on us
                        pass
                except OSError as e:  # the scheduler dropped us first: what it should do with an offender
                    if e.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                        raise
    member = Client(job.port)  # an authenticated worker that then sends nonsense of every shape
    member.register(job, 1)
    assert member.recv()["op"] == P.WELCOME
    for op in (P.HEARTBEAT, P.COMMIT, P.RECOVERED, "nonsense"):
        member.send(op, step="x", generation=[], source={}, from_rank=None, seconds="slow", recomputed=True)
    agent = Client(job.port)
    agent.hello(job, "host-a", ["worker_0", 5, None, {}])
    assert agent.recv()["op"] == P.WELCOME
    for fields in ({"node_id": ["x"]}, {"node_id": "worker_9", "pid": "x", "code": "y", "signal": 3},
                   {"node_id": "worker_1", "pid": 2**70, "code": None}):
        agent.send(P.EXITED, **fields)
    agent.send(P.GAVE_UP, node_id=7, code="x", signal=[], log_tail=42)
    assert sched.popen.poll() is None, sched.text()[-3000:]
    assert "Traceback" not in sched.text()
    still_serving(job, 0)
    assert sched.popen.poll() is None


def test_rejected_hellos_neither_forge_log_lines_nor_flood_the_log(make_job) -> None:
    """400 hellos without the token, each claiming a name that carries a forged log line (a newline, a terminal
    escape, a bidirectional override): the name is logged with its control characters escaped, and the flood costs
    one line plus one summary with its count, not a line each (30,709 rejections in 10 s once grew the log 5.9 MB)."""
    job = make_job(1)
    sched = started(job)
    forged = "x\n2099-01-01 00:00:00 sched INFO job testjob done\x1b[2J\u202e"  # within the 80 characters logged
    flood = 400
    for _ in range(flood):
        c = Client(job.port)
        c.say_hello(P.REGISTER, "not-the-token", node_id=forged, rank=0, world_size=1, incarnation="i", pid=1,
                    host="h", generation=None, rejoin=False)
        assert c.recv()["op"] == P.REJECT
        c.close()
    summary = sched.wait_for(r"(\d+) more like this in the last 10 s; the latest: rejected registration of x\\n2099",
                             transport.LOG_EVERY + 30)
    assert int(summary.group(1)) == flood - 1
    assert sched.count(r"rejected registration of") == 2, sched.text()[-3000:]
    assert sched.count(r"^2099-01-01") == 0 and "\x1b" not in sched.text() and "\u202e" not in sched.text()
    assert "x\\n2099-01-01 00:00:00 sched INFO job testjob done\\x1b[2J\\u202e from 127.0.0.1:" in sched.text()
    still_serving(job)


def test_the_store_serves_only_the_job_on_the_schedulers_address(make_job) -> None:
    job = make_job(1)
    sched = started(job)
    listening = {(addr, port) for addr, port in _listeners() if port in (job.port, job.port + 1)}
    assert listening == {("127.0.0.1", job.port), ("127.0.0.1", job.port + 1)}, listening  # not *:port

    def kv(c: Client, **request: object) -> dict:
        c.send(P.KV, id=1, **request)
        return c.recv()

    value = base64.b64encode(b"secret-address").decode()
    member = Client(job.port + 1)
    member.say_hello(P.STORE_HELLO, job.token, node_id="worker_0")
    welcome = member.recv()
    assert welcome["op"] == P.WELCOME and member.proven(job, welcome)
    assert kv(member, cmd="set", key="job/boot/gen0/rank_0", value=value)["ok"]
    # A second process without the token: nothing it sends reaches the store, whatever it tries.
    for attempt in ("no hello", "wrong token", "plain token"):
        stranger = Client(job.port + 1)
        stranger.challenge()
        if attempt == "wrong token":
            stranger.say_hello(P.STORE_HELLO, "guess", node_id="worker_0")
            assert stranger.recv()["op"] == P.REJECT
        elif attempt == "plain token":
            stranger.say_hello(P.STORE_HELLO, job.token, plain=True, node_id="worker_0")
            assert stranger.recv()["op"] == P.REJECT
        for request in ({"cmd": "get", "key": "job/boot/gen0/rank_0", "timeout": 1},
                        {"cmd": "set", "key": "job/boot/gen0/rank_0", "value": base64.b64encode(b"evil").decode()},
                        {"cmd": "delete", "key": "job/boot/gen0/rank_0"}):
            try:
                stranger.send(P.KV, id=1, **request)
                reply = stranger.recv(5)
            except OSError:
                reply = None
            assert reply is None or reply["op"] == P.REJECT, (attempt, reply)
    got = kv(member, cmd="get", key="job/boot/gen0/rank_0", timeout=1)
    assert got["ok"] and base64.b64decode(got["value"]) == b"secret-address"
    # And the store is bounded: a value over the limit is refused, not stored.
    big = base64.b64encode(b"x" * (P.MAX_STORE_VALUE + 1)).decode()
    assert kv(member, cmd="set", key="big", value=big)["ok"] is False
    assert sched.popen.poll() is None


def _listeners() -> list[tuple[str, int]]:
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            addr, port = local.split(":")
            out.append((socket.inet_ntoa(bytes.fromhex(addr)[::-1]), int(port, 16)))
    return out


def test_descriptor_exhaustion_and_idle_strangers_cost_no_cpu_and_expire(make_job, tmp_path: Path) -> None:
    """With ulimit -n 64 (below what the job's size asks, which the scheduler says), most of it held by 50
    authenticated store connections, and 120 connections that never authenticate: no accept spin (the scheduler's
    CPU over the siege stays near zero, its log does not flood), the strangers are dropped at the pre-authentication
    deadline, and a legitimate worker is served after."""
    job = make_job(1)
    sched = Proc([PYTHON, "-c", "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); "
                  "from toolkit.scheduler import main; sys.exit(main())"], job.sched_env(), job.logs / "sched.log")
    job.procs.append(sched)
    job.wait_serving(sched)
    members = []
    for i in range(50):  # token holders: their connections are not the table's to bound
        c = Client(job.port + 1)
        c.say_hello(P.STORE_HELLO, job.token, node_id=f"worker_{i}")
        assert c.recv()["op"] == P.WELCOME
        members.append(c)
    before = cpu_seconds(sched.pid)
    idle = []
    for _ in range(120):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", job.port))
        idle.append(s)
    time.sleep(5.0)  # a siege is a duration: the scheduler must idle through it
    spent = cpu_seconds(sched.pid) - before
    assert spent < 1.0, f"the scheduler spent {spent:.2f} s of CPU in 5 s of descriptor exhaustion"
    assert 1 <= sched.count(r"cannot accept connections") <= 2, sched.text()[-2000:]  # it ran out, said so once
    assert sched.count(r"the descriptor limit \(RLIMIT_NOFILE 64\) is below the \d+ a job of 1 workers needs") == 1
    waits.wait_for("the idle connections cut off at the pre-authentication deadline",
                   lambda: sched.count(r"did not authenticate within"), transport.PREAUTH_TIMEOUT + 30, poll=0.5,
                   evidence=lambda: sched.text()[-2000:])
    for s in idle:
        s.close()
    for c in members:
        c.close()
    still_serving(job)


def test_strangers_cannot_pile_up_memory(make_job) -> None:
    """200 connections each sending 1 MB without a newline: each is cut off at the first-message limit."""
    job = make_job(1)
    sched = started(job)
    before = rss_mb(sched.pid)
    chunk = b"x" * (64 << 10)
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", job.port), timeout=10)
        try:
            for _ in range(16):
                s.sendall(chunk)
        except (ConnectionResetError, BrokenPipeError, socket.timeout):
            pass
        socks.append(s)
    grown = rss_mb(sched.pid) - before
    for s in socks:
        s.close()
    assert grown < 30, f"the scheduler grew by {grown:.0f} MB"
    still_serving(job)


def test_a_squatter_on_the_schedulers_port_learns_no_token_and_orders_nothing(make_job, tmp_path: Path) -> None:
    """While the scheduler is down, another local user binds its port: the reconnecting worker's hello carries
    no token, and the squatter's unproven answers (a fake `fenced` included) are not obeyed."""
    job = make_job(1, node_timeout=30.0)
    squatter = socket.create_server(("127.0.0.1", job.port))
    worker = job.worker(0, args=["--steps", "3", "--out", str(tmp_path / "out")])
    try:
        squatter.settimeout(60)
        conn, _ = squatter.accept()
        nonce = P.new_nonce()
        conn.sendall(P.encode(P.CHALLENGE, nonce=nonce))
        conn.settimeout(30)
        hello = conn.recv(65536)
        assert job.token.encode() not in hello and b'"token"' not in hello
        conn.sendall(P.encode(P.FENCED, reason="go away"))  # no proof: not the scheduler
        conn.close()
        squatter.close()
        sched = started(job)  # the real one comes up: the worker joins it and finishes
        assert worker.wait(120) == 0, worker.text()
        assert "exiting with code 75" not in worker.text()  # the fake `fenced` was not obeyed
        assert sched.wait(30) == 0
    finally:
        squatter.close()
