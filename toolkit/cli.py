"""The command line: Fabric tasks (`fab deploy train --hosts=...` through fabfile.py) and the same task set as the
`fleet` program, which works from any directory.

Fabric runs a task once per `--hosts` entry; toolkit's tasks act on the whole cluster at once, so they run under
ClusterExecutor, which calls each task once and hands it the raw host list. Flags shared by the tasks (settings.
OPTIONS) typed after any task of one command line apply to every task of it: `fab deploy train --hostfile h`.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable

import fabric
import fabric.main
from invoke import Call, Collection, Context, Exit, Task
from invoke.exceptions import ParseError
from invoke.parser import ParserContext

from toolkit import tasks
from toolkit.check.decide import DEFAULT_MAX_SKEW, DEFAULT_MIN_FREE_GB, DEFAULT_SLOW_FACTOR
from toolkit.errors import UserError
from toolkit.settings import OPTION_NAMES, OPTIONS, CoreFlags, Request


class ClusterContext(Context):
    """An invoke Context that also carries what the command line said about hosts and shared flags."""

    def __init__(self, config: Any, core: CoreFlags, given: dict[str, Any]) -> None:
        super().__init__(config=config)
        self._set(core=core, given=given)

    def request(self) -> Request:
        """This command line's Request: the shared flags typed, the project config's `toolkit:` section, Fabric's
        own flags, the current directory and the environment (a Slurm allocation's hosts). Nothing is resolved yet
        (settings.Request says why)."""
        section = self.config.get("toolkit") or {}
        return Request(self.given, dict(section), self.core, Path.cwd(), dict(os.environ))


class ClusterCall(Call):
    """An invoke Call that carries Fabric's core flags and the shared flags into the context it makes, so that
    every task of one command line sees the same ones."""

    def __init__(self, *args: Any, core: CoreFlags | None = None, given: dict[str, Any] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.core = core or CoreFlags()
        self.given = given or {}

    def clone_data(self) -> dict[str, Any]:
        """invoke's clone data plus `core` and `given`: a cloned call keeps them."""
        return {**super().clone_data(), "core": self.core, "given": self.given}

    def make_context(self, config: Any) -> ClusterContext:
        """A ClusterContext, which is what `cluster_task` bodies require, instead of invoke's Context."""
        return ClusterContext(config, self.core, self.given)


class ClusterExecutor(fabric.Executor):
    """Runs each task once for the whole cluster (Fabric's own executor would run it once per host)."""

    def execute(self, *tasks: Any) -> dict[Task, Any]:
        """Collect the shared flags typed after any of the tasks, then run them; a shared flag given twice with
        different values exits with code 2."""
        self._given = _shared_flags([t for t in tasks if isinstance(t, ParserContext)])
        return super().execute(*tasks)

    def expand_calls(self, calls: list[Any], apply_hosts: bool = True) -> list[Any]:
        """One ClusterCall per task, its pre- and post-tasks included, never one per `--hosts` entry; `apply_hosts`
        is ignored. A `fab -H hosts -- command` remainder is not a task: exit code 2."""
        if self.core and self.core.remainder:
            raise Exit("error: 'fab -H hosts -- command' is not a toolkit task; run ssh or 'fab --list'", code=2)
        core = _core_flags(self.core[0].args) if self.core else CoreFlags()
        out = []
        for call in calls:
            call = call if isinstance(call, Call) else Call(task=call)
            out.extend(self.expand_calls(call.pre, apply_hosts=False))
            out.append(call.clone(into=ClusterCall, with_={"core": core, "given": getattr(self, "_given", {})}))
            out.extend(self.expand_calls(call.post, apply_hosts=False))
        return out


def _core_flags(args: Any) -> CoreFlags:
    timeout = args["connect-timeout"].value
    return CoreFlags(
        hosts=args.hosts.value,
        ssh_config=args["ssh-config"].value,
        identities=tuple(args.identity.value or ()),
        connect_timeout=float(timeout) if timeout else None,
    )


def _shared_flags(contexts: list[ParserContext]) -> dict[str, Any]:
    given: dict[str, Any] = {}
    source: dict[str, str] = {}
    for ctx in contexts:
        for arg in ctx.args.values():
            name = arg.attr_name or arg.name
            if name not in OPTION_NAMES or not arg.got_value:
                continue
            if name in given and given[name] != arg.value:
                flag = "--" + name.replace("_", "-")
                raise Exit(
                    f"error: {flag} is {given[name]!r} for {source[name]} but {arg.value!r} for {ctx.name}; "
                    "give it once",
                    code=2,
                )
            given[name], source[name] = arg.value, ctx.name
    return given


class _Task(Task):
    """An invoke Task whose short flags are named explicitly (automatic ones would take -h for --host)."""

    def __init__(self, body: Callable, short: dict[str, str], **kw: Any) -> None:
        self.short = short
        super().__init__(body, auto_shortflags=False, **kw)

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict[str, Any]:
        opts = super().arg_opts(name, default, taken_names)
        if name in self.short:
            opts["names"].append(self.short[name])
        return opts


def cluster_task(own: dict[str, tuple[Any, str]] | None = None, short: dict[str, str] | None = None) -> Callable:
    """Declare a task taking the shared flags plus its `own` ones ({name: (default, help)}; a list default makes
    a flag that may be given several times, collected in a list). The body receives
    (request, **own flags): what the command line asked, resolved by the task as far as it needs (see
    settings.Request); a UserError becomes one line on stderr and its exit code (2, or the error's own: a job that
    failed under `train --join` exits 1). Run outside a ClusterContext (plain invoke) the task exits 2."""
    own = own or {}

    def decorate(body: Callable[..., Any]) -> Task:
        def run(c: Any, **flags: Any) -> Any:
            if not isinstance(c, ClusterContext):
                raise Exit("error: run toolkit tasks through 'fleet' or the project's fabfile.py", code=2)
            try:
                return body(c.request(), **{k: flags[k] for k in own})
            except UserError as e:
                raise Exit(f"error: {e}", code=e.exit_code) from None

        params = [inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        params += [_param(name, default) for name, (default, _) in own.items()]
        params += [_param(o.name, o.default if o.kind is bool else None) for o in OPTIONS]
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__name__ = body.__name__
        run.__doc__ = body.__doc__
        help_ = {name: text for name, (_, text) in own.items()}
        help_.update({o.name: o.help + (f" [{o.default}]" if o.default not in (None, "", False, True) else "")
                      for o in OPTIONS})
        iterable = [name for name, (default, _) in own.items() if isinstance(default, list)]
        return _Task(run, short or {}, name=body.__name__.rstrip("_"), help=help_, iterable=iterable)

    return decorate


def _param(name: str, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)


@cluster_task(own={"json": (False, "print the plan as JSON"),
                   "render": ("", "write every host's files under DIR/<host>/")})
def plan(request: Request, json: bool, render: str) -> None:
    """Show what would run where (hosts, node ids, ranks, ports), without touching the network."""
    tasks.show_plan(request.settings(script_required=False), as_json=json,
                    render_dir=Path(render) if render else None)


@cluster_task()
def deploy(request: Request) -> None:
    """Copy the job to every host: its rendered launch files and the project directory (only what changed)."""
    tasks.deploy(request.settings())


@cluster_task(own={"deployed": (False, "every host has the job's files now (without it, the record says a deploy "
                                   "is under way and 'fleet train' deploys again)")})
def record(request: Request, deployed: bool) -> None:
    """Write the job record (and make the job token) for a deploy done by the Ansible playbooks; reaches no host."""
    tasks.record_deploy(request.settings(), deployed=deployed)


@cluster_task(own={
    "join": (False, "wait until the job ends, printing changes; exit 0 only if every worker succeeded"),
    "join_timeout": ("", "with --join: stop waiting after this many seconds (the job keeps running)"),
    "fresh": (False, "a job that finished: train it again from the start (its checkpoints and state are moved "
                     "aside, not deleted)"),
    "again": (False, "a job that finished: run it once more from its final checkpoints (e.g. with more epochs)"),
    "no_check": (False, "start without checking the hosts first (see 'fleet check')"),
})
def train(request: Request, join: bool, join_timeout: str, fresh: bool, again: bool, no_check: bool) -> None:
    """Start the job on every host at once (all or nothing), after checking them; deploys it first if it never was."""
    tasks.train(request, join=join, join_timeout=_seconds("--join-timeout", join_timeout), fresh=fresh,
                again=again, check=not no_check)


@cluster_task(own={
    "data": ([], "a data path to compare across hosts (besides --data-path); relative: to the project; repeatable"),
    "min_free_gb": ("", f"GB that must be free at each host's checkpoint directory [{DEFAULT_MIN_FREE_GB:g}]"),
    "max_clock_skew": ("", f"seconds a host's clock may be off this machine's [{DEFAULT_MAX_SKEW:g}]"),
    "slow_factor": ("", f"times the median beyond which a host or link is slow [{DEFAULT_SLOW_FACTOR:g}]"),
})
def check(request: Request, data: list[str], min_free_gb: str, max_clock_skew: str, slow_factor: str) -> None:
    """Check the deployed job's hosts before training: versions, project, data, environment, ports, disk, clock,
    and a timed matmul and all-reduce; one line per problem, naming the host and the fix."""
    free = _number("--min-free-gb", min_free_gb, DEFAULT_MIN_FREE_GB, zero=True)
    tasks.check(request.job_ref(), data=tuple(data or ()), limits=tasks.Limits(
        min_free_bytes=int(free * 1e9),
        max_skew=_number("--max-clock-skew", max_clock_skew, DEFAULT_MAX_SKEW),
        slow_factor=_number("--slow-factor", slow_factor, DEFAULT_SLOW_FACTOR)))


@cluster_task(
    own={
        "json": (False, "print the status as JSON (with --watch: one JSON object per line at each refresh)"),
        "watch": (False, "refresh the table in place until the job ends (exit 0 if it succeeded); Ctrl-C stops "
                         "watching, not the job"),
        "interval": ("", f"seconds between refreshes of --watch [{tasks.WATCH_INTERVAL:g}]"),
    },
    short={"watch": "w"},
)
def status(request: Request, json: bool, watch: bool, interval: str) -> None:
    """Every process of the job: host, node id, rank, pid, state, restarts, step, steps/s, loss, heartbeat age,
    stragglers, the last incident; --watch keeps it live."""
    seconds = _seconds("--interval", interval)
    if seconds is not None and not watch:
        raise UserError("--interval is the refresh of --watch; add --watch")
    if watch:
        tasks.watch(request.job_ref(), tasks.WATCH_INTERVAL if seconds is None else seconds, as_json=json)
    else:
        tasks.status(request.job_ref(), as_json=json)


@cluster_task(
    own={
        "node": ("", "only this process (e.g. worker_3, sched)"),
        "rank": ("", "only the worker of this rank"),
        "host": ("", "only the processes of this host"),
        "follow": (False, "keep printing new lines until Ctrl-C"),
        "lines": ("", f"lines of each log to show first [{tasks.LOG_LINES}]"),
    },
    short={"follow": "f", "lines": "n"},
)
def logs(request: Request, node: str, rank: str, host: str, follow: bool, lines: str) -> None:
    """The processes' logs (scheduler.log, worker_<rank>.log), each line prefixed host:role:rank."""
    count = _whole("-n/--lines", lines)
    tasks.logs(request.job_ref(), node=node or None, rank=_whole("--rank", rank), host_name=host or None,
               follow=follow, lines=tasks.LOG_LINES if count is None else count)


@cluster_task(own={"out": ("", "write the PNG here [<job>-report.png in the current directory]"),
                   "json": (False, "print the report's data as JSON instead of tables (a PNG only with --out)")})
def report(request: Request, out: str, json: bool) -> None:
    """The run's picture and summary: loss per rank, generations, incidents, step rate, stragglers, goodput."""
    tasks.report(request.job_ref(), out=out or None, as_json=json)


@cluster_task()
def stop(request: Request) -> None:
    """Stop the job on every host (SIGTERM, grace period, SIGKILL) and verify that nothing of it is left."""
    tasks.stop(request.job_ref())


@cluster_task(own={
    "node": ("", "restart this process (e.g. worker_3) with the same environment, as recover.sh does"),
    "host": ("", "restart every process of this host (starts its agent if it is gone)"),
})
def restart(request: Request, node: str, host: str) -> None:
    """Restart one process, or one host's processes, by hand; the agent keeps supervising them."""
    tasks.restart(request.job_ref(), node=node or None, host_name=host or None)


@cluster_task(own={
    "host": ("", "the host whose ranks a spare takes over now (it is fenced from the job)"),
    "spare": ("", "the spare host that takes them (also --with; default: the first free spare)"),
}, short={"spare": "with"})
def replace(request: Request, host: str, spare: str) -> None:
    """Hand a host's ranks to a spare host now (as the scheduler does by itself for a host it finds lost)."""
    tasks.replace(request.job_ref(), host or None, spare or None)


def _seconds(flag: str, text: str) -> float | None:
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected a number of seconds") from None
    if not value > 0:
        raise UserError(f"{flag} {text}: give a positive number of seconds")
    return value


def _number(flag: str, text: str, default: float, zero: bool = False) -> float:
    if text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected a number") from None
    if not (value >= 0 if zero else value > 0) or value != value or value == float("inf"):
        raise UserError(f"{flag} {text}: give a {'non-negative' if zero else 'positive'} finite number")
    return value


def _whole(flag: str, text: str) -> int | None:
    if text == "":
        return None
    try:
        return int(text, 10)
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected a whole number") from None


def namespace() -> Collection:
    """The task set of `fleet` and of a project's fabfile.py: plan, deploy, record, check, train, status, logs,
    report, stop, restart, replace."""
    return Collection(plan, deploy, record, check, train, status, logs, report, stop, restart, replace)


def use_cluster_executor() -> None:
    """For fabfile.py: make `fab` run toolkit's tasks once per cluster rather than once per host, and exit 2 on a
    command line it cannot parse, as `fleet` does."""
    program = fabric.main.program
    program.executor_class = ClusterExecutor
    for name in ("parse_core", "parse_tasks"):
        setattr(program, name, _usage_errors_exit_2(getattr(program, name), "fab"))


def _usage_errors_exit_2(step: Callable[..., None], binary: str) -> Callable[..., None]:
    """invoke exits 1 on a flag it does not know; a usage error is exit code 2 (README), with the way to help."""
    def parse(*args: Any) -> None:
        try:
            step(*args)
        except ParseError as e:
            raise Exit(f"error: {e}; '{binary} --help' lists the tasks, '{binary} TASK --help' their flags",
                       code=2) from None

    return parse


class Fleet(fabric.main.Fab):
    """The `fleet` program: Fabric's, with usage errors exiting 2 and the project config read from ./fabric.yaml
    (there is no fabfile to locate it by)."""

    def parse_core(self, argv: Any) -> None:
        """Fabric's parsing of the core flags; a parse error exits 2 and says where help is."""
        _usage_errors_exit_2(super().parse_core, "fleet")(argv)

    def parse_tasks(self) -> None:
        """Fabric's parsing of the tasks and their flags; a parse error exits 2 and says where help is."""
        _usage_errors_exit_2(super().parse_tasks, "fleet")()

    def print_help(self) -> None:
        """Fabric's help (core flags, subcommands), then where a job's hosts come from: those flags belong to the
        tasks, so the core help alone would not name them."""
        super().print_help()
        print("Hosts of a job (given to plan, deploy or train; the other tasks read them from the job record):\n")
        helps = {o.name: o.help for o in OPTIONS}
        self.print_columns([
            ("-H STRING, --hosts=STRING", "[user@]host[:slots],... as mpirun -H"),
            ("--hostfile=STRING", helps["hostfile"]),
            ("--inventory=STRING", helps["inventory"]),
            ("--slurm", helps["slurm"]),
            ("(none of them)", "this machine, without SSH (--worker-num workers)"),
        ])

    def parse_collection(self) -> None:
        """Load the task collection, then the current directory's fabric.yaml as the project config."""
        super().parse_collection()
        # `fleet` has no fabfile to anchor the project config on: read ./fabric.yaml, as fab would next to it.
        self.config.set_project_location(os.getcwd())
        self.config.load_project()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `fleet` console script; `argv` defaults to sys.argv. Exits through invoke: 0 on
    success, 2 on a usage error, a UserError's `exit_code` (2 unless the error says otherwise) on a user error."""
    program = Fleet(
        name="fleet",
        binary="fleet",
        version=_version(),
        namespace=namespace(),
        executor_class=ClusterExecutor,
        config_class=fabric.Config,
    )
    program.run(argv if argv is not None else sys.argv)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("toolkit")
    except PackageNotFoundError:
        return "unknown"
