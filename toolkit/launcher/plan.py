"""Inventory + job options -> LaunchPlan: what runs where, with which environment. Pure: no I/O.

Ranks are assigned host by host in inventory order (msrun with --node_rank), so every rank id, node id and
environment is known before anything starts and stays the same across restarts.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping, Sequence

from toolkit.contracts import envvars, hostspec
from toolkit.contracts.logical import MAX_LOGICAL_RANKS
from toolkit.contracts.protocol import RECOVERY_RESTART as P_RECOVERY_RESTART
from toolkit.contracts.protocol import worker_node_id
from toolkit.errors import UserError
from toolkit.launcher.inventory import MAX_SLOTS, Host, Inventory

SCHED_NODE_ID = "sched"
EXPECTED_FILE = "expected.json"  # on the scheduler's host: where each node id is expected to run
DEFAULT_WORKDIR = "toolkit-jobs"  # relative: under the login user's home on each host
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # whole name: fullmatch (a `$` would let "\n" through)


class PlanError(UserError):
    """Job options that cannot make a plan; the message is the one line shown to the user."""


def log_name(node_id: str) -> str:
    """msrun's names: scheduler.log, worker_<rank>.log."""
    return "scheduler.log" if node_id == SCHED_NODE_ID else f"{node_id}.log"


