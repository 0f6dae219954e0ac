"""The command line as a user runs it: `fleet` and `fab` (through fabfile.py) as real subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(tool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / tool), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    shutil.copy(REPO / "fabfile.py", tmp_path / "fabfile.py")
    return tmp_path


def test_fab_deploy_style_flags_parse_as_typed(project: Path) -> None:
    r = run("fab", "plan", "--hosts=node1:4,node2:4", "--worker-num=6", "--json", cwd=project)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert [p["node_id"] for p in plan["processes"]] == ["sched"] + [f"worker_{i}" for i in range(6)]
    assert [p["host"] for p in plan["processes"]] == ["node1"] * 5 + ["node2"] * 2
    assert plan["job"] == project.name


def test_shared_flags_given_after_a_later_task_apply_to_all(project: Path) -> None:
    (project / "hostfile").write_text("a slots=2\nb slots=1\n")
    r = run("fleet", "plan", "--json", "plan", "--hostfile", "hostfile", "--json", cwd=project)
    assert r.returncode == 0, r.stderr
    first, second = (json.loads(part) for part in r.stdout.replace("}\n{", "}\n\0{").split("\0"))
    assert first == second and first["world_size"] == 3


def test_project_config_gives_defaults_and_flags_override(project: Path) -> None:
    (project / "fabric.yaml").write_text("toolkit:\n  worker_num: 3\n  master_port: 9100\n  job: cfg-job\n")
    r = run("fleet", "plan", "--hosts=a:4", "--json", cwd=project)
    plan = json.loads(r.stdout)
    assert (plan["world_size"], plan["scheduler"]["port"], plan["job"]) == (3, 9100, "cfg-job")
    r = run("fleet", "plan", "--hosts=a:4", "--master-port=9200", "--json", cwd=project)
    assert json.loads(r.stdout)["scheduler"]["port"] == 9200


def test_plan_table_and_render(project: Path) -> None:
    r = run("fleet", "plan", "--hosts=a:2,b", "--render", "out", cwd=project)
    assert r.returncode == 0, r.stderr
    for column in ("host", "node id", "rank", "local rank", "port"):
        assert column in r.stdout
    assert (project / "out/a/launch.sh").is_file() and (project / "out/b/env/worker_2.env").is_file()
    token = (project / "out/a/token").read_text().strip()
    assert len(token) == 32 and token not in r.stdout + r.stderr


def test_local_plan_without_hosts(project: Path) -> None:
    r = run("fleet", "plan", "--worker-num", "2", "--json", cwd=project)
    plan = json.loads(r.stdout)
    assert plan["hosts"][0]["host"] == "localhost" and plan["world_size"] == 2
    assert {p["cwd"] for p in plan["processes"]} == {str(project)}


@pytest.mark.parametrize(
    "args,message",
    [
        (["--hosts=a:x"], "error: --hosts item 1 ('a:x'): slots='x': slots must be a whole number of at least 1"),
        (["--hostfile", "missing"], "missing: hostfile not found; check the path"),
        (["--hosts=a", "--hostfile", "h"], "--hosts and --hostfile both given"),
        (["--hosts=a", "--master-port=abc"], "error: --master-port='abc': expected a whole number"),
        (["--hosts=a:2", "--worker-num=3"], "--worker-num 3 is more than the 2 slots of --hosts"),
        (["--hosts=a", "--job=../x"], "--job '../x': a job name"),
        (["deploy", "--hosts=a", "--script=nope.py"], "--script nope.py: no such file in"),
        (["--hosts=a", "--project=nowhere"], "nowhere: not a directory"),
        (["--inventory", "inv.ini"], "inv.ini:2: not a valid Ansible inventory"),
    ],
)
def test_bad_input_is_one_line_without_traceback(project: Path, args: list[str], message: str) -> None:
    (project / "inv.ini").write_text("[workers]\nfoo bar\n")
    task = [] if args[0] == "deploy" else ["plan"]
    r = run("fleet", *task, *args, cwd=project)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0


def test_plan_needs_no_script_and_says_so(project: Path) -> None:
    """The README's first line, typed at the repository root: a plan is a preview, the script can come later."""
    r = run("fleet", "plan", "--hosts=node1:4,node2:4", cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "worker_7" in r.stdout
    assert f"note: train.py is not in {REPO} (yet): deploy will need it there" in r.stderr


def test_conflicting_shared_flags_between_tasks(project: Path) -> None:
    r = run("fleet", "plan", "--worker-num=1", "plan", "--worker-num=2", "--hosts=a:2", cwd=project)
    assert r.returncode == 2 and "--worker-num is '1' for plan but '2' for plan; give it once" in r.stderr


def test_unknown_config_setting(project: Path) -> None:
    (project / "fabric.yaml").write_text("toolkit:\n  wokrer_num: 3\n")
    r = run("fleet", "plan", cwd=project)
    assert r.returncode == 2 and "fabric.yaml: unknown setting toolkit.wokrer_num" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["plan", "--hosts="], "--hosts item 1: empty"),
    (["plan", "--hosts=a:1000000000"], "slots=1000000000: more than 4096 workers on one host"),
    (["plan", "--hosts=a", "--grace=nan"], "--grace='nan': expected a finite number"),
    (["plan", "--hosts=a", "--node-timeout=inf"], "--node-timeout='inf': expected a finite number"),
    (["plan", "--workdir=/tmp/" + "d" * 90], "is too deep for the agent's sockets"),
    (["logs", "-n", "abc"], "error: -n/--lines 'abc': expected a whole number"),
    (["status", "--nope"], "error: status: unknown flag --nope; 'fleet status --help' lists its flags"),
    (["deploy", "--dry"], "error: deploy: unknown flag --dry; 'fleet deploy --help' lists its flags"),
    (["train", "--prompt-for-sudo-password"], "error: train: unknown flag --prompt-for-sudo-password"),
    (["plan", "--master_addr", "h"], "error: --master-addr is torchrun's and means nothing here: toolkit runs the "
                                     "scheduler"),
    (["plan", "--hosts=a,b", "--nnodes", "3"], "error: --nnodes 3, but 2 host(s) would run workers (a, b)"),
    (["plan", "--hosts=a", "--standalone"], "error: --hosts and --standalone both given"),
    (["plan", "--nnodes=2:1"], "error: --nnodes='2:1': give 1 <= MIN <= MAX"),  # elastic (issue 42)
    (["plan", "--hosts=a,b", "--nnodes=3:4"], "error: --nnodes 4, but 2 host(s) would run workers (a, b)"),
    (["plan", "--hosts=a:2,b:2", "--nnodes=1:2", "--min-workers", "2"], "error: --min-workers 2 and --nnodes 1:2: "
                                                                       "both say how far the job may shrink"),
    (["plan", "--hosts=a:2,b:2", "--min-workers", "5"], "error: --min-workers 5 is above the job's 4 workers"),
    (["plan", "--min-workers", "0"], "error: --min-workers 0: give at least 1"),
    (["plan", "--nproc-per-node", "0"], "error: --nproc-per-node 0: give 1 to 4096 workers per host"),
    (["run", "--worker-num", "2"], "error: fleet run: name the training script after the flags"),
    (["run", "--script", "t.py", "t.py"], "error: run: unknown flag --script"),
    (["plan", "run", "train.py"], "error: 'run' deploys, trains and waits by itself: give it alone, not with plan"),
    (["plan", "--script-args", "--a", "--", "--b"], "error: the script's arguments are given twice"),
    (["--", "--lr", "0.1"], "error: script arguments without a task"),
    (["bogus"], "error: unknown task bogus; 'fleet --help' lists the tasks"),
    (["-t", "abc", "plan"], "error: -t/--connect-timeout 'abc': expected a number of seconds"),
])
def test_hostile_or_mistyped_flags_are_one_line_and_exit_2(project: Path, args: list[str], message: str) -> None:
    started = time.monotonic()
    r = run("fleet", *args, cwd=project)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert time.monotonic() - started < 30  # a billion slots used to eat memory for 30 s


