"""A small job record, as `fleet deploy` writes it, for the unit tests of what reads one (the host table's judge,
the watch's view): no deploy needed."""

from __future__ import annotations

from toolkit.contracts.jobrecord import HostRecord, JobRecord


def two_host_record(job_id: str = "") -> JobRecord:
    """Job "j" on hosts a (the scheduler and worker_0) and b (worker_1), its job directories /w/<host>/job."""
    hosts = tuple(HostRecord(n, n, None, None, None, f"/w/{n}/job", "python3", ids)
                  for n, ids in (("a", ("sched", "worker_0")), ("b", ("worker_1",))))
    procs = ({"host": "a", "role": "sched", "node_id": "sched", "rank": None, "local_rank": None,
              "log": "logs/scheduler.log"},
             {"host": "a", "role": "worker", "node_id": "worker_0", "rank": 0, "local_rank": 0,
              "log": "logs/worker_0.log"},
             {"host": "b", "role": "worker", "node_id": "worker_1", "rank": 1, "local_rank": 0,
              "log": "logs/worker_1.log"})
    return JobRecord("j", False, "a", 8118, hosts, procs, {}, job_id=job_id)
