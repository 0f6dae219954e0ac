"""A model sharded with FSDP2 under the Trainer (issue 45): HSDP on a (2, 2) mesh recovered in place with no lost step,
bitwise equal to an uninterrupted run, whatever moment of a step a kill -9 lands on, and when both ranks of a
replica group die together; a bit flipped in one rank's shard caught by the replica check of its column and redone,
bitwise; pure FSDP (one replica group) recovered from the copies of the shards in another host's
memory (toolkit.train.shardrollback), bitwise, with the steps redone counted; shardings the Trainer cannot recover
refused at `Trainer(...)` in one line. Checkpoints of the shards: the whole job killed (every worker, kill -9)
restarts from the newest step every rank holds, bitwise, for HSDP and pure FSDP; SIGTERM (`fleet stop`) saves last
words a new job resumes from; a restart at another world size is refused in one line; a sharded worker tells the
scheduler it holds no more than its own rank (no shrink).

Real processes: the script (tests/scripts/fsdp_train.py) run by the real agent and scheduler (LocalJob), killed
with SIGKILL; the refusals run the script alone (a world of one), as a user would."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

from toolkit.contracts import protocol
from toolkit.scheduler.elastic import shrink_refusal
from toolkit.testing.localjob import STEP_LINE, LocalJob, clean_env
from toolkit.train import headroom
from toolkit.train.ckpt.shards import ShardName
from toolkit.train.faults import TrainerError
from toolkit.train.replicas import NO_REPLICA
from toolkit.train.shardmodel import Layout
from toolkit.train.shardstate import plan_recovery

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fsdp_train.py"
WORLD = 4
ARGS = ["--mesh", "2,2", "--epochs", "3", "--samples", "512", "--step-delay", "0.03"]  # 3 x 16 steps
JOB_TIMEOUT = 420.0  # s for one job on a loaded 2-core machine; normally ~30 s
ALONE_TIMEOUT = 120.0  # s for the script alone to refuse (torch's import on a loaded machine)
POLL = 0.02
FINAL = re.compile(r"^final parameters: \S+ sha256 ([0-9a-f]{64})$", re.M)
RECOVERED = re.compile(r"^rank (\d+): resumed from step (\d+) .* out of rank (\d+)'s (memory|checkpoint).*?"
                       r"(?:: (\d+) step\(s\) recomputed)?$", re.M)
DEATH = re.compile(r"(worker_\d+) \(pid (\d+) on \S+\) is dead")

pytestmark = pytest.mark.timeout(1200)


def job(root: Path, name: str, args: list[str] = ARGS, *, world: int = WORLD, **options: Any) -> LocalJob:
    project = root / "project"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / SCRIPT.name)
    return LocalJob(root / "work", world, args, job=name, project=project, script=SCRIPT.name, node_timeout=3,
                    cluster_time_out=120, grace=5, max_restarts=30, **options)


def steps(j: LocalJob, rank: int) -> int:
    found = STEP_LINE.findall(j.log(f"worker_{rank}.log"))
    return int(found[-1][1]) if found else 0


def until(what: str, predicate: Callable[[], Any], j: LocalJob) -> Any:
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (value := predicate()):
        if j.agent is not None and j.agent.poll() is not None:
            raise AssertionError(f"the job ended while waiting for {what}\n{j.evidence()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{j.evidence()}")
        time.sleep(POLL)
    return value


def pid_of(j: LocalJob, rank: int) -> int | None:
    p = j.procs().get(f"worker_{rank}") or {}
    return p.get("pid") if p.get("state") == "running" else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final digest of the uninterrupted run (the replica check on, "auto": its columns agree)."""
    text = run_whole(job(tmp_path_factory.mktemp("reference"), "ref"))
    assert "corruption found" not in text, text[-3000:]
    (digest,) = FINAL.findall(text)
    return digest