@pytest.mark.parametrize("change", [{"hosts": []}, {"grace": "abc"}, {"ssh": {}}, {"hosts": [{"name": 3}]},
                                    {"processes": [7]}, {"local": "yes"}])
def test_a_damaged_job_record_is_one_line(project: Path, change: dict) -> None:
    ok = run("fleet", "plan", cwd=project)  # make a valid record by hand from a deploy-like document
    assert ok.returncode == 0
    record = {"job": "j", "local": True, "scheduler_host": "localhost", "sched_port": 9000,
              "hosts": [{"name": "localhost", "hostname": "localhost", "port": None, "user": None, "key_file": None,
                         "job_dir": "/tmp/j", "python": "python3", "node_ids": ["sched", "worker_0"]}],
              "processes": [{"host": "localhost", "role": "MS_WORKER", "node_id": "worker_0", "rank": 0,
                             "local_rank": 0, "log": "logs/worker_0.log"}],
              "ssh": {"known_hosts": "k", "accept_new_host_keys": False, "ssh_config": None, "identities": [],
                      "connect_timeout": None, "parallel": 4}, "grace": 3}
    path = project / ".toolkit" / "jobs" / "j.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**record, **change}))
    r = run("fleet", "status", cwd=project)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{path}: damaged job record:" in r.stderr and "deploy the job again" in r.stderr


