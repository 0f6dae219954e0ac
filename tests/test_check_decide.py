"""The check's decisions (toolkit.launcher.check.decide) and its probe's manifest, without hosts: facts in, problems
out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from toolkit.launcher.check import decide, probe
from toolkit.launcher.check.decide import Problem
from toolkit.launcher.jobhosts.preflight import failure_text


def test_the_majority_wins_and_a_tie_goes_to_the_scheduler() -> None:
    assert decide.odd_ones({"a": 1, "b": 2, "c": 2}, prefer="a") == (2, {"a": 1})
    assert decide.odd_ones({"a": 1, "b": 2}, prefer="a") == (1, {"b": 2})
    assert decide.odd_ones({"a": 1, "b": 2}, prefer="b") == (2, {"a": 1})
    assert decide.odd_ones({"a": 1, "b": 1}, prefer="a") == (1, {})
    assert decide.odd_ones({}, prefer="a") == (None, {})


def test_a_host_with_another_torch_is_named_with_both_versions() -> None:
    facts = {h: {"python": "3.11.7", "torch": "2.13.0", "toolkit": "0.1.0"} for h in ("n1", "n2", "n3")}
    facts["n3"] = {**facts["n3"], "torch": "2.0.0"}
    (p,) = decide.version_problems(facts, "n1")
    assert (p.host, p.check) == ("n3", "torch")
    assert "torch 2.0.0, but 2.13.0 on n1, n2" in p.text
    assert p.line().startswith("n3: torch: torch 2.0.0, but 2.13.0 on n1, n2; install the same torch")
    facts["n1"] = {**facts["n1"], "python": "3.10.1"}  # the scheduler host is the odd one: it is named
    assert [(p.host, p.check) for p in decide.version_problems(facts, "n1")] == [("n1", "python"), ("n3", "torch")]


def test_project_copies_against_the_project_here() -> None:
    local = {"digest": "aa", "files": 2, "bytes": 10}
    same = dict(local)
    assert decide.project_problems({"n1": same, "n2": same}, local) == []
    (p,) = decide.project_problems({"n1": same, "n2": {"digest": "bb", "files": 2, "bytes": 11}}, local)
    assert (p.host, p.check) == ("n2", "project") and "fleet deploy" in p.fix
    (p,) = decide.project_problems({"n1": {"digest": "bb"}, "n2": {"digest": "bb"}}, local)
    assert p.host == "all hosts" and "changed since it was deployed" in p.text
    (p,) = decide.project_problems({"n1": same, "n2": {"error": "missing"}}, local)
    assert p.text == "its copy is missing"


def test_data_that_differs_or_is_missing_names_the_host() -> None:
    m = {"digest": "aa", "files": 3, "bytes": 30}
    data = {"/data": {"n1": m, "n2": m, "n3": {"digest": "bb", "files": 3, "bytes": 31}, "n4": {"error": "missing"}}}
    problems = decide.data_problems(data, "n1")
    assert [(p.host, p.check) for p in problems] == [("n3", "data"), ("n4", "data")]
    assert "/data differs from n1, n2's (3 file(s), 31 bytes there, 3 file(s), 30 bytes on those)" in problems[0].text
    assert problems[1].text == "/data is missing there"


def test_environment_differences_are_one_line_per_host() -> None:
    base = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    envs = {"n1": base, "n2": base, "n3": {**base, "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}}
    (p,) = decide.env_problems(envs, "n1")
    assert p.host == "n3"
    assert p.text == "NCCL_DEBUG='INFO' (others: unset), OMP_NUM_THREADS='4' (others: '1')"


def test_ports_taken_by_this_jobs_scheduler_are_fine() -> None:
    ports = {"8118": {"free": False, "pid": 10, "command": "python -m toolkit.scheduler", "ours": True},
             "8119": {"free": False, "pid": 11, "command": "nc -l 8119", "ours": False},
             "8120": {"free": True}}
    (p,) = decide.port_problems("n1", ports)
    assert p.line() == ("n1: port: port 8119 is taken by pid 11 (nc -l 8119); stop what listens there, or deploy "
                        "with another --master-port")


def test_disk_and_clock_thresholds() -> None:
    problems = decide.disk_problems({"n1": {"path": "/c", "free": 5 * 10**9}, "n2": {"path": "/c", "free": 10**8},
                                     "n3": {"path": "/c", "free": None}}, min_bytes=10**9)
    assert [p.host for p in problems] == ["n2", "n3"] and "0.10 GB free at /c, below 1.00 GB" in problems[0].text
    # read on the host some time between sending and receiving: only what lies outside that window is sure
    assert decide.clock_skew(remote=100.5, sent=100.0, received=101.0) == 0.0
    assert decide.clock_skew(remote=104.0, sent=100.0, received=101.0) == 3.0
    assert decide.clock_skew(remote=90.0, sent=100.0, received=101.0) == 10.0
    assert [p.host for p in decide.clock_problems({"n1": 0.0, "n2": 3.0}, max_skew=2.0)] == ["n2"]


def test_pair_rounds_cover_the_ring_with_no_host_twice_in_a_round() -> None:
    for n in range(1, 9):
        hosts = [f"n{i}" for i in range(n)]
        rounds = decide.pair_rounds(hosts)
        pairs = [p for r in rounds for p in r]
        for r in rounds:
            members = [h for p in r for h in p]
            assert len(members) == len(set(members))
        if n == 1:
            assert rounds == []
        elif n == 2:
            assert pairs == [("n0", "n1")]
        else:
            assert sorted(pairs) == sorted((hosts[i], hosts[(i + 1) % n]) for i in range(n))
            assert len(rounds) == (2 if n % 2 == 0 else 3)
            assert all(sum(h in p for p in pairs) == 2 for h in hosts)


def _ring(times: dict[tuple[str, str], float]) -> dict[tuple[str, str], dict[str, float]]:
    return {k: {"seconds": v} for k, v in times.items()}


def test_the_reference_is_the_median_or_of_two_the_faster() -> None:
    assert decide.reference([0.1, 0.9]) == 0.1
    assert decide.reference([0.1, 0.2, 0.9]) == 0.2
    assert decide.reference([0.1, 0.1, 0.2, 0.9]) == pytest.approx(0.15)


def test_two_hosts_name_the_slow_one_by_matmul_and_a_broken_pair_as_the_link() -> None:
    (p,) = decide.health_problems({"n1": 0.1, "n2": 0.9}, {("n1", "n2"): {"seconds": 0.02}}, factor=3.0)
    assert p.host == "n2" and "9.0x" in p.text
    (p,) = decide.health_problems({"n1": 0.1, "n2": 0.1}, {("n1", "n2"): {"error": "E"}}, factor=3.0)
    assert (p.host, p.check) == ("n1-n2", "link")


def test_a_slow_host_is_named_once_with_how_much_slower() -> None:
    matmul = {"n1": 0.10, "n2": 0.10, "n3": 0.52, "n4": 0.10}
    pairs = _ring({("n1", "n2"): 0.02, ("n2", "n3"): 0.40, ("n3", "n4"): 0.41, ("n4", "n1"): 0.02})
    (p,) = decide.health_problems(matmul, pairs, factor=3.0)
    assert p.host == "n3" and p.slow
    assert "matmul 0.52 s, 5.2x the median 0.10 s" in p.text
    assert "all-reduce with n2 and n4 20.0x the median (0.40 s vs 0.02 s)" in p.text


def test_a_slow_host_among_three_is_named_despite_being_in_most_pairs() -> None:
    pairs = _ring({("n1", "n2"): 0.02, ("n2", "n3"): 0.5, ("n3", "n1"): 0.5})
    (p,) = decide.health_problems({}, pairs, factor=3.0)
    assert p.host == "n3" and "25.0x the median" in p.text


def test_a_slow_or_broken_link_between_fine_hosts_is_named_as_the_link() -> None:
    pairs = _ring({("n1", "n2"): 0.02, ("n2", "n3"): 0.5, ("n3", "n4"): 0.02, ("n4", "n1"): 0.02})
    (p,) = decide.health_problems({}, pairs, factor=3.0)
    assert (p.host, p.check, p.slow) == ("n2-n3", "link", True)
    pairs[("n2", "n3")] = {"error": "TimeoutError: no peer"}
    (p,) = decide.health_problems({}, pairs, factor=3.0)
    assert (p.host, p.slow) == ("n2-n3", False) and "failed (TimeoutError: no peer)" in p.text


def test_a_host_whose_every_pair_failed_is_broken_not_slow() -> None:
    pairs = {("n1", "n2"): {"seconds": 0.02}, ("n2", "n3"): {"error": "E"}, ("n3", "n1"): {"error": "E"}}
    (p,) = decide.health_problems({"n1": 0.1, "n2": 0.1, "n3": 0.1}, pairs, factor=3.0)
    assert (p.host, p.slow) == ("n3", False) and "all-reduce with n2 and n1 failed (E)" in p.text


def test_a_uniform_cluster_and_tiny_differences_are_fine() -> None:
    matmul = {"n1": 0.010, "n2": 0.011, "n3": 0.150}  # 15x, but only 0.14 s: a busy machine's noise
    pairs = _ring({("n1", "n2"): 0.02, ("n2", "n3"): 0.03, ("n3", "n1"): 0.025})
    assert decide.health_problems(matmul, pairs, factor=3.0) == []
    assert decide.health_problems({"n1": 0.1}, {}, factor=3.0) == []


def test_manifest_digest_ignores_mtimes_and_uses_its_cache(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    (data / "sub").mkdir(parents=True)
    (data / "a.bin").write_bytes(b"a" * 100)
    (data / "sub" / "b.bin").write_bytes(b"b" * 50)
    (data / "__pycache__").mkdir()
    (data / "__pycache__" / "x.pyc").write_bytes(b"x")
    first = probe.manifest(str(data), exclude=("__pycache__",), cache_dir=str(cache))
    assert (first["files"], first["bytes"], first["hashed"]) == (2, 150, 2)
    second = probe.manifest(str(data), exclude=("__pycache__",), cache_dir=str(cache))
    assert second == {**first, "hashed": 0}  # nothing read again
    (cached,) = cache.iterdir()
    assert set(json.loads(cached.read_text())) == {"a.bin", "sub/b.bin"}
    os.utime(data / "a.bin", (1, 1))  # same content, new mtime: read again, same digest
    assert probe.manifest(str(data), ("__pycache__",), str(cache)) == {**first, "hashed": 1}
    (data / "a.bin").write_bytes(b"A" * 100)
    changed = probe.manifest(str(data), ("__pycache__",), str(cache))
    assert changed["digest"] != first["digest"] and changed["hashed"] == 1
    assert probe.manifest(str(tmp_path / "nothing"), (), str(cache)) == {"error": "missing"}
    uncached = probe.manifest(str(data), ("__pycache__",), cache_dir=None)
    assert uncached == {**changed, "hashed": 2} and len(list(cache.iterdir())) == 1


def test_problem_line_is_one_line() -> None:
    p = Problem("n2", "disk", "0.10 GB free", "free space")
    assert p.line() == "n2: disk: 0.10 GB free; free space" and "\n" not in p.line()


def test_each_host_is_probed_under_a_workers_env_file_a_spare_under_its_standby_one(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """What `fleet check` and playbooks/check.yml ask each host, on an inventory with a scheduler-only host and a
    spare (issue 26: a spare was probed under env/sched.env, which it does not have, and the playbook's controller
    side crashed on it)."""
    import io

    from toolkit.launcher.inventory import load_ansible_inventory
    from toolkit.launcher.plan import JobOptions, make_plan
    from toolkit.launcher.render import plan_json
    from toolkit.launcher.tasks.check import Limits, facts_problems, main, probe_env_file

    assert probe_env_file(["sched", "worker_0", "worker_1"], []) == ("env/worker_0.env", True)
    assert probe_env_file([], ["worker_3", "worker_4"]) == ("env/worker_3.env", True)  # a spare
    assert probe_env_file(["sched"], []) == ("env/sched.env", False)  # no worker there: not compared
    path = tmp_path / "inv.ini"
    path.write_text("[scheduler]\nhead\n[workers]\nw1 slots=2\nw2 slots=2\n[spares]\nspare1 slots=2\n"
                    "[all:vars]\nworkdir=/jobs\n")
    plan = plan_json(make_plan(load_ansible_inventory(path), JobOptions(job="demo", data_path="data")))
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"plan": plan})))
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert main(["probe"]) == 0
    asked = json.loads(out.getvalue())["hosts"]
    assert {h: a["env_file"] for h, a in asked.items()} == {
        "head": "env/sched.env", "w1": "env/worker_0.env", "w2": "env/worker_2.env", "spare1": "env/worker_0.env"}
    assert asked["spare1"]["args"]["disk_path"] == "/jobs/demo/ckpt" and asked["spare1"]["args"]["data"] == ["data"]
    assert asked["head"]["args"]["ports"] == [8118, 8119] and asked["spare1"]["args"]["ports"] == []

    # the workers' own variables are in every worker's and standby's env file, not in the scheduler's
    worker_env = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    envs = {"head": {"OMP_NUM_THREADS": "1"}, "w1": worker_env, "w2": worker_env, "spare1": worker_env}
    facts = {h: {"python": "3.11", "torch": "2.13.0", "toolkit": "0.1", "data": {}, "env": e,
                 "disk": {"path": "/", "free": 10 ** 12}, "clock": 100.0,
                 "ports": {"8118": {"free": True}, "8119": {"free": True}}} for h, e in envs.items()}
    window = {h: (99.9, 100.1) for h in facts}
    found, _ = facts_problems(facts, "head", None, window, Limits(), ["head"])
    assert found == []
    facts["spare1"]["env"] = {**worker_env, "NCCL_DEBUG": "INFO"}  # a spare set up differently is still named
    found, _ = facts_problems(facts, "head", None, window, Limits(), ["head"])
    assert [p.line() for p in found] == ["spare1: environment: NCCL_DEBUG='INFO' (others: unset); set them alike "
                                         "on every host (the login environment, or the job's env files) or unset them"]


def test_a_problem_every_host_shares_is_one_line_naming_the_hosts_and_no_host_is_said_twice() -> None:
    """One fact, one line (issue 43 item 8): the checkpoint directory on a shared file system too full for every host
    is one line with the three hosts, a host's own problem stays its own line, and an error text that begins with its
    host's name (as a host's error message does) does not name it twice."""
    shared = {"path": "/shared/ckpt/job", "free": 10**8}
    found = decide.disk_problems({h: shared for h in ("n1", "n2", "n3")}, min_bytes=10**9)
    found += decide.disk_problems({"n4": {"path": "/local/ckpt/job", "free": 2 * 10**8}}, min_bytes=10**9)
    found.append(Problem("n5", "probe", "n5: /usr/bin/python3 not found", "fix the host"))
    assert len(found) == 5
    assert failure_text(found).splitlines() == [
        "check found 3 problem(s):",
        "n1, n2, n3: disk: 0.10 GB free at /shared/ckpt/job, below 1.00 GB; free space there, choose another "
        "--ckpt-dir, or lower --min-free-gb",
        "n4: disk: 0.20 GB free at /local/ckpt/job, below 1.00 GB; free space there, choose another --ckpt-dir, or "
        "lower --min-free-gb",
        "n5: probe: /usr/bin/python3 not found; fix the host",
    ]
