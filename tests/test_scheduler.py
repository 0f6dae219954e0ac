"""The scheduler, as a real `python -m toolkit.scheduler` process: formation, its timeout, registration rules
(token, duplicates, re-registration, fencing), heartbeats and generations, the agent messages, persistence across
`kill -9`, and training with real gloo process groups through toolkit.train."""

from __future__ import annotations

import json
import re
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from runtime_harness import (
    PYTHON,
    SCRIPTS,
    Client,
    FakeAgent,
    Job,
    Proc,
    expected_weights,
    job_factory,
    read_result,
)

from toolkit import scheduler as S
from toolkit.contracts import protocol as P
from toolkit.scheduler import state as state_file

pytestmark = pytest.mark.timeout(180)
HEARTBEAT = 0.3


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    with job_factory(tmp_path) as make:
        yield make


def started(job: Job, env: dict[str, str] | None = None) -> Proc:
    sched = job.scheduler(env)
    job.wait_serving(sched)
    return sched


def keep_alive_until(client: Client, sched: Proc, pattern: str, timeout: float) -> None:
    """Heartbeat from `client` (as the runtime does, every HEARTBEAT s) until the scheduler logs `pattern`."""
    deadline = time.monotonic() + timeout
    while True:
        client.send(P.HEARTBEAT, step=1)
        try:
            sched.wait_for(pattern, HEARTBEAT)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise


def welcome(client: Client) -> dict:
    msg = client.recv()
    assert msg is not None and msg["op"] == P.WELCOME, msg
    return msg


# ------------------------------------------------------------------ formation


def test_four_workers_form_train_with_gloo_and_the_scheduler_exits_0(make_job) -> None:
    job = make_job(4)
    sched = started(job)
    out = job.root / "out"
    workers = [job.worker(r, args=["--steps", "6", "--out", str(out)]) for r in range(4)]
    for w in workers:
        assert w.wait(120) == 0, w.text()
    assert sched.wait(30) == 0, sched.text()
    sched.wait_for(r"generation 0 formed: 4 workers", 1)
    assert sched.count(r"is dead") == 0
    want = expected_weights(4, 6)
    for r in range(4):
        result = read_result(out / f"rank_{r}.json")
        assert (result["world_size"], result["generation"], result["reforms"]) == (4, 0, 0)
        assert result["w"] == want


def test_formation_timeout_names_the_missing_node_ids_and_their_hosts(make_job) -> None:
    job = make_job(4, topo_timeout=2.0, node_timeout=30.0)
    expected = job.root / "expected.json"
    expected.write_text(json.dumps({"worker_0": "node-a", "worker_1": "node-b", "worker_2": "node-a"}))
    sched = started(job, {**job.sched_env(), S.TOOLKIT_EXPECTED: str(expected)})
    present = [Client(job.port), Client(job.port)]
    present[0].register(job, 0)
    present[1].register(job, 2)
    for c in present:
        welcome(c)
    assert sched.wait(30) == S.EXIT_FORMATION
    line = sched.wait_for(r"failed: cluster formation timed out", 1).string
    assert "2 of 4 workers never registered: worker_1 (expected on node-b), worker_3;" in line
    assert "worker_0" not in line and "worker_2" not in line
    for c in present:  # the registered workers are told why, so their logs say it too
        assert "worker_1 (expected on node-b)" in c.expect(P.STOP)["reason"]


# ------------------------------------------------------------------ registration rules


def test_a_second_claim_of_a_live_node_id_is_rejected_and_logged_with_its_address(make_job) -> None:
    job = make_job(2, node_timeout=30.0)
    sched = started(job)
    holder = Client(job.port)
    holder.register(job, 1, pid=4242)
    welcome(holder)
    claimant = Client(job.port)
    claimant.register(job, 1, pid=5353)
    msg = claimant.recv()
    assert msg is not None and msg["op"] == P.REJECT and msg["retry"] is True
    assert "pid 4242" in msg["reason"]
    assert claimant.recv() is None  # and the connection is closed
    line = sched.wait_for(r"rejected worker_1 from pid 5353", 5).string
    assert claimant.local_addr in line
    holder.send(P.HEARTBEAT, step=1)  # the holder is untouched
    assert sched.count("is dead") == 0


