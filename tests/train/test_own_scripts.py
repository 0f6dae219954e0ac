"""A user's own training script under toolkit, as a user runs it (`fleet deploy train --join`, default recovery
flags, never --torchrun-script):

- an unmodified torchrun DDP script (examples/ddp/plain.py: env://, DistributedSampler, DataLoader workers, its
  own torch.save checkpoint) survives kill -9 of any worker and a SIGSTOPped one, and finishes with its final
  checkpoint at the requested step: restart recovery, found out by the wrapper on its own;
- the same script ported to toolkit.train (examples/ddp/ported.py: 11 lines added, 36 removed) recovers in place
  from a kill -9 at a random step with no step recomputed and ends bitwise equal to an uninterrupted run;
- a DataLoader (num_workers 0 and 2) resumes at the exact sample mid-epoch.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from toolkit.testing import waits
from toolkit.testing.localjob import EXAMPLES, FLEET, FleetRun, clean_env

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
JOB_TIMEOUT = 300.0  # s for one job on a loaded 2-core machine; normally ~20 s
POLL = 0.05  # s between looks at a log: no event tells that a line was appended
STEP = re.compile(r"^epoch (\d+) step (\d+) loss", re.M)
PLAIN_ARGS = "--epochs 3 --step-delay 0.04"
REFERENCE_ARGS = "--epochs 3"  # an uninterrupted reference: the delay is a wait, not part of the result
EXIT_REJOIN = 76
until = partial(waits.until, bound=JOB_TIMEOUT, poll=POLL)

pytestmark = pytest.mark.timeout(900)


def steps_total(world: int, epochs: int = 3, dataset: int = 2048, batch: int = 32) -> int:
    return epochs * math.ceil(math.ceil(dataset / world) / batch)


def last_step(run: FleetRun, rank: int) -> int:
    steps = STEP.findall(run.log(f"worker_{rank}.log"))
    return int(steps[-1][1]) if steps else 0


def project(tmp_path: Path) -> Path:
    d = tmp_path / "ddp"
    if not d.exists():
        shutil.copytree(EXAMPLES / "ddp", d)
    return d


def plain_run(tmp_path: Path, world: int, *flags: str) -> FleetRun:
    return FleetRun(tmp_path, "plain", ["--project", str(project(tmp_path)), "--script", "plain.py", "--worker-num",
                                        str(world), "--workdir", str(tmp_path / "work"), "--script-args", PLAIN_ARGS,
                                        *flags])


def exits(run: FleetRun, node: str) -> list[dict[str, Any]]:
    return run.procs()[node]["exits"]


def assert_finished_at(run: FleetRun, ckpt: Path, total: int) -> None:
    code, output = run.join(JOB_TIMEOUT)
    assert code == 0, f"{output}\n{run.evidence()}"
    assert torch.load(ckpt / "plain.pt", weights_only=True)["step"] == total
    for node, p in run.procs().items():
        assert p["state"] == "succeeded", f"{node}: {p['state']}\n{run.evidence()}"


# --- an unmodified torchrun script ----------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_an_unmodified_torchrun_script_survives_kill_9_and_sigstop(tmp_path: Path, world: int) -> None:
    """2 workers: kill -9 of rank 0. 3 workers: kill -9 of another rank, then SIGSTOP of a third one past the
    node timeout (the default 6 s). Every fault relaunches every worker, which resume from plain.pt."""
    rng = random.Random()
    run = plain_run(tmp_path, world)
    total = steps_total(world)
    victim = 0 if world == 2 else rng.choice([1, 2])
    try:
        run.start()
        until("every rank past its first checkpoint", lambda: min(last_step(run, r) for r in range(world)) > 12, run)
        pid = run.procs()[f"worker_{victim}"]["pid"]
        os.kill(pid, signal.SIGKILL)
        # The fault took effect: the victim died of it, every other worker left its broken group to be relaunched,
        # and all resumed from the script's own checkpoint.
        until("every worker relaunched and resumed",
              lambda: all(re.search(r"^rank \d+: resumed from step [1-9]", run.log(f"worker_{r}.log"), re.M)
                          for r in range(world)), run)
        assert exits(run, f"worker_{victim}")[0] == {**exits(run, f"worker_{victim}")[0], "pid": pid,
                                                      "signal": "SIGKILL"}
        for r in set(range(world)) - {victim}:
            assert exits(run, f"worker_{r}")[0]["code"] == EXIT_REJOIN, run.evidence()
        if world == 3:
            stopped = ({0, 1, 2} - {victim}).pop()
            resumed = last_step(run, stopped)
            until("training again", lambda: last_step(run, stopped) > resumed + 5, run)
            pid = run.procs()[f"worker_{stopped}"]["pid"]
            os.kill(pid, signal.SIGSTOP)
            until(f"worker_{stopped} declared dead and killed by its agent",
                  lambda: any(e["pid"] == pid and e["signal"] == "SIGKILL" for e in exits(run, f"worker_{stopped}")),
                  run)
            assert re.search(rf"worker_{stopped} \(pid {pid} .*\) is dead: sent no heartbeat", run.log("scheduler.log"))
        assert_finished_at(run, run.dir / "ckpt", total)
        status = fleet_status(tmp_path)
        assert status["recovery"]["mode"] == "restart" and "torchrun-style script" in status["recovery"]["why"]
        # it reports no steps: the view says what is known, never a stale "not recovered yet" or "goodput 0%"
        shown = fleet_text(tmp_path, "status", "--job", "plain").stderr
        assert re.search(r"^last incident .*; its group formed again [\d.]+ s after the failure \(the script reports "
                         r"no steps: when it trained again is not known\)$", shown, re.M), shown
        assert re.search(r"^goodput: at most \d+\.\d% of ", shown, re.M), shown
        gp = json.loads(fleet_text(tmp_path, "report", "--json", "--job", "plain").stdout)["goodput"]
        assert gp["basis"] == "formations" and 0 < gp["goodput"] < 1 and "upper bound" in gp["note"], gp
    finally:
        run.stop()


def fleet_status(cwd: Path) -> dict[str, Any]:
    done = subprocess.run([FLEET, "status", "--json"], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# --- the usual data path ------------------------------------------------------------------------------------


INDICES = SCRIPTS / "indices_worker.py"
BATCH_LINE = re.compile(r"^step (\d+): ([\d ]+)$", re.M)
PER_EPOCH = {"distributed": 13, "random": 26}  # indices_worker: 203 samples (2 replicas for the first), batches of 8


def indices_run(ckpt: Path, *args: str) -> list[tuple[int, str]]:
    done = subprocess.run([sys.executable, str(INDICES), *args], env={**clean_env(), "CKPT_DIR": str(ckpt)},
                          capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout[-2000:] + done.stderr[-3000:]
    return [(int(s), ids) for s, ids in BATCH_LINE.findall(done.stdout)]


@pytest.fixture(scope="module")
def whole_indices(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[tuple[int, str]]]:
    """The samples of each step of an uninterrupted run per sampler, run once for the module: the DataLoader draws
    its order in the main process whatever its number of workers, so one reference (0 workers) serves both."""
    runs: dict[str, list[tuple[int, str]]] = {}

    def whole(sampler: str) -> list[tuple[int, str]]:
        if sampler not in runs:
            runs[sampler] = indices_run(tmp_path_factory.mktemp(f"whole-{sampler}"), "--workers", "0",
                                        "--sampler", sampler)
        return runs[sampler]

    return whole


@pytest.mark.parametrize("sampler", ["distributed", "random"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_resumes_at_the_exact_sample_mid_epoch(tmp_path: Path, workers: int, sampler: str,
                                                             whole_indices: Callable[[str], list[tuple[int, str]]]
                                                             ) -> None:
    flags = ["--workers", str(workers), "--sampler", sampler]
    per_epoch = PER_EPOCH[sampler]
    whole = whole_indices(sampler)  # uninterrupted, 0 workers
    assert [s for s, _ in whole] == list(range(1, 3 * per_epoch + 1))
    stop = random.Random().choice([k for k in range(2, 3 * per_epoch - 1) if k % per_epoch])  # never at an edge
    first = indices_run(tmp_path / "cut", *flags, "--stop-at", str(stop))
    assert [s for s, _ in first] == list(range(1, stop + 1)), f"stopped at {stop}"
    second = indices_run(tmp_path / "cut", *flags)
    assert second and second[0][0] == stop + 1, f"resumed at {second[:1]}, stopped at {stop}"
    assert first + second == whole, \
        f"{sampler} sampler, {workers} workers, stopped mid-epoch at step {stop}; the uninterrupted run had 0 workers"


# --- the same script, ported ------------------------------------------------------------------------------------


RESUMED = re.compile(r"^rank (\d+): resumed from step (\d+) .* out of (rank \d+'s memory).*: (\d+) step\(s\) "
                     r"recomputed$", re.M)


def ported_run(tmp_path: Path, name: str, args: str = PLAIN_ARGS) -> FleetRun:
    return FleetRun(tmp_path, name, ["--project", str(project(tmp_path)), "--script", "ported.py", "--worker-num",
                                     "3", "--workdir", str(tmp_path / "work"), "--script-args", args])


def final_model(run: FleetRun, world: int = 3) -> dict[str, torch.Tensor]:
    from toolkit.contracts.ckptkey import job_key
    from toolkit.train.ckpt.manager import CheckpointManager, Placement

    (host,) = (run.dir / "ckpt").glob("host_*")  # the host's one copy, under the job's key (from its token)
    found = CheckpointManager(host.parent, keep_max=3, placement=Placement(host.name[len("host_"):]),
                              key=job_key((run.dir / "token").read_text().strip())).load_latest()
    assert found is not None, run.evidence()
    step, state = found
    assert step == state["step"] == steps_total(world), run.evidence()
    return state["model"]


def test_the_ported_script_recovers_in_place_with_no_lost_step_and_a_bitwise_equal_result(tmp_path: Path) -> None:
    plain = (EXAMPLES / "ddp" / "plain.py").read_text().split('"""', 2)[2].splitlines()
    ported = (EXAMPLES / "ddp" / "ported.py").read_text().split('"""', 2)[2].splitlines()
    diff = list(difflib.ndiff(plain, ported))
    added = [line for line in diff if line.startswith("+ ")]
    removed = [line for line in diff if line.startswith("- ")]
    # docs/porting.md and README.md say these numbers: change them there if the port changes
    assert (len(added), len(removed)) == (11, 36), "the port's size as the docs give it:\n" + "\n".join(added)

    reference = ported_run(tmp_path, "reference", REFERENCE_ARGS)
    try:
        reference.start()
        assert reference.join(JOB_TIMEOUT)[0] == 0, reference.evidence()
    finally:
        reference.stop()
    rng = random.Random()
    run = ported_run(tmp_path, "faulted")
    victim, target = rng.randrange(3), rng.randint(8, steps_total(3) - 20)
    try:
        run.start()
        until(f"step {target}", lambda: last_step(run, victim) >= target, run)
        pids = {r: run.procs()[f"worker_{r}"]["pid"] for r in range(3)}
        os.kill(pids[victim], signal.SIGKILL)
        code, output = run.join(JOB_TIMEOUT)
        assert code == 0, output + run.evidence()
    finally:
        run.stop()
    why = f"(worker_{victim} killed at step {target})"
    for r in range(3):
        p = run.procs()[f"worker_{r}"]
        assert p["restarts"] == (1 if r == victim else 0), f"worker_{r} {why}\n{run.evidence()}"
        if r != victim:
            assert p["last_pid"] == pids[r], f"survivor worker_{r} was restarted {why}"
        found = RESUMED.findall(run.log(f"worker_{r}.log"))
        assert len(found) == 1 and found[0][3] == "0", f"worker_{r}: {found} {why}\n{run.evidence()}"
    assert len({step for r in range(3) for _, step, _, _ in RESUMED.findall(run.log(f"worker_{r}.log"))}) == 1
    want, got = final_model(reference), final_model(run)
    assert sorted(want) == sorted(got)
    for k in want:
        assert want[k].numpy().tobytes() == got[k].numpy().tobytes(), f"{k} differs {why}"


