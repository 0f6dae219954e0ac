"""What the user asked for: flags, then the project's Fabric config (`toolkit:` section of fabric.yaml), then
defaults, resolved into one validated Settings. The option table here is the single list of shared flags."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from toolkit.errors import UserError
from toolkit.launcher.inventory import Inventory, load_ansible_inventory, load_hostfile, local_inventory, parse_hosts
from toolkit.launcher.plan import DEFAULT_WORKDIR, JobOptions, make_plan
from toolkit.launcher.slurm import in_allocation, slurm_inventory


@dataclass(frozen=True)
class Option:
    """One shared flag: `name` is the attribute (the flag is `--name` with dashes, the config key `toolkit.name`),
    `kind` the type typed and configured values are converted to (bool, int, float or str), `default` the value
    when neither gives one, `help` the flag's help text (one line of `fleet TASK --help`: the default is appended
    there when it says something), `metavar` what its value is called there, and `group` the section of the help
    it is listed in (GROUPS)."""

    name: str
    kind: type
    default: Any
    help: str
    metavar: str = ""
    group: str = "job"

    @property
    def flag(self) -> str:
        """The flag as typed: `--name-with-dashes` (a bool that defaults to true also takes `--no-name`)."""
        return "--" + self.name.replace("_", "-")


def _job_option(name: str, kind: type, help: str, metavar: str = "", group: str = "job") -> Option:
    """A flag that is a field of JobOptions: its default is JobOptions', the one place it is defined."""
    return Option(name, kind, next(f.default for f in dataclasses.fields(JobOptions) if f.name == name), help,
                  metavar, group)


# The sections of a task's help that the shared flags are listed in, in order, with their titles.
GROUPS = {
    "hosts": "Hosts and workers (no host flag: this machine, without SSH)",
    "job": "The job",
    "ssh": "Reaching the hosts",
}

# Every cluster task takes these flags; given to any task of one command line, they apply to all its tasks.
OPTIONS: tuple[Option, ...] = (
    Option("hostfile", str, None, "OpenMPI hostfile: 'host slots=N' lines", "FILE", "hosts"),
    Option("inventory", str, None, "Ansible inventory, INI or YAML", "FILE", "hosts"),
    Option("slurm", bool, False, "the Slurm allocation's hosts (default inside one)", group="hosts"),
    Option("standalone", bool, False, "this machine only, even inside an allocation", group="hosts"),
    Option("nproc_per_node", int, None, "workers on each host (sets every host's slots)", "N", "hosts"),
    Option("nnodes", int, None, "hosts with workers (checked); MIN:MAX may shrink", "N", "hosts"),
    _job_option("min_workers", int, "a lost host, no spare: go on with N or more", "N", "hosts"),
    Option("worker_num", int, None, "total workers [every slot; here: 1]", "N", "hosts"),
    Option("job", str, None, "job name [the project directory's name]", "NAME"),
    Option("project", str, ".", "the script's project, copied to every host", "DIR"),
    _job_option("script", str, "training script, in the project", "FILE"),
    _job_option("script_args", str, "its arguments as one string (or after --)", "ARGS"),
    _job_option("module", bool, "the script is a module, run as python -m (run's -m)"),
    _job_option("no_python", bool, "the script is a program, not Python (run's --no-python)"),
    _job_option("master_port", int, "scheduler P, store P+1 (here: a free pair)", "P"),
    _job_option("max_restarts", int, "restarts of each process before the job fails", "N"),
    _job_option("restart_refill", str, "refills the restarts: progress, never or S", "WHEN"),
    _job_option("node_timeout", float, "heartbeat silence after which a worker is dead", "S"),
    _job_option("cluster_time_out", int, "seconds for every worker to join", "S"),
    _job_option("host_timeout", float, "agent gone, workers dead: a spare takes over", "S"),
    _job_option("recovery", bool, "persist scheduler state (MS_ENABLE_RECOVERY)"),
    Option("data_path", str, None, "data root for the script (DATA_PATH)", "DIR"),
    Option("ckpt_dir", str, None, "checkpoints in DIR/<job> (CKPT_DIR) [<job dir>/ckpt]", "DIR"),
    Option("workdir", str, None, f"where jobs live on each host [~/{DEFAULT_WORKDIR}]", "DIR"),
    Option("python", str, None, "python on the hosts [python3; here: this one]", "PATH"),
    _job_option("grace", float, "from SIGTERM to SIGKILL when stopping", "S"),
    _job_option("bind_core", bool, "pin each worker to its own CPUs"),
    _job_option("warm_spare", bool, "a spare interpreter per host, for fast restarts"),
    _job_option("straggler_factor", float, "own work per step vs the median: a straggler", "X"),
    _job_option("metrics_address", str, "the scheduler's Prometheus endpoint, [HOST:]PORT", "ADDR"),
    _job_option("torchrun_script", bool, "on a fault restart all workers, even on toolkit.train"),
    _job_option("verify_every", str, "steps between replica checks (0: never)", "N"),
    _job_option("logical_ranks", int, "the job's logical ranks, served by the workers", "L"),
    Option("known_hosts", str, "~/.ssh/known_hosts", "host keys are checked against it", "FILE", "ssh"),
    Option("accept_new_host_keys", bool, False, "add unknown host keys (never changed ones)", group="ssh"),
    Option("parallel", int, 32, "hosts contacted at once", "N", "ssh"),
)
OPTION_NAMES = frozenset(o.name for o in OPTIONS)
_JOB_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class CoreFlags:
    """Fabric's own flags that concern toolkit: -H/--hosts, -S/--ssh-config, -i/--identity, -t/--connect-timeout."""

    hosts: str | None = None
    ssh_config: str | None = None
    identities: tuple[str, ...] = ()
    connect_timeout: float | None = None