@pytest.mark.parametrize("how", ["connection closed", "agent reported the exit"])
def test_a_dead_node_id_is_accepted_again_at_once(make_job, how: str) -> None:
    # A node timeout of 60 s proves the acceptance cannot come from a heartbeat expiring: it comes from knowing
    # the death (MindSpore refuses the node id for 30 s).
    job = make_job(2, node_timeout=60.0)
    sched = started(job)
    agent = FakeAgent(job, "host-a", ["worker_0", "worker_1"])
    agent.start()
    old = Client(job.port)
    old.register(job, 0, pid=777)
    welcome(old)
    died = time.monotonic()
    if how == "connection closed":
        old.close()
    else:
        agent.exited("worker_0", 777, code=None, sig="SIGKILL")
    sched.wait_for(r"worker_0 \(pid 777 on testhost\) is dead", 10)
    new = Client(job.port)
    new.register(job, 0, pid=778)
    msg = new.recv()
    accepted = time.monotonic() - died
    assert msg is not None and msg["op"] == P.WELCOME, msg
    print(f"\nre-registration after '{how}': accepted {accepted * 1000:.0f} ms after the death")
    assert sched.count("rejected") == 0


def test_a_silent_holder_blocks_its_node_id_until_its_heartbeat_expires(make_job) -> None:
    job = make_job(2, node_timeout=1.5)
    sched = started(job)
    hung = Client(job.port)  # registers, then never speaks again: a SIGSTOPped process
    hung.register(job, 0, pid=900)
    welcome(hung)
    early = Client(job.port)
    early.register(job, 0, pid=901)
    assert early.recv()["op"] == P.REJECT
    sched.wait_for(r"worker_0 \(pid 900 on testhost\) is dead: sent no heartbeat", 10)
    late = Client(job.port)
    late.register(job, 0, pid=902)
    welcome(late)


def test_a_wrong_token_is_rejected_logged_and_the_token_never_printed(make_job) -> None:
    job = make_job(1)
    sched = started(job)
    for make in (lambda c: c.register(job, 0, token="not-the-token"),
                 lambda c: c.hello(job, "host-x", ["worker_0"], token=""),
                 lambda c: c.register(job, 0, plain=True),  # the right token, in the clear: refused too
                 lambda c: (c.challenge(), c.send(P.HEARTBEAT, step=1))):
        c = Client(job.port)
        make(c)
        msg = c.recv()
        assert msg is not None and msg["op"] == P.REJECT, msg
        assert c.recv() is None
    sched.wait_for(r"rejected registration of worker_0 from 127\.0\.0\.1:\d+: wrong or missing job token", 5)
    sched.wait_for(r"rejected agent hello from 127\.0\.0\.1:\d+ \(host host-x\): wrong or missing job token", 5)
    sched.wait_for(r"rejected registration of worker_0 from 127\.0\.0\.1:\d+: the job token in the clear is "
                   r"refused", 5)
    ok = Client(job.port)  # the rejections did not disturb the job
    ok.register(job, 0)
    welcome(ok)
    assert ok.expect(P.FORMED)["generation"] == 0
    ok.send(P.DONE)
    assert sched.wait(20) == 0
    assert job.token not in sched.text()
    for name in (S.STATE_FILE, state_file.JOURNAL_FILE):
        assert job.token not in (job.recovery_path / name).read_text()


def test_a_fenced_incarnation_coming_back_is_told_to_exit(make_job) -> None:
    job = make_job(2, node_timeout=1.0)
    sched = started(job)
    stale, peer = Client(job.port), Client(job.port)
    stale.register(job, 0, pid=1000)
    peer.register(job, 1, pid=1001)
    for c in (stale, peer):
        c.expect(P.FORMED)
    # the peer keeps its heartbeat; the stale one goes silent (SIGSTOP) and is declared dead
    keep_alive_until(peer, sched, r"worker_0 .* is dead", 30)
    assert peer.expect(P.GENERATION)["generation"] == 1
    assert stale.expect(P.FENCED)  # pushed on its old connection: read the moment it wakes up
    again = Client(job.port)  # or, if that was lost, on its reconnect with the same incarnation
    again.register(job, 0, pid=1000, incarnation=stale.incarnation, rejoin=True)
    assert again.recv()["op"] == P.FENCED
    sched.wait_for(r"fenced worker_0 \(pid 1000 on testhost, 127\.0\.0\.1:\d+\)", 5)


# ------------------------------------------------------------------ heartbeats and generations with real gloo


