"""A Slurm allocation as the host source: SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE parsed into the plan (pure,
through make_plan), `fleet plan` run as a user would with the SLURM_* variables in its environment (the automatic
pick-up, --slurm, precedence and conflicts, one-line errors), and one job deployed and trained from an
"allocation" naming the namespace cluster's hosts, then watched and stopped from outside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from toolkit.contracts import envvars as E
from toolkit.errors import UserError
from toolkit.launcher.inventory import InventoryError, parse_hosts
from toolkit.launcher.plan import JobOptions, make_plan
from toolkit.launcher.render import plan_json
from toolkit.launcher.slurm import slurm_inventory
from toolkit.testing import waits
from toolkit.testing.cluster import Cluster, format_workload

BIN = Path(sys.executable).parent
WORKER = Path(__file__).resolve().parent / "scripts" / "tasks_worker.py"
WAIT = 60.0  # s: bound of every wait on the job to reach a state, on a busy machine
LEFTOVER_WAIT = 90.0  # s for every process of a stopped job to be gone
COMMAND_TIMEOUT = 120.0  # s for one fleet command
OUTSIDE = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # no allocation


def slurm_env(nodelist: str, tasks: str | None = None, job_id: str = "4242", **more: str) -> dict[str, str]:
    env = {E.SLURM_JOB_ID: job_id, E.SLURM_JOB_NODELIST: nodelist, **more}
    return env | ({E.SLURM_TASKS_PER_NODE: tasks} if tasks is not None else {})


def fleet(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`fleet ARGS` in `cwd`, with this environment less any SLURM_* variable, plus `env`."""
    return subprocess.run([str(BIN / "fleet"), *args], cwd=cwd, capture_output=True, text=True,
                          env=OUTSIDE | (env or {}), timeout=COMMAND_TIMEOUT)


def ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0 and "Traceback" not in r.stderr, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def hosts_of(plan: dict[str, Any]) -> list[str]:
    """`host:workers` of each host in plan order, as --hosts would say it."""
    counts: dict[str, int] = {}
    for p in plan["processes"]:
        if p["rank"] is not None:
            counts[p["host"]] = counts.get(p["host"], 0) + 1
    return [f"{h}:{n}" for h, n in counts.items()]


# --- parsing: the forms of Slurm's documentation give the plan the same hosts typed out would ---------------------


@pytest.mark.parametrize("nodelist,tasks,more,hosts", [
    # SLURM_TASKS_PER_NODE as sbatch(1) explains it: "2(x3),1" = two tasks on each of the first three nodes, one on
    # the fourth
    ("lx[10-13]", "2(x3),1", {}, "lx10:2,lx11:2,lx12:2,lx13:1"),
    ("gpu[01-04,07]", "4(x3),2(x2)", {}, "gpu01:4,gpu02:4,gpu03:4,gpu04:2,gpu07:2"),
    ("a[1-2],b3", "1(x2),3", {}, "a1,a2,b3:3"),
    ("n[001-003]-ib", "2(x3)", {}, "n001-ib:2,n002-ib:2,n003-ib:2"),
    ("r[1-2]n[1-2]", "1(x4)", {}, "r1n1,r1n2,r2n1,r2n2"),  # several brackets: every combination, in order
    ("tux5", "2", {}, "tux5:2"),
    # as a real allocation sets them: SLURM_TASKS_PER_NODE is what was placed, SLURM_NTASKS_PER_NODE only asked
    ("gnode[10,20,25,37]", "1(x4)", {E.SLURM_NTASKS_PER_NODE: "4"}, "gnode10,gnode20,gnode25,gnode37"),
    # without SLURM_TASKS_PER_NODE: SLURM_NTASKS_PER_NODE for every host, else 1 each
    ("c[1-3]", None, {E.SLURM_NTASKS_PER_NODE: "3"}, "c1:3,c2:3,c3:3"),
    ("c[1-3]", None, {}, "c1,c2,c3"),
])
def test_documented_forms_plan_like_the_hosts_typed_out(nodelist: str, tasks: str | None, more: dict[str, str],
                                                      hosts: str) -> None:
    options = JobOptions(job="demo")
    inventory = slurm_inventory(slurm_env(nodelist, tasks, **more))
    plan = plan_json(make_plan(inventory, options))
    assert ",".join(hosts_of(plan)) == ",".join(h if ":" in h else h + ":1" for h in hosts.split(","))
    assert plan == plan_json(make_plan(parse_hosts(hosts), options))  # ranks, env, scheduler: all the same
    assert plan["scheduler"]["host"] == hosts.split(",")[0].split(":")[0]  # the first host of the allocation
    assert inventory.source == "Slurm job 4242"
    assert inventory.note.startswith(f"hosts from the allocation of Slurm job 4242: SLURM_JOB_NODELIST='{nodelist}'")
    assert inventory.note.endswith("processes are started over SSH, not srun")