# --- help: toolkit's own, complete, one screen each ------------------------------------------------------------------

SCREEN = (50, 80)  # lines, columns: one screen of a terminal


def test_fleet_help_is_toolkits_own_and_one_screen(project: Path) -> None:
    from toolkit.launcher.cli import namespace

    r = run("fleet", "--help", cwd=project)
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert len(lines) <= SCREEN[0] and max(map(len, lines)) <= SCREEN[1], r.stdout
    for fabric_only in ("--prompt-for-sudo-password", "--list-agent-keys", "--dry", "--echo", "--pty", "Core options"):
        assert fabric_only not in r.stdout
    assert r.stdout.count("--hosts") == 1 and r.stdout.count("-H,") == 1  # described once
    for task in namespace().tasks.values():  # every task, with its whole summary sentence on one line
        summary = task.doc.summary
        assert summary.endswith(".") and f"  {task.name}" in r.stdout
        assert any(line.split(None, 1) == [task.name, summary] for line in lines), (task.name, r.stdout)
    assert run("fleet", cwd=project).stdout == r.stdout  # no task: the same help


def test_every_task_help_is_complete_and_one_screen(project: Path) -> None:
    """Each task's --help lists every flag the task accepts (from the parser's own tables), and fits a screen."""
    from toolkit.launcher.cli import Fleet, namespace

    core = [f for f in Fleet(namespace=namespace()).initial_context.flags if f.startswith("--")]
    for ctx in namespace().to_contexts():
        r = run("fleet", ctx.name, "--help", cwd=project)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        lines = r.stdout.splitlines()
        assert len(lines) <= SCREEN[0] and max(map(len, lines)) <= SCREEN[1], (ctx.name, r.stdout)
        assert lines[0].startswith(f"Usage: fleet {ctx.name} ")
        flags = [f for f in ctx.flags if f.startswith("--")] + [f for f in core if f != "--version"]
        flags += [f"--[no-]{f[5:]}" for f in ctx.inverse_flags]  # --no-recovery: shown as --[no-]recovery
        missing = [f for f in flags if f not in r.stdout and f"--[no-]{f[2:]}" not in r.stdout]
        assert not missing, (ctx.name, missing)
        assert "--prompt-for-sudo-password" not in r.stdout and "Docstring:" not in r.stdout
    plan = run("fleet", "plan", "--help", cwd=project).stdout
    assert "-H, --hosts HOSTS" in plan and "--nproc-per-node N" in plan
    assert run("fleet", "--help", "plan", cwd=project).stdout == plan


def test_fab_task_help_and_list_are_toolkits_and_fabric_flags_it_ignores_are_refused(project: Path) -> None:
    r = run("fab", "train", "--help", cwd=project)
    assert r.returncode == 0 and r.stdout.startswith("Usage: fab train [FLAGS]") and "--fresh" in r.stdout
    listing = run("fab", "--list", cwd=project).stdout  # Fabric's listing shows each summary line whole
    assert "  check     Check that the job's hosts can train together; one line a problem." in listing
    for args in (["--dry", "deploy"], ["deploy", "--dry"], ["--echo", "plan"]):
        r = run("fab", *args, cwd=project)
        assert r.returncode == 2 and "is Fabric's and toolkit's tasks ignore it: leave it out" in r.stderr, r.stderr
    assert not (project / ".toolkit").exists()  # nothing was deployed


