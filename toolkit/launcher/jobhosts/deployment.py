"""Deploying a job (`deploy`, used by `fleet deploy`, `train` on a job never deployed, and `run`): the job's layout,
the rendered files, the project and the local job record on every host, and the plan it follows (`launch_plan`).

`deploy` is safe to repeat: it writes only what changed (rendered files by checksum, the project by size, mtime and
mode), reuses the job's token (so running processes keep their scheduler), and refuses job directories, and a
--ckpt-dir, that other users own or may write (docs/security.md). It starts nothing: `train` does."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import posixpath
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

from toolkit import freeports, privatedir
from toolkit.contracts import agentdoc, envvars, jobrecord
from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.errors import UserError
from toolkit.launcher.inventory import Host as InventoryHost
from toolkit.launcher.inventory import Inventory
from toolkit.launcher.jobhosts.output import human_size, relative, say
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, fan_out, ssh_settings
from toolkit.launcher.jobhosts.scripts import (
    LAYOUT_NOT_OURS,
    LAYOUT_OPEN_TO_OTHERS,
    LAYOUT_OTHER_JOB,
    LAYOUT_SCRIPT,
    LAYOUT_SYMLINK,
)
from toolkit.launcher.plan import HostPlan, LaunchPlan, make_plan
from toolkit.launcher.remote import (
    DEFAULT_EXCLUDE,
    Host,
    HostResult,
    RemoteError,
    SyncStats,
    Target,
)
from toolkit.launcher.render import RenderedFile, render_host
from toolkit.launcher.settings import JOB_OPTIONS, Settings
from toolkit.printable import clean

PROJECT_EXCLUDE = DEFAULT_EXCLUDE + (".toolkit",)


def launch_plan(settings: Settings) -> LaunchPlan:
    """The plan for the typed settings (no host is asked; a local job given no port gets one, see `with_port`). A
    remote workdir relative to home stays relative here; deploy plans again once the hosts have resolved it.
    Raises PlanError (a UserError)."""
    settings = with_port(settings)
    return make_plan(settings.inventory, settings.options, str(settings.project) if settings.local else None)


def with_port(settings: Settings) -> Settings:
    """`settings` with the port of a job on this machine given no --master-port: the one its record has (deployed
    again, a job keeps its port, so what runs keeps its scheduler), else a free pair (freeports): a second local
    job runs beside the first without a port typed. On hosts the default stays fixed (every host must agree on it;
    the start's preflight says when it is taken). The port is recorded with the job, where later commands read it."""
    if not (settings.local and settings.default_port):
        return settings
    job = settings.options.job
    port = None
    if jobrecord.exists(settings.project, job):
        with contextlib.suppress(UserError):  # an unreadable record: deploy rewrites it
            old = jobrecord.load(settings.project, job)
            port = old.sched_port if old.local else None
    port = port or freeports.free_port_pair()
    return replace(settings, options=replace(settings.options, master_port=port), default_port=False)


def deploy(settings: Settings) -> JobRecord:
    """Make every host's job directory (workdirs resolved on the host), upload the rendered files and the
    project (only what changed), and write the local job record.

    Two fan-outs, each raising ClusterError if any host fails: first every host's preflight (python, toolkit,
    a writable workdir) and its workdir resolved to an absolute path there; then the upload. Between them the
    record is saved marked not deployed, so a deploy that fails half-way is redone by the next `train`, and
    `status` never reads an earlier deploy's directories as this one's. A job directory owned by another user,
    or writable by others, is refused (UserError, naming it). Every remote call is bounded (STATUS_TIMEOUT for
    the layout, command_timeout otherwise; transfers by their size). In local mode the project is not copied:
    the job runs in place. Prints a line per host and a summary; returns the record it saved."""
    settings = with_port(settings)
    plan = launch_plan(settings)
    if settings.inventory.note:
        say(f"note: {settings.inventory.note}")
    ssh = ssh_settings(settings)
    targets = [Target.of(h.host, local=plan.local) for h in plan.hosts]
    workdirs = fan_out("checking hosts", targets, functools.partial(_prepare, plan), ssh)
    inventory = settings.inventory.with_hosts(
        replace(settings.inventory.host(name), workdir=path) for name, path in workdirs.items()
    )
    plan = make_plan(inventory, settings.options, str(settings.project) if settings.local else None)
    token = jobrecord.token(settings.project, plan.job)
    identity = Identity.of(token, settings.project)
    # Recorded before the upload (marked incomplete until it is done): from now on `status` looks where this
    # deploy puts the job, never at an earlier deploy's job directories as if they were this one's.
    record = job_record(plan, settings, identity.job_id)
    jobrecord.save(settings.project, replace(record, deployed=False), typed_in=Path.cwd())
    stats = fan_out("deploying", targets, functools.partial(_upload, plan, settings, token, identity), ssh,
                    line=_sent_line)
    _say_not_copied(stats.values(), settings.project)
    path = jobrecord.save(settings.project, record, typed_in=Path.cwd())
    total = _sum_stats(stats.values())
    say(f"deployed job {plan.job} to {len(stats)} host(s): {total.files_sent} file(s) sent "
         f"({human_size(total.bytes_sent)}), {total.files_unchanged} unchanged; job record {relative(path)}")
    return record


def deploy_host(settings: Settings, name: str) -> HostRecord:
    """Deploy the job to one host of `settings` (`fleet grow`: a host joining a running job), as `deploy` does for
    every host: its workdir resolved there, then its layout, rendered files and the project; the other hosts are not
    reached and the local job record is not written (the caller adds the returned host to it). Raises ClusterError
    if the host is unreachable or unfit, UserError for a job directory others own or may write."""
    plan = launch_plan(settings)
    ssh = ssh_settings(settings)
    target = [Target.of(plan.host_plan(name).host, local=plan.local)]
    workdir = fan_out("checking host", target, functools.partial(_prepare, plan), ssh)[name]
    inventory = settings.inventory.with_hosts([replace(settings.inventory.host(name), workdir=workdir)])
    plan = make_plan(inventory, settings.options, None)
    token = jobrecord.token(settings.project, plan.job)
    identity = Identity.of(token, settings.project)
    stats = fan_out("deploying", target, functools.partial(_upload, plan, settings, token, identity), ssh,
                    line=_sent_line)
    _say_not_copied(stats.values(), settings.project)
    return job_record(plan, settings, identity.job_id).host(name)


def _prepare(plan: LaunchPlan, host: Host) -> str:
    """Preflight the host (python, toolkit, a writable workdir) and return its workdir as an absolute path with
    symlinks resolved; RemoteError if it is unfit."""
    hp = plan.host_plan(host.name)
    workdir = hp.job_dir.rsplit("/", 1)[0]
    host.preflight(hp.python, workdir)
    return host.run(["sh", "-c", 'cd -- "$1" && pwd -P', "sh", workdir], check=True).stdout.strip()


def _upload(plan: LaunchPlan, settings: Settings, token: str, identity: Identity, host: Host) -> SyncStats:
    """The job's layout and rendered files, then (remote hosts only) the project, mirrored with delete; then the
    --ckpt-dir checked there. What was sent; RemoteError or UserError on failure."""
    hp = plan.host_plan(host.name)
    stats = _upload_rendered(host, hp.job_dir, render_host(plan, hp, token), identity, plan.job)
    if not plan.local:
        stats = _sum_stats([stats, host.sync_dir(settings.project, f"{hp.job_dir}/project",
                                                 exclude=PROJECT_EXCLUDE, delete=True)])
    _check_ckpt_dir(host, hp, settings.options.ckpt_dir)
    return stats


def _sent_line(r: HostResult[SyncStats]) -> str | None:
    """A host's progress line: what it was sent; nothing for a failed host (fan_out's ClusterError says every
    failure once, the hosts that failed alike on one line)."""
    if not r.ok or r.value is None:
        return None
    s = r.value
    return (f"{r.host}: {s.files_sent} file(s) sent ({human_size(s.bytes_sent)}), {s.files_unchanged} unchanged"
            + (f", {s.removed} removed" if s.removed else "") + f" ({r.seconds:.1f} s)")


def _say_not_copied(stats: Iterable[SyncStats], project: Path) -> None:
    """Warn, once for every host, about the symlinks that point out of the project (never followed, never sent)."""
    outside = sorted({name for st in stats for name in st.outside})
    if outside:
        say(f"not copied: {len(outside)} symlink(s) pointing out of {project} ({', '.join(outside[:5])}"
             + (", ..." if len(outside) > 5 else "") + "): toolkit never follows a link out of the project")


@dataclass(frozen=True)
class Identity:
    """Which job a deploy puts in a job directory (written there as agentdoc.JOB_ID_FILE by LAYOUT_SCRIPT): its id
    (jobrecord.job_id), the SHA-256 of its token file (to recognise a job directory from before job ids), and where
    it is deployed from (shown to the owner of another project that finds it there)."""

    job_id: str
    token_sum: str
    origin: str

    @classmethod
    def of(cls, token: str, project: Path) -> Identity:
        """The identity of the job whose token is `token`, deployed from `project` (its path and this machine's
        name, as one line for people)."""
        return cls(jobrecord.job_id(token), hashlib.sha256(f"{token}\n".encode()).hexdigest(),
                   clean(f"project {project.resolve()} on {socket.gethostname()}", 400))


def _upload_rendered(host: Host, job_dir: str, files: list[RenderedFile], identity: Identity,
                     job: str) -> SyncStats:
    """Make the job's layout (LAYOUT_SCRIPT: directories 0700, ownership, mode and identity checked) and write the
    rendered files whose mode or SHA-256 differ from what is there, in one listing round trip plus one write per
    changed file. Raises UserError if the job directory or its workdir is a symlink, belongs to another user or is
    writable by others (another user could change what the job runs), or holds another project's job `job`
    (nothing of it is touched); else what `Host.run(check=True)` and `Host.write` raise."""
    result = host.run(["sh", "-c", LAYOUT_SCRIPT, "sh", job_dir, identity.job_id, identity.token_sum,
                       identity.origin, *(f.path for f in files)], timeout=STATUS_TIMEOUT)
    _layout_refusal(host.name, job_dir, job, result.exit_code, result.stdout)
    listing = result.check().stdout
    there: dict[str, tuple[int, str]] = {}
    for entry in listing.splitlines():
        words = entry.split(None, 2)
        if len(words) == 3:
            with contextlib.suppress(ValueError):
                there[words[2]] = (int(words[0], 8), words[1])
    sent = nbytes = 0
    for f in files:
        data = f.content.encode()
        if there.get(f.path) == (f.mode, hashlib.sha256(data).hexdigest()):
            continue
        host.write(f"{job_dir}/{f.path}", data, f.mode)
        sent += 1
        nbytes += len(data)
    return SyncStats(files_sent=sent, bytes_sent=nbytes, files_unchanged=len(files) - sent)


def _layout_refusal(host: str, job_dir: str, job: str, code: int | None, out: str) -> None:
    """Raise the RemoteError (a UserError naming `host`) for LAYOUT_SCRIPT's refusals (its exit `code` and what it
    printed, `out`: the path concerned on the first line, what is wrong with it on the next). Returns for any other
    exit."""
    first, _, rest = out.partition("\n")
    path, words = clean(first, 400), rest.split()
    if code == LAYOUT_NOT_OURS:
        owner, me = (words + ["?", "?"])[:2]
        raise RemoteError(host, f"{path} belongs to uid {owner}, not to you (uid {me}): another user made it, and "
                                "could change what the job runs; remove it or choose a --workdir of your own")
    if code == LAYOUT_OPEN_TO_OTHERS:
        raise RemoteError(host, f"{path} is writable by other users (mode {(words + ['?'])[0]}): they could change "
                                "what the job runs; chmod go-w it, or choose a --workdir of your own")
    if code == LAYOUT_SYMLINK:
        raise RemoteError(host, f"{path} is a symbolic link (to {clean(rest.strip(), 400)}): toolkit does not follow "
                                "links for job directories (whoever can change the link decides where the job runs); "
                                "replace it with a directory, or give its target as --workdir")
    if code == LAYOUT_OTHER_JOB:
        _, origin = agentdoc.read_identity(out)
        whose = f"another project's job {job} ({clean(origin, 400)})" if origin else \
            f"a job {job} of another project (deployed before job ids; its token is not this project's)"
        raise RemoteError(host, f"{job_dir} holds {whose}; nothing of it was touched: give this job another --job "
                                "name (or --workdir)")


def _check_ckpt_dir(host: Host, hp: HostPlan, given: str | None) -> None:
    """If --ckpt-dir was `given`: make it on the host (as its workers resolve it) and check that only the operator
    can change it (toolkit.privatedir: another user who can write there could plant checkpoints the job resumes);
    UserError naming the host and the directory otherwise. Spares are checked too: their workers may take over.
    (The default, `<job dir>/ckpt`, is made private with the job directory.)"""
    workers = [p for p in (*hp.processes, *hp.standby) if p.rank is not None]
    if given is None or not workers:
        return
    path = posixpath.join(workers[0].cwd, workers[0].env[envvars.CKPT_DIR])
    result = host.run([hp.python, "-m", "toolkit.privatedir", path, "checkpoint directory",
                       "choose a --ckpt-dir of your own"], timeout=STATUS_TIMEOUT)
    if result.exit_code == privatedir.EXIT_NOT_PRIVATE and result.stdout.strip():
        raise UserError(f"{host.name}: {result.stdout.strip().splitlines()[-1]}")
    result.check()


def job_record(plan: LaunchPlan, settings: Settings, job_id: str) -> JobRecord:
    """The job record for `plan`: per host how to reach it and where its job lives, every process and its log, the
    SSH settings as typed (later commands reach the hosts the same way), the grace period and the job options (a
    later flag that contradicts them is refused, see jobhosts.reach.load_record)."""
    hosts = tuple(
        HostRecord(
            name=h.name,
            hostname=h.host.address or h.name,
            port=h.host.port,
            user=h.host.user,
            key_file=h.host.key_file,
            job_dir=h.job_dir,
            python=h.python,
            node_ids=tuple(p.node_id for p in h.processes),
            ckpt_dir=h.ckpt_dir,
            spare=h.spare,
        )
        for h in plan.hosts
    )
    processes = tuple(
        {"host": p.host, "role": p.role, "node_id": p.node_id, "rank": p.rank, "local_rank": p.local_rank,
         "log": f"logs/{p.log_name}"}
        for p in plan.processes()
    )
    ssh = {
        "known_hosts": settings.known_hosts,
        "accept_new_host_keys": settings.accept_new_host_keys,
        "ssh_config": settings.core.ssh_config,
        "identities": list(settings.core.identities),
        "connect_timeout": settings.core.connect_timeout,
        "parallel": settings.parallel,
    }
    return JobRecord(plan.job, plan.local, plan.scheduler_host, plan.sched_port, hosts, processes, ssh,
                     grace=plan.options.grace, options={name: getattr(plan.options, name) for name in JOB_OPTIONS},
                     job_id=job_id)


def _sum_stats(stats: Any) -> SyncStats:
    """SyncStats added up field by field; `outside` becomes the sorted union of the links left out."""
    stats = list(stats)
    return SyncStats(*(sum(getattr(s, f) for s in stats) for f in
                       ("files_sent", "bytes_sent", "files_unchanged", "dirs_created", "removed")),
                     outside=tuple(sorted({name for s in stats for name in s.outside})))


def recorded_inventory(record: JobRecord) -> Inventory:
    """The hosts of a job on hosts as its record has them (how to reach each, its workdir and python, its workers,
    the scheduler's host and the spares): the inventory `run` deploys to when no host flag is typed, and the one
    `grow` adds a host to."""
    counts = {h.name: sum(1 for n in h.node_ids if n != "sched") for h in record.hosts}
    most = max(counts.values(), default=1) or 1
    hosts = tuple(InventoryHost(name=h.name, slots=counts[h.name] or most,
                                address=h.hostname if h.hostname != h.name else None, port=h.port, user=h.user,
                                key_file=h.key_file, workdir=posixpath.dirname(h.job_dir), python=h.python)
                  for h in record.hosts)
    workers = tuple(h.name for h in record.hosts if not h.spare and counts[h.name])
    spares = tuple(h.name for h in record.hosts if h.spare)
    return Inventory(hosts=hosts, scheduler=record.scheduler_host, workers=workers, spares=spares,
                     source="the job record")