@dataclass(frozen=True)
class Settings:
    """Everything a task that plans a job needs, resolved and validated by `resolve`: the job's options, its hosts,
    the project directory (absolute), and how to reach the hosts (hosts contacted at once, the host-key policy and
    known_hosts file, Fabric's own flags)."""

    options: JobOptions
    inventory: Inventory
    project: Path
    parallel: int
    accept_new_host_keys: bool
    known_hosts: str
    core: CoreFlags
    default_port: bool = False  # no --master-port typed, configured or recorded: a local job's is chosen at deploy

    @property
    def local(self) -> bool:
        """True for a job on this machine without SSH (no hosts given by flag or config)."""
        return self.inventory.local


# The options that are part of a deployed job (the record keeps them): typed again later, they must agree with it.
JOB_OPTIONS = ("script", "script_args", "module", "no_python", "worker_num", "nproc_per_node", "nnodes", "master_port",
               "cluster_time_out", "node_timeout", "recovery", "data_path", "ckpt_dir", "workdir", "python",
               "max_restarts", "grace", "bind_core", "warm_spare", "torchrun_script", "host_timeout", "restart_refill",
               "metrics_address", "verify_every", "min_workers", "min_nodes", "logical_ranks")


# How deploy reached the hosts, kept in the job record's `ssh` (every later task reaches them the same way): typed
# again, they must agree with it, as the job options must.
RECORDED_SSH = ("known_hosts", "accept_new_host_keys", "parallel")


