"""`check`: are the deployed job's hosts fit to train together? Also run by `train` before it starts anything.

Two phases, each one bounded command per host, in parallel (run_on_all), each running toolkit.launcher.check.probe with
the host's deployed interpreter in the environment a worker gets (the host's login environment plus its env
file): `facts` (reachable over SSH with the checked host key, versions, project and data digests, environment,
ports, disk, clock), then `health` (a timed matmul and timed all-reduces between pairs of hosts) on the hosts
whose facts allow it. What the facts mean is decided in toolkit.launcher.check.decide, gathered and tabled by
toolkit.launcher.jobhosts.preflight; this command prints one table on stdout, then one line per problem (the host and
the fix) in the error it raises. Also `python -m toolkit.launcher.tasks.check probe|decide`, for playbooks/check.yml
(`main`)."""

from __future__ import annotations

import json
import posixpath
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from toolkit.errors import UserError
from toolkit.launcher.check import probe
from toolkit.launcher.jobhosts.deployment import PROJECT_EXCLUDE
from toolkit.launcher.jobhosts.output import say
from toolkit.launcher.jobhosts.preflight import (
    Limits,
    facts_args,
    facts_problems,
    failure_text,
    print_report,
    probe_env_file,
    run_check,
)
from toolkit.launcher.jobhosts.reach import load_record, record_ssh
from toolkit.launcher.jobhosts.scripts import PROBE_SCRIPT
from toolkit.launcher.settings import JobRef


def check(ref: JobRef, data: Sequence[str] = (), limits: Limits | None = None) -> None:
    """`fleet check`: run every check on the deployed job's hosts, print the table, and raise UserError with one
    line per problem if any was found (a slow host too). `data`: paths to compare besides the job's --data-path
    (relative ones: to the project directory on each host)."""
    record = load_record(ref)
    report = run_check(record, record_ssh(record, ref.request.core), ref.project, data, limits or Limits())
    print_report(record, report)
    if report.problems:
        raise UserError(failure_text(report.problems))
    say(f"check: all {len(record.hosts)} host(s) of job {record.job} agree and are fit to train")


def main(argv: Sequence[str]) -> int:
    """`python -m toolkit.launcher.tasks.check probe|decide` for playbooks/check.yml (the controller's side of the same
    check, facts phase).

    `probe`: stdin {"plan": fleet plan --json}; stdout {"script", "source", "hosts": {host: {"job_dir", "env_file",
    "python", "args"}}}. `decide PROJECT`: stdin {"plan", "window": [sent, received], "facts": {host: facts}};
    prints one line per problem on stdout and returns 2 if there is any, else 0."""
    doc = json.loads(sys.stdin.read())
    plan = doc["plan"]
    sched = plan["scheduler"]
    envs = {h["host"]: _plan_env(plan, h["host"]) for h in plan["hosts"]}
    if argv[0] == "probe":
        hosts = {}
        for h in plan["hosts"]:
            (env_file, _), env = envs[h["host"]]
            data = [env["DATA_PATH"]] if env.get("DATA_PATH") else []
            ports = [sched["port"], sched["store_port"]] if h["host"] == sched["host"] else []
            ckpt = posixpath.join(f"{h['job_dir']}/project", env["CKPT_DIR"]) if env.get("CKPT_DIR") else \
                f"{h['job_dir']}/ckpt"
            hosts[h["host"]] = {"job_dir": h["job_dir"], "env_file": env_file, "python": h["python"],
                                "args": facts_args(f"{h['job_dir']}/project", h["job_dir"], ckpt, data, ports)}
        print(json.dumps({"script": PROBE_SCRIPT, "source": Path(probe.__file__).read_text(), "hosts": hosts}))
        return 0
    facts = doc["facts"]
    window = tuple(doc["window"])
    found, _ = facts_problems(facts, sched["host"], probe.manifest(argv[1], PROJECT_EXCLUDE, cache_dir=None),
                              {h: window for h in facts}, Limits(), [h for h, ((_, same), _) in envs.items()
                                                                     if not same])
    for p in found:
        print(p.line())
    return 2 if found else 0


def _plan_env(plan: Mapping[str, Any], host: str) -> tuple[tuple[str, bool], Mapping[str, str]]:
    """probe_env_file for a host of `fleet plan --json`, and the environment of the process whose file it is."""
    procs = [p for p in plan["processes"] if p["host"] == host]
    standby = [p for p in plan.get("standby") or [] if p["host"] == host]
    chosen = probe_env_file([p["node_id"] for p in procs], [p["node_id"] for p in standby])
    node_id = chosen[0].removeprefix("env/").removesuffix(".env")
    return chosen, next(p["env"] for p in procs + standby if p["node_id"] == node_id)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
