"""The command line: the `fleet` program (toolkit's own: its own core flags and help screens) and the same task set
for Fabric's `fab` through a project's fabfile.py (`fab deploy train --hosts=...`).

Fabric runs a task once per `--hosts` entry; toolkit's tasks act on the whole cluster at once, so they run under
ClusterExecutor, which calls each task once and hands it the raw host list. Flags shared by the tasks (settings.
OPTIONS) typed after any task of one command line apply to every task of it: `fab deploy train --hostfile h`.

A training script's own arguments never go through invoke's parser, which would join them into one string: they
are split off the command line first (`split_command_line`), after `run SCRIPT` (as torchrun and mpirun take
them) or after `--`, and reach the tasks as `script` and `script_args` (the list quoted back into one string
that JobOptions splits again, the same list).
"""

from __future__ import annotations

import gc
import inspect
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import fabric
import fabric.main
from invoke import Argument, Call, Collection, Context, Exit, Program, Task
from invoke.exceptions import ParseError
from invoke.parser import ParserContext, ParseResult

from toolkit.errors import UserError
from toolkit.launcher import helptext, tasks
from toolkit.launcher.check.decide import DEFAULT_MAX_SKEW, DEFAULT_MIN_FREE_GB, DEFAULT_SLOW_FACTOR
from toolkit.launcher.settings import OPTION_NAMES, OPTIONS, CoreFlags, Request

RUN = "run"  # the task whose first word that is not a flag is the script, everything after it the script's
EXIT_USAGE = 2
EXIT_PIPE = 128 + 13  # stdout closed under us (`fleet plan --json | head`): as a process killed by SIGPIPE

# torchrun's flags that toolkit has no equivalent for, and why: one line instead of "unknown flag".
TORCHRUN_ONLY = {
    "--master-addr": "toolkit runs the scheduler and the job's store on the first host (or the inventory's "
                     "scheduler group): MASTER_ADDR is that host's address",
    "--node-rank": "fleet is started once for all hosts, not on each node, and numbers them in the order they are "
                   "given (GROUP_RANK)",
    "--rdzv-backend": "toolkit's scheduler is the rendezvous, on the first host at --master-port",
    "--rdzv-endpoint": "toolkit's scheduler is the rendezvous, on the first host at --master-port",
    "--rdzv-conf": "toolkit's scheduler is the rendezvous, on the first host at --master-port",
    "--rdzv-id": "the job's name is its run id (--job NAME; TORCHELASTIC_RUN_ID)",
    "--monitor-interval": "each host's agent waits on its workers' exit: there is no interval to set",
    "--log-dir": "each process logs to logs/ in its job directory; 'fleet logs' shows them",
    "--redirects": "each process logs to logs/ in its job directory; 'fleet logs' shows them",
    "--tee": "'fleet run' shows every rank's output prefixed [rank1]: (--ranks, --local-ranks-filter, --quiet "
             "choose) and each process logs to logs/ in its job directory",
    "--role": "every worker has the one role 'default' (ROLE_NAME)",
}


# torchrun's flags that mean what toolkit does anyway: accepted (with these values) and dropped, or refused saying why.
TORCHRUN_SAME = {
    "--run-path": (None, "every script runs as runpy.run_path runs it"),
    "--start-method": ("spawn", "each host's agent starts every worker as a fresh interpreter, as spawn does; fork "
                                "and forkserver have no meaning there"),
}


# torchrun's flags that say what `run`'s SCRIPT is (the kind CommandLine records).
SCRIPT_KINDS = {"-m": "module", "--module": "module", "--no-python": "program", "--no_python": "program"}


@dataclass(frozen=True)
class CommandLine:
    """A command line with the training script's part split off: `tokens` for invoke's parser (tasks and their
    flags), `script` (the first word after `run`'s flags) and `script_args` (what follows it, or what follows
    `--`; None when neither was given)."""

    tokens: list[str]
    script: str | None = None
    script_args: list[str] | None = None
    kind: str = ""  # `run`'s SCRIPT: "module" (-m, --module), "program" (--no-python), "" a Python file