@dataclass(frozen=True)
class JobOptions:
    """The flags every cluster task takes (msrun's where it has one); validated here, once.

    Construction raises PlanError, naming the flag, for a value no job can run with: a job name that is not a safe
    directory name, a master port outside 1024-65534 (the store takes the next port), a worker count below 1, a
    cluster timeout below 1 s, a non-finite node timeout or grace, a node timeout not longer than the heartbeat
    interval, a negative grace or max restarts, an empty script, a newline or NUL in a path, script arguments a
    shell could not split."""

    job: str
    script: str = "train.py"
    script_args: str = ""
    module: bool = False  # `script` is a module's name, run as `python -m` runs it (torchrun's -m)
    no_python: bool = False  # `script` is a program, run as it is (torchrun's --no-python)
    worker_num: int | None = None  # None: every slot
    nproc_per_node: int | None = None  # torchrun's: workers on each worker host (instead of its slots)
    nnodes: int | None = None  # torchrun's: the number of hosts that run workers, checked against the plan
    min_nodes: int | None = None  # torchrun's --nnodes MIN:MAX's MIN: the job may shrink to that many hosts
    min_workers: int | None = None  # the fewest workers the job may shrink to (a lost host, no spare); None: never
    master_port: int = envvars.DEFAULT_SCHED_PORT
    cluster_time_out: int = envvars.DEFAULT_TOPO_TIMEOUT
    node_timeout: float = envvars.DEFAULT_NODE_TIMEOUT
    heartbeat_interval: float = envvars.DEFAULT_HEARTBEAT_INTERVAL
    recovery: bool = True
    data_path: str | None = None
    ckpt_dir: str | None = None
    workdir: str = DEFAULT_WORKDIR
    python: str = "python3"
    max_restarts: int = 3
    restart_refill: str = hostspec.REFILL_PROGRESS  # when a process's count of failures starts again (hostspec)
    grace: float = 10.0
    bind_core: bool = False
    warm_spare: bool = True
    torchrun_script: bool = False  # recover by relaunching every worker even if the script uses toolkit.train
    straggler_factor: float = envvars.DEFAULT_STRAGGLER_FACTOR  # own work per step vs the others' median: a straggler
    host_timeout: float = envvars.DEFAULT_HOST_TIMEOUT  # s a host's ranks dead, its agent gone: lost, a spare steps in
    metrics_address: str | None = None  # [HOST:]PORT of the scheduler's Prometheus endpoint; None: not served
    verify_every: str = "auto"  # steps between the Trainer's replica checks, 0 never, auto: at most 1% of step time
    logical_ranks: int | None = None  # the job's logical ranks L (toolkit.contracts.logical); None: the worker count

    def __post_init__(self) -> None:
        if not _JOB_NAME.fullmatch(self.job):
            raise PlanError(
                f"--job {self.job!r}: a job name is 1-64 letters, digits, '.', '_' or '-', starting with a letter "
                "or digit (it names directories on every host)"
            )
        if not 1024 <= self.master_port <= 65534:
            raise PlanError(
                f"--master-port {self.master_port}: choose a port from 1024 to 65534 (the store uses the next one)"
            )
        if self.worker_num is not None and self.worker_num < 1:
            raise PlanError(f"--worker-num {self.worker_num}: a job needs at least 1 worker")
        if self.nproc_per_node is not None and not 1 <= self.nproc_per_node <= MAX_SLOTS:
            raise PlanError(f"--nproc-per-node {self.nproc_per_node}: give 1 to {MAX_SLOTS} workers per host")
        if self.nnodes is not None and self.nnodes < 1:
            raise PlanError(f"--nnodes {self.nnodes}: a job runs on at least 1 host")
        if self.cluster_time_out < 1:
            raise PlanError(f"--cluster-time-out {self.cluster_time_out}: give a positive number of seconds")
        for flag, value in (("--node-timeout", self.node_timeout), ("--grace", self.grace)):
            if not math.isfinite(value):
                raise PlanError(f"{flag} {value}: give a finite number of seconds")
        if not 0 < self.heartbeat_interval < self.node_timeout:
            raise PlanError(
                f"--node-timeout {self.node_timeout}: must be longer than the heartbeat interval "
                f"({self.heartbeat_interval} s)"
            )
        if self.max_restarts < 0:
            raise PlanError(f"--max-restarts {self.max_restarts}: give 0 or more")
        try:
            hostspec.parse_refill(self.restart_refill)
        except ValueError as e:
            raise PlanError(f"--restart-refill {e}") from None
        if not 1 < self.straggler_factor < math.inf:
            raise PlanError(f"--straggler-factor {self.straggler_factor}: give a factor above 1 (1.5: a rank whose own "
                            "work per step takes 1.5 times the others' median is named a straggler)")
        if self.grace < 0:
            raise PlanError(f"--grace {self.grace}: give 0 or more seconds")
        if not 0 <= self.host_timeout < math.inf:
            raise PlanError(f"--host-timeout {self.host_timeout}: give 0 or more seconds (how long a host's agent may "
                            "be gone, its workers dead, before a spare takes its ranks; 0: only 'fleet replace')")
        if self.metrics_address:
            try:
                envvars.metrics_address(self.metrics_address)
            except ValueError as e:
                raise PlanError(f"--metrics-address {e}") from None
        if self.module and self.no_python:
            raise PlanError("-m and --no-python: the script is a module or a program, give one of them")
        if self.verify_every != "auto" and not self.verify_every.isdigit():
            raise PlanError(f"--verify-every {self.verify_every!r}: give a number of steps between the replicas' "
                            "checks (0: never) or auto (checks costing at most 1% of the step time)")
        _check_logical_ranks(self.logical_ranks, None)
        if not self.script.strip():
            raise PlanError("--script is empty: name the training script, e.g. --script train.py")
        for name, value in (("--workdir", self.workdir), ("--python", self.python), ("--script", self.script)):
            if "\n" in value or "\0" in value:
                raise PlanError(f"{name}: a newline or NUL byte cannot be part of a path")
        try:
            shlex.split(self.script_args)
        except ValueError as e:
            raise PlanError(f"--script-args {self.script_args!r}: {e}; quote it as a shell would") from None

    @property
    def script_argv(self) -> tuple[str, ...]:
        """`script_args` split as a shell would (checked at construction, so this never raises)."""
        return tuple(shlex.split(self.script_args))