def run_whole(j: LocalJob) -> str:
    """Run `j` to its end, uninterrupted (it must exit 0); rank 0's log."""
    try:
        j.start()
        assert j.finish(JOB_TIMEOUT) == 0, j.evidence()
    finally:
        j.cleanup()
    return j.log("worker_0.log")


def kill_rounds(j: LocalJob, victims: list[list[int]], rng: random.Random, first: int = 2) -> None:
    """For each round, once every rank has trained 2 steps past the last round (`first` steps for the first),
    wait a random part of a step or two, then SIGKILL the round's ranks at once."""
    past: dict[int, int] = {r: first - 2 for r in range(WORLD)}
    for ranks in victims:
        until("every rank training", lambda past=past: all(steps(j, r) >= past[r] + 2 for r in range(WORLD)), j)
        time.sleep(rng.uniform(0.0, 0.1))
        pids = [pid_of(j, r) for r in ranks]
        assert None not in pids, j.evidence()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        past = {r: steps(j, r) for r in range(WORLD)}


def check(j: LocalJob, reference: str, deaths: int, why: str) -> None:
    """Ended well, bitwise the reference; each death seen; every recovery from a survivor's memory, 0 recomputed."""
    assert j.finish(JOB_TIMEOUT) == 0, f"{why}\n{j.evidence()}"
    assert len(DEATH.findall(j.log("scheduler.log"))) == deaths, f"{why}\n{j.evidence()}"
    (final,) = FINAL.findall(j.log("worker_0.log"))
    assert final == reference, f"final parameters differ from the uninterrupted run {why}"
    recoveries = [m for r in range(WORLD) for m in RECOVERED.findall(j.log(f"worker_{r}.log"))]
    assert len(recoveries) >= deaths, f"{recoveries} {why}\n{j.evidence()}"
    for rank, step, source, kind, recomputed in recoveries:
        assert kind == "memory" and recomputed == "0", f"rank {rank} at {step} from rank {source}'s {kind}, " \
                                                       f"{recomputed} recomputed {why}\n{j.evidence()}"


def test_hsdp_kills_at_random_moments_lose_no_step_and_change_nothing(tmp_path: Path, reference: str) -> None:
    """5 kills of a random rank each, at random moments of a step; then ranks 2 and 3 (replica group 1, both shards)
    together: each replacement takes its shard from the other replica group, bitwise equal, 0 recomputed."""
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    j = job(tmp_path, "kills")
    victims = [[rng.randrange(WORLD)] for _ in range(5)] + [[2, 3]]
    try:
        j.start()
        kill_rounds(j, victims, rng)
        check(j, reference, 7, f"(seed {seed}, victims {victims})")
    finally:
        j.cleanup()


def test_a_replica_group_lost_whole_is_recovered_from_the_other(tmp_path: Path, reference: str) -> None:
    """Ranks 0 and 1 (replica group 0: shards 0 and 1) killed together, twice."""
    j = job(tmp_path, "group")
    try:
        j.start()
        kill_rounds(j, [[0, 1], [0, 1]], random.Random(1))
        check(j, reference, 4, "(replica group 0 killed twice)")
    finally:
        j.cleanup()


