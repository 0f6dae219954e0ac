from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.contracts import envvars as E
from toolkit.launcher.inventory import load_ansible_inventory, local_inventory, parse_hostfile_text, parse_hosts
from toolkit.launcher.plan import JobOptions, PlanError, make_plan
from toolkit.launcher.render import plan_json

WORKER_KEYS = {
    E.MS_ROLE, E.MS_SCHED_HOST, E.MS_SCHED_PORT, E.MS_WORKER_NUM, E.MS_NODE_ID, E.MS_TOPO_TIMEOUT, E.MS_NODE_TIMEOUT,
    E.MS_ENABLE_RECOVERY, E.MS_RECOVERY_PATH, E.RANK_ID, E.RANK_SIZE, E.DEVICE_ID, E.MASTER_ADDR, E.MASTER_PORT,
    E.RANK, E.WORLD_SIZE, E.LOCAL_RANK, E.LOCAL_WORLD_SIZE, E.GROUP_RANK, E.TORCHELASTIC_USE_AGENT_STORE,
    E.OMP_NUM_THREADS, E.CKPT_DIR, E.TOOLKIT_JOB, E.TOOLKIT_TOKEN_FILE, E.TOOLKIT_AGENT_SOCKET,
    E.TOOLKIT_HEARTBEAT_INTERVAL, E.TOOLKIT_HOST, E.GROUP_WORLD_SIZE, E.ROLE_NAME, E.ROLE_RANK, E.ROLE_WORLD_SIZE,
    E.TORCHELASTIC_RUN_ID, E.TORCHELASTIC_MAX_RESTARTS, E.TORCH_NCCL_COORD_CHECK_MILSEC,
}


def opts(**kw: object) -> JobOptions:
    return JobOptions(job=str(kw.pop("job", "demo")), **kw)  # type: ignore[arg-type]


def test_uneven_slots_rank_host_by_host() -> None:
    plan = make_plan(parse_hosts("a:3,b:1,c:2"), opts())
    workers = [p for p in plan.processes() if p.rank is not None]
    assert [(p.host, p.node_id, p.rank, p.local_rank) for p in workers] == [
        ("a", "worker_0", 0, 0), ("a", "worker_1", 1, 1), ("a", "worker_2", 2, 2),
        ("b", "worker_3", 3, 0),
        ("c", "worker_4", 4, 0), ("c", "worker_5", 5, 1),
    ]
    env = {p.node_id: p.env for p in workers}
    assert [env[f"worker_{r}"][E.LOCAL_WORLD_SIZE] for r in range(6)] == ["3", "3", "3", "1", "2", "2"]
    assert [env[f"worker_{r}"][E.GROUP_RANK] for r in range(6)] == ["0", "0", "0", "1", "2", "2"]
    for p in workers:
        assert set(p.env) == WORKER_KEYS
        assert p.env[E.RANK] == p.env[E.RANK_ID] == str(p.rank)
        assert p.env[E.LOCAL_RANK] == p.env[E.DEVICE_ID] == str(p.local_rank)
        assert p.env[E.WORLD_SIZE] == p.env[E.RANK_SIZE] == p.env[E.MS_WORKER_NUM] == "6"
        # torchrun's: one role ("default") holding every worker, one group per host that runs workers
        assert (p.env[E.ROLE_NAME], p.env[E.ROLE_RANK], p.env[E.ROLE_WORLD_SIZE]) == ("default", str(p.rank), "6")
        assert p.env[E.GROUP_WORLD_SIZE] == "3"
        assert (p.env[E.TORCHELASTIC_RUN_ID], p.env[E.TORCHELASTIC_MAX_RESTARTS]) == ("demo", "3")
        assert p.env[E.MS_ROLE] == E.ROLE_WORKER and p.env[E.MS_NODE_ID] == p.node_id
        assert p.env[E.MS_SCHED_HOST] == p.env[E.MASTER_ADDR] == "a"
        assert (p.env[E.MS_SCHED_PORT], p.env[E.MASTER_PORT]) == ("8118", "8119")
        assert p.env[E.CKPT_DIR] == "toolkit-jobs/demo/ckpt"
        assert p.argv == ("python3", "-m", "toolkit.train", "train.py") and p.cwd == "toolkit-jobs/demo/project"
    sched = plan.process("sched")
    assert (sched.host, sched.role, sched.rank) == ("a", E.ROLE_SCHED, None)
    assert sched.argv[1:] == ("-m", "toolkit.scheduler")
    assert sched.env[E.MS_NODE_ID] == "sched" and E.RANK not in sched.env
    assert sched.env[E.MS_RECOVERY_PATH] == "toolkit-jobs/demo/recovery"