@pytest.mark.parametrize("env,message", [
    ({}, "--slurm: SLURM_JOB_NODELIST is not set, so this is not a Slurm allocation; run fleet inside one"),
    (slurm_env("gpu[01-04"), "SLURM_JOB_NODELIST='gpu[01-04': not a Slurm hostlist (unbalanced brackets)"),
    (slurm_env("gpu[04-01]"), "SLURM_JOB_NODELIST='gpu[04-01]': not a Slurm hostlist (start > stop)"),
    (slurm_env("a[1-2], b3"), "SLURM_JOB_NODELIST='a[1-2], b3': ' b3' is not a host name"),
    (slurm_env(","), "SLURM_JOB_NODELIST=',': names no host"),
    (slurm_env("a[1-2]", "2(x3"), "SLURM_TASKS_PER_NODE='2(x3': not a Slurm tasks-per-node list (counts like 4(x3),2)"),
    (slurm_env("gpu[01-04,07]", "4(x3),2"),
     "SLURM_TASKS_PER_NODE='4(x3),2' gives tasks for 4 host(s), but SLURM_JOB_NODELIST names 5: both must come "
     "from the same allocation"),
    (slurm_env("a[1-2]", "0(x2)"), "SLURM_TASKS_PER_NODE='0(x2)': every host of the allocation needs 1 to 4096 tasks"),
    (slurm_env("a[1-2]", "9999(x2)"), "SLURM_TASKS_PER_NODE='9999(x2)': every host of the allocation needs 1 to "),
    (slurm_env("a[1-2]", None, SLURM_NTASKS_PER_NODE="two"), "SLURM_NTASKS_PER_NODE='two': expected a whole number"),
    (slurm_env("a[1-2]", None, SLURM_NTASKS_PER_NODE="0"), "SLURM_NTASKS_PER_NODE='0': expected a whole number"),
])
def test_bad_allocation_variables_are_one_clear_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(InventoryError) as e:  # SlurmError, or the inventory's own for a host name
        slurm_inventory(env)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert str(e.value).startswith(message), str(e.value)


def test_no_job_id_still_says_where_the_hosts_came_from() -> None:
    inventory = slurm_inventory({E.SLURM_JOB_NODELIST: "a[1-2]"})
    assert inventory.source == "the Slurm allocation"
    assert inventory.note == ("hosts from the Slurm allocation (no SLURM_JOB_ID): SLURM_JOB_NODELIST='a[1-2]', slots "
                              "from neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE: 1 per host; processes "
                              "are started over SSH, not srun")


# --- fleet plan inside an "allocation": pick-up, precedence, conflicts ------------------------------------------


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hostfile").write_text("h1 slots=2\n")
    return tmp_path


ALLOCATION = slurm_env("gpu[01-02]", "4,2", job_id="777")


