"""`python -m toolkit.agent [run|start|stop|status|restart] --job-dir DIR`: the agent's command line, and the client
side of its sockets (used by launch.sh, recover.sh, stop.sh and fleet over SSH).

    python -m toolkit.agent [run] --job-dir DIR       supervise in the foreground
    python -m toolkit.agent start --job-dir DIR       start detached unless already running (launch.sh)
    python -m toolkit.agent restart --job-dir DIR N   restart process N through the agent (recover.sh)
    python -m toolkit.agent status --job-dir DIR      print agent.json, with "alive"
    python -m toolkit.agent stop --job-dir DIR        SIGTERM, bounded wait, SIGKILL; verify nothing is left
    python -m toolkit.agent replace --job-dir DIR HOST [--with SPARE]
                                                      ask the scheduler to hand HOST's ranks to a spare (fleet replace)

A running agent holds state/agent.lock (a second agent for the job exits at once) and records itself in
state/agent.pid as "<pid> <start ticks>": it is only ever signalled when both still match.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import math
import os
import select
import signal
import socket
import sys
from typing import Any, Callable

from toolkit import procs
from toolkit.agent import policy
from toolkit.agent.agentlog import AgentLog, log_tail
from toolkit.agent.control import CLIENT_TIMEOUT
from toolkit.agent.link import LINK_CONNECT_TIMEOUT
from toolkit.agent.supervisor import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USAGE,
    Agent,
)
from toolkit.contracts import hostspec, protocol
from toolkit.contracts import messages as wire
from toolkit.contracts.agentdoc import (
    EXIT_OTHER_JOB,
    VERSION,
    AgentDoc,
    BadDocument,
    ControlOp,
    judge,
    pid_record,
    recorded_groups,
)
from toolkit.contracts.hostspec import HostSpec
from toolkit.contracts.session import Unproven, open_session
from toolkit.errors import UserError
from toolkit.printable import clean

START_TIMEOUT = 30.0  # s for a detached agent to say it is up
STOP_MARGIN = 10.0  # s beyond the grace period that `stop` waits for the agent to finish stopping

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_OTHER_JOB", "EXIT_STOPPED", "EXIT_USAGE", "main", "request", "restart",
           "run", "replace", "running_agent", "start", "status", "stop"]


def _lock(spec: HostSpec) -> int | None:
    """Take state/agent.lock without waiting: the fd that holds the flock, or None if another agent of the job holds it.
    The lock lasts until the fd is closed or the process ends (close-on-exec: children never hold it)."""
    spec.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(spec.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_pid_file(spec: HostSpec) -> tuple[int, int] | None:
    """(pid, start ticks) from the pid file (toolkit.contracts.agentdoc.pid_record); None if it is missing or not in
    that form."""
    try:
        return pid_record(spec.pid_file.read_text())
    except OSError:
        return None


def running_agent(spec: HostSpec) -> tuple[int, int] | None:
    """(pid, ticks) of this job's live agent: the pid file names a process that exists with the same start time."""
    rec = read_pid_file(spec)
    if rec is not None and procs.is_running(*rec):
        return rec
    return None


def run(spec: HostSpec, ready_fd: int | None = None) -> int:
    """`run`: supervise in the foreground until the job ends here; returns the agent's exit code. Takes state/agent.lock
    without waiting: when another agent of the job holds it, says so on stderr and returns EXIT_OK (launch.sh may run
    twice). `ready_fd` (the pipe `start` waits on) gets "ready <pid>" once the agent is up, or "running <pid>" when
    another one runs, and is closed; an agent that fails before says nothing (the pipe closes when it exits). A
    UserError (e.g. bind_core without enough CPUs) is logged to agent.log and raised again. The lock is released when
    this returns."""
    lock = _lock(spec)
    ready: Callable[[str], None] | None = None
    if ready_fd is not None:
        def ready(text: str) -> None:
            try:
                os.write(ready_fd, text.encode() + b"\n")
            finally:
                os.close(ready_fd)
    if lock is None:
        rec = read_pid_file(spec)
        msg = f"{spec.host}: agent of job {spec.job} already running (pid {rec[0] if rec else '?'})"
        print(msg, file=sys.stderr)
        if ready:
            ready(f"running {rec[0] if rec else 0}")
        return EXIT_OK
    log = AgentLog(spec.agent_log, spec.host)
    try:
        return Agent(spec, log).run(ready)
    except UserError as e:
        log("agent", str(e))
        raise
    finally:
        log.close()
        os.close(lock)


