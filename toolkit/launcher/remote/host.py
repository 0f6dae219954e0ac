"""`Host`: a machine to run commands on and copy files to, as one interface over SSH (toolkit.launcher.remote.ssh) and
over this machine without SSH (toolkit.launcher.remote.local). The transport-specific part is five methods; the rest
(argv quoting, preflight, streams, sync) is here once.

Every call is bounded (commands by their timeout, default SshSettings.command_timeout; the rest by the transport's
bounds, see SshHost) and fails as one line naming the host: a RemoteError kind from toolkit.launcher.remote.results, or
a UserError for a local mistake (an unreadable local file, a `~user` path)."""

from __future__ import annotations

import shlex
import stat
import threading
from pathlib import Path
from typing import Callable, Mapping, Sequence

from toolkit.errors import UserError
from toolkit.launcher.remote.paths import home_relative
from toolkit.launcher.remote.projectsync import sync_dir
from toolkit.launcher.remote.results import (
    CommandFailed,
    CommandResult,
    ConnectionLost,
    PreflightFailed,
    SyncStats,
    decode_output,
    output_tail,
    short_command,
    signal_name,
)
from toolkit.launcher.remote.sshsettings import DEFAULT_EXCLUDE

_ENV_NAME = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789"
# Exit codes of the preflight script: each names one thing the host lacks.
_NO_PYTHON, _NO_TOOLKIT, _NO_WORKDIR, _PORT_BUSY = 10, 11, 12, 13
STREAM_POLL = 1.0  # s: longest one read of a streaming command waits before it looks at its stop event
_STREAM_HEADER = "toolkit-stream"