def split_command_line(tokens: list[str], contexts: Mapping[str, ParserContext],
                       initial: ParserContext) -> CommandLine:
    """Find where the training script's part of `tokens` starts, with the tasks' own flag tables (invoke's): a
    flag's value is skipped, a task name switches tasks, the first other word after `run` is the script. On the way,
    `--flag_name` becomes `--flag-name` where that is a flag (torchrun and msrun spell them so), and a flag of
    torchrun's that toolkit has no equivalent for exits 2 saying why. Anything else invoke judges."""
    out: list[str] = []
    ctx: ParserContext | None = None
    seen: set[tuple[str, int]] = set()
    kind = ""
    i = 0
    while i < len(tokens):
        word = tokens[i]
        if word == "--":
            return CommandLine(out, None, tokens[i + 1:])
        if word.startswith("-") and word != "-":
            name, eq, value = word.partition("=")
            name = _dashed(name, ctx, initial)
            if name in TORCHRUN_ONLY and not (ctx and name in ctx.flags):
                raise Exit(f"error: {name} is torchrun's and means nothing here: {TORCHRUN_ONLY[name]}",
                           code=EXIT_USAGE)
            if ctx is not None and ctx.name == RUN and name in SCRIPT_KINDS and not eq:
                if kind:
                    raise Exit("error: -m and --no-python: SCRIPT is a module or a program, give one of them",
                               code=EXIT_USAGE)
                kind = SCRIPT_KINDS[name]
                i += 1
                continue
            if name in TORCHRUN_SAME and not (ctx and name in ctx.flags):
                i += _torchrun_same(name, value if eq else (tokens[i + 1] if i + 1 < len(tokens) else ""), eq)
                continue
            arg = _flag(name, ctx, initial)
            if arg is not None and arg.kind is not list:
                key = (ctx.name if ctx is not None and name in ctx.flags else "", id(arg))
                if key in seen:
                    raise Exit(f"error: {name} given twice: give it once", code=EXIT_USAGE)
                seen.add(key)
            out.append(name + eq + value)
            if arg is not None and arg.takes_value and not arg.optional and not eq and i + 1 < len(tokens):
                out.append(tokens[i + 1])
                i += 1
        elif ctx is not None and ctx.name == RUN:
            return CommandLine(out, word, tokens[i + 1:], kind)
        else:
            if word in contexts:  # another task (or the same one again): its flags are counted anew
                seen = {key for key in seen if key[0] == ""}
            ctx = contexts.get(word, ctx)
            out.append(word)
        i += 1
    return CommandLine(out)


def _torchrun_same(name: str, value: str, eq: str) -> int:
    """How many words a TORCHRUN_SAME flag takes (dropped: it means what toolkit does anyway); exits 2 for a value
    toolkit cannot honour, saying why."""
    wanted, why = TORCHRUN_SAME[name]
    if wanted is None:
        if eq:
            raise Exit(f"error: {name} takes no value: {why}", code=EXIT_USAGE)
        return 1
    if value != wanted:
        raise Exit(f"error: {name} {value or '(no value)'}: {why}; give {wanted} or leave it out", code=EXIT_USAGE)
    return 1 if eq else 2


def _flag(name: str, ctx: ParserContext | None, initial: ParserContext) -> Argument | None:
    """The Argument of flag `name` in the task's context, else among the core flags (by `in` and `[]`: the flag
    tables are Lexicons, whose aliases `.get` does not follow)."""
    for table in ((ctx.flags,) if ctx is not None else ()) + (initial.flags,):
        if name in table:
            return table[name]
    return None


def _dashed(name: str, ctx: ParserContext | None, initial: ParserContext) -> str:
    """`--nproc_per_node` -> `--nproc-per-node` when that is a flag here (or one of torchrun's); else as typed."""
    if not name.startswith("--") or "_" not in name:
        return name
    dashed = name.replace("_", "-")
    known = dashed in initial.flags or dashed in TORCHRUN_ONLY or dashed in TORCHRUN_SAME or (
        ctx is not None and (dashed in ctx.flags or dashed in ctx.inverse_flags))
    return dashed if known else name