def test_a_sigstopped_worker_is_declared_dead_killed_by_its_agent_and_replaced(make_job) -> None:
    job = make_job(3, node_timeout=2.0)
    sched = started(job)
    out = job.root / "out"
    args = ["--steps", "40", "--out", str(out), "--delay", "0.05", "--timeout", "60"]
    workers = {r: job.worker(r, args=args) for r in range(3)}
    replaced: dict[int, Proc] = {}

    def on_kill(node_id: str, pid: int) -> None:  # what the real agent does: SIGKILL, report, relaunch
        rank = int(node_id.split("_")[1])
        victim = workers[rank]
        assert victim.pid == pid
        victim.kill()
        agent.exited(node_id, pid, code=None, sig="SIGKILL")
        replaced[rank] = job.worker(rank, args=args)

    agent = FakeAgent(job, "localhost", [P.worker_node_id(r) for r in range(3)], on_kill)
    agent.start()
    workers[1].wait_for(r"rank 1 step 8\b", 120)
    workers[1].signal(signal.SIGSTOP)
    line = sched.wait_for(r"worker_1 \(pid \d+ on .*\) is dead: sent no heartbeat", 30).string
    assert f"pid {workers[1].pid}" in line
    sched.wait_for(r"generation 1 begins", 5)
    assert agent.wait_message(P.KILL, 10) == {"op": P.KILL, "node_id": "worker_1", "pid": workers[1].pid,
                                              "cause": "heartbeat silence"}
    sched.wait_for(r"generation 1 formed: 3 workers", 120)
    for proc in (workers[0], workers[2], replaced[1]):
        assert proc.wait(120) == 0, proc.text()
    assert sched.wait(30) == 0, sched.text()
    want = expected_weights(3, 40)
    for r in range(3):
        result = read_result(out / f"rank_{r}.json")
        assert result["w"] == want and result["generation"] == 1
    assert read_result(out / "rank_0.json")["reforms"] == 1


def test_a_stale_incarnation_after_sigcont_is_fenced_and_the_job_ends_right(make_job) -> None:
    job = make_job(2, node_timeout=2.0)
    sched = started(job)
    out = job.root / "out"
    args = ["--steps", "30", "--out", str(out), "--delay", "0.05", "--timeout", "60"]
    w0, old = job.worker(0, args=args), job.worker(1, args=args)
    old.wait_for(r"rank 1 step 5\b", 120)
    old.signal(signal.SIGSTOP)
    sched.wait_for(r"worker_1 .* is dead", 30)
    new = job.worker(1, args=args)  # the replacement (no agent here: nobody kills the stopped process)
    sched.wait_for(r"registered worker_1", 60)
    old.signal(signal.SIGCONT)
    assert old.wait(60) == P.EXIT_FENCED
    old.wait_for(r"fenced by the scheduler: declared dead", 1)
    for proc in (w0, new):
        assert proc.wait(120) == 0, proc.text()
    assert sched.wait(30) == 0
    want = expected_weights(2, 30)
    assert [read_result(out / f"rank_{r}.json")["w"] for r in range(2)] == [want, want]


# ------------------------------------------------------------------ persistence


def test_scheduler_kill9_mid_training_and_restart_changes_nothing(make_job) -> None:
    job = make_job(2, node_timeout=3.0)
    sched = started(job)
    out = job.root / "out"
    args = ["--steps", "150", "--out", str(out), "--delay", "0.05"]
    workers = [job.worker(r, args=args) for r in range(2)]
    workers[0].wait_for(r"rank 0 step 10\b", 120)
    mark = len(workers[0].lines)
    sched.kill()
    workers[0].wait_for(r"lost the scheduler", 10, start=mark)
    workers[0].wait_for(r"rank 0 step \d+", 10, start=len(workers[0].lines))  # training goes on while it is down
    state = state_file.load(job.recovery_path / S.STATE_FILE, job.name, 2)
    assert state is not None and state["generation"] == 0 and state["formed"] and len(state["members"]) == 2
    for name in (S.STATE_FILE, state_file.JOURNAL_FILE):
        assert stat.S_IMODE((job.recovery_path / name).stat().st_mode) == 0o600
    again = started(job)
    again.wait_for(r"resumed job testjob .* generation 0 \(formed\), 2 members", 5)
    again.wait_for(r"worker_0 reconnected", 30)
    again.wait_for(r"worker_1 reconnected", 30)
    for w in workers:
        assert w.wait(120) == 0, w.text()
    assert again.wait(30) == 0, again.text()
    want = expected_weights(2, 150)
    for r in range(2):
        result = read_result(out / f"rank_{r}.json")
        assert (result["w"], result["generation"], result["reforms"]) == (want, 0, 0)
    final = state_file.load(job.recovery_path / S.STATE_FILE, job.name, 2)
    assert final is not None and final["status"] == "finished" and final["committed_step"] == 149