def test_inside_an_allocation_fleet_plan_takes_its_hosts(project: Path) -> None:
    r = ok(fleet("plan", "--json", cwd=project, env=ALLOCATION))  # nothing else given: picked up by itself
    assert hosts_of(json.loads(r.stdout)) == ["gpu01:4", "gpu02:2"]
    assert ("note: hosts from the allocation of Slurm job 777: SLURM_JOB_NODELIST='gpu[01-02]', slots from "
            "SLURM_TASKS_PER_NODE='4,2'; processes are started over SSH, not srun") in r.stderr
    assert ok(fleet("plan", "--json", "--slurm", cwd=project, env=ALLOCATION)).stdout == r.stdout
    table = ok(fleet("plan", cwd=project, env=ALLOCATION))
    assert "gpu02" in table.stdout and "Slurm job 777" in table.stderr
    r = fleet("plan", "--worker-num", "7", cwd=project, env=ALLOCATION)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --worker-num 7 is more than the 6 slots of Slurm job 777; add hosts or slots, or lower --worker-num")

    outside = json.loads(ok(fleet("plan", "--json", cwd=project)).stdout)  # no allocation: this machine
    assert hosts_of(outside) == ["localhost:1"]


def test_help_names_the_flag(project: Path) -> None:
    for args in (["--help"], ["plan", "--help"]):
        r = ok(fleet(*args, cwd=project))
        line = next((x for x in r.stdout.splitlines() if x.strip().startswith("--slurm")), "")
        assert "the Slurm allocation's hosts (default inside one)" in line, r.stdout


@pytest.mark.parametrize("args,config,hosts", [
    (["--hosts", "x:3"], "", ["x:3"]),  # another source given: the allocation is not picked up
    ([], "  hostfile: hostfile\n", ["h1:2"]),
    ([], "  slurm: false\n", ["localhost:1"]),  # turned off in fabric.yaml: a local job, even inside
    (["--slurm"], "  hostfile: hostfile\n", ["gpu01:4", "gpu02:2"]),  # typed beats the config
    ([], "  slurm: true\n", ["gpu01:4", "gpu02:2"]),
])
def test_other_sources_take_precedence_over_the_pick_up(project: Path, args: list[str], config: str,
                                                        hosts: list[str]) -> None:
    (project / "fabric.yaml").write_text("toolkit:\n" + config)
    r = ok(fleet("plan", "--json", *args, cwd=project, env=ALLOCATION))
    assert hosts_of(json.loads(r.stdout)) == hosts
    assert ("Slurm job 777" in r.stderr) == hosts[0].startswith("gpu")


@pytest.mark.parametrize("args,config,env,message", [
    (["--slurm", "--hosts", "x"], "", ALLOCATION,
     "error: --hosts and --slurm both given: describe the hosts one way (--hosts, --hostfile, --inventory or --slurm)"),
    (["--slurm", "--hostfile", "hostfile"], "", ALLOCATION, "error: --hostfile and --slurm both given"),
    (["--slurm", "--inventory", "inv.ini"], "", ALLOCATION, "error: --inventory and --slurm both given"),
    ([], "  slurm: true\n  hostfile: hostfile\n", ALLOCATION, "error: --hostfile and --slurm both given"),
    (["--slurm"], "", {}, "error: --slurm: SLURM_JOB_NODELIST is not set, so this is not a Slurm allocation; run "
                          "fleet inside one (salloc, sbatch) or give the hosts with --hosts, --hostfile or --inventory "
                          "instead"),
    ([], "", slurm_env("gpu[01-02", "4,2"),
     "error: SLURM_JOB_NODELIST='gpu[01-02': not a Slurm hostlist (unbalanced brackets)"),
    ([], "", slurm_env("gpu[01-03]", "4,2"), "error: SLURM_TASKS_PER_NODE='4,2' gives tasks for 2 host(s), but "
                                             "SLURM_JOB_NODELIST names 3"),
])
def test_conflicts_and_bad_variables_are_one_line_exit_2(project: Path, args: list[str], config: str,
                                                         env: dict[str, str], message: str) -> None:
    (project / "fabric.yaml").write_text("toolkit:\n" + config if config else "")
    r = fleet("plan", *args, cwd=project, env=env)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(message), r.stderr