@dataclass(frozen=True)
class Process:
    """One process of the job: the scheduler or a worker, with its complete environment.

    `rank` and `local_rank` are None for the scheduler. `env` is read-only and is exactly what its env file
    exports (docs/architecture.md); `cwd` is where it runs (`<job dir>/project`, or the project itself locally)."""

    host: str
    role: str
    node_id: str
    rank: int | None
    local_rank: int | None
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str] = field(hash=False)

    @property
    def log_name(self) -> str:
        """Its log file's name in the job's `logs/`: scheduler.log or worker_<rank>.log."""
        return log_name(self.node_id)


@dataclass(frozen=True)
class HostPlan:
    """What one host runs, and where the job lives there.

    `job_dir` is `<workdir>/<job>`; before deploy resolves it, a remote one may be relative to the login user's
    home. `python` is the interpreter the host's processes and agent run with."""

    host: Host
    job_dir: str
    python: str
    processes: tuple[Process, ...]
    standby: tuple[Process, ...] = ()

    @property
    def spare(self) -> bool:
        """A spare host: it runs nothing until it takes over a lost host's ranks (see `standby`)."""
        return bool(self.standby)

    @property
    def name(self) -> str:
        """The host's inventory name."""
        return self.host.name

    @property
    def ckpt_dir(self) -> str | None:
        """Where this host's workers keep their checkpoints (CKPT_DIR made absolute), None if it runs none."""
        for p in self.processes:
            if p.rank is not None:
                return posixpath.join(p.cwd, p.env[envvars.CKPT_DIR])
        return None


@dataclass(frozen=True)
class LaunchPlan:
    """What runs where for one job, with every environment: make_plan's result, plain immutable data.

    `hosts` holds the hosts that run something (the scheduler's, and those with workers), in inventory order, then
    the spare hosts (HostPlan.spare: nothing runs there until one takes over a lost host's ranks); ranks follow the
    order of the worker hosts. `sched_address` is how peers reach the scheduler's host (MS_SCHED_HOST, MASTER_ADDR);
    `sched_port` is the control server (--master-port), `store_port` the job store on the next port (MASTER_PORT).
    toolkit.launcher.render turns it into each host's files."""

    job: str
    options: JobOptions
    inventory: Inventory
    scheduler_host: str
    sched_address: str
    sched_port: int
    store_port: int
    world_size: int
    hosts: tuple[HostPlan, ...]

    @property
    def local(self) -> bool:
        """True for a job that runs on this machine without SSH."""
        return self.inventory.local

    def processes(self) -> Iterator[Process]:
        """Every process, host by host in plan order; on its host the scheduler comes before the workers. A spare's
        standby processes are not among them (they run only after a takeover)."""
        for host in self.hosts:
            yield from host.processes

    def process(self, node_id: str) -> Process:
        """The process `node_id` (e.g. worker_3, sched); PlanError listing the job's node ids if there is none."""
        for p in self.processes():
            if p.node_id == node_id:
                return p
        known = ", ".join(p.node_id for p in self.processes())
        raise PlanError(f"no process {node_id!r} in job {self.job}; the job has: {known}")

    def host_plan(self, name: str) -> HostPlan:
        """What host `name` runs; PlanError listing the job's hosts if it runs nothing in this job."""
        for h in self.hosts:
            if h.name == name:
                return h
        raise PlanError(f"host {name!r} runs nothing in job {self.job}; its hosts: {', '.join(self.host_names)}")

    @property
    def host_names(self) -> tuple[str, ...]:
        """Names of the job's hosts (spares last), in plan order."""
        return tuple(h.name for h in self.hosts)

    def expected_hosts(self) -> dict[str, str]:
        """{node_id: host} of every worker: the scheduler host's expected.json (TOOLKIT_EXPECTED), from which the
        formation-timeout message names where each missing worker should have started."""
        return {p.node_id: p.host for p in self.processes() if p.rank is not None}