def other_job(spec: HostSpec, job_id: str | None) -> str | None:
    """The one line saying that this job directory holds another project's job than `job_id` (what `fleet` expects
    there), or None when it is that job (or either side has no id: a directory rendered by hand or by an older
    deploy, a caller that did not say)."""
    if not job_id or not spec.job_id or job_id == spec.job_id:
        return None
    origin = f" ({clean(spec.origin, 400)})" if spec.origin else ""
    return (f"{spec.host}: {spec.job_dir} holds another project's job {spec.job}{origin}, not the one asked for: "
            "nothing was done to it; give your job another --job name (or --workdir)")


def start(spec: HostSpec, timeout: float = START_TIMEOUT, overrides: list[str] | None = None,
          job_id: str | None = None) -> int:
    """launch.sh: start the agent detached (its own session, stdout/stderr to agent.log) unless it runs.

    Returns EXIT_OK once the new agent says it is ready (or that another one runs); EXIT_FAILED if it says nothing
    within `timeout` s (it is left running: see agent.log) or exits first (its last log line is printed). `overrides`
    are the flags from `with_overrides`, passed on to the new agent. With `job_id` (fleet's), a job directory that
    holds another project's job is left alone: one line on stderr and EXIT_OTHER_JOB, whether its agent runs or not
    ("already running" is success only for this job)."""
    refusal = other_job(spec, job_id)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return EXIT_OTHER_JOB
    rec = running_agent(spec)
    if rec is not None:
        print(f"{spec.host}: agent of job {spec.job} already running (pid {rec[0]})")
        return EXIT_OK
    spec.agent_log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    r, w = os.pipe()
    os.set_inheritable(w, True)
    argv = [sys.executable, "-m", "toolkit.agent", "run", "--job-dir", str(spec.job_dir), "--ready-fd", str(w),
            *(overrides or [])]
    try:
        pid = os.posix_spawn(sys.executable, argv, dict(os.environ), setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(spec.agent_log), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ])
    finally:
        os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        text = os.read(r, 256).decode(errors="replace").strip() if ready else ""
    finally:
        os.close(r)
    if text.startswith("ready "):
        print(f"{spec.host}: agent started (pid {text.split()[1]}), supervising "
              f"{', '.join(p.node_id for p in spec.processes)}; logs in {spec.job_dir / 'logs'}")
        return EXIT_OK
    if text.startswith("running "):
        print(f"{spec.host}: agent of job {spec.job} already running (pid {text.split()[1]})")
        return EXIT_OK
    if not ready:
        print(f"{spec.host}: the agent (pid {pid}) did not come up within {timeout:g} s; see {spec.agent_log}",
              file=sys.stderr)
        return EXIT_FAILED
    os.waitpid(pid, 0)
    last = [line for line in log_tail(spec.agent_log, 5) if line.strip()]
    print(f"{spec.host}: the agent failed to start: {last[-1] if last else 'no output'} (see {spec.agent_log})",
          file=sys.stderr)
    return EXIT_FAILED