def test_hsdp_a_bit_flipped_in_one_ranks_shard_is_caught_by_its_column_and_redone_bitwise(
        tmp_path: Path, reference: str) -> None:
    """HSDP (2, 2), the replica check every 4 steps (TOOLKIT_VERIFY_EVERY, what --verify-every writes), a bit of
    rank 1's shard of a parameter flipped after step 5 (toolkit.train.inject): at step 8 shard 1's column (ranks 1
    and 3) differs; with two replica groups no majority names the faulty one, so every rank goes back to step 4 and
    redoes the steps (the fault's gradients reached every shard through the reductions); the run ends bitwise equal
    to the uninterrupted one, and the scheduler's ledger holds the incident."""
    j = job(tmp_path, "sdc")
    for r in range(WORLD):
        with open(j.dir / "env" / f"worker_{r}.env", "a") as f:
            f.write("export TOOLKIT_VERIFY_EVERY=4\nexport TOOLKIT_INJECT_CORRUPTION='rank=1,step=5,bit=20'\n")
    (final,) = FINAL.findall(run_whole(j))
    logs = [j.log(f"worker_{r}.log") for r in range(WORLD)]
    assert "rank 1: injected corruption after step 5: flipped bit 20 of params inp.weight[0] (this rank's shard)" \
        in logs[1], j.evidence()
    for r in range(WORLD):
        found = [line for line in logs[r].splitlines() if "corruption found" in line]
        assert found == [f"rank {r}: corruption found at step 8: shard 1's replicas differ with no majority (ranks 1 "
                         "(localhost); ranks 3 (localhost)): with two replica groups no majority can name the faulty "
                         "one; it started in steps 5-8: every rank goes back to step 4 (its last good check) and "
                         "redoes the steps"], j.evidence()
    assert final == reference, "the run redone after the corruption differs from the uninterrupted one"
    incidents = [i for i in json.loads((j.dir / "recovery" / "ledger.json").read_text())["incidents"]
                 if i.get("corruption")]
    assert [(i["cause"], i["corruption"]) for i in incidents] == [
        ("corruption: rank 1 on localhost, rank 3 on localhost, started in steps 5-8: rolled back",
         {"ranks": [1, 3], "hosts": ["localhost", "localhost"], "window": [5, 8], "action": "rolled back"})]


THREE_REPLICAS = ["--mesh", "3,1", "--epochs", "1", "--samples", "384", "--step-delay", "0.03"]  # 16 steps


def test_hsdp_three_replicas_a_flipped_bit_is_healed_from_the_majority_and_redone_bitwise(tmp_path: Path) -> None:
    """HSDP over 3 replica groups (a (3, 1) mesh: world 3), the replica check every 4 steps, a bit of rank 1's shard
    flipped after step 5: at step 8 the column has a majority, so rank 1 alone is named, takes the last good check's
    shard (step 4) from a healthy rank of its column, every rank redoes steps 5-8, and the run ends bitwise equal
    to the uninterrupted one (run beside it, at the same time); the ledger says `healed`."""
    runs = {"ref3": job(tmp_path / "ref3", "ref3", THREE_REPLICAS, world=3),
            "sdc3": job(tmp_path / "sdc3", "sdc3", THREE_REPLICAS, world=3)}
    for j in runs.values():
        for r in range(3):
            with open(j.dir / "env" / f"worker_{r}.env", "a") as f:
                f.write("export TOOLKIT_VERIFY_EVERY=4\n")
    with open(runs["sdc3"].dir / "env" / "worker_1.env", "a") as f:
        f.write("export TOOLKIT_INJECT_CORRUPTION='rank=1,step=5,bit=20'\n")
    with ThreadPoolExecutor(2) as pool:
        texts = dict(zip(runs, pool.map(run_whole, runs.values()), strict=True))
    j = runs["sdc3"]
    (reference,) = FINAL.findall(texts["ref3"])
    (final,) = FINAL.findall(texts["sdc3"])
    logs = [j.log(f"worker_{r}.log") for r in range(3)]
    assert "rank 1: injected corruption after step 5: flipped bit 20 of params inp.weight[0] (this rank's shard)" \
        in logs[1], j.evidence()
    for r in range(3):
        found = [line for line in logs[r].splitlines() if "corruption found" in line]
        assert len(found) == 1 and found[0].startswith(
            f"rank {r}: corruption found at step 8: rank 1 on localhost differs from the majority of its shard's "
            "replicas (shard 0: ranks 0, 2); it started in steps 5-8; every rank goes back to step 4 (the last good "
            "check), rank 1 on localhost receiving its shard from rank "), (found, j.evidence())
    assert re.search(r"receiving its shard from rank [02], and redoes the steps \([0-9.]+ MB received\)$",
                     next(line for line in logs[1].splitlines() if "corruption found" in line)), logs[1][-3000:]
    assert "corruption found" not in texts["ref3"], texts["ref3"][-3000:]
    assert final == reference, "the run healed after the corruption differs from the uninterrupted one"
    incidents = [i for i in json.loads((j.dir / "recovery" / "ledger.json").read_text())["incidents"]
                 if i.get("corruption")]
    assert [(i["corruption"]["ranks"], i["corruption"]["window"], i["corruption"]["action"]) for i in incidents] == \
        [([1], [5, 8], "healed")], incidents


