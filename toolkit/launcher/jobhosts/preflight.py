"""Checking a deployed job's hosts: gather both phases on every host and decide (`run_check`), and the table
(`print_report`). Used by `fleet check` (toolkit.launcher.tasks.check) and by `train` before it starts anything.

Two phases, each one bounded command per host, in parallel (run_on_all), each running toolkit.launcher.check.probe with
the host's deployed interpreter in the environment a worker gets (the host's login environment plus its env
file): `facts` (reachable over SSH with the checked host key, versions, project and data digests, environment,
ports, disk, clock), then `health` (a timed matmul and timed all-reduces between pairs of hosts) on the hosts
whose facts allow it. What the facts mean is decided in toolkit.launcher.check.decide."""

from __future__ import annotations

import json
import posixpath
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.table import Table

from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.errors import UserError
from toolkit.launcher.check import decide, probe
from toolkit.launcher.check.decide import Problem
from toolkit.launcher.jobhosts.deployment import PROJECT_EXCLUDE
from toolkit.launcher.jobhosts.output import human_size, say, table_console
from toolkit.launcher.jobhosts.reach import record_targets
from toolkit.launcher.jobhosts.scripts import PROBE_SCRIPT
from toolkit.launcher.plan import SCHED_NODE_ID
from toolkit.launcher.remote import Host, HostResult, RemoteError, SshSettings, rich_progress, run_on_all

FACTS_TIMEOUT = 60.0  # s for one host's facts (one Python start and hashing new data: generous)
HEALTH_START = 45.0  # s from the health program's start for torch's import and the matmul, before round 1
HEALTH_ROUND = 20.0  # s each round of pairs may take, rendezvous included (a broken peer costs this, once)
HEALTH_MARGIN = 15.0  # s on top of the rounds for the health command as a whole
MATMUL = {"matmul_size": 256, "matmul_iters": 100, "matmul_reps": 3}  # reps of ~0.1 s of one core: longer than
# a CFS period (100 ms), so that a CPU quota shows in every rep rather than in some
ALLREDUCE = {"allreduce_size": 1024, "allreduce_iters": 20}  # small: measures latency more than bandwidth
NOT_FOUND = 127  # the shell's exit status when the interpreter is missing


@dataclass(frozen=True)
class Limits:
    """The thresholds of a check (flags of `fleet check`; `train` uses the defaults)."""

    min_free_bytes: int = int(decide.DEFAULT_MIN_FREE_GB * 1e9)
    max_skew: float = decide.DEFAULT_MAX_SKEW
    slow_factor: float = decide.DEFAULT_SLOW_FACTOR