# --- end to end on the namespace cluster -------------------------------------------------------------------------


def test_a_job_deployed_from_an_allocation_is_watched_and_stopped_outside_it(cluster: Cluster, tmp_path: Path) -> None:
    """Deploy and train in an "allocation" of two cluster hosts, 2 tasks and 1; then status and stop without any
    SLURM_* variable: they reach the hosts the job record names. The allocation names the hosts by address (a
    hostlist of addresses, as Slurm accepts): the cluster's host names resolve only through its ssh_config, and the
    workers must reach the scheduler's host by the same name."""
    first, second = cluster.hosts[:2]
    prefix, low = first.address.rsplit(".", 1)
    assert second.address == f"{prefix}.{int(low) + 1}"
    allocation = slurm_env(f"{prefix}.[{low}-{int(low) + 1}]", "2,1", job_id="31337")
    job = f"s{uuid.uuid4().hex[:8]}"
    d = tmp_path / "proj"
    d.mkdir()
    shutil.copy(WORKER, d / "train.py")
    (d / "fabric.yaml").write_text(f"toolkit:\n  known_hosts: {cluster.known_hosts}\n  python: {cluster.python}\n"
                                   "  warm_spare: false\n  grace: 3\n")
    stopped = False
    try:
        r = ok(fleet("deploy", "train", "--ssh-config", str(cluster.ssh_config), "--job", job, "--master-port", "9950",
                     "--script-args", "--steps 100000 --delay 0.2", cwd=d, env=allocation))
        assert "note: hosts from the allocation of Slurm job 31337" in r.stderr
        assert f"job {job} started on 2 host(s)" in r.stderr

        def running() -> dict[str, Any] | None:
            doc = json.loads(ok(fleet("status", "--job", job, "--json", cwd=d)).stdout)  # outside the allocation
            stepping = all(p["state"] == "running" and (p["rank"] is None or (p["step"] or 0) >= 1)
                           for p in doc["processes"])
            return doc if stepping else None

        doc = waits.wait_for("every process running and stepping", running, WAIT, poll=0.3)
        placed = [(p["host"], p["node_id"]) for p in doc["processes"]]
        assert placed == [(first.address, "sched"), (first.address, "worker_0"), (first.address, "worker_1"),
                          (second.address, "worker_2")]
        for p in doc["processes"]:  # each really runs on the host the allocation named
            name = first.name if p["host"] == first.address else second.name
            assert p["pid"] in cluster.workload_pids(name)

        r = fleet("status", "--job", job, "--slurm", cwd=d, env=slurm_env("elsewhere[1-2]"))
        assert r.returncode == 2 and r.stderr == (  # --slurm typed in another allocation: refused, not followed
            f"error: the hosts typed would run it on elsewhere1, elsewhere2, but job {job} was deployed to "
            f"{first.address}, {second.address}: run 'fleet deploy' with the new values to change job {job} (or "
            "leave the flags out: every task reads them from the job record)\n"), r.stderr

        r = ok(fleet("stop", "--job", job, cwd=d))  # outside the allocation, too
        stopped = "no process of the job is left" in r.stderr
        assert stopped
        waits.wait_for("no process of the job left on any host", lambda: not cluster.workload(), LEFTOVER_WAIT,
                       poll=0.3, evidence=lambda: "still running:\n" + format_workload(cluster.workload()))
    finally:  # the homes are shared by the whole session: leave them as they were
        if not stopped:
            fleet("stop", "--job", job, cwd=d)
        for h in (first, second):
            shutil.rmtree(h.home / "toolkit-jobs", ignore_errors=True)