MIRROR_EVERY = 4  # K: steps between refreshes of the copies of the shards in memory
FSDP_ARGS = ["--mesh", "4", "--epochs", "3", "--samples", "512", "--step-delay", "0.03"]
REDONE = re.compile(r"^rank (\d+): ranks \[[\d, ]+\] lost at step (\d+): every rank goes back to step (\d+), "
                    r".* and redoes (\d+) step\(s\)$", re.M)


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final digest of the uninterrupted pure-FSDP run, on one host: no other host's memory for the copies,
    which rank 0 says at the start, with what a fault would cost; and, once, that the replica check (on by default)
    has no replica of a shard to compare it with."""
    text = run_whole(job(tmp_path_factory.mktemp("fsdp-reference"), "fsdpref", FSDP_ARGS))
    assert text.count(f"rank 0: {NO_REPLICA}") == 1, text[-3000:]
    assert re.search(r"^rank 0: pure FSDP without a copy of each shard in memory \(the job runs on one host: .*\): "
                     r"a lost rank costs a whole-job restart from the newest sharded checkpoint", text, re.M), \
        text[-3000:]
    (digest,) = FINAL.findall(text)
    return digest


def test_pure_fsdp_kills_are_recovered_from_the_copies_in_memory(tmp_path: Path, fsdp_reference: str) -> None:
    """Pure FSDP at world 4 on two simulated hosts of two ranks, copies refreshed every 4 steps; 3 kills of a random
    rank each at random moments: the replacement takes its shard from the copy the other host keeps, every rank
    goes back to the copy's step and redoes the steps since (at most K, plus a refresh still in flight), and the
    run ends bitwise equal to the uninterrupted one."""
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    j = job(tmp_path, "mirror", [*FSDP_ARGS, "--mirror-every", str(MIRROR_EVERY)])
    j.number_hosts(2)
    victims = [[rng.randrange(WORLD)] for _ in range(3)]
    why = f"(seed {seed}, victims {victims})"
    try:
        j.start()
        kill_rounds(j, victims, rng, first=MIRROR_EVERY + 2)
        assert j.finish(JOB_TIMEOUT) == 0, f"{why}\n{j.evidence()}"
    finally:
        j.cleanup()
    assert len(DEATH.findall(j.log("scheduler.log"))) == 3, f"{why}\n{j.evidence()}"
    (final,) = FINAL.findall(j.log("worker_0.log"))
    assert final == fsdp_reference, f"final parameters differ from the uninterrupted run {why}"
    assert "refreshed every 4 steps: a lost rank's shard comes from it" in j.log("worker_0.log"), why
    redone = [m for r in range(WORLD) for m in REDONE.findall(j.log(f"worker_{r}.log"))]
    assert len({(reached, back) for _, reached, back, _ in redone}) >= 3, f"{redone} {why}\n{j.evidence()}"
    for rank, reached, back, count in redone:
        assert int(count) == int(reached) - int(back) < 2 * MIRROR_EVERY, f"rank {rank}: {reached} -> {back} {why}"
    recoveries = [m for r in range(WORLD) for m in RECOVERED.findall(j.log(f"worker_{r}.log"))]
    for rank, _, _, kind, recomputed in recoveries:
        assert kind == "memory" and int(recomputed) < 2 * MIRROR_EVERY, f"rank {rank} {recoveries} {why}"
    print(f"steps redone per recovery: {sorted({(int(a), int(b)) for _, a, b, _ in redone})} {why}")


SUPPORTED_LINE = "supported: fully_shard over a 1-D mesh"
REFUSALS = {  # what the script is given -> what its one line must say
    "tp": (["--refuse", "tp"], ["tensor parallelism is not supported", SUPPORTED_LINE]),
    "offload": (["--refuse", "offload"], ["CPU offload is not supported", SUPPORTED_LINE]),
    "mesh3d": (["--refuse", "mesh3d"], ["slice of a 3-D mesh", SUPPORTED_LINE]),
    "partial": (["--refuse", "partial"], ["not on the model itself", SUPPORTED_LINE]),
    "mirror": (["--mirror-every", "often"], ["shard_mirror='often': give the steps between refreshes", "0 (none)"]),
}


def test_shardings_the_trainer_cannot_recover_are_refused_in_one_line(tmp_path: Path) -> None:
    def run(kind: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), "--mesh", "1", *REFUSALS[kind][0]], cwd=tmp_path,
                              env=clean_env(), capture_output=True, text=True, timeout=ALONE_TIMEOUT)

    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(REFUSALS, pool.map(run, REFUSALS), strict=True))
    for kind, proc in done.items():
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, f"{kind}: {proc.returncode}\n{proc.stderr}"
        assert all(want in lines[0] for want in REFUSALS[kind][1]), lines[0]


def test_the_plan_gives_each_shard_from_its_column_and_completes_torn_steps() -> None:
    hsdp = Layout(2, 2)
    # rank 1 replaced; everyone at step 7: shard 1 comes from rank 3
    plan = plan_recovery([(7, 0, 0), (-1, 1, 0), (7, 0, 0), (7, 0, 0)], hsdp)
    assert (plan.step, plan.holders, plan.replay) == (7, ((0, 2), (3,)), ())
    # the fault cut rank 3's commit short after rank 0 and 2 stepped: rank 3 applies its gradients, gives shard 1
    plan = plan_recovery([(8, 0, 0), (-1, 1, 0), (8, 0, 0), (7, 0, 1)], hsdp)
    assert (plan.step, plan.holders, plan.replay, plan.stepped) == (8, ((0, 2), (3,)), (3,), (0, 2))
    # no rank stepped: those ready just drop their gradients
    plan = plan_recovery([(7, 0, 1), (-1, 1, 0), (7, 0, 1), (7, 0, 1)], hsdp)
    assert (plan.step, plan.replay) == (7, ())
    # both ranks of shard 1 lost: refused in one line
    with pytest.raises(TrainerError, match=r"shard\(s\) \[1\] at step 7 are held by no live rank"):
        plan_recovery([(7, 0, 0), (-1, 1, 0), (7, 0, 0), (-1, 1, 0)], hsdp)


# --- checkpoints of sharded state (toolkit.train.ckpt.shards through the Trainer)

CKPT_EVERY = 4
RESUMED_CKPT = re.compile(r"^rank (\d+): resumed from step (\d+) \(.* out of rank (\d+)'s checkpoint", re.M)
STOPPED = re.compile(r"^rank (\d+): stopped by SIGTERM at step (\d+), checkpoint saved$", re.M)
FSDP2_ARGS = ["--mesh", "2", "--epochs", "1", "--samples", "512", "--step-delay", "0.03"]  # world 2: 32 steps


def newest_held(ckpt: Path, world: int) -> int:
    """The newest step whose shard every rank of a world of `world` wrote (0 for none)."""
    count: dict[int, int] = {}
    for f in ckpt.glob("host_*/step_*.ckpt"):
        name = ShardName.parse(f.name)
        if name is not None and name.parts == world:
            count[name.step] = count.get(name.step, 0) + 1
    return max((step for step, n in count.items() if n == world), default=0)


def kill_whole(j: LocalJob, world: int, ckpt: Path, after: int, rng: random.Random) -> int:
    """Once every rank's shard of a step >= `after` is on disk, at a random moment of the steps after it, kill -9
    every worker at once; the newest step held whole then."""
    until(f"a checkpoint of step {after} or later", lambda: newest_held(ckpt, world) >= after, j)
    time.sleep(rng.uniform(0.0, 0.2))
    pids = [pid_of(j, r) for r in range(world)]
    assert None not in pids, j.evidence()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return newest_held(ckpt, world)


def kill_one(j: LocalJob, world: int, ckpt: Path, after: int, rng: random.Random) -> int:
    """`kill_whole`'s, for one random rank only."""
    until(f"a checkpoint of step {after} or later", lambda: newest_held(ckpt, world) >= after, j)
    time.sleep(rng.uniform(0.0, 0.2))
    pid = pid_of(j, rng.randrange(world))
    assert pid is not None, j.evidence()
    os.kill(pid, signal.SIGKILL)
    return newest_held(ckpt, world)


