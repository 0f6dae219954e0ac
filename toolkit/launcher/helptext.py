"""The help screens of `fleet` and of each task (`fab TASK --help` too): toolkit's own, one screen each, rendered
from the task table (toolkit.launcher.cli) and the shared flags (settings.OPTIONS), so that a flag cannot be accepted
without being described. Pure: text in, text out.

A task that plans a job (plan, deploy, train, run, record) lists every shared flag by section; a task that works
on a deployed job lists how to name the job and reach its hosts, then names the other flags in one paragraph: they
are read from the job record, and typed again they must agree with it."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from toolkit.launcher.settings import GROUPS, OPTIONS, Option

WIDTH = 80  # columns of every help line (a terminal's usual width)
SPEC_WIDTH = 24  # the flag column


@dataclass(frozen=True)
class FlagDoc:
    """One line of help: the flag as typed (`-n, --lines N`) and what it does."""

    spec: str
    text: str


@dataclass(frozen=True)
class TaskDoc:
    """What a task's help says: its name, what follows the name on its usage line, its docstring (the first line
    is the summary `fleet --help` shows), its own flags, and whether it plans a job (and so takes the host and job
    flags) or works on a deployed one."""

    name: str
    usage: str
    doc: str
    own: tuple[FlagDoc, ...]
    plans: bool

    @property
    def summary(self) -> str:
        """The docstring's first line: one whole sentence."""
        return self.doc.strip().splitlines()[0].strip()


# Fabric's own flags that toolkit reads (CoreFlags), as `fleet` takes them; `fab` takes them under the same names.
HOSTS = FlagDoc("-H, --hosts HOSTS", "[user@]host[:slots],... as mpirun -H")
IDENTITY = FlagDoc("-i, --identity FILE", "SSH private key (repeatable)")
SSH_CONFIG = FlagDoc("-S, --ssh-config FILE", "ssh_config file to read")
CONNECT_TIMEOUT = FlagDoc("-t, --connect-timeout S", "seconds to connect to a host over SSH")
# one line for the last two, so that a planning task's help stays one screen
SSH_CORE = (IDENTITY, FlagDoc("-S FILE, -t S", "--ssh-config file; --connect-timeout seconds"))
HELP = FlagDoc("-h, --help", "this help")
WORKER_COUNTS = ("nproc_per_node", "nnodes", "worker_num")  # listed with the hosts, after where they come from
FOOTER = "-h, --help: this help. Flags apply to every task typed; defaults: ./fabric.yaml"


def option_doc(o: Option) -> FlagDoc:
    """A shared flag's help line, its default appended where the default says something."""
    spec = o.flag
    if o.kind is bool and o.default is True:
        spec = "--[no-]" + spec[2:]
        return FlagDoc(spec, o.help + " [on]")
    elif o.kind is not bool:
        spec += " " + (o.metavar or "VALUE")
    text = o.help
    if o.default not in (None, "", False, True) and "[" not in text:
        text += f" [{o.default}]"
    return FlagDoc(spec, text)


def program_help(binary: str, tasks: list[TaskDoc]) -> str:
    """`fleet --help`: how a command line is built, every task with its summary, the host flags, where to go next."""
    out = [
        f"Usage: {binary} TASK [FLAGS] [TASK [FLAGS]]... [-- SCRIPT ARGS...]",
        f"       {binary} run [FLAGS] SCRIPT [SCRIPT ARGS...]     (as torchrun)",
        "",
        "Launch and keep alive data-parallel PyTorch training on many hosts over SSH.",
        "",
        "Tasks:",
    ]
    width = max(len(t.name) for t in tasks) + 2
    for t in tasks:
        out += _wrapped(t.name.ljust(width), t.summary, indent=2)
    out += ["", "Hosts (for plan, deploy, train, run; the other tasks read the job record):"]
    group = [o for o in OPTIONS if o.group == "hosts"]
    out += _flag_lines([HOSTS] + [option_doc(o) for o in group if o.name not in WORKER_COUNTS]
                       + [FlagDoc("(none of them)", "this machine, without SSH")]
                       + [option_doc(o) for o in group if o.name in WORKER_COUNTS])
    out += ["", "Other:"]
    out += _flag_lines([FlagDoc("-h, --help", f"this help; '{binary} TASK --help': a task's flags"),
                        FlagDoc("-V, --version", "toolkit's version")])
    out += ["", *_wrap(
        "Script arguments go after the script ('fleet run train.py --lr 0.1') or after '--' ('fleet deploy train "
        "-- --lr 0.1'). Exit codes: 0 success, 1 the job failed (the evidence is printed), 2 a usage or input "
        "error, 3 the job was stopped (fleet stop) before it ended, 130 Ctrl-C while waiting. Documentation: "
        "README.md and docs/ of toolkit.", WIDTH)]
    return "\n".join(out) + "\n"


