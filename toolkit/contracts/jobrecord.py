"""The local job record: what `deploy` decided (hosts, how to reach them, job directories, processes), kept in
the project's `.toolkit/` so that `train`, `status`, `logs`, `stop` and `restart` need no host flags.

The job token lives beside it in its own 0600 file, made once per job and reused by every deploy, so a re-deploy
never locks running processes out of their scheduler.

Layout: `<project>/.toolkit/jobs/<job>.json` (the record, JSON, written atomically) and `<job>.token`. A deploy
typed in another directory than the project leaves a pointer record there (`{"see": project}`) so later commands
typed there find the job. Reading is strict (`load`): a damaged record is one UserError saying to deploy again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from toolkit import atomicfile
from toolkit.contracts.protocol import is_int, is_number
from toolkit.errors import UserError

RECORD_DIR = ".toolkit/jobs"


@dataclass(frozen=True)
class HostRecord:
    """One host of a deployed job: how to reach it (as deploy did; see jobhosts.reach.host_target) and where its job
    lives, resolved on the host, so no later command has to resolve a relative workdir again."""

    name: str
    hostname: str  # what SSH connects to (may be an ssh_config alias)
    port: int | None
    user: str | None
    key_file: str | None
    job_dir: str  # absolute, resolved on the host at deploy
    python: str
    node_ids: tuple[str, ...]
    ckpt_dir: str | None = None  # CKPT_DIR of the host's workers, absolute (None: none runs there)
    spare: bool = False  # an inventory spare: deployed to, its agent started, running nothing until a takeover
    replaced_by: str | None = None  # a lost (or replaced) host: the spare that took its ranks; it is fenced


@dataclass(frozen=True)
class JobRecord:
    """What deploy decided for a job, so `train`, `status`, `logs`, `stop` and `restart` need no host flags.

    Saved by `save`, read back (validated) by `load`. The lookups (`host`, `process`, `process_of_rank`) raise
    UserError naming what the job does have, so a mistyped name on the command line is one line."""

    job: str
    local: bool
    scheduler_host: str
    sched_port: int
    hosts: tuple[HostRecord, ...]
    processes: tuple[dict[str, Any], ...]  # host, role, node_id, rank, local_rank, log (relative to the job dir)
    ssh: dict[str, Any]  # known_hosts, accept_new_host_keys, ssh_config, identities, connect_timeout, parallel
    grace: float = 10.0  # s between SIGTERM and SIGKILL on the hosts (stop waits that long and a margin)
    deployed: bool = True  # False while a deploy is under way (or if it failed): `train` deploys again
    options: dict[str, Any] = field(default_factory=dict)  # the JobOptions it was deployed with (flags typed later
    # must agree with them)
    job_id: str = ""  # which job this is, beyond its name (`job_id`); "" only for a record no token backs

    @property
    def world_size(self) -> int:
        """The number of workers (processes with a rank; the scheduler has none)."""
        return sum(1 for p in self.processes if p["rank"] is not None)

    @property
    def live_hosts(self) -> tuple[HostRecord, ...]:
        """The hosts still part of the job: every host but those replaced by a spare (fenced by the scheduler)."""
        return tuple(h for h in self.hosts if h.replaced_by is None)

    def with_takeovers(self, takeovers: list[dict[str, Any]]) -> JobRecord:
        """The record after the spares' takeovers (each {host: the lost host, by: the spare, node_ids, seq}, as the
        spares' agents recorded them), applied in the scheduler's order (`seq`): the processes move to the spare, the
        lost host keeps no node id and names its replacement (so does an earlier holder of those ranks whose own
        replacement was never seen: its spare was unreachable when asked). Pure and idempotent (the same takeovers
        again change nothing); a takeover naming a host the record does not have is skipped."""
        hosts = {h.name: h for h in self.hosts}
        processes = [dict(p) for p in self.processes]
        for t in sorted(takeovers, key=lambda t: t["seq"]):
            lost, by = hosts.get(t["host"]), hosts.get(t["by"])
            if lost is None or by is None or by.name == lost.name or lost.replaced_by is not None:
                continue  # unknown, or applied already
            moved = set(t["node_ids"])
            for p in processes:
                if p["node_id"] in moved:
                    p["host"] = by.name
            ckpt = by.ckpt_dir
            if ckpt is None and lost.ckpt_dir is not None:  # the spare's workers use its own job directory
                ckpt = (by.job_dir + lost.ckpt_dir[len(lost.job_dir):] if lost.ckpt_dir.startswith(lost.job_dir + "/")
                        else lost.ckpt_dir)
            for name, h in hosts.items():  # the lost host, and any earlier holder of those ranks not seen replaced
                if name != by.name and (name == lost.name or moved & set(h.node_ids)):
                    hosts[name] = replace(h, node_ids=tuple(n for n in h.node_ids if n not in moved),
                                          replaced_by=h.replaced_by or by.name)
            hosts[by.name] = replace(by, node_ids=tuple(sorted(set(by.node_ids) | moved, key=_rank_key)),
                                     ckpt_dir=ckpt)
        return replace(self, hosts=tuple(hosts[h.name] for h in self.hosts), processes=tuple(processes))

    def host(self, name: str) -> HostRecord:
        """The host named `name`; UserError listing the job's hosts if there is none."""
        for h in self.hosts:
            if h.name == name:
                return h
        raise UserError(f"job {self.job} has no host {name!r}; its hosts: {', '.join(h.name for h in self.hosts)}")

    def process(self, node_id: str) -> dict[str, Any]:
        """The process `node_id` ("sched", "worker_3"); UserError listing the job's node ids if there is none."""
        for p in self.processes:
            if p["node_id"] == node_id:
                return p
        raise UserError(
            f"job {self.job} has no process {node_id!r}; it has: {', '.join(p['node_id'] for p in self.processes)}"
        )

    def process_of_rank(self, rank: int) -> dict[str, Any]:
        """The worker of global rank `rank`; UserError giving the range of ranks if there is none."""
        for p in self.processes:
            if p["rank"] == rank:
                return p
        raise UserError(f"job {self.job} has no rank {rank}; ranks are 0 to {self.world_size - 1}")