@dataclass(frozen=True)
class Request:
    """What one command line asked for, before anything is resolved: the flags typed (`given`), the project's
    config (`toolkit:` in fabric.yaml), Fabric's own flags, where it was typed, and the environment it was typed in
    (read for a Slurm allocation's variables only, never written).

    Why not resolve at once: a task that plans a job (plan, deploy, and train of a job never deployed) needs every
    input to be valid, its script included; a task that works on a deployed job (status, logs, stop, restart,
    train of a deployed job) only needs to find the job's record, and reads the rest from it."""

    given: Mapping[str, Any]
    config: Mapping[str, Any]
    core: CoreFlags
    cwd: Path
    environ: Mapping[str, str] = dataclasses.field(default_factory=dict)
    recorded: Recorded | None = None

    def settings(self, script_required: bool = True) -> Settings:
        """Resolve the request for a task that plans a job (see `resolve`); UserError names the first bad input."""
        return resolve(self.given, self.config, self.core, self.cwd, script_required=script_required,
                       environ=self.environ, recorded=self.recorded)

    def with_recorded(self, recorded: Recorded) -> Request:
        """The same request with a deployed job's values as the defaults of what was not typed (`run`)."""
        return dataclasses.replace(self, recorded=recorded)

    def job_ref(self) -> JobRef:
        """Where to find the deployed job's record: in --project if given, else where the command is typed (the
        project itself, or where `deploy --project DIR` was typed: a pointer there names the project). UserError if
        the project directory does not exist or a typed flag or config entry is invalid."""
        values = _values(self.given, self.config)
        project = (self.cwd / str(values.get("project", "."))).resolve()
        if not project.is_dir():
            raise UserError(f"--project {project}: not a directory; give the project directory the job was deployed "
                            "from")
        return JobRef(project, values.get("job"), self)

    def contradictions(self, job: str, options: Mapping[str, Any], hosts: tuple[str, ...], local: bool) -> list[str]:
        """The typed flags whose value differs from what job `job` was deployed with, one line each. `options` holds
        the recorded JOB_OPTIONS and the SSH settings deploy recorded (RECORDED_SSH)."""
        typed = _values(self.given, {})
        out = []
        for name in JOB_OPTIONS + RECORDED_SSH:
            if name not in typed or name not in options:
                continue
            value = typed[name]
            if name == "workdir" and local:
                value = str((self.cwd / Path(value).expanduser()).resolve())
            if name == "known_hosts":
                value = str(Path(value).expanduser())
            if name == "nnodes" and isinstance(value, tuple):  # MIN:MAX: MAX recorded as nnodes, MIN as min_nodes
                if (value[1], value[0]) == (options[name], options.get("min_nodes")):
                    continue
                value = f"{value[0]}:{value[1]}"
            if value == options[name]:
                continue
            flag = "--" + name.replace("_", "-")
            was = "without it" if options[name] is None else f"with {options[name]!r}"
            if name == "script_args":
                out.append(f"the script's arguments {value!r} are not the ones job {job} was deployed with "
                           f"({options[name]!r}): 'fleet deploy train -- {value}' deploys and starts them")
            else:
                out.append(f"{flag} {value!r}, but job {job} was deployed {was}")
        if self.given.get("standalone") and not local:
            out.append(f"--standalone, but job {job} was deployed to {', '.join(hosts)}")
        if self.core.hosts is not None or any(self.given.get(k) for k in ("hostfile", "inventory", "slurm")):
            settings = self.settings(script_required=False)
            plan = make_plan(settings.inventory, settings.options, str(settings.project))
            planned = tuple(h.name for h in plan.hosts)
            if local or planned != hosts:
                where = "this machine" if local else ", ".join(hosts)
                out.append(f"the hosts typed would run it on {', '.join(planned)}, but job {job} was deployed to "
                           f"{where}")
        return out


# The flags that say where a job runs and how many workers it has: typed, none of them is taken from a record.
HOST_FLAGS = ("hosts", "hostfile", "inventory", "slurm", "standalone")
SIZE_FLAGS = ("worker_num", "nproc_per_node", "nnodes")


@dataclass(frozen=True)
class Recorded:
    """What a deployed job was deployed with, as the defaults of a command that deploys it again (`run`): its
    job options (JOB_OPTIONS) and, for a job on hosts, its inventory. They come after the typed flags and before
    the project's config: only what is typed changes the job (`resolve` applies them)."""

    options: Mapping[str, Any]
    inventory: Inventory | None  # None: a job on this machine


@dataclass(frozen=True)
class JobRef:
    """Which deployed job a task works on: the project whose record it is in, its name (None: the project's only
    job, or among several the one named after the project), and the request, to check what was typed against the
    record."""

    project: Path
    job: str | None
    request: Request

    @property
    def default_job(self) -> str:
        """The job name made from the project directory's name: what --job defaults to."""
        return _job_name(self.project)


def _values(given: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - OPTION_NAMES)
    if unknown:
        raise UserError(f"fabric.yaml: unknown setting toolkit.{unknown[0]}; known: {', '.join(sorted(OPTION_NAMES))}")
    values = {o.name: _convert(o, config[o.name], f"fabric.yaml: toolkit.{o.name}")
              for o in OPTIONS if o.name in config}
    values.update({o.name: _convert(o, given[o.name], "--" + o.name.replace("_", "-"))
                   for o in OPTIONS if o.name in given})
    return values