def job_ckpt_dir(options: JobOptions) -> str | None:
    """The job's own directory under --ckpt-dir (`<ckpt-dir>/<job>`), None without one. Why not the directory as
    given: two jobs given the same one destroyed each other's checkpoints (each took the other's for files to
    refuse or prune), and `--fresh` moved it all aside; under its own subdirectory a job sees only its own (and a
    checkpoint root holding another key's is refused outright: toolkit.train.ckpt.hostdir)."""
    return posixpath.join(options.ckpt_dir, options.job) if options.ckpt_dir else None


def job_dir(host: Host, options: JobOptions) -> str:
    """`<workdir>/<job>` on `host`, the host's own workdir (inventory) taking precedence over --workdir. A relative
    workdir is under the login user's home on that host; deploy resolves it and plans again."""
    return posixpath.join(host.workdir or options.workdir, options.job)


def make_plan(inventory: Inventory, options: JobOptions, local_project_dir: str | None = None) -> LaunchPlan:
    """Place the scheduler and every worker, assign ranks host by host, and build each process's environment.

    Processes run in `<job dir>/project`, where deploy copies the project; a local job (no SSH) runs in place, in
    `local_project_dir`. Workers fill the worker hosts' slots in inventory order, so a --worker-num below the slot
    count leaves the last slots (and hosts) out. Each spare host (inventory.spares) comes last, running nothing, with
    every worker as it would run there (`HostPlan.standby`). Deterministic: the same inputs give the same plan, ranks
    included.

    Raises PlanError when --worker-num exceeds the inventory's slots, when a local inventory comes without
    `local_project_dir`, or when an absolute job directory is too deep for the agent's unix socket paths.
    """
    if inventory.local and local_project_dir is None:
        raise PlanError("a local job needs the project directory it runs in")
    placement = _placement(inventory, options)
    world = sum(n for _, n in placement)
    _check_logical_ranks(options.logical_ranks, world)
    sched = inventory.host(inventory.scheduler)
    build = _ProcessBuilder(options, _common_env(inventory, options, sched, world), world, len(placement),
                            local_project_dir if inventory.local else None, min_workers(options, placement))
    seats = _seats(placement)
    by_host: dict[str, list[Process]] = {h.name: [] for h, _ in placement}
    by_host.setdefault(sched.name, []).append(build.scheduler(sched, inventory.spares))
    for host, seat in seats:
        by_host[host.name].append(build.worker(host, seat))
    hosts = _host_plans(inventory, options, by_host, build, seats)
    for hp in hosts:
        _check_socket_paths(hp)
    return LaunchPlan(
        job=options.job,
        options=options,
        inventory=inventory,
        scheduler_host=sched.name,
        sched_address=sched.reach,
        sched_port=options.master_port,
        store_port=options.master_port + 1,
        world_size=world,
        hosts=hosts,
    )


@dataclass(frozen=True)
class _Seat:
    """Where one worker sits in the job: its global `rank`, its `local_rank` among the `local_world` workers of its
    host, and its host's index `group_rank` among the hosts that run workers."""

    rank: int
    local_rank: int
    local_world: int
    group_rank: int


def _seats(placement: list[tuple[Host, int]]) -> list[tuple[Host, _Seat]]:
    """Every worker's (host, seat), ranks assigned host by host in placement order, local ranks from 0 on each."""
    seats = []
    for group_rank, (host, n) in enumerate(placement):
        for local_rank in range(n):
            seats.append((host, _Seat(len(seats), local_rank, n, group_rank)))
    return seats