def _rank_key(node_id: str) -> tuple[int, str]:
    """Order node ids as the plan does: the scheduler first, then workers by rank."""
    tail = node_id.rsplit("_", 1)[-1]
    return (int(tail) if tail.isascii() and tail.isdigit() else -1, node_id)


def update(project: Path, record: JobRecord) -> Path:
    """Rewrite the record where `project` finds it (its own, or the one its pointer names): a later change of the
    job's layout (a spare's takeover) goes where deploy wrote it. Returns the path; OSError if it cannot be
    written."""
    path = locate(project, record.job)
    _write(path, asdict(record))
    return path


def record_path(project: Path, job: str) -> Path:
    """Where the record of `job` lives under `project` (whether or not it exists, and without following a
    pointer: see `locate`)."""
    return project / RECORD_DIR / f"{job}.json"


def save(project: Path, record: JobRecord, typed_in: Path | None = None) -> Path:
    """Write the record in the project's .toolkit/; with `typed_in` (the directory the command was typed in, if
    it is not the project), also a pointer there, so that the next command typed there finds the job without
    --project.

    Written atomically (a reader sees the old record or the new one, never half), mode 0600; .toolkit/jobs is
    created (0700) if needed. Returns the record's path. OSError if it cannot be written."""
    path = record_path(project, record.job)
    _write(path, asdict(record))
    if typed_in is not None and typed_in.resolve() != project.resolve():
        _write(record_path(typed_in, record.job), {"see": str(project.resolve())})
    return path