def resumed_whole(j: LocalJob, world: int, held: int, why: str, times: int = 1) -> int:
    """Every rank resumed `times` times out of its own checkpoint, the last time all at the same step, at least
    `held`; that step."""
    found = [RESUMED_CKPT.findall(j.log(f"worker_{r}.log")) for r in range(world)]
    assert all(len(f) == times for f in found), f"{found} {why}\n{j.evidence()}"
    assert all(rank == source for f in found for rank, _, source in f), f"{found} {why}"
    (step,) = {int(f[-1][1]) for f in found}
    assert step >= held, f"resumed from {step}, {held} was held whole {why}"
    return step


def test_hsdp_whole_job_killed_resumes_from_the_shards_bitwise_and_another_world_is_refused_in_one_line(
        tmp_path: Path, reference: str) -> None:
    """HSDP (2, 2), a checkpoint every 4 steps: every worker killed at once at a random moment; their agent
    relaunches them, every rank reads its own shard of the newest step all hold, and the run ends bitwise equal
    to the uninterrupted one. Then a job of 2 workers on the same checkpoints: each says one line, no traceback,
    and the job fails at once (no restarts: a restart would refuse the same)."""
    rng = random.Random(random.SystemRandom().randrange(2**32))
    disk = tmp_path / "disk"
    j = job(tmp_path / "a", "shards", args=[*ARGS, "--ckpt-every", str(CKPT_EVERY)], ckpt_dir=str(disk))
    ckpt = disk / "shards"
    try:
        j.start()
        held = kill_whole(j, WORLD, ckpt, rng.choice([8, 12, 16]), rng)
        assert j.finish(JOB_TIMEOUT) == 0, j.evidence()
    finally:
        j.cleanup()
    resumed = resumed_whole(j, WORLD, held, f"(killed after {held})")
    assert resumed % CKPT_EVERY == 0, f"resumed from step {resumed}, not one the interval saves"
    (final,) = FINAL.findall(j.log("worker_0.log"))
    assert final == reference, f"final parameters differ from the uninterrupted run (killed after {held})"

    before = sorted(p.name for p in ckpt.rglob("*"))
    two = job(tmp_path / "b", "shards", world=2, args=["--mesh", "2", "--epochs", "1"], ckpt_dir=str(disk),
              token=j.token)
    try:
        two.start()
        code = two.finish(JOB_TIMEOUT)
    finally:
        two.cleanup()
    assert code != 0, two.evidence()
    assert sorted(p.name for p in ckpt.rglob("*")) == before, "the refusal changed the checkpoints"
    want = re.compile(r"^rank \d: \S+ holds the sharded checkpoint of step 48 of a world of 4; this run is a world of "
                      r"2 on a \(2,\) mesh: .* restart with 4 workers, or move the checkpoint directory aside", re.M)
    for r in range(2):
        text = two.log(f"worker_{r}.log")
        assert len(want.findall(text)) == 1 and "Traceback" not in text, text[-3000:]
    reason = two.doc().get("reason") or ""  # what `fleet` says of the failed job: the line, and no restart
    assert "holds the sharded checkpoint of step 48 of a world of 4" in reason and \
        f"(exit code {protocol.EXIT_FATAL}) after 0 restarts" in reason, two.evidence()


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final digest of the uninterrupted pure FSDP run (world 2)."""
    (digest,) = FINAL.findall(run_whole(job(tmp_path_factory.mktemp("fsdp-reference"), "fsdpref", world=2,
                                            args=FSDP2_ARGS)))
    return digest


def test_pure_fsdp_whole_job_killed_then_stopped_resumes_each_time_from_the_shards_bitwise(
        tmp_path: Path, fsdp2_reference: str) -> None:
    """Pure FSDP, world 2 on one host (so no copy of the shards in another host's memory), a checkpoint every 4
    steps: one rank killed (the survivor cannot go on without the lost shard: it says so and exits, its agent
    relaunches it, and both resume from the shards); then every
    worker killed at once (relaunched by the agent, resumed from the shards); then the job stopped (SIGTERM to every
    worker, as `fleet stop`): every rank saves the same step (last words), and a new job on the same checkpoints
    resumes from it and ends bitwise equal to the uninterrupted run."""
    rng = random.Random(random.SystemRandom().randrange(2**32))
    disk = tmp_path / "disk"
    args = [*FSDP2_ARGS, "--ckpt-every", str(CKPT_EVERY)]
    j = job(tmp_path / "a", "fsdp", world=2, args=args, ckpt_dir=str(disk))
    ckpt = disk / "fsdp"
    resumed = 0
    try:
        j.start()
        for times, kill in enumerate((kill_one, kill_whole), start=1):
            held = kill(j, 2, ckpt, resumed + 4, rng)
            until("both ranks resumed from the checkpoints and stepped on", lambda times=times, held=held: all(
                len(RESUMED_CKPT.findall(j.log(f"worker_{r}.log"))) == times and steps(j, r) >= held + 3
                for r in range(2)), j)
            resumed = resumed_whole(j, 2, held, f"(killed after {held}, {kill.__name__})", times)
            assert resumed % CKPT_EVERY == 0, f"resumed from step {resumed}, not one the interval saves"
        j.cleanup()  # SIGTERM to the agent: it stops every worker with SIGTERM, as fleet stop does
    finally:
        j.cleanup()
    stops = {int(m[1]) for r in range(2) for m in STOPPED.findall(j.log(f"worker_{r}.log"))}
    assert len(stops) == 1, f"ranks stopped at different steps: {stops}\n{j.evidence()}"
    (last,) = stops
    assert resumed < last < 32 and newest_held(ckpt, 2) == last, f"{resumed} {last} {newest_held(ckpt, 2)}"

    again = job(tmp_path / "b", "fsdp", world=2, args=args, ckpt_dir=str(disk), token=j.token)
    try:
        again.start()
        assert again.finish(JOB_TIMEOUT) == 0, again.evidence()
    finally:
        again.cleanup()
    assert resumed_whole(again, 2, last, "(after the stop)") == last
    (final,) = FINAL.findall(again.log("worker_0.log"))
    assert final == fsdp2_reference, f"final parameters differ from the uninterrupted run (killed after {held}, " \
                                    f"stopped at {last})"


def test_a_sharded_worker_holds_only_its_own_rank_so_the_job_waits_rather_than_shrinks() -> None:
    """A worker of a sharded model says it holds 1 logical rank (what the Trainer publishes as `capacity`),
    whatever its free memory; with --min-workers 2 of 4, the scheduler's decision on a lost host then refuses to go
    on with 3 (the job waits); a DDP worker with the memory for 2 lets it."""
    sharded = headroom.reported(True, 1, 1000, 10**9)
    assert sharded == 1
    why = shrink_refusal([0, 1, 3], 4, 2, 4, {0: sharded, 1: sharded, 3: sharded})
    assert why is not None and "worker_0 (holds 1)" in why
    ddp = headroom.reported(False, 1, 1000, 10**9)
    assert shrink_refusal([0, 1, 3], 4, 2, 4, {0: ddp, 1: ddp, 3: ddp}) is None
