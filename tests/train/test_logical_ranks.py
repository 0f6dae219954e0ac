"""Logical ranks end to end (issue 42 item 1), through the real agent, scheduler and workers: 2 workers serving 4
logical ranks (`--logical-ranks 4`) end with parameters bitwise equal to those of 4 workers under the real torchrun;
and so does such a job whose worker is killed with SIGKILL mid-run (each process serving 2 logical ranks), the
survivor going on in place and the replacement taking its state from it. Each run scales its loss with a GradScaler
(handed over in `state=`), unscales and clips the gradient's norm, and one step's loss is inf: that step is skipped
and the scale backed off once, and the scaler ends in the same state as the torchrun run's. The processes there run
the step body once per logical rank: each worker's log has every step twice. And a real worker told a wrong
assignment in an authenticated `formed` stops with one line instead of training on it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import re
import signal
import socket
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import pytest
import torch
from runtime_harness import Job
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from toolkit.contracts import protocol as P
from toolkit.testing import waits
from toolkit.testing.localjob import FINAL_LINE, STEP_LINE, LocalJob, TorchrunRun
from toolkit.train.faults import LoaderError
from toolkit.train.logicalgrad import LogicalGrad, deferred
from toolkit.train.lossscale import in_step, scalers_in
from toolkit.train.stepdata import StepData, retarget
from toolkit.train.trainer import as_built

INF_STEP = 7  # the step whose loss is inf: skipped, the scale halved
ARGS = ["--epochs", "2", "--ckpt-interval", "4", "--keep-max", "3", "--timeout", "30", "--grad-scaler",
        "--clip-norm", "0.1", "--inf-loss-at", str(INF_STEP)]  # the gradient's norm is 0.14-0.3: clipped every step
STEPS = 2 * 12  # 1440 samples over 4 logical ranks, 360 each, in batches of 32: 12 a epoch
SCALER_LINE = re.compile(r"^final grad scaler: scale (\S+), growth tracker (\d+)$", re.M)
# GradScaler's defaults: 2**16, halved once at INF_STEP, then one clean update a step (growth only after 2000)
SCALER_AT_END = [(str(2.0**15), str(STEPS - INF_STEP))]
JOB_TIMEOUT = 240.0  # s for one job on a loaded 2-core machine; normally ~20 s
SPARE_TIMEOUT = 60.0  # s for the agent's warm spare to import torch
POLL = 0.02  # s between looks at a log: no event tells that a line was appended
RESUMED = re.compile(r"^rank (\d+): resumed from step (\d+) .*out of rank \d+'s memory.*: (\d+) step\(s\) recomputed$",
                     re.M)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory) -> Iterator[Callable[[], tuple[Path, str]]]:
    """The final parameters of 4 workers under the real torchrun (one logical rank each, as any torchrun job), their
    GradScaler's final state checked. The run starts with the module and goes on alongside the first test's job;
    calling the fixture waits for its end."""
    run = TorchrunRun(tmp_path_factory.mktemp("torchrun4"), 4, ARGS)

    def final() -> tuple[Path, str]:
        log = run.logs(JOB_TIMEOUT)[0]
        assert len(STEP_LINE.findall(log)) == STEPS, log[-2000:]
        assert SCALER_LINE.findall(log) == SCALER_AT_END, log[-2000:]
        return run.final(JOB_TIMEOUT)

    try:
        yield final
    finally:
        run.stop()


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
    (final,) = FINAL_LINE.findall(job.log("worker_0.log"))
    ref_path, ref_digest = four_workers()
    assert final[1] == ref_digest, "2 workers serving 4 logical ranks differ from 4 workers"
    assert_bitwise_equal(Path(final[0]), ref_path)
    assert SCALER_LINE.findall(job.log("worker_0.log")) == SCALER_AT_END, job.evidence()


def test_a_kill9_of_a_worker_serving_two_logical_ranks_recovers_in_place_bitwise(tmp_path, four_workers) -> None:
    seed = random.SystemRandom().randrange(2**32)
    target = random.Random(seed).randint(4, STEPS // 2 - 2)  # seconds of steps left for the kill on a loaded machine
    why = f"(seed {seed}: kill worker_1 at step {target} of {STEPS})"
    job = LocalJob(tmp_path, 2, [*ARGS, "--step-delay", "0.2"], job="lrk", node_timeout=3, cluster_time_out=120,
                   grace=20, logical_ranks=4)
    try:
        job.start()
        waits.until("the warm spare to be ready", lambda: (job.doc().get("warm_spare") or {}).get("ready"), job,
                    SPARE_TIMEOUT, poll=POLL)
        waits.until(f"worker_1 at step {target}", lambda: job.last_step(1) >= target, job, JOB_TIMEOUT, poll=POLL)
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
    (final,) = FINAL_LINE.findall(survivor)
    ref_path, ref_digest = four_workers()
    assert final[1] == ref_digest, f"final parameters differ from 4 workers' {why}"
    assert_bitwise_equal(Path(final[0]), ref_path)
    assert SCALER_LINE.findall(survivor) == SCALER_AT_END, why


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


# --- the parts, without processes ---------------------------------------------------------------------------------


def digits(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


@pytest.mark.parametrize("n, drop_last", [(10, False), (11, False), (11, True)])
def test_a_sampler_made_for_the_workers_is_set_to_the_shard_of_a_logical_rank(n: int, drop_last: bool) -> None:
    for logical_world in (3, 4):
        for lr in range(logical_world):
            sampler = DistributedSampler(digits(n), 2, 0, shuffle=True, seed=5, drop_last=drop_last)
            retarget(sampler, logical_world, lr)
            own = DistributedSampler(digits(n), logical_world, lr, shuffle=True, seed=5, drop_last=drop_last)
            assert (list(sampler), len(sampler)) == (list(own), len(own))


def test_each_logical_rank_served_gets_the_batches_and_randomness_of_a_process_of_its_own() -> None:
    """A process of 2 workers serving logical ranks 1 and 3 of 4 draws, step by step and across epochs, what the
    processes of ranks 1 and 3 of 4 would: the same batches, and the same global generator state after each."""
    data = digits(37)
    served = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 0, shuffle=True, seed=1))
    lanes = StepData(served, 7, 4, (1, 3), False)
    alone = {lr: StepData(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 4, lr, shuffle=True,
                                                                                      seed=1)), 7, 4, (lr,), True)
             for lr in (1, 3)}
    assert lanes.position.per_epoch == alone[1].position.per_epoch == 3
    for step in [*range(8), 4, 5]:  # two steps redone
        for lr in (1, 3):
            x, _ = lanes.batch(step, lr)
            drawn = torch.rand(3)
            y, _ = alone[lr].batch(step, lr)
            assert torch.equal(x, y) and torch.equal(drawn, torch.rand(3)), (step, lr)
    lanes.serve(4, (3,), False)  # a grow takes logical rank 1 away: the script's loader now serves 3
    assert torch.equal(lanes.batch(8, 3)[0], alone[3].batch(8, 3)[0])
    lanes.serve(4, (0,), True)  # as the script built it (2 replicas, rank 0), as in a job without logical ranks
    assert (served.sampler.num_replicas, served.sampler.rank, len(served.sampler)) == (2, 0, 19)


def test_a_process_started_while_shrunk_draws_its_logical_ranks_batches_after_the_grow() -> None:
    """Issue 42, a kill during a shrink: the worker restarted while the job ran on 4 workers of 6 logical ranks built
    its sampler for that world (4 replicas, rank 2). Back at 6 workers, serving logical rank 2 alone, it must draw
    logical rank 2 of 6's batches, not its shard of 4 as built (that ended the job with other bits, every replica
    equal to the others)."""
    data = digits(48)  # 8 samples a logical rank of 6: 2 batches of 4 an epoch; 12 a shard of 4
    built = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 4, 2, shuffle=True, seed=1))
    shrunk = SimpleNamespace(world_size=4, rank=2, logical_world=6, logical_ranks=(2,))
    grown = SimpleNamespace(world_size=6, rank=2, logical_world=6, logical_ranks=(2,))
    assert as_built(grown, (6, 2)) and not as_built(grown, (4, 2))  # the same logical rank, another world built
    lanes = StepData(built, 7, 6, (2,), as_built(shrunk, (4, 2)))
    lanes.serve(6, (2,), as_built(grown, (4, 2)))
    alone = StepData(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 6, 2, shuffle=True, seed=1)),
                     7, 6, (2,), True)
    for step in range(5):  # across epochs
        assert torch.equal(lanes.batch(step, 2)[0], alone.batch(step, 2)[0]), step


def test_data_that_cannot_be_split_by_logical_rank_is_refused_in_one_line() -> None:
    data = digits(3)
    own = DataLoader(data, batch_sampler=[[0, 1], [2]])
    with pytest.raises(LoaderError, match=r"its own batch_sampler \(list\), which cannot be split by logical rank"):
        StepData(own, 0, 2, (0, 1), False)
    small = DataLoader(data, batch_size=1, sampler=DistributedSampler(data, 1, 0))
    with pytest.raises(LoaderError, match="the dataset's 3 samples cannot be split evenly over the job's 4 logical"):
        StepData(small, 0, 4, (0, 1, 2, 3), False)
    StepData(own, 0, 1, (0,), True)  # one logical rank, as the script built it: its own batch_sampler is fine


def test_the_gradient_of_several_logical_ranks_is_their_mean_summed_in_logical_order_bitwise() -> None:
    """One process serving logical ranks 0, 1, 2 of 3: after the three micro-batches the parameters' .grad is
    ((g0 + g1) + g2) / 3 to the bit, what the rank-ordered allreduce of 3 processes gives; the copies are one per
    extra logical rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    xs = [torch.randn(4, 5) for _ in range(3)]
    grads = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    logical = LogicalGrad(model, None, 0, 3, [(0, 1, 2)], "gloo")
    logical.bucket = 13  # buckets that cut parameters
    assert len(logical.copies) == 2
    for lane, x in enumerate(xs):
        logical.begin(lane)
        model(x).pow(2).sum().backward()
        if lane < 2:
            logical.keep(lane)
    logical.reduce()
    for i, p in enumerate(model.parameters()):
        want = torch.div(torch.add(grads[0][i], grads[1][i]).add_(grads[2][i]), 3)
        assert p.grad.numpy().tobytes() == want.numpy().tobytes()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_grad_scaler_over_several_logical_ranks_unscales_checks_and_updates_the_mean_once_bitwise(enabled) -> None:
    """One process serving logical ranks 0, 1, 2 of 3 with a GradScaler handed over in `state=` (its methods shadowed
    per lane as the Trainer does: toolkit.train.lossscale) steps bitwise as one process given DDP's gradient, the
    mean of the 3 scaled gradients: unscale_ and clip_grad_norm_ on that mean, an overflow on logical rank 1 alone
    at step 2 skipping the step for all and halving the scale, update() once a step (the scale grows every 2 clean
    steps). Disabled, the scaler's unscale_ still marks where the clipping of the mean goes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
    scaler, twin_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, enabled=enabled)
                           for _ in range(2))
    logical = LogicalGrad(model, None, 0, 3, [(0, 1, 2)], "gloo")
    opt.register_step_pre_hook(lambda *_: logical.reduce())
    updates = Counter()
    overflow = (2, 1) if enabled else None  # (step, logical rank)
    clipped: list[float] = []  # the norms clip_grad_norm_ saw, lane by lane
    norms: list[float] = []  # the twin's, step by step

    def body(m: torch.nn.Module, o: torch.optim.Optimizer, s: torch.amp.GradScaler, x: torch.Tensor, lr: int,
             step: int, backward_only: bool = False) -> None:
        o.zero_grad(set_to_none=True)
        loss = m(x).pow(2).sum() * (math.inf if (step, lr) == overflow else 1.0)
        s.scale(loss).backward()
        if backward_only:
            return
        s.unscale_(o)
        clipped.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
        s.step(o)
        s.update()

    for step in range(6):
        xs = [torch.randn(4, 5) for _ in range(3)]
        for lane, x in enumerate(xs):
            logical.begin(lane)
            last = lane == 2
            with contextlib.nullcontext() if last else deferred(opt), \
                    in_step(scalers_in({"scaler": scaler}), logical, lane, last, lambda: updates.update(["update"])):
                body(model, opt, scaler, x, lane, step)
            if not last:
                logical.keep(lane)
        assert clipped[-3:-1] == [0.0, 0.0]  # lanes but the last: the gradient kept at unscale_, none to clip
        grads = []
        for lr, x in enumerate(xs):  # the twin: DDP's gradient, the mean of the scaled ones, then the scaler
            body(twin, twin_opt, twin_scaler, x, lr, step, backward_only=True)
            grads.append([p.grad.clone() for p in twin.parameters()])
        for i, p in enumerate(twin.parameters()):
            p.grad = torch.div(torch.add(grads[0][i], grads[1][i]).add_(grads[2][i]), 3)
        before = twin_scaler.get_scale()
        twin_scaler.unscale_(twin_opt)
        norm = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0))
        assert (norm == clipped[-1] or math.isnan(norm) and math.isnan(clipped[-1])), step  # the mean's norm
        norms.append(norm)
        twin_scaler.step(twin_opt)
        twin_scaler.update()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert p.detach().numpy().tobytes() == q.detach().numpy().tobytes(), step
        assert scaler.state_dict() == twin_scaler.state_dict(), step
        if enabled and step == overflow[0]:
            assert twin_scaler.get_scale() == before / 2  # the step was skipped, the scale backed off
    assert updates["update"] == (6 if enabled else 0)
    assert sum(n > 1.0 for n in norms) >= 3  # the clipping did clip
    assert all(name not in scaler.__dict__ for name in ("unscale_", "step", "update"))  # put back
    if enabled:
        # grown after steps 0-1, halved at step 2's overflow, grown after steps 3-4: one update a step, not 3
        assert (scaler.get_scale(), scaler.state_dict()["_growth_tracker"]) == (2.0**11, 1)
