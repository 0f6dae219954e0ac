from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.launcher.inventory import parse_hosts
from toolkit.launcher.plan import JobOptions, Process, make_plan
from toolkit.launcher.render import TEMPLATES, RenderError, render_env, render_host, write_files

HOSTILE = [
    "plain",
    "with spaces  and\ttabs",
    "single ' quote",
    'double " quote',
    "$(touch /tmp/pwned-by-toolkit)",
    "`touch /tmp/pwned-by-toolkit`",
    "a; rm -rf / ;",
    "line one\nline two\n",
    "${HOME} $HOME \\ backslash",
    "ünïcødé ✓ 日本",
    "",
    "-n",
    "*",
    "'\"'\"'",
]


def read_env_file(path: Path) -> dict[str, str]:
    """What a process sees: the env file applied by bash exactly as the agent applies it."""
    out = subprocess.run(
        ["env", "-i", "bash", "-c", 'set -a; . "$1"; env -0', "_", str(path)],
        capture_output=True, check=True,
    ).stdout
    env = dict(item.split(b"=", 1) for item in out.split(b"\0") if item)
    return {k.decode(): v.decode() for k, v in env.items() if k not in (b"PWD", b"SHLVL", b"_")}


def hostile_process(values: list[str]) -> Process:
    env = {f"V{i}": v for i, v in enumerate(values)}
    return Process("h", "MS_WORKER", "worker_0", 0, 0, ("python3",), "/tmp", MappingProxyType(env))


def test_env_file_yields_exactly_the_hostile_values(tmp_path: Path) -> None:
    path = tmp_path / "w.env"
    path.write_text(render_env(hostile_process(HOSTILE)))
    assert read_env_file(path) == {f"V{i}": v for i, v in enumerate(HOSTILE)}
    assert not Path("/tmp/pwned-by-toolkit").exists()


def test_an_environment_variable_name_with_a_trailing_newline_is_refused() -> None:
    process = Process("h", "MS_WORKER", "worker_0", 0, 0, ("python3",), "/tmp", MappingProxyType({"EVIL\n": "x"}))
    with pytest.raises(RenderError, match="'EVIL\\\\n' is not an environment variable name"):
        render_env(process)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40),
                min_size=1, max_size=5))
def test_env_file_round_trips_any_text(tmp_path_factory: pytest.TempPathFactory, values: list[str]) -> None:
    path = tmp_path_factory.mktemp("env") / "w.env"
    path.write_text(render_env(hostile_process(values)), encoding="utf-8")
    assert read_env_file(path) == {f"V{i}": v for i, v in enumerate(values)}


def hostile_plan(tmp_path: Path):
    python_dir = tmp_path / "my python $(touch pwned) `x` 'q'"
    python_dir.mkdir()
    fake_python = python_dir / "python"
    # Stands in for the host's python: records the arguments launch.sh passes to it.
    fake_python.write_text('#!/bin/bash\nprintf "%s\\n" "$PWD" "$@" > "$(dirname "$0")/argv"\n')
    fake_python.chmod(0o755)
    options = JobOptions(job="j-1", python=str(fake_python), data_path="/data/$(id)/a b", script_args="--x 'a b'")
    return make_plan(parse_hosts("node1:2,node2"), options), python_dir


def test_rendered_scripts_are_valid_bash_and_quote_every_value(tmp_path: Path) -> None:
    plan, python_dir = hostile_plan(tmp_path)
    job_dir = tmp_path / "job"
    write_files(render_host(plan, plan.hosts[0], "s3cret"), job_dir)
    for script in ("launch.sh", "recover.sh", "stop.sh"):
        subprocess.run(["bash", "-n", str(job_dir / script)], check=True)
        assert os.access(job_dir / script, os.X_OK)
    subprocess.run([str(job_dir / "launch.sh")], check=True, cwd="/")
    assert (python_dir / "argv").read_text().splitlines() == [
        str(job_dir), "-m", "toolkit.agent", "start", "--job-dir", str(job_dir),
    ]
    subprocess.run([str(job_dir / "recover.sh"), "worker_1"], check=True)
    assert (python_dir / "argv").read_text().splitlines()[1:] == [
        "-m", "toolkit.agent", "restart", "--job-dir", str(job_dir), "worker_1",
    ]
    usage = subprocess.run([str(job_dir / "recover.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "one of: sched worker_0 worker_1" in usage.stderr
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    env = read_env_file(job_dir / "env" / "worker_1.env")
    assert env["DATA_PATH"] == "/data/$(id)/a b" and env["RANK"] == "1"


def test_files_modes_and_the_token_stays_secret(tmp_path: Path) -> None:
    plan, _ = hostile_plan(tmp_path)
    files = render_host(plan, plan.hosts[0], "s3cret-token")
    write_files(files, tmp_path / "job")
    modes = {f.path: stat.S_IMODE((tmp_path / "job" / f.path).stat().st_mode) for f in files}
    assert modes["token"] == 0o600 and modes["env/worker_0.env"] == 0o600 and modes["launch.sh"] == 0o755
    assert [f.path for f in files if "s3cret-token" in f.content] == ["token"]
    assert json.loads((tmp_path / "job" / "expected.json").read_text()) == {
        "worker_0": "node1", "worker_1": "node1", "worker_2": "node2"}
    assert "expected.json" not in [f.path for f in render_host(plan, plan.hosts[1], "t")]
    spec = json.loads((tmp_path / "job" / "host.json").read_text())
    assert [p["node_id"] for p in spec["processes"]] == ["sched", "worker_0", "worker_1"]
    assert spec["processes"][1]["argv"][-2:] == ["--x", "a b"]


def test_templates_pass_every_value_through_quote() -> None:
    """The templates are shared with Ansible, so no Python-side guard can catch a raw value: check the source."""
    raw = []
    for template in TEMPLATES.glob("*.j2"):
        for expr in re.findall(r"{{(.*?)}}", template.read_text()):
            expr = expr.strip()
            if not expr.endswith("| quote") and expr != "name":  # env names are checked by render_env
                raw.append(f"{template.name}: {{{{ {expr} }}}}")
    assert raw == []


def test_a_spare_host_gets_every_workers_env_file_and_a_standby_host_json(tmp_path: Path) -> None:
    from toolkit.contracts import hostspec
    from toolkit.launcher.inventory import load_ansible_inventory

    inv = tmp_path / "inventory.ini"
    inv.write_text("[workers]\na slots=1\nb slots=1\n[spares]\ns\n")
    plan = make_plan(load_ansible_inventory(str(inv)), JobOptions(job="demo", workdir=str(tmp_path / "w")))
    files = render_host(plan, plan.host_plan("s"), "t" * 64)
    assert {f.path for f in files} >= {"host.json", "env/worker_0.env", "env/worker_1.env", "token", "launch.sh"}
    write_files(files, tmp_path / "s")
    spec = hostspec.load(tmp_path / "s")
    assert spec.spare and spec.processes == ()
    assert [p.node_id for p in spec.standby] == ["worker_0", "worker_1"]
    assert read_env_file(tmp_path / "s" / "env" / "worker_1.env")["RANK"] == "1"