def _write(path: Path, data: dict[str, Any]) -> None:
    """`data` as indented JSON at `path`, atomically (toolkit.atomicfile, mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomicfile.write(path, json.dumps(data, indent=2) + "\n")


def locate(where: Path, job: str) -> Path:
    """The record of `job` as seen from `where`: its own, or the one its pointer names.

    Follows one pointer, never a chain. A missing or unreadable file is returned as is (`load` reports it)."""
    path = record_path(where, job)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return path
    if isinstance(data, dict) and isinstance(data.get("see"), str) and set(data) == {"see"}:
        return record_path(Path(data["see"]), job)
    return path


def exists(project: Path, job: str) -> bool:
    """Whether a record of `job` can be found from `project` (directly or through a pointer)."""
    return locate(project, job).is_file()


def deployed_jobs(project: Path) -> list[str]:
    """The names of the jobs with a record (or a pointer) under `project`, sorted."""
    return sorted(p.stem for p in (project / RECORD_DIR).glob("*.json"))


def choose(project: Path, job: str | None, default: str | None = None) -> str | None:
    """The job a command means: the one named; else the project's only job; else, among several, the one named
    `default` (the project's default job name). None if the project has no record to choose from.

    Raises UserError if several jobs are there and none is named or the default. The name is not checked
    against the records (see `exists`, `load`)."""
    if job is not None:
        return job
    found = deployed_jobs(project)
    if len(found) == 1:
        return found[0]
    if default is not None and default in found:
        return default
    if len(found) > 1:
        raise UserError(f"{project} has several jobs ({', '.join(found)}); pick one with --job NAME")
    return None


def load(project: Path, job: str | None, default: str | None = None) -> JobRecord:
    """The record of `job` (see `choose` when no name was given).

    Raises UserError, with what to do, when there is no job to choose, the job was never deployed from
    `project`, or the file is unreadable, not JSON, or fails the field checks (RecordError)."""
    job = choose(project, job, default)
    if job is None:
        raise UserError(f"no job deployed from {project}; run 'fleet deploy train' there (or pass --project DIR)")
    path = locate(project, job)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"job {job} was never deployed from {project}; run 'fleet deploy --job {job}' first") from None
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: unreadable job record ({type(e).__name__}: {e}); deploy the job again") from None
    try:
        record = _parse(data)
    except RecordError as e:
        raise UserError(f"{path}: damaged job record: {e}; deploy the job again (fleet deploy)") from None
    if not record.job_id:  # a record from before job ids: the token beside it says which job it is
        with contextlib.suppress(OSError):
            record = replace(record, job_id=job_id(path.with_suffix(".token").read_text().strip()))
    return record


class RecordError(ValueError):
    """A field of the record is missing or of the wrong type."""


def _parse(data: Any) -> JobRecord:
    """Every field checked for its type, so that a damaged record is one line, never a traceback later."""
    if not isinstance(data, dict):
        raise RecordError("not a JSON object")

    def field_(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str = "") -> Any:
        value = obj.get(name)
        if not isinstance(value, kind) or isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                                   else (kind,)):
            raise RecordError(f"{where}{name} is {json.dumps(value)[:60]}")
        return value

    hosts_raw = field_(data, "hosts", list)
    if not hosts_raw:
        raise RecordError("hosts is empty")
    hosts = []
    for i, h in enumerate(hosts_raw):
        where = f"hosts[{i}]."
        if not isinstance(h, dict):
            raise RecordError(f"hosts[{i}] is not an object")
        port = h.get("port")
        if port is not None and (not is_int(port) or not 0 < port < 65536):
            raise RecordError(f"{where}port is {json.dumps(port)[:60]}")
        node_ids = field_(h, "node_ids", list, where)
        ckpt = h.get("ckpt_dir")
        replaced_by = h.get("replaced_by")
        hosts.append(HostRecord(
            name=field_(h, "name", str, where), hostname=field_(h, "hostname", str, where), port=port,
            user=h.get("user") if isinstance(h.get("user"), str) else None,
            key_file=h.get("key_file") if isinstance(h.get("key_file"), str) else None,
            job_dir=field_(h, "job_dir", str, where), python=field_(h, "python", str, where),
            node_ids=tuple(str(n) for n in node_ids), ckpt_dir=ckpt if isinstance(ckpt, str) else None,
            spare=h.get("spare") is True, replaced_by=replaced_by if isinstance(replaced_by, str) else None))
    processes = field_(data, "processes", list)
    for i, p in enumerate(processes):
        where = f"processes[{i}]."
        if not isinstance(p, dict):
            raise RecordError(f"processes[{i}] is not an object")
        for name in ("host", "node_id", "role", "log"):
            field_(p, name, str, where)
        if p.get("rank") is not None:
            field_(p, "rank", int, where)
    ssh = field_(data, "ssh", dict)
    for name in ("known_hosts", "accept_new_host_keys", "ssh_config", "identities", "connect_timeout", "parallel"):
        if name not in ssh:
            raise RecordError(f"ssh.{name} is missing")
    grace = data.get("grace", 10.0)
    if not is_number(grace) or not 0 <= grace < 86400:
        raise RecordError(f"grace is {json.dumps(grace)[:60]}")
    port = field_(data, "sched_port", int)
    options = data.get("options") or {}
    if not isinstance(options, dict):
        raise RecordError("options is not an object")
    return JobRecord(
        job=field_(data, "job", str), local=field_(data, "local", bool),
        scheduler_host=field_(data, "scheduler_host", str), sched_port=port, hosts=tuple(hosts),
        processes=tuple(processes), ssh=ssh, grace=float(grace), deployed=bool(data.get("deployed", True)),
        options=dict(options), job_id=data["job_id"] if isinstance(data.get("job_id"), str) else "")


def token(project: Path, job: str) -> str:
    """The job's token, created on first use; never printed.

    64 hex digits (256 random bits), in `.toolkit/jobs/<job>.token` with mode 0600, and reused by every later
    deploy. It appears whole or not at all: written to a private file first, then linked into place, which fails
    if a token is there already (two deploys at once agree on the first one; none is ever overwritten). deploy
    copies it to each host's job directory; it never appears on a command line, in an environment or in a log
    (docs/security.md)."""
    path = project / RECORD_DIR / f"{job}.token"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
    finally:
        draft.unlink()
    return path.read_text().strip()


def job_id(token: str) -> str:
    """The job's id: what tells this job from another project's job of the same name in the same job directory.

    Derived from the job's token (made once per job, at the first deploy, and kept), so it is fixed for the job's
    life and needs no file of its own; one-way, so showing it (agent.json, the job directory's `job-id`) reveals
    nothing of the token."""
    return hashlib.sha256(b"toolkit job id\0" + token.encode()).hexdigest()[:32]