@dataclass
class Report:
    """What a check found: the table's rows by host, and the problems."""

    rows: dict[str, dict[str, str]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


def failure_text(problems: Sequence[Problem]) -> str:
    """The error's text, one fact one line: a count, then one line per problem, the hosts that share one (the same
    check, text and fix: a disk too small on a shared file system, a port every host lacks) named together on it
    (`a, b, c: disk: ...`), in the order first found. A text that begins with its host's name again (an error
    message of the host's) loses that prefix: the host is said once."""
    facts: dict[tuple[str, str, str], list[str]] = {}
    for p in problems:
        key = (p.check, p.text.removeprefix(f"{p.host}: "), p.fix)
        facts.setdefault(key, []).append(p.host)
    lines = [Problem(", ".join(dict.fromkeys(hosts)), *key).line() for key, hosts in facts.items()]
    return f"check found {len(lines)} problem(s):\n" + "\n".join(lines)


def run_check(record: JobRecord, ssh: SshSettings, project: Path, data: Sequence[str] = (),
              limits: Limits | None = None) -> Report:
    """Gather both phases and decide; never raises for a host's failure (it becomes that host's problem)."""
    limits = limits or Limits()
    paths = list(dict.fromkeys(([record.options["data_path"]] if record.options.get("data_path") else [])
                               + list(data)))
    report = Report(rows={h.name: {} for h in record.hosts})
    sched = record.scheduler_host
    ports = [record.sched_port, record.sched_port + 1]
    times: dict[str, tuple[float, float]] = {}

    def gather(host: Host) -> dict[str, Any]:
        h = record.host(host.name)
        args = facts_args(str(project) if record.local else f"{h.job_dir}/project", h.job_dir,
                          _ckpt_dir(record, h), paths, ports if h.name == sched else [])
        sent = time.time()
        out = _probe(host, h, _env_file(record, h)[0], "facts", args, FACTS_TIMEOUT)
        times[h.name] = (sent, time.time())
        return out

    with rich_progress("checking hosts", len(record.hosts)) as progress:
        results = run_on_all(record_targets(record), gather, ssh, progress=progress)
    facts = _reached(results, report)
    local = probe.manifest(str(project), PROJECT_EXCLUDE, cache_dir=None)  # a project is small: read it whole
    _decide_facts(record, facts, local, times, limits, report)
    bad_versions = {p.host for p in report.problems if p.check in ("python", "torch", "toolkit")}
    fit = [h for h in facts if h not in bad_versions]
    for h in bad_versions & set(facts):
        report.rows[h]["matmul"] = report.rows[h]["all-reduce"] = "skipped"
    _health(record, ssh, {h: facts[h] for h in fit}, limits, report)
    return report


def probe_env_file(node_ids: Sequence[str], standby: Sequence[str]) -> tuple[str, bool]:
    """The env file (relative to the job directory) the probe runs under on a host that runs `node_ids` (a spare:
    none, and `standby`, the workers it may take over), and whether the environment it gives is compared with the
    other hosts'. The host's first worker's file; on a spare, its first standby worker's (a spare holds an env file
    for every worker of the job, and no other); on a host that runs only the scheduler, the scheduler's, whose
    environment is not compared: no worker runs there, and the workers' own variables are not in that file."""
    for node_id in (*node_ids, *standby):
        if node_id != SCHED_NODE_ID:
            return f"env/{node_id}.env", True
    return f"env/{SCHED_NODE_ID}.env", False


def _env_file(record: JobRecord, h: HostRecord) -> tuple[str, bool]:
    """probe_env_file for a recorded host: a spare stands by for every worker of the job, in rank order."""
    workers = sorted((p for p in record.processes if p["rank"] is not None), key=lambda p: p["rank"])
    return probe_env_file(h.node_ids, [p["node_id"] for p in workers] if h.spare else [])


def _ckpt_dir(record: JobRecord, h: HostRecord) -> str:
    """Where the host's workers keep checkpoints (a spare's: where its standby workers would, the job's subdirectory
    of --ckpt-dir relative to their project directory as the plan renders it); the job directory's ckpt/ on a host
    that runs no worker."""
    if h.ckpt_dir:
        return h.ckpt_dir
    given = record.options.get("ckpt_dir")
    return posixpath.join(h.job_dir, "project", given, record.job) if given and h.spare else f"{h.job_dir}/ckpt"


def facts_args(project: str, job_dir: str, ckpt_dir: str, data: Sequence[str], ports: Sequence[int]) -> dict[str, Any]:
    """The probe's `facts` arguments for one host (also what playbooks/check.yml sends, through `main`)."""
    return {"project": project, "exclude": PROJECT_EXCLUDE, "data": list(data), "job_dir": job_dir,
            "disk_path": ckpt_dir, "ports": list(ports), "env_names": decide.ENV_NAMES,
            "env_prefixes": decide.ENV_PREFIXES}


def _probe(host: Host, h: HostRecord, env_file: str, mode: str, args: Mapping[str, Any],
           timeout: float) -> dict[str, Any]:
    """Run the probe on the host under `env_file`; its JSON answer, or UserError naming what went wrong there."""
    source = Path(probe.__file__).read_text()
    result = host.run(["sh", "-c", PROBE_SCRIPT, "sh", h.job_dir, env_file, h.python, source, mode,
                       json.dumps(args)], timeout=timeout)
    if result.exit_code == NOT_FOUND:
        raise UserError(f"{h.python} not found; install Python 3 there or set the host's python= (inventory)")
    result.check()
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise UserError(f"the check's probe printed no answer: {result.stdout.strip()[-200:]}") from None


def _reached(results: Mapping[str, HostResult[dict[str, Any]]], report: Report) -> dict[str, dict[str, Any]]:
    """The hosts that answered; every other one becomes a problem: `ssh` (unreachable, host key unknown or
    changed, login refused, the command failed) or `probe` (no interpreter, no answer)."""
    out = {}
    for name, r in results.items():
        if r.ok and r.value is not None:
            out[name] = r.value
        else:
            text = (r.error or "failed").removeprefix(f"{name}: ")
            what = "ssh" if isinstance(r.exception, RemoteError) else "probe"
            report.problems.append(Problem(name, what, text, "fix the host or its entry in the inventory, then "
                                           "check again"))
            report.rows[name]["state"] = "unreachable"
    return out


def facts_problems(facts: Mapping[str, dict[str, Any]], sched: str, local: Mapping[str, Any] | None,
                   times: Mapping[str, tuple[float, float]], limits: Limits,
                   env_apart: Sequence[str] = ()) -> tuple[list[Problem], dict[str, float]]:
    """Every problem the facts show (no project comparison without `local`; no environment comparison for the
    hosts in `env_apart`, which run no worker: probe_env_file), and each host's clock skew."""
    found = decide.version_problems(facts, sched)
    if local is not None:
        found += decide.project_problems({h: f["project"] for h, f in facts.items()}, local)
    data: dict[str, dict[str, Any]] = {}
    for h, f in facts.items():
        for path, m in f["data"].items():
            data.setdefault(path, {})[h] = m
    found += decide.data_problems(data, sched)
    found += decide.env_problems({h: f["env"] for h, f in facts.items() if h not in env_apart}, sched)
    if sched in facts:
        found += decide.port_problems(sched, facts[sched]["ports"])
    found += decide.disk_problems({h: f["disk"] for h, f in facts.items()}, limits.min_free_bytes)
    skews = {h: decide.clock_skew(f["clock"], *times[h]) for h, f in facts.items()}
    found += decide.clock_problems(skews, limits.max_skew)
    return found, skews


def _decide_facts(record: JobRecord, facts: Mapping[str, dict[str, Any]], local: Mapping[str, Any],
                  times: Mapping[str, tuple[float, float]], limits: Limits, report: Report) -> None:
    apart = [h.name for h in record.hosts if not _env_file(record, h)[1]]
    found, skews = facts_problems(facts, record.scheduler_host, None if record.local else local, times, limits,
                                  apart)
    sched = record.scheduler_host
    report.problems += found
    for h, f in facts.items():
        row = report.rows[h]
        row.update(python=f["python"], torch=f["torch"], toolkit=f["toolkit"],
                   project=_digest(f["project"]) if not record.local else "in place",
                   data=", ".join(_digest(m) for m in f["data"].values()) or "-",
                   env=f"{len(f['env'])} var(s)" + (" (no worker)" if h in apart else ""),
                   disk=human_size(f["disk"]["free"]) if f["disk"]["free"] is not None else "?",
                   clock=f"{skews[h]:.1f} s")
        if h == sched:
            row["ports"] = ", ".join(f"{p} {'free' if v['free'] else 'ours' if v['ours'] else 'taken'}"
                                     for p, v in f["ports"].items())
    hashed = sum(m.get("hashed", 0) for f in facts.values() for m in f["data"].values())
    if any(f["data"] for f in facts.values()):
        say(f"data: {hashed} file(s) hashed, the rest taken from the hosts' manifest caches")


def _digest(m: Mapping[str, Any] | None) -> str:
    if not m:
        return "-"
    return m["error"] if "error" in m else f"{m['digest'][:8]} ({m['files']} files)"


def _health(record: JobRecord, ssh: SshSettings, facts: Mapping[str, dict[str, Any]], limits: Limits,
            report: Report) -> None:
    """The health phase on the hosts in `facts` (those whose versions agree): a matmul on each, an all-reduce on
    each pair of the ring (pair k's store on its first host, port MS_SCHED_PORT + 2 + k)."""
    names = [h.name for h in record.hosts if h.name in facts]
    if not names:
        return
    rounds = decide.pair_rounds(names)
    schedule: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    index = 0
    for r, pairs in enumerate(rounds):
        for a, b in pairs:
            store = facts[a].get("address") or record.host(a).hostname
            for rank, (me, peer) in enumerate(((a, b), (b, a))):
                schedule[me].append({"peer": peer, "store": store, "port": record.sched_port + 2 + index,
                                     "rank": rank, "deadline": HEALTH_START + (r + 1) * HEALTH_ROUND})
            index += 1
    timeout = HEALTH_START + len(rounds) * HEALTH_ROUND + HEALTH_MARGIN

    def run(host: Host) -> dict[str, Any]:
        h = record.host(host.name)
        return _probe(host, h, _env_file(record, h)[0], "health", {**MATMUL, **ALLREDUCE,
                                                                   "pairs": schedule[host.name]}, timeout)

    targets = [t for t in record_targets(record) if t.name in facts]
    with rich_progress("health test", len(targets)) as progress:
        results = run_on_all(targets, run, ssh, progress=progress)
    matmul: dict[str, float] = {}
    pair_results: dict[tuple[str, str], dict[str, Any]] = {}
    for name, r in results.items():
        if not r.ok or r.value is None:
            report.problems.append(Problem(name, "health", (r.error or "failed").removeprefix(f"{name}: "),
                                           "look at the host's torch installation and load"))
            continue
        matmul[name] = r.value["matmul"]
        report.rows[name]["matmul"] = f"{r.value['matmul']:.3f} s"
    for pairs in rounds:
        for a, b in pairs:
            if a not in matmul or b not in matmul:
                continue  # a host whose health program failed is named already
            seen = [results[h].value["pairs"].get(p) for h, p in ((a, b), (b, a))]
            errors = [s for s in seen if s and "error" in s]
            ok = [s["seconds"] for s in seen if s and "seconds" in s]
            pair_results[(a, b)] = errors[0] if errors else {"seconds": max(ok)} if ok else {"error": "no answer"}
    for h in names:
        mine = [(p, v) for (a, b), v in pair_results.items() for p in ((b,) if a == h else (a,) if b == h else ())]
        report.rows[h]["all-reduce"] = ", ".join(f"{p} {v['seconds']:.3f} s" if "seconds" in v else f"{p} failed"
                                                 for p, v in mine) or "-"
    report.problems += decide.health_problems(matmul, pair_results, limits.slow_factor)


COLUMNS = ("host", "python", "torch", "toolkit", "project", "data", "env", "disk", "clock", "ports", "matmul",
           "all-reduce", "problems")


def print_report(record: JobRecord, report: Report) -> None:
    """The table on stdout: one row per host, its facts and how many problems name it."""
    table = Table(title=f"check of job {record.job}: {len(record.hosts)} host(s), scheduler "
                        f"{record.scheduler_host}:{record.sched_port}")
    for column in COLUMNS:
        table.add_column(column)
    for name, row in report.rows.items():
        count = sum(1 for p in report.problems if p.host == name or name in p.host.split("-"))
        cells = [name] + [row.get(c, "-") for c in COLUMNS[1:-1]] + [str(count) if count else "ok"]
        if row.get("state") == "unreachable":
            cells[1] = "unreachable"
        table.add_row(*cells)
    table_console().print(table)
