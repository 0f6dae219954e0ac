"""`python -m toolkit.train SCRIPT [ARGS...]`: how every worker of a toolkit job runs its training script.

Why a wrapper at all: a script written for torchrun (`dist.init_process_group()` from env://) never registers
with the scheduler, so nothing would notice a stuck peer, and env:// puts every incarnation's keys under the same
names in one store: a relaunched rank can read a dead incarnation's address and wait on it forever (torchrun's
stale-key hang, REFERENCE.md). The wrapper makes such a script a toolkit worker without changing a line of it.

What it does, and when: nothing until the script asks for a process group. Then, in that call:
- a script that calls `toolkit.train.init()` registers itself for in-place recovery (survivors re-form the group
  and the replacement takes the state from a peer); the wrapper stays out of the way;
- a script that calls `dist.init_process_group()` with env:// (or tcp:// to MASTER_ADDR:MASTER_PORT) reaches the
  wrapper's rendezvous handler, which registers on the script's behalf for restart recovery, waits until every
  rank has, and hands torch the store under this generation's own key prefix. When the job moves to a new
  generation (a peer died), this process exits with EXIT_REJOIN and its agent relaunches it at once, outside its
  crash budget: every worker starts again from its own checkpoints, as under torchrun, but a relaunched rank only
  ever meets keys of its own generation, and a stuck peer is found by its heartbeats, so it never hangs.
A script that never asks for a group just runs. Outside toolkit (no MS_ROLE) the script runs as under `python`.

When the script fails, its own cause is what the job reports (docs/architecture.md, "Failure causes"): an exception
is written to TORCHELASTIC_ERROR_FILE in torch's `@record` format (unless the script's own `@record` wrote it), which
the agent reads; a torchrun-style script whose collective failed waits a bounded time for the scheduler's word, so
that a peer's death seen first as a reset connection is a rejoin (EXIT_REJOIN), not this worker's crash; and the
process then exits at once with the script's status, without the interpreter's teardown (it would destroy process
groups left behind, whose transport threads can abort the process: SIGABRT instead of the script's status). A
failure while the job's checkpoint directory cannot take a checkpoint (another user may write it, read-only, a full
disk) is no crash a restart heals: it is said in one line, first, and the process ends with EXIT_FATAL, which the
agent gives up on at once (`cannot_heal`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, NoReturn, Sequence
from urllib.parse import urlparse

import torch.distributed as dist

from toolkit import atomicfile, privatedir
from toolkit.contracts import envvars, protocol
from toolkit.errors import UserError
from toolkit.train import log, progress, stacks
from toolkit.train import store as job_store
from toolkit.train.channel import Channel
from toolkit.train.faults import JobStopped, RuntimeConfigError, first_line, looks_collective
from toolkit.train.log import say
from toolkit.train.runtime import DEFAULT_TIMEOUT, MODE_TOOLKIT, WorkerEnv, notify_agent
from toolkit.train.scriptreport import ScriptReporter

EXIT_REJOIN = protocol.EXIT_REJOIN
EXIT_SETUP = 2  # a usage or set-up error, said by the script (argparse, the Trainer's refusal of its directory)
HOOKED = ("env", "tcp")  # the rendezvous schemes that reach the job's store


class ScriptSession:
    """The registration the wrapper makes on a torchrun-style script's behalf, started by its first rendezvous."""

    def __init__(self, cfg: WorkerEnv) -> None:
        self.cfg = cfg
        self.channel: Channel | None = None
        self.reporter: ScriptReporter | None = None

    def install(self) -> None:
        """Route env:// (and tcp:// naming this job's store) through `rendezvous`; tcp:// elsewhere keeps torch's
        handler. RuntimeConfigError if this torch has no rendezvous table to hook."""
        # `torch.distributed.rendezvous` is also the name of a function there: import the module by its path
        rdzv = importlib.import_module("torch.distributed.rendezvous")
        handlers = getattr(rdzv, "_rendezvous_handlers", None)
        if not isinstance(handlers, dict) or not all(s in handlers for s in HOOKED):
            raise RuntimeConfigError("this torch version has no env:// rendezvous table to bind to the scheduler's "
                                     "store; call toolkit.train.init() in the script instead")
        originals = {scheme: handlers[scheme] for scheme in HOOKED}

        def handler(url: str, timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT), **kwargs: Any) -> Iterator:
            parsed = urlparse(url)
            if parsed.scheme == "tcp" and (parsed.hostname, parsed.port) != (self.cfg.store_host,
                                                                             self.cfg.store_port):
                return originals["tcp"](url, timeout=timeout, **kwargs)  # somewhere else: not the job's store
            return self.rendezvous(timeout)

        for scheme in HOOKED:
            handlers[scheme] = handler

    def rendezvous(self, timeout: timedelta) -> Iterator[tuple[Any, int, int]]:
        """torch's rendezvous for the script's `init_process_group()`: register for restart recovery, wait until the
        generation has formed (bounded by MS_TOPO_TIMEOUT plus MS_NODE_TIMEOUT), and yield once (the job store under
        the generation's key prefix, rank, world size). `timeout` bounds the store connection.

        RegistrationError if the scheduler cannot be reached or refuses this worker, JobStopped if the job stopped
        or the generation did not form in time; the process exits EXIT_REJOIN if the generation was left before the
        group was built. RuntimeError on a second `init_process_group()`, or when torch asks for another round:
        under toolkit a torchrun-style process forms its group once and is relaunched after a fault."""
        if self.channel is not None:
            raise RuntimeError("a second init_process_group() in one process: under toolkit a torchrun-style script "
                               "forms its group once; a fault relaunches the process")
        channel = Channel(self.cfg, exit_on_new_generation=True)
        channel.count_collectives = True  # the progress the watchdog sees while the script reports no step
        self.channel = channel
        deadline = time.monotonic() + self.cfg.topo_timeout
        channel.join(deadline)
        channel.start()
        generation, prefix = channel.wait_formed(None, deadline + self.cfg.node_timeout)
        if channel.adopt(generation):
            say(self.cfg.node_id, f"generation {generation} was abandoned before the script's group was built; "
                                   f"exiting with code {EXIT_REJOIN} for the agent to relaunch it")
            sys.stdout.flush()
            os._exit(EXIT_REJOIN)
        say(self.cfg.node_id, f"the script's process group: generation {generation}, restart recovery (a fault "
                               "relaunches every worker, which resume from their own checkpoints)")
        notify_agent(self.cfg, {"node_id": self.cfg.node_id, "recovery": protocol.RECOVERY_RESTART})
        self.reporter = ScriptReporter(self.cfg, channel)
        progress.install(self.reporter)  # toolkit.train.report() from the script
        store = job_store.connect(self.cfg.store_host, self.cfg.store_port, self.cfg.token, self.cfg.node_id, timeout)
        # an elastic job's generation may be smaller (issue 42): the script's group gets that world, as torchrun's
        # --nnodes MIN:MAX gives a restarted script (its RANK and WORLD_SIZE variables stay the job's slots)
        rank, world = channel.view.shape or (self.cfg.rank, self.cfg.world_size)
        yield dist.PrefixStore(prefix, store), rank, world
        raise RuntimeError("env:// under toolkit does not re-rendezvous in place: the process is relaunched")

    def end(self, code: int, error: BaseException | None = None) -> int:
        """The script returned `code` (`error`: the exception it raised, if any); returns the process's status. A
        clean finish is `done` (not a death) for the scheduler.

        A failure once the script's group was formed may be a peer's death seen first: the peer's connections reset
        before the scheduler's word reached this process, and the script raised (or exited non-zero) on it. So,
        unless the error is plainly the script's own (an exception that is no collective failure, or a world of
        one), wait up to WorkerEnv.word_wait for that word: if the job moved on, this process exits EXIT_REJOIN
        (relaunched outside its crash budget; its control thread may exit first, as on any new generation); if not
        (or the job stopped), the failure is the script's own and `code` stands. The connection stays open until
        the process exits: closed earlier, it would read as a death the scheduler fences."""
        ch = self.channel
        if ch is None:
            return code
        if code == 0:
            if ch.done():
                notify_agent(self.cfg, {"node_id": self.cfg.node_id, "done": True})
            return 0
        if ch.view.held is None or self.cfg.world_size == 1 or (error is not None and not looks_collective(error)):
            return code
        what = f"{type(error).__name__}: {first_line(error)}" if error is not None else f"exit code {code}"
        # and the progress watchdog's bound: a collective that timed out on a stuck peer is not this rank's failure
        wait = self.cfg.word_wait + protocol.stall_bound(self.reporter.pace.p99() if self.reporter else None)
        say(self.cfg.node_id, f"the script failed ({what}); waiting up to {wait:g} s for the scheduler's word (a "
                               "peer's death, or a stuck peer, breaks the collectives before it is announced)")
        try:
            moved = ch.wait_change(ch.view.held, wait)
        except JobStopped:
            return code
        if moved is None:
            return code
        exit_now(EXIT_REJOIN)  # the control thread said why (it may exit first: Channel._handle)


