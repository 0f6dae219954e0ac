"""toolkit.train.fence with real loopback TCP connections: a peer's hangup is seen (`wait_hangup`), and abandoning
the armed group shuts its connections down and tells its watchers, once, and only for the generation armed; with a
real gloo group, `wait` ends a collective at the trip and keeps it, with its group, until gloo ends it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from toolkit.train import fence as fence_mod
from toolkit.train.fence import Fence

BOUND = 30.0  # s: generous, the hangup is reported at once
HERE = Path(__file__).resolve().parent
PROC_TIMEOUT = 180.0  # s for a worker of fence_worker.py on a loaded machine; normally ~15 s


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(ours, the peer's): one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        before = fence_mod.tcp_sockets()
        ours = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    assert ours.fileno() in fence_mod.opened_since(before)
    yield ours, peer
    ours.close()
    peer.close()


def armed(ours: socket.socket, generation: int = 0) -> Fence:
    f = Fence()
    f.arm(generation)
    f.add_sockets({ours.fileno(): fence_mod.tcp_sockets()[ours.fileno()]})
    return f


def test_a_live_peer_is_no_hangup_and_its_death_is_one(connection) -> None:
    ours, peer = connection
    f = armed(ours)
    peer.sendall(b"data arriving does not count")
    assert f.wait_hangup(0.2) is False
    peer.close()
    assert f.wait_hangup(BOUND) is True
    assert Fence().wait_hangup(0.0) is False  # nothing recorded (NCCL): never a hangup


def test_a_recorded_connection_closed_since_counts_as_its_peer_gone(connection) -> None:
    ours, _ = connection
    f = armed(ours)
    ours.close()
    assert f.wait_hangup(BOUND) is True


def test_abandon_shuts_the_armed_groups_connections_once_and_only_for_its_generation(connection) -> None:
    ours, peer = connection
    f = armed(ours, generation=4)
    told: list[int] = []
    f.watch(lambda: told.append(1))
    assert f.abandon(3) == 0 and not f.tripped and told == []  # another generation's group: untouched
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(ours.recv(10)))
    reader.start()  # a receive blocked on a live peer
    assert f.abandon(4) == 1 and f.tripped and told == [1]
    reader.join(BOUND)
    assert got == [b""]  # the blocked receive returned: its connection was shut down
    assert f.abandon(4) == 0 and told == [1]  # once
    assert peer.recv(10) == b""  # and the peer sees it end


def rank0_row(worker: str, port: int, group_timeout: float) -> dict:
    """Run `worker` (this directory's) as ranks 0 and 1 of a gloo group on `port`; rank 0's last line, as JSON.
    Rank 1 is killed once rank 0 has ended (it waits on its stdin)."""
    procs = [subprocess.Popen([sys.executable, str(HERE / worker), str(r), str(port), str(group_timeout)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=PROC_TIMEOUT)
        assert procs[0].returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=PROC_TIMEOUT)


def test_wait_gives_a_collectives_result_and_at_a_trip_leaves_it_stranded_with_its_group(new_port) -> None:
    """`Fence.wait` on a real gloo group of two processes: the result of a collective that completes; and one that
    only the group's timeout could end (the peer never joins it, no socket recorded) raises Abandoned at the trip
    while it is still pending, the group's destroy returns before that collective ends (its group is held), and the
    group is let go once gloo ended it (at the group's timeout, 8 s here)."""
    row = rank0_row("fence_worker.py", new_port(), 8)
    assert row["gathered"] == [10, 11], row
    assert "gloo" in row["outcome"] and "abandoned" in row["outcome"], row  # read as a broken collective
    assert row["pending_at_raise"] and row["stranded_at_raise"] == 1, row  # the trip, not the timeout, ended it
    assert row["pending_after_destroy"], f"destroying the group waited for its stranded collective: {row}"
    assert row["released"], row


def test_fsdps_all_gather_entered_after_a_trip_raises_at_once(new_port) -> None:
    """FSDP2's own collectives through the fence (toolkit.train.shardcomm.FencedComms), on a real gloo group of two
    processes: a step completes through them; and a forward entered after the fence tripped, with the peer alive
    and silent, raises Abandoned naming the all-gather at once, where gloo waited for the group's timeout (60 s
    here; the mesh's groups had 30 minutes) and its peers for it (30 random-moment kills of bench/hsdp_recovery.py
    hung a job that way)."""
    row = rank0_row("fsdp_fence_worker.py", new_port(), 60)
    assert row["loss"] == row["loss"], row  # the step through the fenced collectives completed (not NaN)
    assert row["outcome"].startswith("Abandoned") and "all-gather" in row["outcome"], row
    assert row["seconds"] < 30, row  # the trip ended it, not the group's 60 s timeout