def apply_command_line(core: ParseResult, argv: list[str], contexts: Mapping[str, ParserContext],
                       initial: ParserContext) -> None:
    """Split the training script's part off what invoke's core parse left for the tasks (`core.unparsed`, and
    after a `--` the rest of `argv` word for word: invoke would join it into one string), and keep it on `core`
    (`core.script_line`) for ClusterExecutor."""
    rest = list(core.unparsed)
    if "--" in argv[1:]:
        rest += argv[argv.index("--", 1):]
    line = split_command_line(rest, contexts, initial)
    core.unparsed[:] = line.tokens
    core.remainder = ""
    core.script_line = line  # type: ignore[attr-defined]


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
        """Collect the shared flags typed after any of the tasks and the script's part of the command line, then
        run them; a shared flag given twice with different values, or script arguments given twice, exit 2."""
        contexts = [t for t in tasks if isinstance(t, ParserContext)]
        line = getattr(self.core, "script_line", None) if self.core else None
        self._given = _script_flags(_shared_flags(contexts), [c.name for c in contexts], line or CommandLine([]))
        return super().execute(*tasks)

    def expand_calls(self, calls: list[Any], apply_hosts: bool = True) -> list[Any]:
        """One ClusterCall per task, its pre- and post-tasks included, never one per `--hosts` entry; `apply_hosts`
        is ignored."""
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
    if timeout is not None:
        try:
            timeout = float(timeout)
        except ValueError:
            raise Exit(f"error: -t/--connect-timeout {timeout!r}: expected a number of seconds", code=EXIT_USAGE) \
                from None
        if not 0 < timeout < float("inf"):
            raise Exit(f"error: -t/--connect-timeout {timeout:g}: give a positive number of seconds", code=EXIT_USAGE)
    return CoreFlags(
        hosts=args.hosts.value,
        ssh_config=args["ssh-config"].value,
        identities=tuple(args.identity.value or ()),
        connect_timeout=timeout or None,
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
                    code=EXIT_USAGE,
                )
            given[name], source[name] = arg.value, ctx.name
    return given


def _script_flags(given: dict[str, Any], names: list[str], line: CommandLine) -> dict[str, Any]:
    """`given` with the script and its arguments of the command line (`run SCRIPT ARGS`, `-- ARGS`) as `script` and
    `script_args`. Exits 2 for `run` with other tasks or without a script, and for arguments given both after `--`
    and with --script-args."""
    if RUN in names:
        if len(names) > 1:
            raise Exit(f"error: 'run' deploys, trains and waits by itself: give it alone, not with "
                       f"{', '.join(n for n in names if n != RUN)}", code=EXIT_USAGE)
        if line.script is None:
            raise Exit("error: fleet run: name the training script after the flags, its arguments after it (fleet "
                       "run --nproc-per-node 2 train.py --lr 0.1)", code=EXIT_USAGE)
        return {**given, "script": line.script, "script_args": shlex.join(line.script_args or []),
                "module": line.kind == "module", "no_python": line.kind == "program"}
    if line.script_args is None:
        return given
    if "script_args" in given:
        raise Exit("error: the script's arguments are given twice, with --script-args and after '--': give them one "
                   "way", code=EXIT_USAGE)
    return {**given, "script_args": shlex.join(line.script_args)}


class _Task(Task):
    """An invoke Task whose short flags are named explicitly (automatic ones would take -h for --host), with what
    its help screen says (`doc`: a helptext.TaskDoc)."""

    def __init__(self, body: Callable, short: dict[str, str], doc: helptext.TaskDoc, **kw: Any) -> None:
        self.short = short
        self.doc = doc
        super().__init__(body, auto_shortflags=False, **kw)

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict[str, Any]:
        opts = super().arg_opts(name, default, taken_names)
        if name in self.short:
            opts["names"].append(self.short[name])
        return opts


Own = Mapping[str, tuple]  # flag attribute -> (default, help[, metavar]); a list default: repeatable