def resolve(given: Mapping[str, Any], config: Mapping[str, Any], core: CoreFlags, cwd: Path,
            script_required: bool = True, environ: Mapping[str, str] | None = None,
            recorded: Recorded | None = None) -> Settings:
    """`given` holds only the flags typed on the command line; `config` is the `toolkit:` config section; `environ`
    the environment (only a Slurm allocation's variables are read). With `script_required` (deploy, train) the
    training script must exist in the project; a plan is shown without.

    A typed flag beats the config, which beats the Option's default. Without a host source (--hosts, --hostfile,
    --inventory, --slurm, or a hostfile/inventory/slurm in the config) the hosts are the Slurm allocation's when
    `environ` has SLURM_JOB_NODELIST (unless the config says `slurm: false`), else the job is local: --worker-num
    workers (default 1) on this machine, --workdir made absolute (default ~/toolkit-jobs), this interpreter as
    --python. Raises UserError (InventoryError and PlanError are ones) for the first bad input: an unknown config
    key, a value of the wrong type, two host sources, a malformed host source (a Slurm variable included), a
    project that is not a directory, a missing script, flags JobOptions rejects, --parallel below 1.

    With `recorded` (a deployed job's values, see Recorded), they stand in for what was not typed: its options
    (but none of SIZE_FLAGS when one of them was typed) and its hosts (unless a host flag was typed)."""
    config = _without_recorded(config, recorded, given, core)
    on_hosts = _typed_hosts(given, core) or any(config.get(k) for k in ("hostfile", "inventory", "slurm"))
    given = _counted_nproc(given, "--nproc-per-node", on_hosts)
    config = _counted_nproc(config, "fabric.yaml: toolkit.nproc_per_node", on_hosts)
    values = {o.name: o.default for o in OPTIONS} | _values(given, config)
    if recorded is not None and recorded.inventory is not None and not _typed_hosts(given, core):
        inventory = recorded.inventory
    else:
        inventory = _inventory(given, config, core.hosts, values, cwd, environ or {})
    project = (cwd / str(values["project"])).resolve()
    if not project.is_dir():
        raise UserError(f"--project {project}: not a directory; give the directory that holds the training script")
    job = values["job"] or _job_name(project)
    local = inventory.local
    workdir = values["workdir"]
    if workdir is None:
        workdir = str(Path.home() / DEFAULT_WORKDIR) if local else DEFAULT_WORKDIR
    elif local:
        workdir = str((cwd / Path(workdir).expanduser()).resolve())
    python = values["python"] or (sys.executable if local else "python3")
    script = values["script"]
    is_file = not (values["module"] or values["no_python"])  # a module or program is found where it runs
    if script_required and is_file and not Path(script).is_absolute() and not (project / script).is_file():
        raise UserError(f"--script {script}: no such file in {project}; pass --project DIR or the script's path in it")

    job_fields = {f.name for f in dataclasses.fields(JobOptions)} & OPTION_NAMES
    options = JobOptions(**{**{n: values[n] for n in job_fields}, **_min_max_nodes(values, given, recorded),
                            "job": job, "workdir": workdir, "python": python})
    parallel = values["parallel"]
    if parallel < 1:
        raise UserError(f"--parallel {parallel}: give at least 1")
    return Settings(
        options=options,
        inventory=inventory,
        project=project,
        parallel=parallel,
        accept_new_host_keys=values["accept_new_host_keys"],
        known_hosts=str(Path(values["known_hosts"]).expanduser()),
        core=core,
        default_port="master_port" not in given and "master_port" not in config,
    )


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one directory per GPU the driver knows (no torch import needed)


def _counted_nproc(values: Mapping[str, Any], where: str, on_hosts: bool) -> Mapping[str, Any]:
    """`values` with torchrun's `--nproc-per-node auto|cpu|gpu` counted on this machine: gpu its GPUs (UserError if
    it has none), cpu its CPUs, auto its GPUs if it has any, else its CPUs. On hosts they would have to be counted
    on each host: UserError saying to give a number (or each host's slots)."""
    word = str(values.get("nproc_per_node", "")).strip().lower()
    if word not in ("auto", "cpu", "gpu"):
        return values
    if on_hosts:
        raise UserError(f"{where} {word}: counted on this machine only; for hosts give a number, or each host's "
                        "slots (host:N in --hosts, slots=N in a hostfile or inventory)")
    try:
        gpus = sum(1 for _ in NVIDIA_GPUS.iterdir())
    except OSError:
        gpus = 0
    if word == "gpu" and not gpus:
        raise UserError(f"{where} gpu: this machine has no GPU the NVIDIA driver knows ({NVIDIA_GPUS}); give a number, "
                        "or cpu")
    count = gpus if word == "gpu" or (word == "auto" and gpus) else (os.cpu_count() or 1)
    return {**values, "nproc_per_node": count}


def _typed_hosts(given: Mapping[str, Any], core: CoreFlags) -> bool:
    return core.hosts is not None or any(given.get(k) not in (None, False) for k in HOST_FLAGS if k != "hosts")