def test_scheduler_on_its_own_host_and_per_host_vars(tmp_path: Path) -> None:
    path = tmp_path / "inv.ini"
    path.write_text(
        "[scheduler]\nhead ansible_host=10.0.0.1 python=/venv/bin/python\n"
        "[workers]\nw1 slots=2 workdir=/scratch\nw2 slots=2\n"
    )
    plan = make_plan(load_ansible_inventory(path), opts(master_port=9000, recovery=False))
    head = plan.host_plan("head")
    assert [p.node_id for p in head.processes] == ["sched"]
    assert head.processes[0].argv[0] == "/venv/bin/python"
    assert plan.sched_address == "10.0.0.1"
    assert plan.host_plan("w1").job_dir == "/scratch/demo"
    for p in plan.processes():
        assert p.env[E.MS_SCHED_HOST] == "10.0.0.1" and p.env[E.MASTER_PORT] == "9001"
        assert p.env[E.MS_ENABLE_RECOVERY] == "0"
    assert plan.process("worker_0").env[E.CKPT_DIR] == "/scratch/demo/ckpt"
    assert plan.process("worker_2").env[E.CKPT_DIR] == "toolkit-jobs/demo/ckpt"
    shared = make_plan(load_ansible_inventory(path), opts(master_port=9000, ckpt_dir="/nfs/ckpt"))
    assert {p.env[E.CKPT_DIR] for p in shared.processes() if p.rank is not None} == {"/nfs/ckpt/demo"}  # its own


def test_fewer_workers_than_slots_uses_the_first_slots() -> None:
    plan = make_plan(parse_hosts("a:2,b:2,c:2"), opts(worker_num=3))
    assert [(p.host, p.rank) for p in plan.processes() if p.rank is not None] == [("a", 0), ("a", 1), ("b", 2)]
    assert plan.host_names == ("a", "b")  # c runs nothing
    assert plan.world_size == 3


def test_more_workers_than_slots_is_an_error() -> None:
    with pytest.raises(PlanError, match="--worker-num 7 is more than the 6 slots of --hosts; add hosts or slots"):
        make_plan(parse_hosts("a:3,b:3"), opts(worker_num=7))


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"job": "a/b"}, "--job 'a/b': a job name is 1-64 letters"),
        ({"job": ""}, "--job '': a job name"),
        ({"job": ".hidden"}, "--job '.hidden'"),
        ({"job": "x" * 65}, "a job name is 1-64"),
        ({"job": "evil\n"}, "--job 'evil\\n': a job name is 1-64"),  # `$` with match let a trailing newline by
        ({"master_port": 1023}, "--master-port 1023: choose a port from 1024 to 65534"),
        ({"master_port": 65535}, "--master-port 65535: choose a port from 1024 to 65534 (the store uses the next one)"),
        ({"worker_num": 0}, "--worker-num 0: a job needs at least 1 worker"),
        ({"script_args": "--name 'unclosed"}, "--script-args \"--name 'unclosed\": No closing quotation"),
        ({"node_timeout": 1.0}, "--node-timeout 1.0: must be longer than the heartbeat interval"),
        ({"cluster_time_out": 0}, "--cluster-time-out 0"),
        ({"max_restarts": -1}, "--max-restarts -1"),
        ({"script": " "}, "--script is empty"),
        ({"workdir": "a\nb"}, "--workdir: a newline or NUL byte cannot be part of a path"),
    ],
)
def test_bad_job_options(kw: dict, message: str) -> None:
    with pytest.raises(PlanError) as e:
        opts(**kw)
    assert message in str(e.value)


def test_script_args_split_like_a_shell() -> None:
    plan = make_plan(parse_hosts("a"), opts(script="t.py", script_args="--name 'my run' --lr=0.1 \"$HOME\""))
    assert plan.process("worker_0").argv == ("python3", "-m", "toolkit.train", "t.py", "--name", "my run", "--lr=0.1",
                                             "$HOME")


def test_same_cluster_three_ways_gives_the_same_plan(tmp_path: Path) -> None:
    ini = tmp_path / "inv.ini"
    ini.write_text("[workers]\nn1 slots=3\nn2\nn3 slots=2\n")
    sources = [
        parse_hosts("n1:3,n2,n3:2"),
        parse_hostfile_text("n1 slots=3\nn2 slots=1\nn3 slots=2\n", "hostfile"),
        load_ansible_inventory(ini),
    ]
    plans = [plan_json(make_plan(inv, opts(worker_num=5, data_path="/data"))) for inv in sources]
    assert plans[0] == plans[1] == plans[2]
    assert len(plans[0]["processes"]) == 6