@dataclass(frozen=True)
class _ProcessBuilder:
    """Makes the job's Process records from what they all share: the options, the environment common to every
    process (`_common_env`), the world size, the number of worker hosts, and the directory a local job runs in
    (`project`; None: each host's `<job dir>/project`, where deploy copies it). Pure: the same seat on the same host
    always gives the same Process, which is how a spare's standby workers match the ones they would replace."""

    options: JobOptions
    common: Mapping[str, str]
    world: int
    groups: int
    project: str | None
    min_workers: int | None = None  # TOOLKIT_MIN_WORKERS (`min_workers`): None, the job never shrinks

    def _cwd(self, jd: str) -> str:
        """Where a process of the job directory `jd` runs."""
        return self.project or posixpath.join(jd, "project")

    def scheduler(self, sched: Host, spares: Sequence[str]) -> Process:
        """The scheduler process on `sched`; `spares` (inventory order) become its TOOLKIT_SPARES, less its own
        host."""
        options, jd = self.options, job_dir(sched, self.options)
        return Process(
            host=sched.name,
            role=envvars.ROLE_SCHED,
            node_id=SCHED_NODE_ID,
            rank=None,
            local_rank=None,
            argv=(_python(sched, options), "-m", "toolkit.scheduler"),
            cwd=self._cwd(jd),
            env=MappingProxyType({
                **self.common, **_dir_env(jd), envvars.MS_ROLE: envvars.ROLE_SCHED, envvars.MS_NODE_ID: SCHED_NODE_ID,
                envvars.TOOLKIT_EXPECTED: posixpath.join(jd, EXPECTED_FILE),
                envvars.TOOLKIT_STRAGGLER_FACTOR: _num(options.straggler_factor),
                envvars.TOOLKIT_HOST_TIMEOUT: _num(options.host_timeout),
                **({envvars.TOOLKIT_MIN_WORKERS: str(self.min_workers)} if self.min_workers is not None else {}),
                envvars.TOOLKIT_SPARES: ",".join(n for n in spares if n != sched.name),
                envvars.TORCHELASTIC_MAX_RESTARTS: str(options.max_restarts),
                **({envvars.TOOLKIT_METRICS_ADDRESS: options.metrics_address} if options.metrics_address else {}),
                **({envvars.TOOLKIT_LOGICAL_RANKS: str(options.logical_ranks)} if options.logical_ranks else {}),
            }),
        )

    def worker(self, host: Host, seat: _Seat) -> Process:
        """The worker of `seat`, run from `host`'s job directory (a spare's standby worker is the same seat on the
        spare host)."""
        options, jd = self.options, job_dir(host, self.options)
        return Process(
            host=host.name,
            role=envvars.ROLE_WORKER,
            node_id=worker_node_id(seat.rank),
            rank=seat.rank,
            local_rank=seat.local_rank,
            argv=(_python(host, options), *_wrapper(options), *_script_kind(options), options.script,
                  *options.script_argv),
            cwd=self._cwd(jd),
            env=MappingProxyType(self._worker_env(host, seat, jd)),
        )

    def _worker_env(self, host: Host, seat: _Seat, jd: str) -> dict[str, str]:
        """The environment of the worker of `seat` on `host` (job directory `jd`): msrun's, torchrun's and
        toolkit's variables (docs/architecture.md)."""
        options, rank = self.options, str(seat.rank)
        env = {
            **self.common,
            **_dir_env(jd),
            envvars.MS_ROLE: envvars.ROLE_WORKER,
            envvars.MS_NODE_ID: worker_node_id(seat.rank),
            envvars.RANK_ID: rank,
            envvars.RANK: rank,
            envvars.LOCAL_RANK: str(seat.local_rank),
            envvars.DEVICE_ID: str(seat.local_rank),
            envvars.LOCAL_WORLD_SIZE: str(seat.local_world),
            envvars.GROUP_RANK: str(seat.group_rank),
            envvars.GROUP_WORLD_SIZE: str(self.groups),
            envvars.ROLE_NAME: envvars.DEFAULT_ROLE_NAME,
            envvars.ROLE_RANK: rank,
            envvars.ROLE_WORLD_SIZE: str(self.world),
            envvars.TORCHELASTIC_RUN_ID: options.job,
            envvars.TORCHELASTIC_MAX_RESTARTS: str(options.max_restarts),
            envvars.TOOLKIT_HEARTBEAT_INTERVAL: _num(
                envvars.heartbeat_interval(self.world, options.heartbeat_interval, options.node_timeout)),
            envvars.TORCH_NCCL_COORD_CHECK_MILSEC: str(envvars.nccl_coord_check_ms(self.world)),
            envvars.TOOLKIT_AGENT_SOCKET: posixpath.join(jd, "state", "progress.sock"),
            envvars.TOOLKIT_HOST: host.name,
            envvars.TORCHELASTIC_USE_AGENT_STORE: "True",
            envvars.CKPT_DIR: job_ckpt_dir(options) or posixpath.join(jd, "ckpt"),
        }
        if options.data_path is not None:
            env[envvars.DATA_PATH] = options.data_path
        if options.torchrun_script:
            env[envvars.TOOLKIT_RECOVERY] = P_RECOVERY_RESTART
        if options.verify_every != "auto":
            env[envvars.TOOLKIT_VERIFY_EVERY] = options.verify_every
        return env