def _without_recorded(config: Mapping[str, Any], recorded: Recorded | None, given: Mapping[str, Any],
                      core: CoreFlags) -> Mapping[str, Any]:
    """The config with the recorded job's options over it (they beat the config, typed flags beat them): none of
    SIZE_FLAGS when one was typed, and the host sources of the config only when a host flag was typed (else the
    recorded hosts, or for a local job this machine)."""
    if recorded is None:
        return config
    out = dict(config)
    sized = any(given.get(k) is not None for k in SIZE_FLAGS)
    for name, value in recorded.options.items():
        if name in OPTION_NAMES and not (sized and name in SIZE_FLAGS):
            out[name] = value
        if value is None:
            out.pop(name, None)
    if not _typed_hosts(given, core):
        for key in ("hostfile", "inventory", "slurm"):
            out.pop(key, None)
        out["slurm"] = False  # the recorded hosts, not an allocation's
    return out


def _inventory(given: Mapping[str, Any], config: Mapping[str, Any], cli_hosts: str | None, values: Mapping[str, Any],
               cwd: Path, environ: Mapping[str, str]) -> Inventory:
    typed = [(k, v) for k, v in (("hosts", cli_hosts), ("hostfile", given.get("hostfile")),
                                 ("inventory", given.get("inventory"))) if v is not None]  # '' is a typo, not "none"
    typed += [("slurm", True)] if given.get("slurm") else []
    typed += [("standalone", True)] if given.get("standalone") else []
    if not typed:
        typed = [(k, config[k]) for k in ("hostfile", "inventory") if config.get(k)]
        typed += [("slurm", True)] if values["slurm"] else []
    if len(typed) > 1:
        flags = " and ".join("--" + k for k, _ in typed)
        raise UserError(f"{flags} both given: describe the hosts one way (--hosts, --hostfile, --inventory or --slurm)")
    if not typed and "slurm" not in given and "slurm" not in config and in_allocation(environ):
        typed = [("slurm", True)]  # inside an allocation, with no other source: its hosts, not this machine
    if not typed or typed[0][0] == "standalone":
        return local_inventory(values.get("worker_num") or values.get("nproc_per_node") or 1)
    kind, value = typed[0]
    if kind == "slurm":
        return slurm_inventory(environ)
    if kind == "hosts":
        return parse_hosts(str(value))
    path = Path(str(value)).expanduser()
    path = path if path.is_absolute() else cwd / path
    return load_hostfile(path) if kind == "hostfile" else load_ansible_inventory(path)


def _convert(option: Option, value: Any, where: str) -> Any:
    if value is None:
        return None
    if option.name == "nnodes" and ":" in str(value):
        return _min_max(str(value), where)
    kind = option.kind
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{where}={value!r}: expected true or false")
    if kind in (int, float):
        try:
            if isinstance(value, bool):
                raise ValueError
            number = kind(str(value).strip()) if kind is float else int(str(value).strip(), 10)
        except ValueError:
            raise UserError(f"{where}={value!r}: expected a {'whole ' if kind is int else ''}number") from None
        if not math.isfinite(number):
            raise UserError(f"{where}={value!r}: expected a finite number")
        return number
    return str(value)


def _min_max_nodes(values: Mapping[str, Any], given: Mapping[str, Any], recorded: Recorded | None) -> dict[str, Any]:
    """torchrun's --nnodes MIN:MAX (`_min_max`'s pair) as JobOptions' nnodes (MAX) and min_nodes (MIN); without it
    typed, a deployed job's recorded MIN."""
    if isinstance(values["nnodes"], tuple):
        return {"nnodes": values["nnodes"][1], "min_nodes": values["nnodes"][0]}
    if recorded is not None and given.get("nnodes") is None:
        return {"min_nodes": recorded.options.get("min_nodes")}
    return {}


def _min_max(value: str, where: str) -> tuple[int, int]:
    """torchrun's --nnodes MIN:MAX as (MIN, MAX): MAX is the hosts that run workers (checked against the plan as a
    single number is), MIN how many of them the job may shrink to. UserError unless 1 <= MIN <= MAX, whole numbers."""
    low, _, high = value.partition(":")
    try:
        lo, hi = int(low.strip(), 10), int(high.strip(), 10)
    except ValueError:
        raise UserError(f"{where}={value!r}: expected MIN:MAX, two whole numbers of hosts (2:4)") from None
    if not 1 <= lo <= hi:
        raise UserError(f"{where}={value!r}: give 1 <= MIN <= MAX (the job may shrink to MIN hosts of MAX)")
    return lo, hi


def _job_name(project: Path) -> str:
    name = _JOB_CHARS.sub("-", project.name).strip("-.") or "job"
    return name[:64]