def test_a_restarted_scheduler_waits_for_its_members_then_declares_the_absent_dead(make_job) -> None:
    job = make_job(2, node_timeout=2.0)
    sched = started(job)
    back, gone = Client(job.port), Client(job.port)
    back.register(job, 0, pid=1)
    gone.register(job, 1, pid=2)
    for c in (back, gone):
        c.expect(P.FORMED)
    sched.kill()
    again = started(job)
    again.wait_for(r"resumed job .* 2 members waiting to reconnect", 5)
    incarnation = back.incarnation
    back = Client(job.port)
    back.register(job, 0, pid=1, incarnation=incarnation, rejoin=True)
    assert welcome(back)["generation"] == 0
    newcomer = Client(job.port)  # a new incarnation of rank 1 while the old one may still come back
    newcomer.register(job, 1, pid=3)
    assert newcomer.recv()["op"] == P.REJECT
    keep_alive_until(back, again, r"worker_1 .* is dead: did not reconnect", 30)
    assert back.expect(P.GENERATION)["generation"] == 1
    newcomer = Client(job.port)
    newcomer.register(job, 1, pid=3)
    welcome(newcomer)
    prefix = again.wait_for(r"generation 1 formed: .* store prefix (\S+)", 5).group(1)
    formed = back.expect(P.FORMED)
    assert {k: formed[k] for k in ("op", "generation", "prefix", "faults")} == {
        "op": P.FORMED, "generation": 1, "prefix": prefix, "faults": 1}  # the history for the checkpoint interval
    assert formed["uptime"] > 0
    assert newcomer.expect(P.FORMED)["prefix"] == prefix
    old_prefix = sched.wait_for(r"generation 0 formed: .* store prefix (\S+)", 1).group(1)
    assert prefix.split("/")[1] != old_prefix.split("/")[1]  # a new store: a new boot id in every key


def test_sigterm_persists_the_state_and_exits(make_job) -> None:
    job = make_job(2)
    sched = started(job)
    c = Client(job.port)
    c.register(job, 0, pid=31)
    welcome(c)
    sched.signal(signal.SIGTERM)
    assert sched.wait(20) == 128 + signal.SIGTERM
    sched.wait_for(r"stopped by SIGTERM; state persisted", 1)
    state = state_file.load(job.recovery_path / S.STATE_FILE, job.name, 2)
    assert state is not None
    assert [m["node_id"] for m in state["members"]] == ["worker_0"] and state["status"] == "running"


# ------------------------------------------------------------------ agents


def test_gave_up_fails_the_job_and_stops_every_agent(make_job) -> None:
    job = make_job(2)
    sched = started(job)
    a = FakeAgent(job, "host-a", ["worker_0"])
    b = FakeAgent(job, "host-b", ["worker_1", "sched"])
    a.start()
    b.start()
    sched.wait_for(r"agent of host-b connected", 5)
    a.client.send(P.GAVE_UP, node_id="worker_0", code=1, signal=None, log_tail="Traceback\nValueError: bad data\n")
    assert sched.wait(20) == S.EXIT_FAILED
    for agent in (a, b):
        reason = agent.wait_message(P.STOP, 5)["reason"]
        assert "worker_0 on host-a failed after its last allowed restart (exit code 1)" in reason
        assert "ValueError: bad data" in reason
    sched.wait_for(r"job testjob failed: worker_0 on host-a", 1)


def test_an_unmodified_torchrun_script_trains_under_the_launcher(make_job) -> None:
    # As every worker runs: through the wrapper, which registers it (restart recovery) when it asks for its group.
    job = make_job(2, topo_timeout=600.0)
    sched = started(job)
    agent = FakeAgent(job, "localhost", ["worker_0", "worker_1"])
    agent.start()
    script = str(SCRIPTS / "runtime_torchrun_script.py")
    wrapped = [PYTHON, "-c", "import sys; from toolkit.train.wrapper import main; sys.exit(main())", script,
               "--steps", "5"]
    procs = [job.start(wrapped, job.worker_env(r), f"worker_{r}.log") for r in range(2)]
    digests = []
    for r, proc in enumerate(procs):
        assert proc.wait(120) == 0, proc.text()
        digests.append(proc.wait_for(rf"rank {r} params ([0-9a-f]{{64}})", 1).group(1))
        proc.wait_for(rf"rank {r}/2 step 4 loss", 1)
    assert digests[0] == digests[1]
    sched.wait_for(r"registered worker_0 .*restart recovery", 1)
    assert agent.wait_message(P.FINISHED, 10)["op"] == P.FINISHED
    assert sched.wait(20) == 0