def test_an_unknown_flag_starts_nothing(project: Path) -> None:
    for tool in ("fleet", "fab"):
        r = run(tool, "deploy", "train", "--worker-num", "2", "--dry", cwd=project)
        assert r.returncode == 2 and "unknown flag --dry" in r.stderr or "--dry is Fabric's" in r.stderr, r.stderr
    assert not (project / ".toolkit").exists()


# --- the script's arguments, as torchrun takes them ------------------------------------------------------------------


def _worker_argv(plan_json: str) -> list[list[str]]:
    return [p["argv"] for p in json.loads(plan_json)["processes"] if p["node_id"] != "sched"]


def test_script_arguments_after_double_dash_reach_the_script_word_for_word(project: Path) -> None:
    args = ["--lr", "0.1", "--name", "a b", "--", "--x=1", "'q'"]
    for tool in ("fleet", "fab"):
        r = run(tool, "plan", "--hosts=a:2", "--json", "--", *args, cwd=project)
        assert r.returncode == 0, r.stderr
        assert _worker_argv(r.stdout) == [["python3", "-m", "toolkit.train", "train.py", *args]] * 2


def test_torchrun_spellings(project: Path) -> None:
    """--nproc-per-node (and --nproc_per_node) sets every host's workers, --nnodes checks the hosts, --standalone is
    this machine; msrun's underscores work too."""
    r = run("fleet", "plan", "--hosts=a:4,b", "--nproc_per_node", "2", "--nnodes=2", "--master_port", "9100", "--json",
            cwd=project)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert [(p["host"], p["node_id"]) for p in plan["processes"]] == [
        ("a", "sched"), ("a", "worker_0"), ("a", "worker_1"), ("b", "worker_2"), ("b", "worker_3")]
    assert plan["scheduler"]["port"] == 9100
    r = run("fleet", "plan", "--standalone", "--nproc-per-node", "3", "--json", cwd=project)
    assert r.returncode == 0 and json.loads(r.stdout)["world_size"] == 3, r.stderr


def test_torchrun_remaining_spellings(project: Path) -> None:
    """--nproc-per-node auto|cpu counts this machine's CPUs (no GPU here: gpu is refused with why, and on hosts any
    of them), --run-path and --start-method spawn are what toolkit does anyway, another start method is refused
    with why, and a flag given twice is one line naming it (it was "unknown task 2")."""
    cpus = os.cpu_count()
    for word in ("auto", "cpu"):
        r = run("fleet", "plan", "--nproc-per-node", word, "--run-path", "--start-method", "spawn", "--json",
                cwd=project)
        assert r.returncode == 0 and json.loads(r.stdout)["world_size"] == cpus, r.stderr
    refusals = {
        ("plan", "--nproc-per-node", "gpu"): "error: --nproc-per-node gpu: this machine has no GPU",
        ("plan", "--hosts=a,b", "--nproc_per_node=auto"): "error: --nproc-per-node auto: counted on this machine only",
        ("plan", "--start_method", "fork"): "error: --start-method fork: each host's agent starts every worker as a "
                                            "fresh interpreter",
        ("run", "--nproc-per-node", "2", "--nproc_per_node", "2", "train.py"): "error: --nproc-per-node given twice",
        ("run", "-m", "--no-python", "x"): "error: -m and --no-python: SCRIPT is a module or a program",
    }
    for args, said in refusals.items():
        r = run("fleet", *args, cwd=project)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(said), (args, r.stderr)


def test_train_with_other_script_arguments_says_what_to_type(project: Path) -> None:
    r = run("fleet", "record", "--worker-num", "1", "--job", "j", "--workdir", str(project / "w"), "--", "--epochs",
            "3", cwd=project)
    assert r.returncode == 0, r.stderr
    r = run("fleet", "train", "--", "--lr", "0.1", cwd=project)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert ("error: the script's arguments '--lr 0.1' are not the ones job " in r.stderr
            and "('--epochs 3'): 'fleet deploy train -- --lr 0.1' deploys and starts them" in r.stderr)


def test_output_cut_short_by_head_is_no_traceback(project: Path) -> None:
    """`fleet plan --json | head`: the reader leaves early; fleet ends quietly, as a Unix tool killed by SIGPIPE."""
    proc = subprocess.Popen([str(BIN / "fleet"), "plan", "--hosts=a:2000", "--json"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "{\n"
    proc.stdout.close()  # more than a pipe's buffer is still to come: the next write fails with EPIPE
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and err == "", err