def run_script(argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run SCRIPT ARGS as `python SCRIPT ARGS` would, as a toolkit worker (see the module docstring); returns the
    exit status."""
    if not argv or argv[0] in ("-m", "--no-python") and len(argv) < 2:
        raise RuntimeConfigError("usage: python -m toolkit.train [-m MODULE | --no-python PROGRAM | SCRIPT] "
                                 "[ARGS...]: name the training script, module or program")
    module = argv[1] if argv[0] == "-m" else None
    script = argv[0]
    if argv[0] == "--no-python":
        return _run_program(list(argv[1:]))
    if module is not None:
        sys.path[0] = os.getcwd()  # as `python -m`: the module is found from the working directory
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise RuntimeConfigError(f"-m {module}: no such module (from {Path.cwd()} and the python path)")
        script, argv = spec.origin or module, [spec.origin or module, *argv[2:]]
    elif not Path(script).is_file():
        raise RuntimeConfigError(f"{script}: no such training script (relative to {Path.cwd()})")
    cfg = WorkerEnv.from_env(os.environ if env is None else env)
    session = ScriptSession(cfg) if cfg.mode == MODE_TOOLKIT else None
    if session is not None:
        session.install()
        stacks.dump_on_signal()  # a stuck worker's stacks to its log before its agent kills it
    sys.argv = list(argv)  # the script reads its own arguments, as under `python SCRIPT ARGS`
    log.whole_lines()  # its prints and the control thread's lines share the log: none may tear another
    if module is None:
        sys.path[0] = str(Path(script).resolve().parent)  # and imports its neighbours, as under `python SCRIPT`
    code, error = _run(script, module)
    if session is not None:
        code = session.end(code, error)
        if code not in (0, EXIT_REJOIN, EXIT_SETUP):  # a set-up error (the Trainer's refusal) said it already
            code = cannot_heal(code, error, os.environ if env is None else env)
    if code == 0 and dist.is_initialized():
        # the script's group, left for it after the end (Runtime.done): destroyed here when the script did not
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return code


def _run_program(argv: list[str]) -> int:
    """`--no-python PROGRAM ARGS` (torchrun's): run the program as a child in this process's group (the agent's
    signals reach it with this process) and return its exit status (128 + N for a signal N, as a shell says). It
    gets the worker's environment, as a script that never asks for a process group does (there is no group to
    hook in another program)."""
    try:
        child = subprocess.Popen(argv)
    except OSError as e:
        raise RuntimeConfigError(f"--no-python {argv[0]}: {e.strerror} (relative to {Path.cwd()} and PATH)") from None
    while True:
        try:
            code = child.wait()
            break
        except KeyboardInterrupt:
            continue  # the child got the same SIGINT: its status says what it did with it
    return 128 - code if code < 0 else code


def _run(script: str, module: str | None) -> tuple[int, BaseException | None]:
    """Run the script as `python SCRIPT` would (a `module` as `python -m MODULE`); (its exit status, the exception
    it raised or None). An exception is shown as python shows it and recorded in the error file (`record_error`)."""
    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0, None
        if isinstance(e.code, int):
            return e.code, None
        log.line(str(e.code), sys.stderr)
        record_error(e)
        return 1, e
    except KeyboardInterrupt:
        return 130, None
    except BaseException as e:  # noqa: BLE001 - the script's own failure: show it as python would, exit non-zero
        traceback.print_exc()
        record_error(e)
        return 1, e
    return 0, None


FULL_BELOW = 1 << 20  # bytes free under which a checkpoint directory's disk is full: no checkpoint fits there


def unusable(directory: str) -> str | None:
    """Why checkpoint directory `directory` cannot take a checkpoint, whatever restarts come: one line naming it and
    what to do; None when it can (or does not exist: the script may not use it). Another user may write it (or a
    directory above it: privatedir), it is on a read-only file system, this user may not write it, or its disk has
    less than FULL_BELOW free. Read-only checks (stat, statvfs, access): nothing is written."""
    path = Path(directory)
    if not path.is_dir():
        return None
    fix = "choose a --ckpt-dir of your own on a disk with room, or fix this one, then run the job again"
    found = privatedir.problem(path, "checkpoint directory", fix)
    if found is not None:
        return found
    try:
        fs = os.statvfs(path)
    except OSError as e:
        return f"checkpoint directory {path} cannot be read ({e.strerror}); {fix}"
    if fs.f_flag & os.ST_RDONLY:
        return f"checkpoint directory {path} is on a read-only file system; {fix}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"checkpoint directory {path} is not writable by this user (uid {os.geteuid()}); {fix}"
    free = fs.f_bavail * fs.f_frsize
    if free < FULL_BELOW:
        return f"checkpoint directory {path} is on a full disk ({free >> 10} KiB free); {fix}"
    return None


def cannot_heal(code: int, error: BaseException | None, env: dict[str, str] | os._Environ[str]) -> int:
    """The script failed with `code` (`error`: its exception, if any) under toolkit: if its checkpoint directory
    (CKPT_DIR) cannot take a checkpoint (`unusable`), no restart can fix that, and a torchrun-style script would fail
    again at its next save, restart after restart (the red team's read-only and full directories: 10-19 s of
    backoff to fail). Then one line says so, first, in the log and in the error file (what the agent reports as the
    cause, the script's own word after it), and the status is EXIT_FATAL: the agent gives up at once. Else `code`
    stands."""
    directory = env.get(envvars.CKPT_DIR)
    why = unusable(directory) if directory else None
    if why is None:
        return code
    what = f"{type(error).__name__}: {first_line(error)}" if error is not None else f"exit code {code}"
    line = f"{why} (no restart can fix that; the script failed: {what})"
    log.line(f"toolkit.train: {line}", sys.stderr)
    path = env.get(envvars.TORCHELASTIC_ERROR_FILE)
    if path:
        with contextlib.suppress(OSError):  # the cause is extra: the status says the job cannot go on anyway
            atomicfile.write(Path(path), json.dumps({"message": line}).encode(), mode=0o600)
    return protocol.EXIT_FATAL


def record_error(error: BaseException) -> None:
    """Write `error` to TORCHELASTIC_ERROR_FILE as torch's `@record` does (its ErrorHandler: the message is
    "Type: text", with the traceback and a timestamp), for the agent to report as the failure's cause. Nothing when
    the variable is unset or the file exists: the script's own `@record` wrote it first, and its word stands.
    Called while `error` is being handled (the traceback is the current one). A file that cannot be written is a
    warning: the exit status still tells a failure."""
    path = os.environ.get(envvars.TORCHELASTIC_ERROR_FILE)
    if not path or os.path.lexists(path):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)
    except Exception as e:  # noqa: BLE001 - the cause is extra; the failure is reported by its status anyway
        warnings.warn(f"toolkit.train: could not write {envvars.TORCHELASTIC_ERROR_FILE}={path}: {e}", stacklevel=1)


def exit_now(code: int) -> NoReturn:
    """End the worker with `code` at once: atexit handlers run and every open file is flushed, but the interpreter's
    teardown is skipped. That teardown frees the process groups the script left behind (FSDP's mesh keeps its
    own), and a gloo worker thread that drops a finished collective's tensors then needs the GIL of an interpreter
    that is going away: it exits inside a C++ destructor, and the process aborts (std::terminate, `terminate called
    without an active exception`: SIGABRT in place of the script's status; seen with gdb on a pure-FSDP worker's
    core, 2026-11-28). Or the teardown blocks on a peer that is gone. What the teardown would still have done for
    the script, flushing the files it left open, is done here."""
    atexit._run_exitfuncs()
    flush_open_files()
    os._exit(code)


FLUSH_PASSES = 3  # each pushes buffered data one layer down: text over a compressor over a buffered file


def flush_open_files() -> None:
    """Flush every open file object of the process (its standard streams included), errors ignored: what the
    interpreter's teardown does as it frees them. Several passes in any order reach the bottom layer of stacked
    files. Costs one walk of the garbage collector's objects (0.14 s with torch loaded)."""
    import _io

    # type(), not isinstance: isinstance reads __class__, which some objects answer with a warning (torch's
    # deprecated reduce_op) or an error
    files = [o for o in gc.get_objects() if issubclass(type(o), _io._IOBase)]
    files += [sys.stdout, sys.stderr]
    for _ in range(FLUSH_PASSES):
        for f in files:
            with contextlib.suppress(Exception):
                if not f.closed and f.writable():
                    f.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m toolkit.train` (a bad invocation is one line on stderr and exit code 2). Once the
    script ran, the process ends at once with its status (`exit_now`), as well after success as after failure."""
    try:
        code = run_script(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        log.line(f"toolkit.train: error: {e}", sys.stderr)
        return 2
    exit_now(code)