def request(spec: HostSpec, msg: dict, timeout: float = CLIENT_TIMEOUT) -> dict:
    """One conversation on the agent's control socket: `msg` as one JSON line out, the one-line JSON reply back. Each
    socket operation is bounded by `timeout`. Raises OSError (no agent listening, a timeout, the connection closed
    without an answer) or ValueError (a reply that is not JSON)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(spec.control_socket))
        s.sendall(json.dumps(msg).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    if not buf.strip():
        raise OSError("the agent closed the connection without answering")
    return json.loads(buf)


def status(spec: HostSpec) -> dict[str, Any]:
    """agent.json as the running agent says it, else as it left it, judged by toolkit.contracts.agentdoc's rule (a
    recorded agent that no longer runs is `gone`), as JSON has it (AgentDoc.to_dict)."""
    rec = running_agent(spec)
    if rec is not None:
        try:
            reply = AgentDoc.from_obj(request(spec, {"op": ControlOp.STATUS.value}))
            return dataclasses.replace(reply, alive=True).to_dict()
        except (OSError, ValueError):
            pass
    try:
        doc: AgentDoc | None = AgentDoc.parse(spec.agent_json.read_bytes())
    except (OSError, BadDocument):
        doc = None
    judged = judge(doc, rec)
    if doc is None:
        judged = dataclasses.replace(judged, version=VERSION, job=spec.job, host=spec.host, alive=rec is not None)
    if spec.job_id:  # which job the directory holds, whatever wrote agent.json
        judged = dataclasses.replace(judged, job_id=spec.job_id, job_dir=str(spec.job_dir))
    return judged.to_dict()


def restart(spec: HostSpec, node_id: str) -> int:
    """recover.sh: restart `node_id` through the running agent; returns EXIT_OK or EXIT_FAILED (the reason on stderr).
    The restart is not counted against max_restarts. Raises UserError for a process this host does not run. Without a
    running agent it starts one (`start`), which starts every process of the host. One control conversation, bounded by
    CLIENT_TIMEOUT."""
    if spec.proc(node_id) is None:
        raise UserError(f"{spec.host}: no process {node_id!r} in this job here; this host runs "
                        f"{', '.join(p.node_id for p in spec.processes)}")
    if running_agent(spec) is None:
        print(f"{spec.host}: the agent was not running; starting it (it starts {node_id} with the others)")
        return start(spec)
    try:
        reply = request(spec, {"op": ControlOp.RESTART.value, "node_id": node_id})
    except (OSError, ValueError) as e:
        print(f"{spec.host}: the agent did not answer on {spec.control_socket} ({e}); try stop.sh then launch.sh",
              file=sys.stderr)
        return EXIT_FAILED
    if not reply.get("ok"):
        print(f"{spec.host}: {reply.get('error')}", file=sys.stderr)
        return EXIT_FAILED
    was = reply.get("was_pid")
    print(f"{spec.host}: restarting {node_id}" + (f" (pid {was} gets SIGTERM, then a new process starts)"
                                                  if was else f" (new pid {reply.get('pid')})"))
    return EXIT_OK


def stop(spec: HostSpec, timeout: float | None = None, job_id: str | None = None, by: str | None = None) -> int:
    """stop.sh: SIGTERM the agent, wait (bounded) for it to stop its processes, SIGKILL it if it must, then make sure no
    process of the groups it recorded is left. With `by` (who stops it: "fleet stop"), the agent is first asked on its
    control socket (bounded by CLIENT_TIMEOUT), so that its processes' exits are recorded as that stop ("stopped by
    fleet stop"); SIGTERM when it does not answer.

    Returns EXIT_OK when nothing of the job is left, else EXIT_FAILED naming the survivors on stderr. The agent gets
    `timeout` s (default grace + STOP_MARGIN), then procs.KILL_WAIT after its SIGKILL; each leftover process gets
    procs.KILL_WAIT after its own. The agent is only signalled while its pid file's pid and start time still match.
    With `job_id` (fleet's), another project's job in this directory is left running: EXIT_OTHER_JOB."""
    refusal = other_job(spec, job_id)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return EXIT_OTHER_JOB
    timeout = spec.grace + STOP_MARGIN if timeout is None else timeout
    rec = running_agent(spec)
    said = f"{spec.host}: agent was not running"
    if rec is not None:
        pid, ticks = rec
        if not (by and _asked_to_stop(spec, by)):
            procs.kill_quietly(pid, signal.SIGTERM)
        if procs.wait_gone(pid, ticks, timeout):
            said = f"{spec.host}: stopped (agent pid {pid})"
        else:
            procs.kill_quietly(pid, signal.SIGKILL)
            procs.wait_gone(pid, ticks, procs.KILL_WAIT)
            said = f"{spec.host}: agent pid {pid} did not stop within {timeout:g} s: killed"
    left = _leftovers(spec)
    if left:
        print(f"{spec.host}: processes still running after stop: {', '.join(map(str, left))}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{said}; no process of the job is left")
    return EXIT_OK


def _asked_to_stop(spec: HostSpec, by: str) -> bool:
    """Whether the agent took a stop request naming `by` on its control socket (one bounded conversation)."""
    try:
        return request(spec, {"op": ControlOp.STOP.value, "by": by}).get("ok") is True
    except (OSError, ValueError, AttributeError):
        return False


def _recorded_groups(spec: HostSpec) -> list[tuple[str, int, int]]:
    """(node_id, pgid, leader start ticks) of the groups agent.json records; [] without a readable agent.json."""
    try:
        return recorded_groups(spec.agent_json.read_text(encoding="utf-8"))
    except OSError:
        return []


def _leftovers(spec: HostSpec) -> list[int]:
    """SIGKILL what is left of the groups in agent.json (the agent normally leaves nothing); return survivors."""
    groups = _recorded_groups(spec)
    for _, pgid, ticks in groups:
        for pid in procs.reclaim_group(pgid, ticks):
            procs.wait_gone(pid, None, procs.KILL_WAIT)
    return [info.pid for _, pgid, ticks in groups for info in procs.owned_group_members(pgid, ticks)]


def with_overrides(spec: HostSpec, args: argparse.Namespace) -> tuple[HostSpec, list[str]]:
    """Apply --max-restarts/--grace/--bind-core/--warm-spare over host.json; also returns them as flags, which `start`
    hands on to the detached agent. Raises UserError for a negative --max-restarts or a negative or infinite --grace."""
    flags: list[str] = []
    if args.max_restarts is not None:
        if args.max_restarts < 0:
            raise UserError(f"--max-restarts {args.max_restarts}: give 0 or more")
        spec = dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, max_restarts=args.max_restarts))
        flags += ["--max-restarts", str(args.max_restarts)]
    if args.grace is not None:
        if not 0 <= args.grace < math.inf:
            raise UserError(f"--grace {args.grace}: give 0 or more seconds, a finite number")
        spec = dataclasses.replace(spec, grace=args.grace)
        flags += ["--grace", str(args.grace)]
    for name in ("bind_core", "warm_spare"):
        value = getattr(args, name)
        if value is not None:
            spec = dataclasses.replace(spec, **{name: value})
            flags.append(("--" if value else "--no-") + name.replace("_", "-"))
    return spec, flags


COMMANDS = ("run", "start", "stop", "status", "restart", "replace")
REPLACE_TIMEOUT = 10.0  # s for the scheduler to answer a replace request


def replace(spec: HostSpec, host: str, spare: str | None) -> int:
    """Ask the job's scheduler (host.json's address, the job token) to hand `host`'s ranks to `spare` (or to the first
    free spare): an authenticated `replace` connection (toolkit.contracts.session), bounded by REPLACE_TIMEOUT. Prints
    the answer: what moved where (EXIT_OK), or the scheduler's reason for refusing (EXIT_FAILED); a scheduler that
    cannot be reached or proven is a UserError naming its address."""
    where = f"{spec.sched_host}:{spec.sched_port}"
    try:
        token = spec.token_file.read_text(encoding="utf-8").strip()
        session = open_session((spec.sched_host, spec.sched_port), token, wire.Replace(host, spare), REPLACE_TIMEOUT,
                               min(REPLACE_TIMEOUT, LINK_CONNECT_TIMEOUT))
    except (OSError, protocol.ProtocolError, Unproven) as e:
        raise UserError(f"cannot ask the scheduler at {where} to replace {host}: {e}; is the job running?") from None
    session.sock.close()
    reply = session.reply
    if not isinstance(reply, wire.Welcome):
        print(f"{spec.host}: the scheduler refused: {wire.refusal(reply)[0]}", file=sys.stderr)
        return EXIT_FAILED
    nodes = ", ".join(reply.node_ids or ())
    print(f"{reply.host} replaced by {reply.spare}: it takes {nodes}; {reply.host} is fenced")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """The agent's command line: `[run|start|stop|status|restart] --job-dir DIR ...`, `run` when no command is given;
    returns the exit code. A UserError (bad host.json, bad flag) is printed on stderr and gives its exit code (2);
    argparse exits 2 itself for unknown arguments. `status` prints the judged agent.json on stdout."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    ap = argparse.ArgumentParser(prog=f"python -m toolkit.agent {command}",
                                 description="The per-host supervisor of a toolkit job.",
                                 epilog="\n\n".join([*(__doc__ or "").split("\n\n")[1:],
                                                      (policy.__doc__ or "").split("\n\n")[1]]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job-dir", required=True, help="the job directory (holds host.json)")
    if command == "run":
        ap.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    if command == "restart":
        ap.add_argument("node_id", help="the process to restart, e.g. worker_3")
    if command == "replace":
        ap.add_argument("host", help="the host whose ranks a spare takes over")
        ap.add_argument("--with", dest="spare", default=None, help="the spare host (default: the first free one)")
    if command == "stop":
        ap.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the agent before SIGKILL (default: grace + 10)")
        ap.add_argument("--by", default=None, help="who stops the job (e.g. 'fleet stop'): the cause recorded for "
                                                   "its processes")
    if command in ("start", "stop"):
        ap.add_argument("--job-id", default=None,
                        help="act only if the job directory holds this job (its job-id file); else exit 4")
    if command in ("run", "start"):
        ap.add_argument("--max-restarts", type=int, default=None,
                        help="restarts of one process before the job fails (host.json: max_restarts, default 3)")
        ap.add_argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL")
        ap.add_argument("--bind-core", action=argparse.BooleanOptionalAction, default=None,
                        help="pin each worker to its own CPUs (msrun's --bind_core)")
        ap.add_argument("--warm-spare", action=argparse.BooleanOptionalAction, default=None,
                        help="keep an interpreter with torch imported for fast replacement")
    args = ap.parse_args(argv)
    try:
        spec = hostspec.load(args.job_dir)
        if command in ("run", "start"):
            spec, overrides = with_overrides(spec, args)
        if command == "run":
            return run(spec, args.ready_fd)
        if command == "start":
            return start(spec, overrides=overrides, job_id=args.job_id)
        if command == "restart":
            return restart(spec, args.node_id)
        if command == "stop":
            return stop(spec, args.timeout, args.job_id, args.by)
        if command == "replace":
            return replace(spec, args.host, args.spare)
        print(json.dumps(status(spec), indent=1))
        return EXIT_OK
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