def task_help(binary: str, task: TaskDoc) -> str:
    """`fleet TASK --help`: usage, the task's docstring, its own flags, then the shared ones (by section for a task
    that plans a job; else those that name the job and reach its hosts, and the rest in one paragraph)."""
    out = [f"Usage: {binary} {task.name} {task.usage}".rstrip()]  # the task's docstring under it: one screen
    for paragraph in task.doc.strip().split("\n\n"):
        out += _wrap(" ".join(paragraph.split()), WIDTH)
    if task.own:
        out.append(f"Flags of {task.name}:")
        out += _flag_lines(list(task.own))
    shared = [o for o in OPTIONS if o.name not in not_for(task.name)]
    if task.plans:
        for group, title in GROUPS.items():
            docs = [option_doc(o) for o in shared if o.group == group]
            if group == "hosts":
                docs.insert(0, HOSTS)
            if group == "ssh":
                docs = list(SSH_CORE) + docs
            out.append(title + ":")
            out += _flag_lines(docs)
        out += _wrap(FOOTER, WIDTH)
    else:
        out.append("Which job (its record, .toolkit/jobs/<job>.json, holds the rest):")
        out += _flag_lines([option_doc(o) for o in shared if o.name in ("job", "project")])
        out.append("Reaching its hosts (as deploy recorded; typed now, these override):")
        out += _flag_lines(list(SSH_CORE))
        rest = ["-H/--hosts"] + [option_doc(o).spec.split()[0] for o in shared if o.name not in ("job", "project")]
        out += _wrap("Also accepted, and refused when they contradict the job record: " + ", ".join(rest)
                             + f". {HELP.spec}: {HELP.text}.", WIDTH)
    return "\n".join(out) + "\n"


# Shared flags a task does not take: `run` is given the script and its arguments after its flags. `module` and
# `no_python` are no task's flags: `run -m MODULE` and `run --no-python PROGRAM` set them (as torchrun's); a config
# may too.
_NOT_FOR = {"run": ("script", "script_args")}
_NO_FLAG = ("module", "no_python")


def not_for(task: str) -> tuple[str, ...]:
    """The shared flags `task` refuses (attribute names)."""
    return _NOT_FOR.get(task, ()) + _NO_FLAG


def _wrap(text: str, width: int, **kw: str) -> list[str]:
    """textwrap.wrap that never breaks a flag at its dashes."""
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **kw)


def _flag_lines(docs: list[FlagDoc]) -> list[str]:
    out = []
    for d in docs:
        out += _wrapped(d.spec.ljust(SPEC_WIDTH) + " ", d.text, indent=2)
    return out


def _wrapped(head: str, text: str, indent: int) -> list[str]:
    """`head` then `text`, wrapped to WIDTH with the continuation lines under the text."""
    lead = " " * indent
    if len(head) > SPEC_WIDTH + 1 and len(lead + head + text) > WIDTH:
        return [lead + head.rstrip()] + _wrap(text, WIDTH, initial_indent=lead + " " * (SPEC_WIDTH + 1),
                                                      subsequent_indent=lead + " " * (SPEC_WIDTH + 1))
    return _wrap(head + text, WIDTH, initial_indent=lead, subsequent_indent=lead + " " * len(head))