def test_local_plan_runs_in_the_project() -> None:
    plan = make_plan(local_inventory(2), opts(workdir="/home/u/jobs", python="/usr/bin/python3"), "/home/u/proj")
    assert plan.local and plan.sched_address == "127.0.0.1"
    assert {p.cwd for p in plan.processes()} == {"/home/u/proj"}
    assert plan.process("worker_1").env[E.TOOLKIT_AGENT_SOCKET] == "/home/u/jobs/demo/state/progress.sock"
    with pytest.raises(PlanError, match="a local job needs the project directory"):
        make_plan(local_inventory(1), opts())


def test_unknown_node_is_named_with_the_known_ones() -> None:
    plan = make_plan(parse_hosts("a:2"), opts())
    with pytest.raises(PlanError, match="no process 'worker_9' in job demo; the job has: sched, worker_0, worker_1"):
        plan.process("worker_9")


def test_every_script_runs_through_the_wrapper_and_torchrun_script_forces_restart_recovery() -> None:
    plan = make_plan(parse_hosts("a:2"), opts(script="t.py", script_args="--x 1"))
    assert plan.process("worker_1").argv == ("python3", "-m", "toolkit.train", "t.py", "--x", "1")
    assert E.TOOLKIT_RECOVERY not in plan.process("worker_1").env  # auto: the script's own calls decide
    plan = make_plan(parse_hosts("a:2"), opts(script="t.py", script_args="--x 1", torchrun_script=True))
    assert plan.process("worker_1").argv == ("python3", "-m", "toolkit.train", "t.py", "--x", "1")
    assert plan.process("worker_1").env[E.TOOLKIT_RECOVERY] == "restart"
    assert plan.expected_hosts() == {"worker_0": "a", "worker_1": "a"}
    assert plan.process("sched").env[E.TOOLKIT_EXPECTED] == "toolkit-jobs/demo/expected.json"


def test_spare_hosts_run_nothing_and_stand_by_for_every_worker(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.ini"
    inv.write_text("[workers]\na slots=2\nb slots=2\n[spares]\ns workdir=/srv/jobs\n")
    plan = make_plan(load_ansible_inventory(str(inv)), opts(workdir="/w"))
    assert plan.host_names == ("a", "b", "s")
    spare = plan.host_plan("s")
    assert spare.spare and spare.processes == ()
    assert [p.node_id for p in plan.processes()] == ["sched", "worker_0", "worker_1", "worker_2", "worker_3"]
    by_node = {p.node_id: p for p in plan.processes()}
    for p in spare.standby:  # each worker as the spare would run it: its rank's variables, the spare's directories
        same = by_node[p.node_id]
        assert (p.rank, p.local_rank, p.host) == (same.rank, same.local_rank, "s")
        for key in (E.RANK, E.LOCAL_RANK, E.LOCAL_WORLD_SIZE, E.GROUP_RANK, E.MASTER_ADDR, E.WORLD_SIZE):
            assert p.env[key] == same.env[key]
        assert p.env[E.TOOLKIT_HOST] == "s" and same.env[E.TOOLKIT_HOST] == same.host
        assert p.env[E.TOOLKIT_AGENT_SOCKET] == "/srv/jobs/demo/state/progress.sock"
        assert p.cwd == "/srv/jobs/demo/project"
    spec = next(h["spec"] for h in plan_json(plan)["hosts"] if h["host"] == "s")
    assert spec["processes"] == [] and [p["node_id"] for p in spec["standby"]] == [f"worker_{r}" for r in range(4)]
    assert by_node["sched"].env[E.TOOLKIT_HOST_TIMEOUT] == "60" and by_node["sched"].env[E.TOOLKIT_SPARES] == "s"
    with pytest.raises(PlanError, match="--host-timeout -1"):
        opts(host_timeout=-1)


def test_nproc_per_node_places_that_many_workers_on_every_host_and_nnodes_checks_the_hosts() -> None:
    plan = make_plan(parse_hosts("a:4,b,c"), opts(nproc_per_node=2, nnodes=3))
    assert [(p.host, p.local_rank) for p in plan.processes() if p.rank is not None] == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)]
    assert {p.env[E.GROUP_WORLD_SIZE] for p in plan.processes() if p.rank is not None} == {"3"}
    assert make_plan(parse_hosts("a,b"), opts(nproc_per_node=2, worker_num=3)).world_size == 3
    assert make_plan(local_inventory(1), opts(nproc_per_node=4), "/p").world_size == 4
    with pytest.raises(PlanError, match=r"--worker-num 5 is more than the 4 workers of --nproc-per-node 2 on 2 host"):
        make_plan(parse_hosts("a,b"), opts(nproc_per_node=2, worker_num=5))
    with pytest.raises(PlanError, match=r"--nnodes 3, but 2 host\(s\) would run workers \(a, b\)"):
        make_plan(parse_hosts("a:2,b:2,c"), opts(worker_num=4, nnodes=3))