# --- a plain script's progress, with one line --------------------------------------------------------------------


REPORTING = "reporting.py"
RESUMED_PLAIN = re.compile(r"^rank 0: resumed from step (\d+)$", re.M)


def reporting_script(project: Path) -> Path:
    """plain.py with the lines docs/porting.md shows for progress without a port: the import, a report of each step
    with its loss (and the run's total of steps), and of each checkpoint."""
    text = (project / "plain.py").read_text()
    edits = [("import torch\n", "import torch\nfrom toolkit.train import report\n"),
             ("            step += 1\n",
              "            step += 1\n            report(step, loss=loss, total=args.epochs * len(loader))\n"),
             ("                save(ckpt, model, optimizer, step)\n",
              "                save(ckpt, model, optimizer, step)\n                report(step, checkpoint=True)\n")]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = project / REPORTING
    path.write_text(text)
    return path


def fleet_text(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([FLEET, *args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_a_plain_script_reporting_its_steps_shows_progress_and_what_a_fault_and_a_stop_cost(tmp_path: Path) -> None:
    """plain.py plus toolkit.train.report (issue 26): its steps and loss show in `status`, `status --watch` and the
    report's loss plot; a kill -9 is an incident that recovers at the first step reported after the restart,
    resumed from the checkpoint the script reported; `fleet stop` then `fleet train` again is no incident."""
    reporting_script(project(tmp_path))
    epochs = 6  # long enough to stop it mid-run after the fault, on a loaded machine
    run = FleetRun(tmp_path, "reporting", ["--project", str(project(tmp_path)), "--script", REPORTING,
                                           "--worker-num", "2", "--workdir", str(tmp_path / "work"), "--script-args",
                                           f"--epochs {epochs} --step-delay 0.05"])
    total = steps_total(2, epochs)
    watcher = None
    try:
        run.start()
        until("the job deployed", lambda: run.procs(), run)
        watcher = subprocess.Popen([FLEET, "status", "--watch", "--json", "--interval", "1", "--job", "reporting"],
                                   cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        until("both ranks past the first checkpoint", lambda: min(last_step(run, r) for r in range(2)) > 12, run)
        status = until("the scheduler's step and loss of both ranks", lambda: (lambda s: s if all(
            isinstance(p["step"], int) and p["step"] > 10 and isinstance(p["loss"], float)
            for p in s["processes"] if p["role"] == "worker") else None)(fleet_status(tmp_path)), run)
        assert status["live"]["reports_steps"] is True
        assert status["live"]["progress"]["total"] == total  # report(total=): the ETA of status and --watch
        pid = run.procs()["worker_1"]["pid"]
        os.kill(pid, signal.SIGKILL)
        until("rank 0 resumed from the checkpoint", lambda: RESUMED_PLAIN.search(run.log("worker_0.log")), run)
        until("the incident recovered", lambda: (fleet_status(tmp_path)["live"]["last_incident"] or {}).get(
            "time_to_recover"), run)
        resumed = int(RESUMED_PLAIN.findall(run.log("worker_0.log"))[-1])
        until("training again past the resume", lambda: min(last_step(run, r) for r in range(2)) > resumed + 5, run)
        stopped = fleet_text(tmp_path, "stop", "--job", "reporting")
        assert stopped.returncode == 0, stopped.stderr
        assert run.join(JOB_TIMEOUT)[0] != 0, f"the job ended before the stop\n{run.evidence()}"
        assert max(last_step(run, r) for r in range(2)) < total
        watched, _ = watcher.communicate(timeout=120)
        run.start("train")  # again: it resumes from the script's checkpoint
        code, output = run.join(JOB_TIMEOUT)
        assert code == 0, f"{output}\n{run.evidence()}"
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
            watcher.wait(10)
        run.stop()
    refreshes = [json.loads(line) for line in watched.splitlines()]
    assert any(all(isinstance(p["step"], int) and isinstance(p["loss"], float) for p in r["processes"]
                   if p["role"] == "worker") for r in refreshes), refreshes[-1]

    done = fleet_text(tmp_path, "status", "--job", "reporting")
    assert done.returncode == 0, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("last incident")]
    assert re.match(r"last incident \(#1 of 1\): killed by SIGKILL: worker_1 on localhost at step \d+ \(worker_0 "
                    r"relaunched with it: restart recovery\); recovered in [\d.]+ s, \d+ step\(s\) recomputed$",
                    line), done.stderr
    assert "did not reconnect" not in done.stderr and "not recovered" not in done.stderr
    (goodput,) = [ln for ln in done.stderr.splitlines() if ln.startswith("goodput: ")]
    assert "at most" not in goodput, goodput

    data = json.loads(fleet_text(tmp_path, "report", "--json", "--job", "reporting").stdout)
    # the newest step a heartbeat carried (one a second, ~20 steps a second here): the last ones may not be in it
    assert data["outcome"] == "finished" and total - 60 <= data["last_step"] <= total, data
    first, last = data["incidents"][0], data["incidents"][-1]
    assert (first["cause"], first["processes"][0]) == ("killed by SIGKILL", "worker_1"), first
    # the survivor leaving (exit 76) for its relaunch is no second incident (issue 41)
    assert len(data["incidents"]) == 1 and first["relaunched"] == ["worker_0"], data["incidents"]
    assert last["resumed_from"] == resumed and last["recomputed"] >= 0 and last["time_to_recover"] > 0, last
    assert sorted(data["loss"]) == ["0", "1"] and all(len(s["step"]) >= 3 for s in data["loss"].values()), data["loss"]
    gp = data["goodput"]
    assert gp["basis"] == "steps" and 0 < gp["goodput"] < 1 and gp["productive"] > 0, gp


# --- a port that forgets its scheduler ----------------------------------------------------------------------------


SCHEDULED = "scheduled.py"
DIVERGED = re.compile(r"^rank \d: toolkit\.train: after the recovery at step (\d+), at step (\d+) the learning rate "
                      r"differs between ranks .*: an LR scheduler is likely not handed over: pass it to the Trainer, "
                      r"e\.g\. Trainer\(\.\.\., state=\{\"sched\": scheduler\}\); stopping the job", re.M)


def scheduled_script(project: Path, handed_over: bool) -> str:
    """ported.py with a LambdaLR stepped every step, handed to the Trainer in `state=` or forgotten."""
    name = f"{'handed' if handed_over else 'forgotten'}-{SCHEDULED}"
    text = (project / "ported.py").read_text()
    state = ', state={"sched": scheduler}' if handed_over else ""
    lambda_lr = "    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.98 ** e)\n"
    edits = [("    dataset = Teacher()\n", lambda_lr + "    dataset = Teacher()\n"),
             ("ckpt_every=args.ckpt_every)", f"ckpt_every=args.ckpt_every{state})"),
             ("            optimizer.step()\n", "            optimizer.step()\n            scheduler.step()\n")]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (project / name).write_text(text)
    return name


def scheduled_run(tmp_path: Path, job: str, script: str, args: str = PLAIN_ARGS) -> FleetRun:
    return FleetRun(tmp_path, job, ["--project", str(project(tmp_path)), "--script", script, "--worker-num", "2",
                                    "--workdir", str(tmp_path / "work"), "--script-args", f"{args} --workers 0"])


def test_a_port_that_forgets_its_scheduler_stops_after_a_recovery_and_one_that_hands_it_over_is_bitwise(
        tmp_path: Path) -> None:
    """Issue 26: without the scheduler in state= the replacement's LambdaLR restarts at epoch 0 and its learning rate
    drifts from the survivor's; the check after the recovery stops the job with the one line. With it, the run
    recovers and ends bitwise equal to an uninterrupted one (the check changes nothing)."""
    handed, forgotten = (scheduled_script(project(tmp_path), h) for h in (True, False))
    reference = scheduled_run(tmp_path, "reference", handed, REFERENCE_ARGS)
    try:
        reference.start()
        assert reference.join(JOB_TIMEOUT)[0] == 0, reference.evidence()
    finally:
        reference.stop()
    run, code, output, victim, why = killed_once(tmp_path, "handed", handed)
    assert code == 0, f"{output}\n{run.evidence()} {why}"
    assert "toolkit.train: after the recovery" not in run.log("worker_0.log") + run.log("worker_1.log"), why
    want, got = final_model(reference, 2), final_model(run, 2)
    assert all(want[k].numpy().tobytes() == got[k].numpy().tobytes() for k in want), f"differs {why}"

    run, code, output, victim, why = killed_once(tmp_path, "forgotten", forgotten)
    assert code != 0, f"{output}\n{run.evidence()} {why}"
    found = DIVERGED.findall(run.log("worker_0.log") + run.log("worker_1.log"))
    assert len(found) == 2 and int(found[0][1]) == int(found[0][0]) + 1, f"{found}\n{run.evidence()} {why}"
    assert "an LR scheduler is likely not handed over" in output, output  # the failure shows the line
    for r in range(2):
        p = run.procs()[f"worker_{r}"]
        assert p["exits"][-1]["code"] == 77 and p["restarts"] == (1 if r == victim else 0), (r, p, why)


def killed_once(tmp_path: Path, job: str, script: str) -> tuple[FleetRun, int, str, int, str]:
    """Run `script`, kill -9 a random worker at a random step, wait for the end: (run, exit code of --join, its
    output, the victim, what happened)."""
    run = scheduled_run(tmp_path, job, script)
    rng = random.Random()
    victim, target = rng.randrange(2), rng.randint(8, steps_total(2) - 30)
    try:
        run.start()
        until(f"step {target}", lambda: last_step(run, victim) >= target, run)
        os.kill(run.procs()[f"worker_{victim}"]["pid"], signal.SIGKILL)
        code, output = run.join(JOB_TIMEOUT)
    finally:
        run.stop()
    return run, code, output, victim, f"({script}: worker_{victim} killed at step {target})"
# --- the end of a plain script -------------------------------------------------------------------------------


def test_a_plain_script_ending_with_barrier_and_destroy_always_ends_0(tmp_path: Path) -> None:
    """A torchrun-style script that ends with `dist.barrier(); dist.destroy_process_group()` (tests/scripts/
    plain_end.py), killed at random steps (rank 0, then rank 1), then killed while its peer waits in the final
    barrier; its last act, on rank 1, a C call that holds the GIL for longer than the node timeout, after rank 0
    finished. Every death relaunches both ranks (the one in the barrier rejoins: never charged a crash), the silent
    rank 1 is vouched for by its agent (alive, not stopped) and allowed to finish, and the job ends 0."""
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(SCRIPTS / "plain_end.py", project)
    linger = tmp_path / "linger"
    linger.touch()  # the first rank 1 that reaches the end waits there, its peer in the final barrier
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    steps, node_timeout, block = 40, 3, 8
    args = f"--steps {steps} --ckpt-every 4 --step-delay 0.05 --linger-rank 1 --linger-file {linger} --gil-rank 1 " \
           f"--gil-block {block}"
    run = FleetRun(tmp_path, "ends", ["--project", str(project), "--script", "plain_end.py", "--worker-num", "2",
                                      "--workdir", str(tmp_path / "work"), "--node-timeout", str(node_timeout),
                                      "--script-args", args])
    first, second = rng.randint(5, 15), rng.randint(20, 30)
    why = f"(seed {seed}: rank 0 killed at step {first}, rank 1 at step {second}, then in its final linger)"
    step_line = re.compile(r"^rank \d step (\d+) ", re.M)

    def runs(rank: int) -> list[str]:
        return re.split(r"^--- toolkit agent .*---$", run.log(f"worker_{rank}.log"), flags=re.M)[1:]

    def kill(rank: int) -> None:
        pid = until(f"worker_{rank} running {why}", lambda: run.procs()[f"worker_{rank}"]["pid"], run)
        os.kill(pid, signal.SIGKILL)

    try:
        run.start()
        for victim, step in ((0, first), (1, second)):  # kill #1 stops short of step 20: the second is later
            until(f"rank {victim} at step {step} {why}",
                  lambda v=victim, s=step: runs(v) and any(int(x) >= s for x in step_line.findall(runs(v)[-1])), run)
            kill(victim)
        until(f"rank 1 lingering before its final barrier {why}",
              lambda: "rank 1: lingering" in run.log("worker_1.log"), run)
        until(f"rank 0 in the final barrier {why}", lambda: "DONE rank 0" in runs(0)[-1], run)
        kill(1)
        linger.unlink()
        code, output = run.join(JOB_TIMEOUT)
        assert code == 0, f"{why}\n{output}\n{run.evidence()}"
    finally:
        run.stop()
    assert torch.load(run.dir / "ckpt" / "plain_end.pt", weights_only=True)["step"] == steps
    procs = run.procs()
    for r in range(2):
        assert procs[f"worker_{r}"]["state"] == "succeeded", f"worker_{r} {why}\n{run.evidence()}"
        # each death was one rank's SIGKILL: the other rank rejoined (76) every time, never a counted crash
        ends = [(e["code"], e["signal"]) for e in exits(run, f"worker_{r}")]
        killed = 1 if r == 0 else 2
        assert ends.count((None, "SIGKILL")) == killed and ends[-1] == (0, None), f"worker_{r}: {ends} {why}"
        assert set(ends[:-1]) <= {(None, "SIGKILL"), (EXIT_REJOIN, None)}, f"worker_{r}: {ends} {why}"
        assert procs[f"worker_{r}"]["counted_restarts"] == killed, f"worker_{r} {why}"
    sched = run.log("scheduler.log")
    assert re.search(r"worker_1 \(pid \d+ on \S+\) sent no heartbeat for [\d.]+ s, but its agent sees it running "
                     r"\(not stopped\)", sched), sched[-3000:]  # the GIL block took effect, and was waited out
    assert "is dead: sent no heartbeat" not in sched, sched[-3000:]
    assert f"rank 1: blocking {block} s in C, holding the GIL" in run.log("worker_1.log")
    assert "rank 1: the end" in run.log("worker_1.log")