def test_a_wrapped_unmodified_script_restarts_the_world_with_fresh_keys(make_job) -> None:
    # `python -m toolkit.train SCRIPT`: env:// binds to the scheduler's store under the generation's prefix; on a
    # death the survivor exits EXIT_REJOIN and the relaunched pair meets only keys of generation 1. The order is
    # forced as a loaded host produces it: the survivor's collective fails (its peer's connections reset) before
    # the scheduler's word reaches it (late_word.py holds the word until the worker asks for it). That failure is a
    # rejoin, not the survivor's crash.
    job = make_job(2, node_timeout=6.0)
    sched = started(job)
    script = str(SCRIPTS / "runtime_torchrun_script.py")
    wrapped = [PYTHON, "-c", "import sys; from toolkit.train.wrapper import main; sys.exit(main())",
               str(SCRIPTS / "late_word.py"), script, "--steps", "40", "--delay", "0.05"]
    first = {r: job.start(wrapped, job.worker_env(r), f"worker_{r}.log") for r in range(2)}
    first[1].wait_for(r"rank 1/2 step 5 ", 120)
    first[1].kill()
    assert first[0].wait(30) == P.EXIT_REJOIN, first[0].text()
    out = first[0].text()
    failed = re.search(r"the script failed \(.*\); waiting up to [\d.]+ s for the scheduler's word", out)
    word = re.search(r"late_word: the scheduler's word of generation 1 reaches the worker", out)
    moved = re.search(r"the job moved to generation 1; this script cannot re-form in place", out)
    assert failed and word and moved and failed.start() < word.start() < moved.start(), out  # the collective first
    again = {r: job.start(wrapped, job.worker_env(r), f"worker_{r}.log") for r in range(2)}
    digests = []
    for r, proc in again.items():
        assert proc.wait(120) == 0, proc.text()
        proc.wait_for(r"the script.s process group: generation 1, restart recovery", 1)
        digests.append(proc.wait_for(rf"rank {r} params ([0-9a-f]{{64}})", 1).group(1))
    assert digests[0] == digests[1]
    assert sched.wait(20) == 0, sched.text()


def test_a_wrapped_scripts_own_error_stays_its_own_when_the_job_does_not_move_on(make_job, tmp_path: Path) -> None:
    # The bounded wait for the scheduler's word decides: rank 0 raises an error that reads like a collective's, of
    # its own (no peer died). No word comes, so it exits 1 with its error recorded as the cause (the error file the
    # agent reads); rank 1, whose collective broke because rank 0 left, hears the word and rejoins.
    job = make_job(2, node_timeout=2.0)
    sched = started(job)
    wrapped = [PYTHON, "-c", "import sys; from toolkit.train.wrapper import main; sys.exit(main())",
               str(SCRIPTS / "runtime_torchrun_script.py"), "--steps", "40", "--delay", "0.05", "--fail-at", "5"]
    envs = {r: {**job.worker_env(r), "TORCHELASTIC_ERROR_FILE": str(tmp_path / f"error_{r}.json")} for r in range(2)}
    procs = {r: job.start(wrapped, envs[r], f"worker_{r}.log") for r in range(2)}
    assert procs[0].wait(60) == 1, procs[0].text()
    procs[0].wait_for(r"the script failed \(RuntimeError: rank 0: Connection reset by peer, or so this script says "
                      r"at step 5\); waiting up to [\d.]+ s", 1)
    assert "the job moved" not in procs[0].text()
    error = json.loads((tmp_path / "error_0.json").read_text())
    assert error["message"]["message"] == "RuntimeError: rank 0: Connection reset by peer, or so this script says " \
                                          "at step 5"
    assert procs[1].wait(60) == P.EXIT_REJOIN, procs[1].text()
    sched.kill()


# ------------------------------------------------------------------ configuration


