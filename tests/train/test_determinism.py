"""The rank-ordered allreduce (toolkit.train.determinism): the same bits as the rank-ordered mean whatever DDP's
bucket layout, within float tolerance of DDP's own allreduce, and about a ring allreduce's traffic. Real gloo
groups of separate processes; the bitwise end-to-end check across kills is tests/train/test_zero_loss.py's, the
speed bench/bitwise_allreduce.py's."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
PROC_TIMEOUT = 120.0  # s for one worker on a loaded machine; normally ~5 s


@contextlib.contextmanager
def workers(world: int, port: int, *scenario: str) -> Iterator[list[subprocess.Popen]]:
    """The ranks of determinism_worker.py (`scenario`: its optional last argument), killed on the way out if still
    running."""
    procs = [subprocess.Popen([sys.executable, str(HERE / "determinism_worker.py"), str(r), str(world), str(port),
                               *scenario], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(world)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def last_row(p: subprocess.Popen) -> dict:
    """The worker's last JSON line, once it exited 0."""
    out, err = p.communicate(timeout=PROC_TIMEOUT)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_ordered_mean_is_layout_independent_and_close_to_a_plain_allreduce(new_port) -> None:
    """World 3 (a ring's order differs from rank order from 3 ranks on); world 4 runs end to end in test_zero_loss."""
    world = 3
    with workers(world, new_port()) as procs:
        rows = [last_row(p) for p in procs]
    for row in rows:
        # Bit for bit the rank-ordered mean, in DDP's first iteration and after it rebuilt its buckets, with one
        # bucket or many: the bucket layout does not enter the arithmetic.
        assert row["one_bucket"] == [True, True], row
        assert row["many_buckets"] == [True, True], row
        # The Trainer's wrapper: its bucket size from the first iteration on (several buckets there, where DDP's
        # default has one), gradients as views of the buckets; the same bits.
        assert row["trainers"] == [True, True], row
        assert row["trainers_buckets"][0] > 1, row
        # Summed in a given order of the ranks (that of the logical ranks they serve): that order's mean, bitwise.
        assert row["permuted"] == [True, True], row
        # DDP's own allreduce adds in another order: close, not necessarily equal.
        assert row["plain_diff"] <= 1e-5 * row["scale"], row
        # A ring allreduce's traffic: 2(n-1)/n of the gradients each way, as DDP's own (not n-1 times).
        ring = 2 * (world - 1) / world * row["grad_bytes"]
        assert ring <= row["ordered_bytes"] <= 1.1 * ring + 64 * 1024, row
        assert row["ordered_bytes"] <= 1.1 * row["plain_bytes"] + 64 * 1024, row


def test_a_reduction_waiting_on_a_stopped_peer_ends_when_the_fence_trips(new_port) -> None:
    """Rank 0 stops before its backward; rank 1's reduction waits on it (the group's timeout is 120 s). Tripping
    rank 1's fence, as the runtime does when a new generation is announced, ends its backward at once with an
    error the runtime reads as a broken collective: nothing else can (a gloo receive cut mid-message is never
    woken, toolkit.train.fence), so here the fence records no socket and only its watchers act."""
    with workers(2, new_port(), "abandoned") as procs:
        for p in procs:
            line = ""
            while '"backward"' not in line:
                assert p.poll() is None, p.stderr.read()
                line = p.stdout.readline()
        procs[1].stdin.write("trip\n")  # rank 1's fence trips, as at a new generation
        procs[1].stdin.flush()
        row = last_row(procs[1])
    assert "gloo" in row["outcome"] and "abandoned" in row["outcome"], row
    assert row["after_trip"] < 30, f"the backward waited for the group's timeout, not the trip: {row}"


def test_a_backward_under_way_when_the_fence_trips_ends_at_its_next_bucket(new_port) -> None:
    """A new generation announced while a survivor's backward runs: the backward ends at the next gradient bucket
    with the error the runtime reads as a broken collective, instead of computing the rest of the gradients first
    (a whole backward, 0.3-0.5 s of a 670 MB model here, before the survivor could re-form). Rank 0 stops before
    its backward; rank 1's fence trips once its first gradient is accumulated."""
    with workers(2, new_port(), "midway") as procs:
        row = last_row(procs[1])
    assert "gloo" in row["outcome"] and "abandoned" in row["outcome"], row
    assert row["accumulated"] < row["parameters"], f"the backward ran to its end after the trip: {row}"


def test_the_scratch_is_one_buffer_reused_and_grown_for_the_largest_bucket() -> None:
    """The reducer's thread takes its receive and sum buffers from one kept buffer (no new memory per bucket)."""
    import torch

    from toolkit.train.determinism import Scratch

    scratch = Scratch()
    like = torch.zeros(1, dtype=torch.float32)
    a = scratch.take(3, 100, like)
    assert [t.numel() for t in a] == [100] * 3 and all(t.dtype == torch.float32 for t in a)
    for i, t in enumerate(a):
        t.fill_(i)  # disjoint: each keeps its own values
    assert [float(t.sum()) for t in a] == [0.0, 100.0, 200.0]
    first = scratch.buf
    b = scratch.take(3, 50, torch.zeros(1, dtype=torch.float64))  # 1200 bytes: fits the kept 1200
    assert scratch.buf is first and b[0].data_ptr() == first.data_ptr() and b[2].dtype == torch.float64
    scratch.take(4, 100, like)  # larger: grown once
    assert scratch.buf is not first and scratch.buf.numel() == 1600


def test_the_trainers_ordered_reduction_wrapper_has_its_buckets_from_the_start_and_the_user_decides_last() -> None:
    """The bucket size the rank-ordered reduction is measured with (bench/bitwise_allreduce.py) is the one the
    Trainer's DDP wrapper gets, as a list (DDP then lays its buckets out from the first iteration, not one bucket for
    all), with gradients as views of the buckets; NCCL and DDP's own allreduce keep DDP's defaults; the user's `ddp=`
    arguments win, and a bucket size of the user's, either way given, replaces ours."""
    from toolkit.train import determinism
    from toolkit.train.ddpmodel import ddp_arguments

    assert ddp_arguments({}, True, "gloo") == {"init_sync": False, "bucket_cap_mb_list": [determinism.GLOO_BUCKET_MB],
                                               "gradient_as_bucket_view": True}
    assert determinism.GLOO_BUCKET_MB > 25  # DDP's default
    assert ddp_arguments({}, True, "nccl") == {"init_sync": False}
    assert ddp_arguments({}, False, "gloo") == {"init_sync": False}
    assert ddp_arguments({"bucket_cap_mb": 10, "init_sync": True, "gradient_as_bucket_view": False}, True, "gloo") == \
        {"init_sync": True, "bucket_cap_mb": 10, "gradient_as_bucket_view": False}
    assert ddp_arguments({"bucket_cap_mb_list": [5, 10]}, True, "gloo") == {
        "init_sync": False, "bucket_cap_mb_list": [5, 10], "gradient_as_bucket_view": True}