def _host_plans(inventory: Inventory, options: JobOptions, by_host: Mapping[str, list[Process]],
                build: _ProcessBuilder, seats: list[tuple[Host, _Seat]]) -> tuple[HostPlan, ...]:
    """The HostPlans: every host that runs something (`by_host`), in inventory order, then each spare host that
    runs nothing, standing by with every worker seat as it would run there."""
    hosts = tuple(
        HostPlan(host=h, job_dir=job_dir(h, options), python=_python(h, options), processes=tuple(by_host[h.name]))
        for h in inventory.hosts
        if h.name in by_host
    )
    return hosts + tuple(
        HostPlan(host=h, job_dir=job_dir(h, options), python=_python(h, options), processes=(),
                 standby=tuple(build.worker(h, seat) for _, seat in seats))
        for h in (inventory.host(name) for name in inventory.spares)
        if h.name not in by_host
    )


def min_workers(options: JobOptions, placement: Sequence[tuple[Host, int]]) -> int | None:
    """How far the job may shrink, in workers: --min-workers, or for --nnodes MIN:MAX the workers of the MIN hosts
    with the fewest (whichever hosts are lost, MIN hosts left hold at least that many). None: it never shrinks.
    PlanError for --min-workers below 1 or above the job's workers (it could never run), for both it and MIN:MAX,
    and for MIN above the hosts."""
    world = sum(n for _, n in placement)
    if options.min_workers is not None and options.min_workers < 1:
        raise PlanError(f"--min-workers {options.min_workers}: give at least 1 (the fewest workers the job may "
                        "shrink to when a host is lost with no spare)")
    if options.min_workers is not None and options.min_nodes is not None:
        raise PlanError(f"--min-workers {options.min_workers} and --nnodes {options.min_nodes}:{options.nnodes}: "
                        "both say how far the job may shrink; give one of them")
    if options.min_workers is not None and options.min_workers > world:
        raise PlanError(f"--min-workers {options.min_workers} is above the job's {world} workers: give 1 to {world}")
    if options.min_nodes is None:
        return options.min_workers
    if options.min_nodes > len(placement):
        raise PlanError(f"--nnodes {options.min_nodes}:{options.nnodes}: MIN is above the {len(placement)} host(s) "
                        "that run workers; give MIN <= MAX")
    return sum(sorted(n for _, n in placement)[:options.min_nodes])


def _check_logical_ranks(logical: int | None, world: int | None) -> None:
    """PlanError naming --logical-ranks for a count out of range, or below the `world` workers (when known)."""
    if logical is None:
        return
    if not 1 <= logical <= MAX_LOGICAL_RANKS:
        raise PlanError(f"--logical-ranks {logical}: give 1 to {MAX_LOGICAL_RANKS} (at least the number of workers)")
    if world is not None and logical < world:
        raise PlanError(f"--logical-ranks {logical} is below the {world} workers: each worker serves one logical rank "
                        f"or more; give at least {world}, or leave it out (then it is {world})")