def cluster_task(own: Own | None = None, short: dict[str, str] | None = None, plans: bool = False,
                 usage: str = "[FLAGS]", paired: tuple[str, str, str] | None = None) -> Callable:
    """Declare a task taking the shared flags (but those helptext.not_for it) plus its `own` ones ({name: (default,
    help[, metavar])}; a list default makes a flag that may be given several times, collected in a list). The body
    receives (request, **own flags): what the command line asked, resolved by the task as far as it needs (see
    settings.Request); a UserError becomes one line on stderr and its exit code (2, or the error's own: a job that
    failed under `train --join` exits 1). Run outside a ClusterContext (plain invoke) the task exits 2. `plans`:
    the task plans a job from the flags (its help lists the host and job flags by section); `usage` follows the
    task's name on its usage line. The body's docstring is its help, the first line its summary. `paired`: (flag,
    flag, help) of two own flags shown on one line of the help (a help at the one screen's cap)."""
    own = dict(own or {})

    def decorate(body: Callable[..., Any]) -> Task:
        name = body.__name__.rstrip("_")

        def run(c: Any, **flags: Any) -> Any:
            if not isinstance(c, ClusterContext):
                raise Exit("error: run toolkit tasks through 'fleet' or the project's fabfile.py", code=EXIT_USAGE)
            try:
                return body(c.request(), **{k: flags[k] for k in own})
            except UserError as e:
                raise Exit(f"{e.prefix}{e}", code=e.exit_code) from None

        shared = [o for o in OPTIONS if o.name not in helptext.not_for(name)]
        params = [inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        params += [_param(n, spec[0]) for n, spec in own.items()]
        params += [_param(o.name, o.default if o.kind is bool else None) for o in shared]
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__name__ = body.__name__
        run.__doc__ = body.__doc__
        help_ = {n: spec[1] for n, spec in own.items()}
        help_.update({o.name: o.help for o in shared})
        iterable = [n for n, spec in own.items() if isinstance(spec[0], list)]
        rows = [_own_doc(n, spec, (short or {}).get(n)) for n, spec in own.items()
                if paired is None or n != paired[1]]
        if paired is not None:
            first = list(own).index(paired[0])
            rows[first] = helptext.FlagDoc(f"{rows[first].spec}, --{paired[1].replace('_', '-')}", paired[2])
        doc = helptext.TaskDoc(name, usage, inspect.cleandoc(body.__doc__ or ""), tuple(rows), plans)
        return _Task(run, short or {}, doc, name=name, help=help_, iterable=iterable)

    return decorate


def _own_doc(name: str, spec: tuple, short: str | None) -> helptext.FlagDoc:
    flag = "--" + name.replace("_", "-")
    flags = f"-{short}, {flag}" if short and len(short) == 1 else (f"--{short}, {flag}" if short else flag)
    metavar = spec[2] if len(spec) > 2 else ("" if isinstance(spec[0], bool) else "VALUE")
    return helptext.FlagDoc(f"{flags} {metavar}".rstrip(), spec[1])


def _param(name: str, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)


# --- the tasks, in the order `fleet --help` lists them ---------------------------------------------------------------

_JOIN_TIMEOUT = ("", "stop waiting after S seconds (the job goes on)", "S")
_FRESH = (False, "start over from step 0 (the old run moved aside)")
_AGAIN = (False, "a finished job: once more from its final checkpoints")
_NO_CHECK = (False, "start without checking the hosts ('fleet check')")
_RANKS = ("", "show only these ranks' output (0,3)", "LIST")
_LOCAL_RANKS = ("", "show only these local ranks' output, on every host", "LIST")
_QUIET = (False, "show no output of the ranks (their logs keep it)")
_STREAM = {"ranks": _RANKS, "local_ranks_filter": _LOCAL_RANKS, "quiet": _QUIET}


@cluster_task(own={"fresh": _FRESH, "again": _AGAIN, "no_check": _NO_CHECK, "join_timeout": _JOIN_TIMEOUT,
                   "detach": (False, "return once started; the job goes on (no Ctrl-C stop)"), **_STREAM},
              plans=True, usage="[FLAGS] [-m | --no-python] SCRIPT [SCRIPT ARGS...]")
def run(request: Request, fresh: bool, again: bool, no_check: bool, join_timeout: str, detach: bool, ranks: str,
        local_ranks_filter: str, quiet: bool) -> None:
    """Deploy, start and wait, as torchrun; Ctrl-C stops the job."""
    stream = tasks.RankFilter.parse(ranks, local_ranks_filter, quiet)
    if detach and (join_timeout or stream != tasks.RankFilter()):
        raise UserError("--detach returns once the job started; --join-timeout, --ranks, --local-ranks-filter and "
                        "--quiet are for a run that waits: leave them out, or --detach")
    tasks.run(request, join_timeout=_seconds("--join-timeout", join_timeout), fresh=fresh, again=again,
              check=not no_check, detach=detach, stream=stream)


@cluster_task(own={"json": (False, "print the plan as JSON"),
                   "render": ("", "also write every host's files under DIR/<host>/", "DIR")}, plans=True)
def plan(request: Request, json: bool, render: str) -> None:
    """Show what would run where (hosts, ranks, ports); touches no host."""
    tasks.show_plan(request.settings(script_required=False), as_json=json,
                    render_dir=Path(render) if render else None)


@cluster_task(plans=True, usage="[FLAGS] [-- SCRIPT ARGS...]")
def deploy(request: Request) -> None:
    """Copy the job's launch files and project to every host (what changed).

    Starts nothing ('fleet train' does) and writes the job record that the later tasks read."""
    tasks.deploy(request.settings())


@cluster_task(own={
    "join": (False, "wait for the end: exit 0 if every worker succeeded"),
    "join_timeout": ("", "with --join: stop waiting after S (the job goes on)", "S"),
    "fresh": _FRESH,
    "again": _AGAIN,
    "no_check": _NO_CHECK,
    "ranks": _RANKS,
    "quiet": _QUIET,
}, plans=True, usage="[FLAGS] [-- SCRIPT ARGS...]",
    paired=("fresh", "again", "from step 0 (old run aside); a finished job: again"))
def train(request: Request, join: bool, join_timeout: str, fresh: bool, again: bool, no_check: bool, ranks: str,
          quiet: bool) -> None:
    """Start the job on every host at once (all or nothing), after a check."""
    stream = tasks.RankFilter.parse(ranks, "", quiet)
    if not join and stream != tasks.RankFilter():
        raise UserError("--ranks and --quiet choose the output --join shows: add --join")
    tasks.train(request, join=join, join_timeout=_seconds("--join-timeout", join_timeout), fresh=fresh,
                again=again, check=not no_check, stream=stream)


@cluster_task(own={
    "data": ([], "another data path to compare (repeatable)", "PATH"),
    "min_free_gb": ("", f"GB free where checkpoints go [{DEFAULT_MIN_FREE_GB:g}]", "GB"),
    "max_clock_skew": ("", f"seconds a clock may be off this one's [{DEFAULT_MAX_SKEW:g}]", "S"),
    "slow_factor": ("", f"times the median that makes a host slow [{DEFAULT_SLOW_FACTOR:g}]", "X"),
})
def check(request: Request, data: list[str], min_free_gb: str, max_clock_skew: str, slow_factor: str) -> None:
    """Check that the job's hosts can train together; one line a problem.

    Versions, project copy, data, environment, ports, disk and clock, then a timed matmul on each host and an
    all-reduce between neighbours; each problem names the host and the fix (exit 2). A relative --data path is
    relative to the project on each host."""
    free = _number("--min-free-gb", min_free_gb, DEFAULT_MIN_FREE_GB, zero=True)
    tasks.check(request.job_ref(), data=tuple(data or ()), limits=tasks.Limits(
        min_free_bytes=int(free * 1e9),
        max_skew=_number("--max-clock-skew", max_clock_skew, DEFAULT_MAX_SKEW),
        slow_factor=_number("--slow-factor", slow_factor, DEFAULT_SLOW_FACTOR)))


@cluster_task(
    own={
        "json": (False, "JSON (with --watch: one object per refresh)"),
        "watch": (False, "refresh until the job ends (Ctrl-C: stop watching)"),
        "interval": ("", f"seconds between refreshes of --watch [{tasks.WATCH_INTERVAL:g}]", "S"),
    },
    short={"watch": "w"},
)
def status(request: Request, json: bool, watch: bool, interval: str) -> None:
    """Every process: host, rank, pid, state, restarts, step, loss.

    Also steps/s, heartbeat age, stragglers, the last incident and the goodput so far. --watch keeps the table
    live and exits 0 if the job succeeded, 3 if stopped, 1 if it failed."""
    seconds = _seconds("--interval", interval)
    if seconds is not None and not watch:
        raise UserError("--interval is the refresh of --watch; add --watch")
    if watch:
        tasks.watch(request.job_ref(), tasks.WATCH_INTERVAL if seconds is None else seconds, as_json=json)
    else:
        tasks.status(request.job_ref(), as_json=json)


@cluster_task(
    own={
        "node": ("", "only this process (e.g. worker_3, sched)", "NODE"),
        "rank": ("", "only the worker of this rank", "N"),
        "host": ("", "only the processes of this host", "HOST"),
        "follow": (False, "keep printing new lines until Ctrl-C"),
        "lines": ("", f"lines of each log to show first [{tasks.LOG_LINES}]", "N"),
    },
    short={"follow": "f", "lines": "n"},
)
def logs(request: Request, node: str, rank: str, host: str, follow: bool, lines: str) -> None:
    """The processes' logs, each line prefixed host:role:rank.

    scheduler.log and worker_<rank>.log of every host, or of the processes chosen; -f follows them."""
    count = _whole("-n/--lines", lines)
    tasks.logs(request.job_ref(), node=node or None, rank=_whole("--rank", rank), host_name=host or None,
               follow=follow, lines=tasks.LOG_LINES if count is None else count)


@cluster_task(own={"out": ("", "the PNG [<job>-report.png here]", "FILE"),
                   "json": (False, "the report's data as JSON (a PNG only with --out)")})
def report(request: Request, out: str, json: bool) -> None:
    """The run's picture (<job>-report.png) and summary, or them as JSON.

    Loss per rank, generations, incidents, steps/s and own work per step, stragglers, and where the time went
    (goodput)."""
    tasks.report(request.job_ref(), out=out or None, as_json=json)


@cluster_task()
def stop(request: Request) -> None:
    """Stop the job on every host; verify that nothing of it is left.

    SIGTERM (a toolkit.train script saves a last checkpoint), the grace period, then SIGKILL."""
    tasks.stop(request.job_ref())


@cluster_task(own={
    "node": ("", "restart this process (e.g. worker_3), as recover.sh", "NODE"),
    "host": ("", "restart this host's processes (and its agent)", "HOST"),
})
def restart(request: Request, node: str, host: str) -> None:
    """Restart one process, or one host's processes, by hand.

    With the same environment, as recover.sh on the host does; the agent goes on supervising them."""
    tasks.restart(request.job_ref(), node=node or None, host_name=host or None)


@cluster_task(own={
    "host": ("", "the host whose ranks a spare takes now", "HOST"),
    "spare": ("", "the spare that takes them [the first free one]", "HOST"),
}, short={"spare": "with"})
def replace(request: Request, host: str, spare: str) -> None:
    """Hand a host's ranks to a spare host (inventory [spares]) now.

    As the scheduler does by itself for a host it finds lost; the host is fenced from the job."""
    tasks.replace(request.job_ref(), host or None, spare or None)


@cluster_task(own={"host": ("", "the new host, [USER@]HOST[:SLOTS]", "HOST")})
def grow(request: Request, host: str) -> None:
    """Give a degraded elastic job a new host for its lost host's slots.

    The host is deployed to and checked (as 'fleet check') first; its workers join at the next step boundary,
    taking the state from a peer. A job that lost no host has nothing to grow into."""
    tasks.grow(request, host or None)


@cluster_task(own={"deployed": (False, "every host has the job's files now")}, plans=True)
def record(request: Request, deployed: bool) -> None:
    """Write the job record and token of a deploy the playbooks made.

    Reaches no host.

    Without --deployed the record says a deploy is under way, and 'fleet train' deploys again."""
    tasks.record_deploy(request.settings(), deployed=deployed)


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
    """The task set of `fleet` and of a project's fabfile.py, in the order the help lists them."""
    return Collection(run, plan, deploy, train, check, status, logs, report, stop, restart, replace, grow, record)


def _docs(collection: Collection) -> list[helptext.TaskDoc]:
    order = [t.name for t in namespace().tasks.values()]
    return [collection[name].doc for name in order if name in collection.tasks]


# Fabric's core flags that toolkit's tasks have no use for: given to `fab` with a toolkit task, they would be
# accepted and do nothing, so they are refused (fleet does not take them at all).
FABRIC_IGNORED = ("dry", "echo", "hide", "pty", "warn-only", "command-timeout", "prompt-for-sudo-password",
                  "prompt-for-login-password", "prompt-for-passphrase")


def use_cluster_executor() -> None:
    """For fabfile.py: make `fab` run toolkit's tasks once per cluster rather than once per host, take the script's
    arguments after `--` word for word, print toolkit's help of a task (`fab TASK --help`), refuse Fabric's flags
    that toolkit's tasks ignore, and exit 2 on a command line it cannot parse, as `fleet` does.

    What stays Fabric's: `fab --help` and `fab --version` (printed before the fabfile is loaded), `fab --list`
    (which shows each task's summary line), and `fab -H HOSTS -- COMMAND` without a task (Fabric runs the command
    on the hosts; the fabfile is not even loaded)."""
    program = fabric.main.program
    program.executor_class = ClusterExecutor
    parse = program.parse_tasks

    def parse_tasks() -> None:
        """Split the script's part off, parse the tasks (a parse error exits 2), refuse FABRIC_IGNORED."""
        apply_command_line(program.core, program.argv, _contexts(program.collection), program.initial_context)
        _usage_errors_exit_2(parse, "fab")()
        given = [name for name in FABRIC_IGNORED if name in program.args and program.args[name].value]
        if given and program.tasks:
            raise Exit(f"error: --{given[0]} is Fabric's and toolkit's tasks ignore it: leave it out", code=EXIT_USAGE)

    program.parse_tasks = parse_tasks
    program.print_task_help = lambda name: print(helptext.task_help("fab", program.collection[name].doc), end="")


def _contexts(collection: Collection) -> dict[str, ParserContext]:
    return {ctx.name: ctx for ctx in collection.to_contexts()}


def _usage_errors_exit_2(step: Callable[..., None], binary: str) -> Callable[..., None]:
    """invoke exits 1 on a flag it does not know; a usage error is exit code 2 (README), in one line that says
    where help is."""
    def parse(*args: Any) -> None:
        try:
            step(*args)
        except ParseError as e:
            raise Exit(_parse_error(e, binary), code=EXIT_USAGE) from None

    return parse


def _parse_error(e: ParseError, binary: str) -> str:
    """invoke's parse error as one line with the way to help: an unknown flag names the task it was given to."""
    text = str(e)
    task = getattr(e.context, "name", None)
    if text.startswith("No idea what '") and text.endswith("' is!"):
        word = text[len("No idea what '"):-len("' is!")]
        if word.startswith("-") and task:
            return f"error: {task}: unknown flag {word}; '{binary} {task} --help' lists its flags"
        return f"error: unknown {'flag' if word.startswith('-') else 'task'} {word}; '{binary} --help' lists the tasks"
    where = f"'{binary} {task} --help'" if task else f"'{binary} --help'"
    return f"error: {text}; {where} says what it takes"


class Fleet(Program):
    """The `fleet` program: invoke's task runner with toolkit's own core flags (help, version, and the SSH flags it
    shares with `fab`: -H, -i, -S, -t) and help screens, the script's part of the command line split off first,
    usage errors exiting 2, and the project config read from ./fabric.yaml (there is no fabfile to locate it by)."""

    def core_args(self) -> list[Argument]:
        """Only what toolkit reads: no Fabric or invoke flag that would be accepted and do nothing."""
        return [
            Argument(names=("help", "h"), optional=True, help=helptext.HELP.text),
            Argument(names=("version", "V"), kind=bool, default=False, help="toolkit's version"),
            Argument(names=("hosts", "H"), help=helptext.HOSTS.text),
            Argument(names=("identity", "i"), kind=list, help=helptext.IDENTITY.text),
            Argument(names=("ssh-config", "S"), help=helptext.SSH_CONFIG.text),
            Argument(names=("connect-timeout", "t"), help=helptext.CONNECT_TIMEOUT.text),
        ]

    def create_config(self) -> None:
        """Fabric's config (the project's is fabric.yaml), without loading ssh_config: toolkit reads it itself."""
        self.config = self.config_class(lazy=True)
        self.config.load_base_conf_files()
        self.config.merge()

    def parse_core(self, argv: Any) -> None:
        """The core flags; --version prints and exits; a parse error exits 2."""
        self.normalize_argv(argv)
        _usage_errors_exit_2(self.parse_core_args, "fleet")()
        if self.args.version.value:
            self.print_version()
            raise Exit

    def parse_collection(self) -> None:
        """The bundled task set, and the current directory's fabric.yaml as the project config."""
        self.collection = self.namespace
        self.config.set_project_location(os.getcwd())
        self.config.load_project()

    def parse_tasks(self) -> None:
        """Split the script's part off, then parse the tasks and their flags; a parse error exits 2."""
        apply_command_line(self.core, self.argv, _contexts(self.collection), self.initial_context)
        _usage_errors_exit_2(super().parse_tasks, "fleet")()

    def parse_cleanup(self) -> None:
        """--help (the program's, or a task's); no task given: the help, or exit 2 if script arguments were."""
        halp = self.args.help.value
        if halp is True:
            self.print_help()
            raise Exit
        if halp:
            if halp not in self.collection.tasks:
                raise Exit(f"error: unknown task {halp}; 'fleet --help' lists the tasks", code=EXIT_USAGE)
            self.print_task_help(halp)
            raise Exit
        if not self.tasks:
            if self.core.script_line.script_args is not None:
                raise Exit("error: script arguments without a task: 'fleet train -- ARGS' or 'fleet run SCRIPT ARGS'",
                           code=EXIT_USAGE)
            self.print_help()
            raise Exit

    def update_config(self, merge: bool = True) -> None:
        """Nothing from the command line goes into invoke's config: the tasks get their flags directly."""
        self.config.merge()

    def print_help(self) -> None:
        """toolkit's help: usage, every task's summary, the host flags."""
        print(helptext.program_help("fleet", _docs(self.collection)), end="")

    def print_task_help(self, name: str) -> None:
        """toolkit's help of one task."""
        print(helptext.task_help("fleet", self.collection[name].doc), end="")

    def print_version(self) -> None:
        """`fleet (toolkit) VERSION`."""
        print(f"fleet (toolkit) {self.version}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `fleet` console script; `argv` defaults to sys.argv. Exits through invoke: 0 on
    success, 2 on a usage error, a UserError's `exit_code` (2 unless the error says otherwise) on a user error,
    141 when stdout was closed under it (`fleet plan --json | head`), without a traceback."""
    program = Fleet(
        name="fleet",
        binary="fleet",
        version=_version(),
        namespace=namespace(),
        executor_class=ClusterExecutor,
        config_class=fabric.Config,
    )
    try:
        program.run(argv if argv is not None else sys.argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would print the error again when it flushes stdout at exit: point stdout at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_PIPE)
    finally:
        gc.freeze()  # the interpreter's last collections over every module fleet loaded: no use at its exit


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("toolkit")
    except PackageNotFoundError:
        return "unknown"
