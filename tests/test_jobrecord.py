"""The job record's layout after spares took over (toolkit.contracts.jobrecord.JobRecord.with_takeovers): pure, driven
directly; `fleet status` applying it to real hosts is in tests/e2e/test_spares.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from toolkit.contracts import jobrecord
from toolkit.contracts.jobrecord import HostRecord, JobRecord


def record() -> JobRecord:
    def host(name: str, node_ids: tuple[str, ...], spare: bool = False) -> HostRecord:
        ckpt = f"/w/{name}/job/ckpt" if node_ids and node_ids != ("sched",) else None
        return HostRecord(name, name, None, None, None, f"/w/{name}/job", "python3", node_ids, ckpt, spare)

    hosts = (host("a", ("sched", "worker_0")), host("b", ("worker_1", "worker_2")), host("s1", (), True),
             host("s2", (), True))
    processes = tuple({"host": h, "role": "worker" if r is not None else "sched", "node_id": n, "rank": r,
                       "local_rank": 0, "log": f"logs/{n}.log"}
                      for h, n, r in (("a", "sched", None), ("a", "worker_0", 0), ("b", "worker_1", 1),
                                      ("b", "worker_2", 2)))
    ssh = {"known_hosts": "~/.ssh/known_hosts", "accept_new_host_keys": False, "ssh_config": None, "identities": [],
           "connect_timeout": 10.0, "parallel": 32}
    return JobRecord("job", False, "a", 8118, hosts, processes, ssh)


def test_takeovers_move_the_ranks_in_the_schedulers_order_and_are_idempotent() -> None:
    moves = [{"host": "s1", "by": "s2", "node_ids": ["worker_1", "worker_2"], "seq": 2},  # as polled: any order
             {"host": "b", "by": "s1", "node_ids": ["worker_1", "worker_2"], "seq": 1}]
    new = record().with_takeovers(moves)
    assert {p["node_id"]: p["host"] for p in new.processes} == {"sched": "a", "worker_0": "a", "worker_1": "s2",
                                                                 "worker_2": "s2"}
    assert [(h.name, h.node_ids, h.replaced_by) for h in new.hosts] == [
        ("a", ("sched", "worker_0"), None), ("b", (), "s1"), ("s1", (), "s2"),
        ("s2", ("worker_1", "worker_2"), None)]
    assert new.host("s2").ckpt_dir == "/w/s2/job/ckpt"  # the spare's workers checkpoint in its own job directory
    assert [h.name for h in new.live_hosts] == ["a", "s2"]
    assert new.with_takeovers(moves) == new and record().with_takeovers([]) == record()
    assert record().with_takeovers([{"host": "zz", "by": "s1", "node_ids": ["worker_1"], "seq": 1}]) == record()
    only_last = record().with_takeovers(moves[:1])  # s1's agent could not be asked: b's own replacement unseen
    assert [(h.name, h.node_ids, h.replaced_by) for h in only_last.hosts] == [
        ("a", ("sched", "worker_0"), None), ("b", (), "s2"), ("s1", (), "s2"), ("s2", ("worker_1", "worker_2"), None)]


def test_the_updated_record_is_written_where_the_project_finds_it_and_reads_back(tmp_path: Path) -> None:
    elsewhere, project = tmp_path / "typed", tmp_path / "project"
    jobrecord.save(project, record(), typed_in=elsewhere)
    new = record().with_takeovers([{"host": "b", "by": "s1", "node_ids": ["worker_1", "worker_2"], "seq": 1}])
    path = jobrecord.update(elsewhere, new)  # through the pointer: the project's record changes
    assert path == jobrecord.record_path(project, "job")
    assert json.loads(jobrecord.record_path(elsewhere, "job").read_text()) == {"see": str(project.resolve())}
    back = jobrecord.load(elsewhere, "job")
    assert asdict(back) == asdict(new) and back.host("b").replaced_by == "s1" and back.host("s1").spare