def test_a_missing_setting_is_one_line_and_exit_2(make_job) -> None:
    job = make_job(2)
    env = job.sched_env()
    del env["MS_WORKER_NUM"]
    proc = Proc([PYTHON, "-m", "toolkit.scheduler"], env, job.logs / "bad.log")
    assert proc.wait(30) == S.EXIT_CONFIG
    assert "scheduler: error: MS_WORKER_NUM is not set: give the total number of workers" in proc.text()
    assert "Traceback" not in proc.text()


def test_a_busy_port_is_one_line_and_exit_2(make_job) -> None:
    job = make_job(1)
    first = started(job)
    second = Proc([PYTHON, "-m", "toolkit.scheduler"], job.sched_env(), job.logs / "second.log")
    assert second.wait(30) == S.EXIT_CONFIG
    assert f"cannot serve on 127.0.0.1:{job.port}" in second.text() and "Traceback" not in second.text()
    first.kill()


def test_config_reads_the_environment_and_hides_the_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = S.Config.from_env({"MS_WORKER_NUM": "3", "TOOLKIT_TOKEN_FILE": str(token), "MS_SCHED_PORT": "9000",
                             "MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(tmp_path)})
    assert (cfg.port, cfg.store_port, cfg.world_size, cfg.node_timeout, cfg.recovery) == (9000, 9001, 3, 6.0, True)
    assert cfg.token == "s3cret" and "s3cret" not in repr(cfg)
    with pytest.raises(S.ConfigError, match="MS_NODE_TIMEOUT='soon': expected a number of seconds"):
        S.Config.from_env({"MS_WORKER_NUM": "3", "TOOLKIT_TOKEN_FILE": str(token), "MS_NODE_TIMEOUT": "soon"})
    with pytest.raises(S.ConfigError, match="TOOLKIT_TOKEN_FILE is not set"):
        S.Config.from_env({"MS_WORKER_NUM": "3"})
    with pytest.raises(S.ConfigError, match="needs MS_RECOVERY_PATH"):
        S.Config.from_env({"MS_WORKER_NUM": "3", "TOOLKIT_TOKEN_FILE": str(token), "MS_ENABLE_RECOVERY": "1"})
    assert cfg.logical_ranks == 3  # by default: one logical rank per worker
    base = {"MS_WORKER_NUM": "3", "TOOLKIT_TOKEN_FILE": str(token)}
    assert S.Config.from_env({**base, "TOOLKIT_LOGICAL_RANKS": "7"}).logical_ranks == 7
    for bad in ("2", "70000"):
        with pytest.raises(S.ConfigError, match=f"TOOLKIT_LOGICAL_RANKS={bad}: give 3 to 65536 logical ranks"):
            S.Config.from_env({**base, "TOOLKIT_LOGICAL_RANKS": bad})


def test_rank_of_node_ids() -> None:
    assert [S.rank_of(n) for n in ("worker_0", "worker_17", "sched", "worker_", "worker_x")] == [0, 17, None, None,
                                                                                                  None]


def test_workers_that_never_register_but_run_under_agents_are_served_not_failed(make_job) -> None:
    # A plain torchrun-style script never talks to the scheduler; its agents vouch that it runs. At the formation
    # deadline the scheduler keeps serving the store instead of failing the job, and agents' exit reports end it.
    job = make_job(2, topo_timeout=1.5)
    sched = started(job)
    agent = FakeAgent(job, "localhost", ["worker_0", "worker_1"])
    agent.start()
    sched.wait_for(r"no worker registered within MS_TOPO_TIMEOUT=1.5 s, but every one runs under its agent", 30)
    assert sched.popen.poll() is None
    agent.exited("worker_0", 11, code=0)
    agent.exited("worker_1", 12, code=0)
    assert agent.wait_message(P.FINISHED, 10) == {"op": P.FINISHED}
    assert sched.wait(20) == 0


def test_a_busy_store_port_is_one_line_and_exit_2(make_job) -> None:
    job = make_job(1)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", job.port + 1))
        squatter.listen(1)
        proc = Proc([PYTHON, "-m", "toolkit.scheduler"], job.sched_env(), job.logs / "busy.log")
        assert proc.wait(30) == S.EXIT_CONFIG
    assert (f"scheduler: error: cannot serve the store on 127.0.0.1:{job.port + 1} (MASTER_PORT): address already "
            "in use; is another job using the port") in proc.text()
    assert "Traceback" not in proc.text()