def test_a_big_job_stretches_the_steady_intervals() -> None:
    """Past HEARTBEATS_PER_S (NCCL_CHECKS_PER_S) ranks each worker heartbeats (checks the store for NCCL's dump
    signal) less often: the scheduler reads them all on one thread. The heartbeat never past a third of the node
    timeout."""
    small = make_plan(parse_hosts("a:3,b:3"), opts()).process("worker_5").env
    assert (small[E.TOOLKIT_HEARTBEAT_INTERVAL], small[E.TORCH_NCCL_COORD_CHECK_MILSEC]) == ("1", "1000")
    hosts = ",".join(f"h{i}:8" for i in range(512))
    big = make_plan(parse_hosts(hosts), opts()).process("worker_4095").env
    assert (big[E.WORLD_SIZE], big[E.TOOLKIT_HEARTBEAT_INTERVAL], big[E.TORCH_NCCL_COORD_CHECK_MILSEC]) == (
        "4096", "2", "8000")
    assert E.heartbeat_interval(16384, 1.0, 6.0) == 2.0  # capped: a worker may miss two and live
    assert E.heartbeat_interval(16384, 1.0, 30.0) == 8.0 and E.nccl_coord_check_ms(1024) == 2000
    assert E.heartbeat_interval(64, 2.5, 6.0) == 2.5  # a longer interval asked for is kept


def test_logical_ranks_reach_the_scheduler_and_fewer_than_the_workers_are_refused_naming_the_flag() -> None:
    inv = parse_hosts("a:2,b:2")
    sched = next(p for p in make_plan(inv, opts(logical_ranks=6)).processes() if p.rank is None)
    assert sched.env[E.TOOLKIT_LOGICAL_RANKS] == "6"
    sched = next(p for p in make_plan(inv, opts()).processes() if p.rank is None)
    assert E.TOOLKIT_LOGICAL_RANKS not in sched.env  # the scheduler's default: the worker count
    with pytest.raises(PlanError, match=r"^--logical-ranks 3 is below the 4 workers: .* give at least 4"):
        make_plan(inv, opts(logical_ranks=3))
    for bad in (0, 70000):
        with pytest.raises(PlanError, match=f"^--logical-ranks {bad}: give 1 to 65536"):
            opts(logical_ranks=bad)


def test_how_far_a_job_may_shrink_reaches_the_scheduler_and_is_checked_against_the_plan() -> None:
    """Issue 42: --min-workers N, or --nnodes MIN:MAX as the workers of the MIN hosts with the fewest (whichever
    hosts are lost, MIN left hold at least that many), as TOOLKIT_MIN_WORKERS; none: the job never shrinks."""
    def min_workers(hosts: str, **kw: object) -> str | None:
        plan = make_plan(parse_hosts(hosts), opts(**kw))
        return plan.process("sched").env.get(E.TOOLKIT_MIN_WORKERS)

    assert min_workers("a:4,b:2,c:1", nnodes=3, min_nodes=2) == "3"  # c and b
    assert min_workers("a:2,b:2,c:2", min_workers=4) == "4"
    assert min_workers("a:2,b:2,c:2") is None
    for kw, message in (({"min_workers": 7}, "--min-workers 7 is above the job's 6 workers: give 1 to 6"),
                        ({"min_workers": 0}, "--min-workers 0: give at least 1"),
                        ({"min_workers": 2, "min_nodes": 1, "nnodes": 3}, "both say how far the job may shrink"),
                        ({"min_nodes": 4, "nnodes": 3}, "MIN is above the 3 host")):
        with pytest.raises(PlanError, match=message):
            make_plan(parse_hosts("a:2,b:2,c:2"), opts(**kw))