class Host:
    """A machine to run commands on and copy files to. Paths are the host's: relative ones (and `~/...`) are
    relative to the user's home there, as for ssh and sftp.

    Open ones come from `open_host` (or a HostPool); close with `close()` or a `with` block. A transport sets
    `name` (the inventory name every error starts with) and `settings` (SshSettings: the bounds), and implements
    `_run_text`, `_stream_text`, `_put_file`, `_write_bytes` and `_mkdir`. One Host is used by one thread at a
    time (run_on_all gives each host its own worker)."""

    name: str

    def run(
        self,
        command: Sequence[str] | str,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = False,
    ) -> CommandResult:
        """Run an argv list (quoted with shlex.join) or a POSIX shell script given as one string (only for
        scripts toolkit writes: user values go in as argv or through shlex.quote). With check, a failure raises
        the matching RemoteError.

        The command runs in the home directory (or `cwd`) with `env` exported, and is killed on the host after
        `timeout` seconds (None: settings.command_timeout). Without check the result tells what happened (exit
        status, timeout, signal, lost connection) and nothing is raised for the command's failure; with check a
        failure raises ConnectionLost or CommandFailed. SshHost raises, check or not, HostStalled when the host
        stops answering and CommandFailed for an SSH error on a live connection. ValueError for an empty argv or
        an invalid environment variable name; UserError for a `~user` cwd."""
        text = command_text(command, cwd, env)
        result = self._run_text(text, timeout)
        return result.check() if check else result

    def put(self, local: str | Path, remote: str, mode: int | None = None) -> None:
        """Copy a file, atomically (temp name, then rename), with the local file's mode unless `mode`.

        No byte is ever readable under a looser mode than `mode`; a failed copy leaves no temp file. Raises
        UserError if the local file cannot be read; CommandFailed, ConnectionLost or HostStalled from the
        transfer, which is bounded by its size (see SshSettings)."""
        local = Path(local)
        try:
            st = local.stat()
        except OSError as e:
            raise UserError(f"{local}: cannot read ({e.strerror}); check the path") from None
        self._put_file(local, home_relative(remote), stat.S_IMODE(st.st_mode) if mode is None else mode, None)

    def write(self, remote: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write `data` to a file, atomically, with `mode` (0o600 for secrets: the mode is set before the data
        lands under its final name). Raises as `put` does; the directory must exist."""
        self._write_bytes(home_relative(remote), data.encode() if isinstance(data, str) else data, mode)

    def sync_dir(
        self,
        local_dir: str | Path,
        remote_dir: str,
        exclude: Sequence[str] = DEFAULT_EXCLUDE,
        delete: bool = False,
    ) -> SyncStats:
        """Make remote_dir hold local_dir's files (toolkit.launcher.remote.projectsync): incremental, never following a
        symlink out of local_dir; with delete, remote files that are not local (and not excluded) are removed.

        Returns what was sent, kept and removed, and the symlinks left out (`SyncStats.outside`: the caller says
        so). Raises UserError if local_dir is not a directory, else as `run(check=True)` and `put` do."""
        return sync_dir(self, Path(local_dir), remote_dir, exclude, delete)

    def detach(
        self,
        argv: Sequence[str],
        log: str,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Start argv in its own session, detached from this connection (stdin /dev/null, output to `log`,
        relative to cwd), and return its pid. It outlives the connection.

        Returns once the process runs in its new session. Raises ValueError for an empty argv, ConnectionLost if
        the connection dropped before the pid came back, CommandFailed if no pid came back (the shell's error)."""
        if not argv:
            raise ValueError("detach needs a command")
        # The child reports its own pid from inside its new session on fd 3 (the channel) and closes it before
        # exec: so this returns once the process runs detached, with its real pid (even if setsid forked).
        script = (f"setsid /bin/sh -c 'echo $$ >&3; exec 3>&-; exec \"$@\"' sh {shlex.join(list(argv))} "
                  f"3>&1 > {shlex.quote(log)} 2>&1 < /dev/null &")
        result = self.run(script, cwd=cwd, env=env)
        what = f"cannot start {short_command(shlex.join(list(argv)))}"
        if result.connection_lost:
            raise ConnectionLost(self.name, f"{what}: {result.describe()}")
        try:
            return int(result.stdout.split()[-1])
        except (IndexError, ValueError):
            raise CommandFailed(self.name, f"{what}: {output_tail(result.stderr) or result.describe()}") from None

    def stream(
        self,
        command: Sequence[str] | str,
        on_lines: Callable[[list[str]], None],
        stop: threading.Event,
        poll: float = STREAM_POLL,
    ) -> CommandResult:
        """Run a command and hand the lines of its stdout to on_lines as they arrive (`tail -F` over SSH), until
        the command ends, the connection is lost, or `stop` is set. No read waits longer than `poll`. On stop,
        the command's process group on the host is killed (its leader reports its pid and group first), so a
        follower never outlives the stream; stderr comes back in the result.

        There is no overall timeout (`logs -f` streams until Ctrl-C); starting the command is bounded, and over
        SSH a dead peer ends the stream through TCP_USER_TIMEOUT and keepalives. on_line runs in the calling
        thread. Returns a CommandResult with empty stdout: `stopped` when `stop` ended it, else its exit status,
        signal or lost connection; raises only if the command cannot be started (HostStalled if the host does
        not answer). The lines of one read come in one call: what follows a fast writer costs per read, not per
        line."""
        text = command_text(command)
        # sshd (and LocalHost) start the command as a session leader: its pid is its process group.
        wrapped = (f'read -r _ _ _ _ g _ < /proc/$$/stat; echo "{_STREAM_HEADER} $$ $g"; '
                   f"exec /bin/sh -c {shlex.quote(text)}")
        lines = LineSplitter(on_lines)
        code, err, finished, stopped = self._stream_text(wrapped, lines, stop, poll)
        lines.flush()
        if stopped:
            return CommandResult(self.name, text, None, "", err, stopped=True)
        if not finished or code is None:
            lost = self._lost()
            return CommandResult(self.name, text, None, "", err, connection_lost=lost,
                                 signal=None if lost else "a signal")
        if code < 0:
            return CommandResult(self.name, text, None, "", err, signal=signal_name(-code))
        return CommandResult(self.name, text, code, "", err)

    def _end_stream(self, header: tuple[int, int] | None) -> None:
        """Kill a stream's command on the host: its whole process group when it leads one, else the pid.

        `header` is the (pid, pgid) the stream's wrapper printed first (None: it never did, nothing to kill).
        SIGTERM, bounded by dead_after; the result is not checked (the command may have ended meanwhile)."""
        if header is None:
            return
        pid, pgid = header
        target = f"-{pid}" if pgid == pid else str(pid)
        self.run(["kill", "-s", "TERM", "--", target], timeout=self.settings.dead_after)

    def preflight(self, python: str, workdir: str, ports: Sequence[int] = ()) -> None:
        """Check before starting anything that the host has `python`, that it imports toolkit, that `workdir`
        can be created, and that `ports` are free; raise PreflightFailed naming the first thing missing.

        One command (one round trip, one Python start), bounded by command_timeout. A port counts as free if it
        can be bound on all IPv4 interfaces. If the check itself cannot run, raises ConnectionLost or CommandFailed
        instead. Called by deploy (workdir only) and by train on the scheduler's host (with the job's two ports)
        when no agent runs there yet."""
        # One interpreter for the import and every port (each start of Python costs ~0.1 s of CPU per host).
        check = (
            "import socket, sys\n"
            "try:\n"
            "    import toolkit\n"
            "except Exception as e:\n"
            "    print(f'{type(e).__name__}: {e}', file=sys.stderr)\n"
            f"    sys.exit({_NO_TOOLKIT})\n"
            "for p in sys.argv[1:]:\n"
            "    s = socket.socket()\n"
            "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "    try:\n"
            "        s.bind(('', int(p)))\n"
            "    except OSError:\n"
            "        print(p)\n"
            f"        sys.exit({_PORT_BUSY})\n"
            "    finally:\n"
            "        s.close()\n"
        )
        script = (
            'py=$1 wd=$2 check=$3; shift 3\n'
            f'case $py in */*) test -x "$py" ;; *) command -v "$py" >/dev/null 2>&1 ;; esac || exit {_NO_PYTHON}\n'
            f'mkdir -p -- "$wd" && test -w "$wd" || exit {_NO_WORKDIR}\n'
            'exec "$py" -c "$check" "$@"\n'
        )
        wd = home_relative(workdir)
        result = self.run(["sh", "-c", script, "sh", python, wd, check, *(str(p) for p in ports)])
        if result.ok:
            return
        if result.connection_lost or result.exit_code not in (_NO_PYTHON, _NO_TOOLKIT, _NO_WORKDIR, _PORT_BUSY):
            result.check()
            raise CommandFailed(self.name, result.describe())
        detail = output_tail(result.stderr, lines=1)  # a traceback's last line says it all
        cause = {
            _NO_PYTHON: f"python {python} not found; install Python 3 there or set the host's python= "
                        "(inventory) / --python",
            _NO_TOOLKIT: f"{python} cannot import toolkit ({detail or 'no detail'}); install toolkit on the host "
                         "or point python= at an interpreter that has it",
            _NO_WORKDIR: f"cannot create the workdir {workdir} ({detail or 'not writable'}); choose a writable "
                         "--workdir or fix its permissions",
            _PORT_BUSY: f"port {result.stdout.strip()} is already in use; stop what listens there or choose "
                        "another --master-port",
        }[result.exit_code]
        raise PreflightFailed(self.name, cause)

    def close(self) -> None:
        """Release the connection; a no-op here (LocalHost has none). Safe to call more than once."""
        pass

    def _lost(self) -> bool:
        """Whether a stream that ended without an exit status ended because the connection is gone."""
        return False

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the transport-specific part
    def _run_text(self, text: str, timeout: float | None) -> CommandResult:
        """Run shell text (from command_text) with /bin/sh, killed after `timeout` (None: command_timeout); the
        outcome as a CommandResult, never raising for the command's own failure."""
        raise NotImplementedError

    def _stream_text(self, text: str, lines: LineSplitter, stop: threading.Event,
                     poll: float) -> tuple[int | None, str, bool, bool]:
        """(exit status, stderr, finished, stopped); a negative status is a signal.

        Feed stdout to `lines` until the command ends or `stop` is set (then kill it, see `_end_stream`); no
        wait longer than `poll` between looks at `stop`. `finished` False: no exit status came back."""
        raise NotImplementedError

    def put_file(self, local: Path, remote: str, mode: int, mtime: int | None = None) -> None:
        """Copy `local` to `remote` (home-relative) atomically with `mode`, and `mtime` if given; what the directory
        sync (toolkit.launcher.remote.projectsync) sends each changed file with. RemoteError on failure."""
        self._put_file(local, remote, mode, mtime)

    def mkdir(self, remote: str) -> None:
        """Create one directory (home-relative; its parent exists). RemoteError on failure."""
        self._mkdir(remote)

    def _put_file(self, local: Path, remote: str, mode: int, mtime: int | None) -> None:
        """Copy `local` to `remote` (home-relative) atomically with `mode`, and `mtime` if given (sync compares
        it); RemoteError on failure, with the temp file removed."""
        raise NotImplementedError

    def _write_bytes(self, remote: str, data: bytes, mode: int) -> None:
        """Write `data` to `remote` atomically with `mode`, set before the data lands; RemoteError on failure."""
        raise NotImplementedError

    def _mkdir(self, remote: str) -> None:
        """Create one directory (its parent exists); RemoteError on failure."""
        raise NotImplementedError


class LineSplitter:
    """Bytes of a stream -> whole lines for the callback, those of each chunk in one call (decoded once: a newline
    never falls inside a UTF-8 sequence); the first line is the stream's header (pid, group)."""

    def __init__(self, on_lines: Callable[[list[str]], None]) -> None:
        self.on_lines = on_lines
        self.buf = b""
        self.header: tuple[int, int] | None = None
        self.header_seen = False

    def feed(self, data: bytes) -> None:
        """Take the next chunk; complete lines go out, a partial last line waits for the rest."""
        complete, newline, self.buf = (self.buf + data).rpartition(b"\n")
        if newline:
            self._lines(decode_output(complete).split("\n"))

    def flush(self) -> None:
        """Hand out a last line that had no newline (at the end of the stream)."""
        if self.buf:
            self._lines([decode_output(self.buf)])
            self.buf = b""

    def _lines(self, lines: list[str]) -> None:
        """The first line, if it is the header, sets `header` and is swallowed; every other line goes to on_lines."""
        if not self.header_seen:
            self.header_seen = True
            words = lines[0].split()
            if len(words) == 3 and words[0] == _STREAM_HEADER and words[1].isdigit():
                self.header = (int(words[1]), int(words[2]) if words[2].isdigit() else -1)
                lines = lines[1:]
        if lines:
            self.on_lines(lines)


def command_text(command: Sequence[str] | str, cwd: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The shell text for a command: argv quoted with shlex.join (and exec'd), a script as is; `cd` and
    `export` lines (quoted) before it.

    What Host.run sends, so also what error messages show. A failed `cd` exits 1 before the command runs.
    Raises ValueError for an empty argv or an environment variable name that is not [A-Za-z_][A-Za-z0-9_]*."""
    if isinstance(command, str):
        body = command
    else:
        argv = list(command)
        if not argv:
            raise ValueError("empty command")
        body = "exec " + shlex.join(argv)  # no shell left between: a signal that kills argv is seen as such
    lines = []
    if cwd is not None:
        lines.append(f"cd -- {shlex.quote(home_relative(cwd))} || exit 1")
    for name, value in (env or {}).items():
        if not name or name[0].isdigit() or any(c not in _ENV_NAME for c in name):
            raise ValueError(f"environment variable name {name!r} is not valid")
        lines.append(f"export {name}={shlex.quote(str(value))}")
    return "\n".join(lines + [body])