def _placement(inventory: Inventory, options: JobOptions) -> list[tuple[Host, int]]:
    """(host, workers on it) for the hosts that run workers, in order: each worker host's slots (or
    --nproc-per-node) filled in turn until --worker-num workers are placed (every slot without it). PlanError when
    --worker-num exceeds the slots, or when --nnodes is not the number of hosts that run workers."""
    per_host = [(h, options.nproc_per_node or h.slots) for h in inventory.worker_hosts]
    total = sum(n for _, n in per_host)
    world = options.worker_num if options.worker_num is not None else total
    if world > total:
        slots = f"{total} slots of {inventory.source}" if options.nproc_per_node is None else (
            f"{total} workers of --nproc-per-node {options.nproc_per_node} on {len(per_host)} host(s)")
        raise PlanError(f"--worker-num {world} is more than the {slots}; add hosts or slots, or lower --worker-num")
    placement = []
    left = world
    for host, slots in per_host:
        n = min(slots, left)
        if n:
            placement.append((host, n))
        left -= n
    if options.nnodes is not None and options.nnodes != len(placement):
        names = ", ".join(h.name for h, _ in placement)
        raise PlanError(f"--nnodes {options.nnodes}, but {len(placement)} host(s) would run workers ({names}): "
                        "toolkit runs on the hosts you name (--hosts, --hostfile, --inventory, --slurm; none: this "
                        "machine); name that many, or leave --nnodes out")
    return placement


MAX_SOCKET_PATH = 107  # bytes of a unix socket path (sun_path, with its NUL): the agent's sockets are in the job dir
AGENT_SOCKETS = ("state/agent.sock", "state/progress.sock")


def _check_socket_paths(hp: HostPlan) -> None:
    """The agent's control and progress sockets live in the job directory: a job directory too deep for a unix
    socket would deploy and then fail at the first `status`. Known only for absolute job dirs (a remote workdir
    relative to home is resolved at deploy, which plans again)."""
    if not posixpath.isabs(hp.job_dir):
        return
    for name in AGENT_SOCKETS:
        path = posixpath.join(hp.job_dir, name)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise PlanError(f"{hp.name}: the job directory {hp.job_dir} is too deep for the agent's sockets ({path} "
                            f"is over {MAX_SOCKET_PATH} bytes); choose a shorter --workdir or --job name")


def _common_env(inventory: Inventory, options: JobOptions, sched: Host, world: int) -> dict[str, str]:
    return {
        envvars.MS_SCHED_HOST: sched.reach,
        envvars.MS_SCHED_PORT: str(options.master_port),
        envvars.MASTER_ADDR: sched.reach,
        envvars.MASTER_PORT: str(options.master_port + 1),
        envvars.MS_WORKER_NUM: str(world),
        envvars.RANK_SIZE: str(world),
        envvars.WORLD_SIZE: str(world),
        envvars.MS_TOPO_TIMEOUT: str(options.cluster_time_out),
        envvars.MS_NODE_TIMEOUT: _num(options.node_timeout),
        envvars.MS_ENABLE_RECOVERY: "1" if options.recovery else "0",
        envvars.TOOLKIT_JOB: options.job,
        envvars.OMP_NUM_THREADS: "1",
    }


def _dir_env(jd: str) -> dict[str, str]:
    return {
        envvars.MS_RECOVERY_PATH: posixpath.join(jd, "recovery"),
        envvars.TOOLKIT_TOKEN_FILE: posixpath.join(jd, "token"),
    }


def _script_kind(options: JobOptions) -> tuple[str, ...]:
    """What toolkit.train's wrapper is told the script is: a module (`-m`), a program (`--no-python`) or a file."""
    return ("-m",) if options.module else ("--no-python",) if options.no_python else ()


def _wrapper(options: JobOptions) -> tuple[str, ...]:
    """Every worker runs its script through `python -m toolkit.train` (toolkit.train.wrapper): a torchrun-style
    script is registered on its behalf, a toolkit.train script registers itself."""
    return ("-m", "toolkit.train")


def _python(host: Host, options: JobOptions) -> str:
    return host.python or options.python


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
