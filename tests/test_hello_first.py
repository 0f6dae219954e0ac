"""Hello first (issue 39, round 3, finding 2): a client's first message proves the job token without waiting for the
scheduler's challenge, so the scheduler authenticates it at accept, before a flood of connections that prove nothing
(from the worker's own address) can compete with it; its freshness is a time window and a nonce used once
(toolkit.scheduler.replay). The pure parts with a fake clock; then a real scheduler under a real flood of partial
hellos from the workers' own address (tests/scripts/flood.py), reached by the real store client."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import pytest
from runtime_harness import PYTHON, Job, job_factory

from toolkit.contracts import protocol as P
from toolkit.scheduler.replay import Replays
from toolkit.testing import waits
from toolkit.train import store as job_store

pytestmark = pytest.mark.timeout(300)
FLOOD_SCRIPT = Path(__file__).resolve().parent / "scripts" / "flood.py"
TOKEN = "ab" * 32
WAIT = 120.0  # s for any one state on a loaded 2-core machine
FLOOD_PER_PORT = 300  # partial hellos held open on each of the scheduler's ports (its table holds 256)
FLOOD_RATE = 3000  # new flood connections a second, at most: far beyond the 64 a second one source may open
SESSIONS = 60  # store connections the worker opens through the flood


def test_a_first_hello_proves_the_token_without_the_servers_nonce_and_covers_what_it_claims() -> None:
    data, nonce = P.first_hello(P.STORE_HELLO, TOKEN, 1000.0, node_id="worker_1")
    msg = P.decode(data.rstrip(b"\n"))
    assert msg["nonce"] == nonce and msg["sent"] == 1_000_000 and "token" not in msg
    assert P.check_client(TOKEN, "any server nonce", msg) and P.hello_sent(msg) == 1_000_000
    assert not P.check_client("cd" * 32, "", msg)  # another token
    assert not P.check_client(TOKEN, "", {**msg, "node_id": "worker_0"})  # claims someone else
    assert not P.check_client(TOKEN, "", {**msg, "sent": 1_000_001})  # another time: the proof covers it
    assert not P.check_client(TOKEN, "", {**msg, "sent": True}) and P.hello_sent({**msg, "sent": "1"}) == -1
    assert P.hello_sent({"op": P.REGISTER}) is None  # a hello that answers a challenge


def test_a_first_hello_is_fresh_once_within_the_window_and_the_clock_difference_is_named() -> None:
    replays = Replays(skew=300.0)
    assert replays.verdict("n1", 1_000_000, now=1010.0) == ""
    assert replays.verdict("n1", 1_000_000, now=1011.0) == "a hello seen before (replayed)"
    assert replays.verdict("n2", 1_000_000, now=1400.0).startswith("its clock is 400 s behind the scheduler's "
                                                                  "(at most 300 s allowed): synchronise")
    assert replays.verdict("n3", 2_000_000, now=1000.0).startswith("its clock is 1000 s ahead")
    assert replays.verdict("n1", 1_600_000, now=1610.1) == ""  # forgotten once its hello could no longer pass
    assert len(replays) == 1


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    with job_factory(tmp_path) as make:
        yield make


def hello_reply(port: int, hello: bytes) -> tuple[str, dict]:
    """Send `hello` first on a new connection: the nonce of the server's challenge and its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(hello)
        lines = P.LineBuffer()
        got: list[dict] = []
        while len(got) < 2:
            data = s.recv(65536)
            assert data, f"closed after {got}"
            got.extend(lines.feed(data))
    return P.challenge_nonce(got[0]), got[1]


def test_a_replayed_first_hello_is_refused_and_a_skewed_clock_is_named_in_a_proven_answer(make_job) -> None:
    job = make_job(1)
    sched = job.scheduler()
    job.wait_serving(sched)
    hello, _ = P.first_hello(P.STORE_HELLO, job.token, time.time(), node_id="worker_0")
    assert hello_reply(job.port + 1, hello)[1]["op"] == P.WELCOME
    _, again = hello_reply(job.port + 1, hello)  # the same bytes, as an eavesdropper would send them
    assert again["op"] == P.REJECT and "proof" not in again and "replayed" in again["reason"]
    skewed, mine = P.first_hello(P.STORE_HELLO, job.token, time.time() - 3600, node_id="worker_0")
    server_nonce, answer = hello_reply(job.port + 1, skewed)
    assert answer["op"] == P.REJECT and P.check_server(job.token, server_nonce, mine, answer)  # proven: trusted
    assert re.fullmatch(r"this host's clock: its clock is 36\d\d s behind the scheduler's \(at most 300 s allowed\): "
                        r"synchronise the hosts' clocks \(NTP\)", answer["reason"]), answer
    waits.wait_for("the scheduler's line on the skewed clock", lambda: sched.count(r"its clock is \d+ s behind"),
                   WAIT, poll=0.2, evidence=lambda: sched.text()[-2000:])


def test_a_flood_from_the_workers_own_address_never_keeps_a_worker_out(make_job, monkeypatch) -> None:
    """The red team's flood (round 3): partial hellos from 127.0.0.1, the workers' own address, opened far beyond the
    rate one source may have and held open, so the table of connections waiting to authenticate stays full and
    evicts the oldest of that source all the time. Through it, the real store client connects again and again (as
    every worker does after each formation): every connection is served, and it takes no more tries than
    connections, give or take the few whose hello had not arrived when the scheduler accepted them (those reconnect
    at once, uncounted by any pause; a fifth more tries at most, for a loaded machine). Measured with 100
    connections: 100 tries with hello first, twice; with the challenge answered first (the old client), 126 and 168
    tries, and pauses after runs of evictions."""
    job = make_job(1)
    sched = job.scheduler()
    job.wait_serving(sched)
    flood = subprocess.Popen([PYTHON, str(FLOOD_SCRIPT), "partial", "127.0.0.1", f"{job.port},{job.port + 1}",
                              str(FLOOD_PER_PORT), str(FLOOD_RATE)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tries = []
    real_open = job_store.open_session

    def counted(*args, **kwargs):  # the real handshake, counted
        tries.append(1)
        return real_open(*args, **kwargs)

    try:
        assert flood.stdout is not None
        waits.wait_for("the flood's connections open", lambda: re.match(r"opened \d+", flood.stdout.readline()),
                       WAIT, poll=0.0, evidence=lambda: sched.text()[-2000:])
        waits.wait_for("the table of connections waiting to authenticate full and evicting",
                       lambda: sched.count("to make room for"), WAIT, poll=0.2, evidence=lambda: sched.text()[-2000:])
        monkeypatch.setattr(job_store, "open_session", counted)
        pauses: list[float] = []
        for i in range(SESSIONS):
            store = job_store.connect("127.0.0.1", job.port + 1, job.token, f"worker_{i % 4}",
                                      timedelta(seconds=WAIT), sleep=pauses.append)
            try:
                store.set(f"test/flood/{i}", b"v")
                assert store.multi_get([f"test/flood/{i}"]) == [b"v"]
            finally:
                store.close()
        assert flood.poll() is None, "the flood stopped: it was not there for the whole test"
        assert sched.count("to make room for") >= 1 and sched.popen.poll() is None
        assert not pauses, f"a connection waited {pauses}: only evictions are retried, and those at once"
        assert len(tries) <= SESSIONS + SESSIONS // 5, f"{len(tries)} tries for {SESSIONS} connections"
    finally:
        flood.send_signal(signal.SIGKILL)
        flood.wait(30)
