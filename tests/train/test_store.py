"""The job's store client (toolkit.train.store) against a real `python -m toolkit.scheduler`: a real 4-rank gloo
group bootstraps from it with GLOO_ENABLE_STORE_V2_API and GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER in one set and one
multi_get per rank, and `connect` retries a store that refuses or resets connections until its deadline but never
one that answers without proving the token or refuses for good. The store's core is in tests/test_kvstore.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from runtime_harness import ROOT, Job, Proc

from toolkit.contracts import protocol as P
from toolkit.train import store as job_store

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).resolve().parent
WORLD = 4
PROC_TIMEOUT = 180.0
GLOO_VARS = {"GLOO_ENABLE_STORE_V2_API": "1", "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "1"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, Proc]]:
    """A scheduler for a job of WORLD workers that never register: only its store is used."""
    job = Job(tmp_path_factory.mktemp("store"), WORLD, topo_timeout=3600)
    sched = job.scheduler()
    try:
        job.wait_serving(sched)
        yield job, sched
    finally:
        job.cleanup()


class Gate:
    """A listener in front of the real store: bound at once, listening only after `open()` (until then connects
    are refused); the first `drop` connections it accepts are closed before a byte (as a scheduler at its
    connection limits does at accept), the others relayed to `target`."""

    def __init__(self, target: int, drop: int) -> None:
        self.target, self.drop = target, drop
        self.accepted = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.threads: list[threading.Thread] = []

    def open(self) -> None:
        self.sock.listen(16)
        self._spawn(self._serve)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.drop:
                conn.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=30)
            self._spawn(_pump, conn, upstream)
            self._spawn(_pump, upstream, conn)

    def close(self) -> None:
        self.sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_a_four_rank_gloo_group_bootstraps_in_one_set_and_one_multi_get_per_rank(served) -> None:
    job, sched = served
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "TOOLKIT_", "GLOO_", "TORCH"))}
    env.update(GLOO_VARS, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "store_worker.py"), str(r), str(WORLD), str(job.port + 1),
                               str(job.token_file), "test/gen0/"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=PROC_TIMEOUT)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert sorted(r["rank"] for r in results) == list(range(WORLD))
    for r in results:
        assert r["sum"] == sum(range(1, WORLD + 1))  # the group works: 1 + 2 + 3 + 4
        assert r["requests"] == {"set": 1, "multi_get": 1}, r  # no per-rank get or wait
        assert r["after"] == r["requests"]  # collectives never touch the store
    assert sched.popen.poll() is None and sched.count(r"ERROR|Traceback") == 0


def test_connect_retries_a_refusing_store_until_it_serves(served) -> None:
    job, _ = served
    gate = Gate(job.port + 1, drop=1)
    pauses: list[float] = []

    def pause(seconds: float) -> None:  # after two refused connects the listener comes up, and drops one more
        pauses.append(seconds)
        if len(pauses) == 2:
            gate.open()
        time.sleep(seconds)

    try:
        store = job_store.connect("127.0.0.1", gate.port, job.token, "worker_0", timedelta(seconds=60), sleep=pause)
        try:
            store.set("test/retry/k", b"v")
            assert store.multi_get(["test/retry/k", "test/retry/k"]) == [b"v", b"v"]
        finally:
            store.close()
    finally:
        gate.close()
    # refused, refused (each after a pause), closed at accept (to make room, as under a flood: again at once), served
    assert len(pauses) == 2 and gate.accepted == 2
    assert all(job_store.RETRY_FIRST / 2 <= p <= job_store.RETRY_MAX for p in pauses)


def test_a_multi_get_too_long_for_one_reply_is_asked_in_parts(served) -> None:
    job, _ = served
    store = job_store.connect("127.0.0.1", job.port + 1, job.token, "worker_0", timedelta(seconds=60))
    try:
        keys = [f"test/big/{i}" for i in range(9)]
        for i, key in enumerate(keys):
            store.set(key, bytes([i]) * P.MAX_STORE_VALUE)
        with pytest.raises(job_store.StoreError, match="ask for fewer keys"):  # what one request would get
            store._call("multi_get", keys=keys, timeout=1)
        assert store.multi_get(keys) == [bytes([i]) * P.MAX_STORE_VALUE for i in range(9)]
        for key in keys:
            store.delete_key(key)
    finally:
        store.close()


def test_connect_gives_up_at_its_deadline(served) -> None:
    gate = Gate(0, drop=0)  # never listens: every connect is refused
    try:
        with pytest.raises(job_store.StoreError, match=r"after \d+ attempts"):
            job_store.connect("127.0.0.1", gate.port, "t", "worker_0", timedelta(seconds=0.5))
    finally:
        gate.close()


def test_a_peer_without_the_token_or_a_proven_refusal_is_not_retried(served) -> None:
    job, _ = served
    gate = Gate(job.port + 1, drop=0)
    gate.open()
    try:
        with pytest.raises(job_store.StoreError, match="did not prove the job token"):
            job_store.connect("127.0.0.1", gate.port, "not-the-token", "worker_0", timedelta(seconds=60))
        assert gate.accepted == 1
    finally:
        gate.close()

    refuser = socket.socket()
    refuser.bind(("127.0.0.1", 0))
    refuser.listen(4)
    accepted: list[int] = []

    def refuse() -> None:  # a store that proves the token and refuses for good
        while True:
            try:
                conn, _ = refuser.accept()
            except OSError:
                return
            accepted.append(1)
            with conn:
                nonce = P.new_nonce()
                conn.sendall(P.encode(P.CHALLENGE, nonce=nonce))
                hello = P.decode(conn.makefile("rb").readline())
                conn.sendall(P.encode(P.REJECT, reason="this node is not in the job", retry=False,
                                      proof=P.server_proof(job.token, nonce, hello["nonce"])))

    threading.Thread(target=refuse, daemon=True).start()
    try:
        with pytest.raises(job_store.StoreRefused, match="this node is not in the job"):
            job_store.connect("127.0.0.1", refuser.getsockname()[1], job.token, "worker_0", timedelta(seconds=60))
        assert accepted == [1]
    finally:
        refuser.close()


def test_the_backoff_doubles_to_its_cap_with_jitter() -> None:
    assert [job_store.retry_pause(a, lambda: 1.0) for a in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert job_store.retry_pause(3, lambda: 0.0) == 0.2
    assert job_store.retry_pause(10 ** 6, lambda: 0.5) == 0.75


def test_multi_get_batches_fit_one_request() -> None:
    keys = [f"k{i}" for i in range(2500)]
    batches = list(job_store._batches(keys))
    assert [len(b) for b in batches] == [P.MAX_STORE_KEYS, P.MAX_STORE_KEYS, 452]
    assert sum(batches, []) == keys
    long = ["x" * 1000 + str(i) for i in range(600)]
    assert all(len(json.dumps(b)) < P.MAX_STORE_LINE // 2 + 1100 for b in job_store._batches(long))
