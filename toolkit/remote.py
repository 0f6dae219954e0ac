"""The doing layer's transport: one `Host` per machine (SSH through Fabric, or this machine without SSH) and a
bounded parallel fan-out that returns a result per host.

Fabric on its own accepts any host key (it hard-codes paramiko's AutoAddPolicy and reads no known_hosts file) and
an open connection to a host that drops off the network hangs for an hour; both are fixed here, in one place, so
every task gets strict host keys and bounded waits. Every failure becomes one line naming the host and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import os
import select
import shlex
import signal
import socket
import stat
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

from toolkit import atomicfile
from toolkit.errors import UserError

DEFAULT_PARALLEL = 32
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_EXCLUDE = ("__pycache__", "*.pyc", ".git", ".venv", ".mypy_cache", ".pytest_cache")
LOCALHOST = "localhost"
_ENV_NAME = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789"
# Exit codes of the preflight script: each names one thing the host lacks.
_NO_PYTHON, _NO_TOOLKIT, _NO_WORKDIR, _PORT_BUSY = 10, 11, 12, 13
_KILL_AFTER = 1.0  # s between a timed-out command's SIGTERM and SIGKILL
STREAM_POLL = 1.0  # s: longest one read of a streaming command waits before it looks at its stop event
MIN_TRANSFER_RATE = 1e6  # bytes/s an sftp transfer may not fall below before it counts as stalled
_STREAM_HEADER = "toolkit-stream"

T = TypeVar("T")


# --- settings and targets --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SshSettings:
    """How to reach hosts. `dead_after` bounds every wait on an open connection: data unacknowledged for that
    long (TCP_USER_TIMEOUT, with keepalives so there always is data) or a channel not opened in that time means
    the host is gone."""

    known_hosts: str = "~/.ssh/known_hosts"
    accept_new_host_keys: bool = False
    ssh_config: str | None = None  # None: ~/.ssh/config and /etc/ssh/ssh_config, as ssh reads them
    identity_files: tuple[str, ...] = ()
    connect_timeout: float | None = None  # None: ssh_config's ConnectTimeout, else DEFAULT_CONNECT_TIMEOUT
    keepalive_interval: float = 5.0
    dead_after: float = 15.0
    command_timeout: float = 300.0  # default bound of run() on the host (every remote call has one)
    parallel: int = DEFAULT_PARALLEL

    def __post_init__(self) -> None:
        if not isinstance(self.parallel, int) or self.parallel < 1:
            raise UserError(f"--parallel {self.parallel}: give a whole number of hosts of at least 1")
        for name in ("connect_timeout", "keepalive_interval", "dead_after", "command_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"SSH setting {name}={value!r}: give a positive number of seconds")
        if isinstance(self.identity_files, str):
            object.__setattr__(self, "identity_files", (self.identity_files,))

    @property
    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts).expanduser()


@dataclass(frozen=True)
class Target:
    """One host to reach: its inventory name, and what overrides ssh_config (None: ssh_config, then defaults).
    A `local` target runs on this machine without SSH."""

    name: str
    hostname: str | None = None
    port: int | None = None
    user: str | None = None
    key_file: str | None = None
    local: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise UserError("a host needs a name")
        if self.port is not None and not 1 <= self.port <= 65535:
            raise UserError(f"host {self.name}: SSH port {self.port} is outside 1-65535")

    @classmethod
    def of(cls, host: Any, local: bool = False) -> Target:
        """From anything shaped like toolkit.inventory.Host (name, address, port, user, key_file)."""
        address = getattr(host, "address", None)
        return cls(
            name=host.name,
            hostname=address.removeprefix("[").removesuffix("]") if address else None,
            port=getattr(host, "port", None),
            user=getattr(host, "user", None),
            key_file=getattr(host, "key_file", None),
            local=local,
        )


# --- results and errors ----------------------------------------------------------------------------------------


class RemoteError(UserError):
    """One host failed; the message is `<host>: <cause>` on one line."""

    def __init__(self, host: str, cause: str) -> None:
        super().__init__(f"{host}: {cause}")
        self.host = host
        self.cause = cause


class HostUnreachable(RemoteError):
    pass


class AuthenticationFailed(RemoteError):
    pass


class UnknownHostKey(RemoteError):
    pass


class ChangedHostKey(RemoteError):
    pass


class ConnectionLost(RemoteError):
    pass


class CommandFailed(RemoteError):
    pass


class PreflightFailed(RemoteError):
    pass


class HostStalled(RemoteError):
    """The host (its sshd session, or the network) stopped answering within the call's bound."""


def _stalled(what: str, seconds: float) -> str:
    return (f"stopped answering: {what} got no answer within {seconds:g} s (the host, its SSH session or the network "
            "stalled); the connection was closed")


@dataclass(frozen=True)
class CommandResult:
    """What one command did. `exit_code` is None when there is none: the connection was lost (the far side
    vanished: not the command's failure), the command timed out, or a signal killed it."""

    host: str
    command: str
    exit_code: int | None
    stdout: str
    stderr: str
    connection_lost: bool = False
    timed_out: bool = False
    signal: str | None = None
    stopped: bool = False  # a stream ended by its stop event (the command was killed on purpose)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def describe(self) -> str:
        """The cause in a few words, for a one-line error."""
        if self.connection_lost:
            return "connection lost while running a command (host down or cut off)"
        if self.timed_out:
            return f"command timed out: {_short(self.command)}"
        if self.stopped:
            return f"command stopped on request: {_short(self.command)}"
        tail = _tail(self.stderr) or _tail(self.stdout)
        how = f"killed by {self.signal}" if self.signal else (
            "ended without an exit status" if self.exit_code is None else f"exited with {self.exit_code}")
        return f"command {how}: {_short(self.command)}" + (f": {tail}" if tail else "")

    def check(self) -> CommandResult:
        """Return self if the command succeeded, else raise the matching one-line error."""
        if self.ok:
            return self
        if self.connection_lost:
            raise ConnectionLost(self.host, self.describe())
        raise CommandFailed(self.host, self.describe())


@dataclass(frozen=True)
class SyncStats:
    files_sent: int = 0
    bytes_sent: int = 0
    files_unchanged: int = 0
    dirs_created: int = 0
    removed: int = 0
    outside: tuple[str, ...] = ()  # symlinks to something out of the directory: never followed, never sent


@dataclass(frozen=True)
class HostResult(Generic[T]):
    """The outcome of one host's part of a fan-out. `finished` (monotonic) orders failures: the earliest is the
    root cause. `skipped`: never attempted because another host had already failed (fail_fast)."""

    host: str
    ok: bool
    value: T | None = None
    error: str | None = None
    seconds: float = 0.0
    finished: float = 0.0
    skipped: bool = False
    exception: BaseException | None = field(default=None, repr=False, compare=False)


class ClusterError(UserError):
    """Some hosts failed. The first line names the root cause (the earliest failure); one line per failed host
    follows."""

    def __init__(self, results: Mapping[str, HostResult[Any]]) -> None:
        self.results = dict(results)
        failed = [r for r in results.values() if not r.ok]
        attempted = sorted((r for r in failed if not r.skipped), key=lambda r: r.finished)
        self.failures = tuple(attempted + [r for r in failed if r.skipped])
        if not self.failures:
            raise ValueError("ClusterError needs at least one failed host")
        root = self.failures[0]
        lines = [f"{len(failed)} of {len(results)} hosts failed; root cause: {root.error}"]
        lines += [f"  {r.error}" + (" (root cause)" if r is root else "") for r in self.failures]
        super().__init__("\n".join(lines))

    @property
    def root_cause(self) -> HostResult[Any]:
        return self.failures[0]


# --- hosts -----------------------------------------------------------------------------------------------------


class Host:
    """A machine to run commands on and copy files to. Paths are the host's: relative ones (and `~/...`) are
    relative to the user's home there, as for ssh and sftp."""

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
        the matching RemoteError."""
        text = command_text(command, cwd, env)
        result = self._run_text(text, timeout)
        return result.check() if check else result

    def put(self, local: str | Path, remote: str, mode: int | None = None) -> None:
        """Copy a file, atomically (temp name, then rename), with the local file's mode unless `mode`."""
        local = Path(local)
        try:
            st = local.stat()
        except OSError as e:
            raise UserError(f"{local}: cannot read ({e.strerror}); check the path") from None
        self._put_file(local, _home_relative(remote), stat.S_IMODE(st.st_mode) if mode is None else mode, None)

    def write(self, remote: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write `data` to a file, atomically, with `mode` (0o600 for secrets: the mode is set before the data
        lands under its final name)."""
        self._write_bytes(_home_relative(remote), data.encode() if isinstance(data, str) else data, mode)

    def sync_dir(
        self,
        local_dir: str | Path,
        remote_dir: str,
        exclude: Sequence[str] = DEFAULT_EXCLUDE,
        delete: bool = False,
    ) -> SyncStats:
        """Make remote_dir hold local_dir's files. Incremental: one listing command, then only files whose
        size, mtime (whole seconds) or mode differ are sent; a second sync of an unchanged tree sends nothing.
        With delete, remote files that are not local (and not excluded) are removed."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise UserError(f"{local_dir}: not a directory; nothing to copy to {self.name}")
        remote_dir = _home_relative(remote_dir)
        local_files, local_dirs, outside = _scan(local_dir, exclude)
        listing = self.run(
            f"mkdir -p -- {shlex.quote(remote_dir)} && find {shlex.quote(remote_dir)} -mindepth 1 "
            "-printf '%y %s %T@ %m %P\\0'"
        )
        if not listing.ok:
            raise (ConnectionLost if listing.connection_lost else CommandFailed)(
                self.name, f"cannot list {remote_dir}: {listing.describe()}")
        remote: dict[str, tuple[str, int, int, int]] = {}
        for entry in listing.stdout.split("\0"):
            if entry:
                kind, size, mtime, mode, rel = entry.split(" ", 4)
                remote[rel] = (kind, int(size), int(float(mtime)), int(mode, 8))

        def excluded(rel: str) -> bool:
            return any(fnmatch.fnmatch(part, pat) for part in rel.split("/") for pat in exclude)

        stale = [rel for rel, info in remote.items()
                 if (rel in local_files and info[0] != "f") or (rel in local_dirs and info[0] != "d")]
        if delete:
            stale += [rel for rel in remote if rel not in local_files and rel not in local_dirs and not excluded(rel)]
        stale = [rel for rel in stale if not any(rel.startswith(s + "/") for s in stale if s != rel)]
        if stale:
            self.run(["rm", "-rf", "--", *(f"{remote_dir}/{rel}" for rel in stale)], check=True)
        for rel in stale:
            remote.pop(rel, None)
        dirs_created = 0
        for rel in sorted(local_dirs):
            if rel not in remote or remote[rel][0] != "d":
                self._mkdir(f"{remote_dir}/{rel}")
                dirs_created += 1
        sent = unchanged = nbytes = 0
        for rel, (size, mtime, mode) in sorted(local_files.items()):
            if remote.get(rel) == ("f", size, mtime, mode):
                unchanged += 1
                continue
            self._put_file(local_dir / rel, f"{remote_dir}/{rel}", mode, mtime)
            sent += 1
            nbytes += size
        return SyncStats(files_sent=sent, bytes_sent=nbytes, files_unchanged=unchanged,
                         dirs_created=dirs_created, removed=len(stale), outside=tuple(outside))

    def detach(
        self,
        argv: Sequence[str],
        log: str,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Start argv in its own session, detached from this connection (stdin /dev/null, output to `log`,
        relative to cwd), and return its pid. It outlives the connection."""
        if not argv:
            raise ValueError("detach needs a command")
        # The child reports its own pid from inside its new session on fd 3 (the channel) and closes it before
        # exec: so this returns once the process runs detached, with its real pid (even if setsid forked).
        script = (f"setsid /bin/sh -c 'echo $$ >&3; exec 3>&-; exec \"$@\"' sh {shlex.join(list(argv))} "
                  f"3>&1 > {shlex.quote(log)} 2>&1 < /dev/null &")
        result = self.run(script, cwd=cwd, env=env)
        what = f"cannot start {_short(shlex.join(list(argv)))}"
        if result.connection_lost:
            raise ConnectionLost(self.name, f"{what}: {result.describe()}")
        try:
            return int(result.stdout.split()[-1])
        except (IndexError, ValueError):
            raise CommandFailed(self.name, f"{what}: {_tail(result.stderr) or result.describe()}") from None

    def stream(
        self,
        command: Sequence[str] | str,
        on_line: Callable[[str], None],
        stop: threading.Event,
        poll: float = STREAM_POLL,
    ) -> CommandResult:
        """Run a command and hand each line of its stdout to on_line as it arrives (`tail -F` over SSH), until
        the command ends, the connection is lost, or `stop` is set. No read waits longer than `poll`. On stop,
        the command's process group on the host is killed (its leader reports its pid and group first), so a
        follower never outlives the stream; stderr comes back in the result."""
        text = command_text(command)
        # sshd (and LocalHost) start the command as a session leader: its pid is its process group.
        wrapped = (f'read -r _ _ _ _ g _ < /proc/$$/stat; echo "{_STREAM_HEADER} $$ $g"; '
                   f"exec /bin/sh -c {shlex.quote(text)}")
        lines = _LineSplitter(on_line)
        code, err, finished, stopped = self._stream_text(wrapped, lines, stop, poll)
        lines.flush()
        if stopped:
            return CommandResult(self.name, text, None, "", err, stopped=True)
        if not finished or code is None:
            lost = isinstance(self, SshHost) and not self.alive()
            return CommandResult(self.name, text, None, "", err, connection_lost=lost,
                                 signal=None if lost else "a signal")
        if code < 0:
            return CommandResult(self.name, text, None, "", err, signal=_signal_name(-code))
        return CommandResult(self.name, text, code, "", err)

    def _end_stream(self, header: tuple[int, int] | None) -> None:
        """Kill a stream's command on the host: its whole process group when it leads one, else the pid."""
        if header is None:
            return
        pid, pgid = header
        target = f"-{pid}" if pgid == pid else str(pid)
        self.run(["kill", "-s", "TERM", "--", target], timeout=self.settings.dead_after)

    def preflight(self, python: str, workdir: str, ports: Sequence[int] = ()) -> None:
        """Check before starting anything that the host has `python`, that it imports toolkit, that `workdir`
        can be created, and that `ports` are free; raise PreflightFailed naming the first thing missing."""
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
        wd = _home_relative(workdir)
        result = self.run(["sh", "-c", script, "sh", python, wd, check, *(str(p) for p in ports)])
        if result.ok:
            return
        if result.connection_lost or result.exit_code not in (_NO_PYTHON, _NO_TOOLKIT, _NO_WORKDIR, _PORT_BUSY):
            result.check()
            raise CommandFailed(self.name, result.describe())
        detail = _tail(result.stderr, lines=1)  # a traceback's last line says it all
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
        pass

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the transport-specific part
    def _run_text(self, text: str, timeout: float | None) -> CommandResult:
        raise NotImplementedError

    def _stream_text(self, text: str, lines: _LineSplitter, stop: threading.Event,
                     poll: float) -> tuple[int | None, str, bool, bool]:
        """(exit status, stderr, finished, stopped); a negative status is a signal."""
        raise NotImplementedError

    def _put_file(self, local: Path, remote: str, mode: int, mtime: int | None) -> None:
        raise NotImplementedError

    def _write_bytes(self, remote: str, data: bytes, mode: int) -> None:
        raise NotImplementedError

    def _mkdir(self, remote: str) -> None:
        raise NotImplementedError


class LocalHost(Host):
    """This machine, without SSH (local mode): the same commands through /bin/sh, started in the home
    directory like an SSH session, so tasks behave the same with and without hosts."""

    def __init__(self, name: str = LOCALHOST, settings: SshSettings | None = None) -> None:
        self.name = name
        self.settings = settings or SshSettings()
        self.home = Path.home()

    def _path(self, path: str) -> Path:
        return self.home / path

    def _run_text(self, text: str, timeout: float | None) -> CommandResult:
        timeout = self.settings.command_timeout if timeout is None else timeout
        proc = subprocess.Popen(["/bin/sh", "-c", text], cwd=self.home, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return CommandResult(self.name, text, None, _decode(out), _decode(err), timed_out=True)
        code = proc.returncode
        if code < 0:
            return CommandResult(self.name, text, None, _decode(out), _decode(err), signal=_signal_name(-code))
        return CommandResult(self.name, text, code, _decode(out), _decode(err))

    def _stream_text(self, text: str, lines: _LineSplitter, stop: threading.Event,
                     poll: float) -> tuple[int | None, str, bool, bool]:
        proc = subprocess.Popen(["/bin/sh", "-c", text], cwd=self.home, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        err: list[bytes] = []
        poller = select.poll()
        fds = {proc.stdout.fileno(): lines.feed, proc.stderr.fileno(): err.append}  # type: ignore[union-attr]
        for fd in fds:
            poller.register(fd, select.POLLIN)
        stopped = False
        try:
            while fds:
                if stop.is_set():
                    stopped = True
                    break
                for fd, _ in poller.poll(poll * 1000):
                    data = os.read(fd, 1 << 16)
                    if data:
                        fds[fd](data)
                    else:
                        poller.unregister(fd)
                        del fds[fd]
        finally:
            # Its own session (not yet reaped, so the number is still its): the whole tree, nothing else.
            if stopped or fds:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=self.settings.dead_after)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait(timeout=self.settings.dead_after)
            proc.stdout.close()  # type: ignore[union-attr]
            proc.stderr.close()  # type: ignore[union-attr]
        return code, _decode(b"".join(err)), True, stopped

    def _put_file(self, local: Path, remote: str, mode: int, mtime: int | None) -> None:
        dest = self._path(remote)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out, open(local, "rb") as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.chmod(tmp, mode)
            if mtime is not None:
                os.utime(tmp, (mtime, mtime))
            os.replace(tmp, dest)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise CommandFailed(self.name, f"cannot write {dest}: {e.strerror}") from None

    def _write_bytes(self, remote: str, data: bytes, mode: int) -> None:
        dest = self._path(remote)
        try:
            atomicfile.write(dest, data, mode=mode)
        except OSError as e:
            raise CommandFailed(self.name, f"cannot write {dest}: {e.strerror}") from None

    def _mkdir(self, remote: str) -> None:
        try:
            self._path(remote).mkdir(exist_ok=True)
        except OSError as e:
            raise CommandFailed(self.name, f"cannot create {self._path(remote)}: {e.strerror}") from None


class SshHost(Host):
    """A host over SSH (Fabric): connected when constructed (so an unreachable host, a failed login or a bad
    host key raise here, as one line), with keepalives and bounded waits from then on."""

    def __init__(self, target: Target, settings: SshSettings, known_hosts: KnownHosts | None = None) -> None:
        import fabric

        self.name = target.name
        self.target = target
        self.settings = settings
        config = fabric_config(settings)  # one per connection: Fabric's Config is not safe to share across threads
        conn = fabric.Connection(
            target.hostname or target.name,
            user=target.user,
            port=target.port,
            config=config,
            connect_kwargs={},
        )
        self.address = f"{conn.host}:{conn.port}"
        keys = [str(Path(k).expanduser()) for k in (
            ([target.key_file] if target.key_file else []) + list(settings.identity_files))]
        from_config = [str(Path(k).expanduser()) for k in conn.connect_kwargs.get("key_filename", [])]
        keys += [k for k in from_config if k not in keys and os.path.exists(k)]  # ssh skips missing ones too
        for k in keys:
            if not os.path.isfile(k):
                raise AuthenticationFailed(self.name, f"SSH key file {k} not found; fix the host's key file "
                                                      "(ansible_ssh_private_key_file / IdentityFile)")
        timeout = settings.connect_timeout or (float(conn.connect_timeout) if conn.connect_timeout else None) \
            or DEFAULT_CONNECT_TIMEOUT
        self.connect_timeout = timeout
        conn.connect_timeout = timeout
        conn.connect_kwargs = {
            "banner_timeout": timeout,
            "auth_timeout": timeout,
            "channel_timeout": settings.dead_after,
            **({"key_filename": keys, "look_for_keys": False, "allow_agent": False} if keys else {}),
        }
        known_hosts = known_hosts or KnownHosts(settings)
        hop: Any = conn
        while isinstance(hop, fabric.Connection):  # ProxyJump hops get the same host-key rules
            known_hosts.apply(hop.client, hop.host, hop.port)
            hop = hop.gateway
        self._conn = conn
        self.stalled = False  # the last liveness probe got no answer on a live connection
        self._open()

    def _open(self) -> None:
        try:
            self._connect()
        except BaseException:
            self.close()  # paramiko leaves the transport thread running after a refused key or login
            raise
        self._conn.transport.set_keepalive(self.settings.keepalive_interval)

    def _socket(self) -> socket.socket:
        """Our own TCP connection, so that its options hold from the first packet: TCP_NODELAY (without it
        every SSH round trip waits out delayed ACKs, ~40 ms) and TCP_USER_TIMEOUT (unacknowledged data for
        dead_after seconds ends the connection instead of hanging)."""
        conn = self._conn
        sock = socket.create_connection((conn.host, int(conn.port)), timeout=self.connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.settings.dead_after * 1000))
        return sock

    def _connect(self) -> None:
        import paramiko

        conn = self._conn
        user = conn.user
        try:
            if not conn.gateway:  # through ProxyJump/ProxyCommand, Fabric makes the socket
                conn.connect_kwargs["sock"] = self._socket()
            conn.open()
        except _UnknownKey as e:
            raise UnknownHostKey(self.name, e.describe(self.settings)) from None
        except paramiko.BadHostKeyException as e:
            known_as = conn.host if int(conn.port) == 22 else f"[{conn.host}]:{conn.port}"
            raise ChangedHostKey(
                self.name,
                f"host key for {known_as} has CHANGED ({e.key.get_name()} {e.key.fingerprint}, known_hosts has "
                f"{e.expected_key.fingerprint}): possibly someone in the middle; if the host was reinstalled, remove "
                f"the old key with `ssh-keygen -R '{known_as}' -f {self.settings.known_hosts}` and connect again",
            ) from None
        except paramiko.AuthenticationException as e:
            keys = ", ".join(conn.connect_kwargs.get("key_filename", [])) or "default keys and agent"
            raise AuthenticationFailed(
                self.name, f"authentication failed for user {user} at {self.address} with {keys} ({e}); check the "
                           "key and the host's authorized_keys") from None
        except paramiko.ssh_exception.NoValidConnectionsError as e:
            raise HostUnreachable(self.name, f"unreachable: {_socket_cause(next(iter(e.errors.values())), self.address)}"
                                  ) from None
        except socket.gaierror as e:
            raise HostUnreachable(self.name, f"unreachable: cannot resolve {conn.host} ({e.strerror}); check the "
                                             "host name or set its address (ansible_host / HostName)") from None
        except (TimeoutError, socket.timeout):
            raise HostUnreachable(self.name, f"unreachable: no answer from {self.address} within "
                                             f"{self.connect_timeout:g}s (connect timeout)") from None
        except OSError as e:
            raise HostUnreachable(self.name, f"unreachable: {_socket_cause(e, self.address)}") from None
        except (paramiko.SSHException, EOFError) as e:
            text = str(e) or type(e).__name__
            if "no authentication methods" in text.lower():
                raise AuthenticationFailed(
                    self.name, f"authentication failed for user {user} at {self.address}: no key to offer (no "
                               "IdentityFile, no default key in ~/.ssh, no agent); give the host's key file") from None
            if "banner" in text.lower() or isinstance(e, EOFError):
                text = f"no SSH server answered at {self.address} within {self.connect_timeout:g}s ({text})"
            raise HostUnreachable(self.name, f"SSH handshake failed: {text}") from None

    @property
    def connection(self) -> Any:
        """The Fabric Connection, for tasks that need Fabric itself."""
        return self._conn

    def alive(self) -> bool:
        """Whether the connection still works: one round trip, bounded by dead_after. paramiko's own wait has no
        bound (a host whose session process is stopped never answers), so it runs in a thread that is abandoned,
        with the connection closed under it, when the bound passes."""
        transport = self._conn.transport
        if transport is None or not transport.is_active():
            return False
        asker = threading.Thread(target=transport.global_request, args=("keepalive@openssh.com",),
                                 kwargs={"wait": True}, daemon=True, name=f"keepalive:{self.name}")
        asker.start()
        asker.join(self.settings.dead_after)
        if asker.is_alive():
            self.stalled = True  # the connection was up, nobody answered on it
            transport.close()  # ends the asker too
            return False
        return transport.is_active()

    @contextlib.contextmanager
    def _bounded(self, seconds: float, what: str) -> Iterator[None]:
        """Run the block under a watchdog: if it has not returned within `seconds`, the connection is closed,
        which makes any paramiko call blocked in it return, and HostStalled says what hung. Every remote call
        goes through one: paramiko waits without a bound in several places (channel requests, sftp replies)."""
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            transport = self._conn.transport
            if transport is not None:
                transport.close()

        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        except Exception:
            if fired.is_set():
                raise HostStalled(self.name, _stalled(what, seconds)) from None
            raise
        finally:
            timer.cancel()
        if fired.is_set():
            raise HostStalled(self.name, _stalled(what, seconds))

    def _run_text(self, text: str, timeout: float | None) -> CommandResult:
        import paramiko

        timeout = self.settings.command_timeout if timeout is None else timeout
        # Closing the channel would not stop the remote command: the host's own `timeout` kills its process group;
        # the local bound only guards against a host that stops answering.
        sent = f"exec timeout -k {_KILL_AFTER:g} {timeout:g} /bin/sh -c {shlex.quote(text)}"
        guard = timeout + _KILL_AFTER + self.settings.dead_after
        start = time.monotonic()
        try:
            with self._bounded(guard + self.settings.dead_after, f"command {_short(text)}"):
                code, out, err, finished = self._exec(sent, guard)
        except (paramiko.SSHException, EOFError, OSError) as e:
            if self.alive():
                raise CommandFailed(self.name, f"SSH error while running {_short(text)}: {e}") from None
            if self.stalled:
                raise HostStalled(self.name, _stalled(f"command {_short(text)}", self.settings.dead_after)) from None
            return CommandResult(self.name, text, None, "", "", connection_lost=True)
        if not finished:
            lost = not self.alive()
            if self.stalled:  # up, but nothing answers: not the command's timeout
                raise HostStalled(self.name, _stalled(f"command {_short(text)}", guard))
            return CommandResult(self.name, text, None, out, err, timed_out=True, connection_lost=lost)
        if code == -1:  # no exit status: the connection dropped, or a signal killed the command
            lost = not self.alive()
            return CommandResult(self.name, text, None, out, err, connection_lost=lost,
                                 signal=None if lost else "a signal")
        if timeout is not None and code in (124, 137) and time.monotonic() - start >= timeout:
            return CommandResult(self.name, text, None, out, err, timed_out=True)
        return CommandResult(self.name, text, code, out, err)

    def _exec(self, command: str, bound: float | None) -> tuple[int, str, str, bool]:
        """Run on a new channel with stdin closed; wait on the channel's readiness (no sleep loop) until both
        output streams end and the exit status is in, or `bound` passes. A dead transport closes the channel,
        which ends the wait too. Returns (exit status or -1, stdout, stderr, finished)."""
        deadline = None if bound is None else time.monotonic() + bound
        chan = self._conn.transport.open_session(timeout=self.settings.dead_after)
        try:
            chan.exec_command(command)
            chan.shutdown_write()
            out: list[bytes] = []
            err: list[bytes] = []
            poller = select.poll()
            poller.register(chan.fileno(), select.POLLIN)
            while True:
                while chan.recv_ready():
                    out.append(chan.recv(1 << 16))
                while chan.recv_stderr_ready():
                    err.append(chan.recv_stderr(1 << 16))
                ended = chan.eof_received or chan.closed
                if ended and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return -1, _decode(b"".join(out)), _decode(b"".join(err)), False
                poller.poll(None if left is None else max(1, int(left * 1000)))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            finished = chan.status_event.wait(left)  # a command may close its output before it exits
            return chan.exit_status if finished else -1, _decode(b"".join(out)), _decode(b"".join(err)), finished
        finally:
            chan.close()

    def _stream_text(self, text: str, lines: _LineSplitter, stop: threading.Event,
                     poll: float) -> tuple[int | None, str, bool, bool]:
        with self._bounded(2 * self.settings.dead_after, f"starting {_short(text)}"):
            chan = self._conn.transport.open_session(timeout=self.settings.dead_after)
            chan.exec_command(text)
        err: list[bytes] = []
        stopped = False
        try:
            chan.shutdown_write()
            poller = select.poll()
            poller.register(chan.fileno(), select.POLLIN)
            while True:
                while chan.recv_ready():
                    lines.feed(chan.recv(1 << 16))
                while chan.recv_stderr_ready():
                    err.append(chan.recv_stderr(1 << 16))
                if (chan.eof_received or chan.closed) and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if stop.is_set():
                    stopped = True
                    if self._conn.transport.is_active():
                        self._end_stream(lines.header)
                    break
                poller.poll(max(1, int(poll * 1000)))
            if stopped:
                return None, _decode(b"".join(err)), True, True
            finished = chan.status_event.wait(self.settings.dead_after)
            code = chan.exit_status if finished and chan.exit_status != -1 else None
            return code, _decode(b"".join(err)), finished and code is not None, False
        finally:
            chan.close()

    @contextlib.contextmanager
    def _sftp_errors(self, what: str, size: int = 0) -> Iterator[Any]:
        """An sftp session for one transfer, bounded: dead_after, plus the time `size` bytes take at
        MIN_TRANSFER_RATE."""
        import paramiko

        try:
            with self._bounded(2 * self.settings.dead_after + size / MIN_TRANSFER_RATE, what):
                yield self._conn.sftp()
        except (paramiko.SSHException, EOFError, OSError) as e:
            if not self.alive():
                if self.stalled:
                    raise HostStalled(self.name, _stalled(what, self.settings.dead_after)) from None
                raise ConnectionLost(self.name, f"connection lost while {what} (host down or cut off)") from None
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise CommandFailed(self.name, f"{what}: {reason}") from None

    def _put_file(self, local: Path, remote: str, mode: int, mtime: int | None) -> None:
        tmp = _temp_name(remote)
        with self._sftp_errors(f"copying {local} to {remote}", local.stat().st_size) as sftp:
            try:
                with open(local, "rb") as src, sftp.open(tmp, "wb") as f:
                    f.chmod(mode)  # before any data: a secret is never readable under a looser mode
                    f.set_pipelined(True)
                    while chunk := src.read(1 << 15):
                        f.write(chunk)
                if mtime is not None:
                    sftp.utime(tmp, (mtime, mtime))
                sftp.posix_rename(tmp, remote)
            except BaseException:
                with contextlib.suppress(Exception):
                    sftp.remove(tmp)
                raise

    def _write_bytes(self, remote: str, data: bytes, mode: int) -> None:
        tmp = _temp_name(remote)
        with self._sftp_errors(f"writing {remote}", len(data)) as sftp:
            try:
                with sftp.open(tmp, "wb") as f:
                    f.chmod(mode)
                    f.write(data)
                sftp.posix_rename(tmp, remote)
            except BaseException:
                with contextlib.suppress(Exception):
                    sftp.remove(tmp)
                raise

    def _mkdir(self, remote: str) -> None:
        with self._sftp_errors(f"creating {remote}") as sftp:
            sftp.mkdir(remote)

    def close(self) -> None:
        """Close the connection and any ProxyJump hops under it (Fabric leaves those open).

        Fabric's own close() does nothing for a connection whose open() failed (a refused host key or login
        leaves paramiko's transport running and Fabric never recorded it): the paramiko client is closed directly,
        and with it the TCP connection, so the server's pre-authentication process ends too."""
        import fabric

        hop: Any = self._conn
        while isinstance(hop, fabric.Connection):
            with contextlib.suppress(Exception):
                hop.close()
            with contextlib.suppress(Exception):
                hop.client.close()
            sock = hop.connect_kwargs.get("sock")
            if isinstance(sock, socket.socket):
                sock.close()
            hop = hop.gateway


# --- strict host keys ------------------------------------------------------------------------------------------


class _UnknownKey(Exception):
    """Raised by the host-key policy for a host that has no key in known_hosts (and accept-new is off)."""

    def __init__(self, hostname: str, key: Any) -> None:
        super().__init__(hostname)
        self.hostname = hostname
        self.key = key

    def describe(self, settings: SshSettings) -> str:
        host = self.hostname
        scan = host[1:].replace("]:", " -p ") if host.startswith("[") else host
        return (f"host key unknown: {host} is not in {settings.known_hosts} ({self.key.get_name()} "
                f"{self.key.fingerprint}); verify it and add it (`ssh-keyscan {scan} >> {settings.known_hosts}`), "
                "or pass --accept-new-host-keys to trust keys seen for the first time")


class KnownHosts:
    """settings.known_hosts, parsed once for a whole fan-out; each connection gets only its own host's entries
    (parsing the file per connection costs hosts x lines key decodings: minutes at a few hundred hosts).

    Checking: a changed key is always refused (paramiko raises BadHostKeyException before any policy is asked);
    an unknown one is refused unless accept_new_host_keys, in which case it is appended to the file (under a
    lock, so parallel connections and processes do not lose lines)."""

    def __init__(self, settings: SshSettings) -> None:
        import paramiko

        self.path = settings.known_hosts_path
        self.accept_new = settings.accept_new_host_keys
        self.keys = paramiko.HostKeys()
        if self.path.exists():
            try:
                with open(self.path) as f:
                    fcntl.flock(f, fcntl.LOCK_SH)
                    self.keys.load(str(self.path))
            except OSError as e:
                raise UserError(f"{self.path}: cannot read known_hosts ({e.strerror}); check the path") from None

    def apply(self, client: Any, hostname: str, port: int) -> None:
        """Make `client` check the key of hostname:port against this file."""
        import paramiko

        name = hostname if int(port) == 22 else f"[{hostname}]:{port}"
        entry = self.keys.lookup(name)
        if entry is not None:
            for keytype in entry.keys():
                client.get_host_keys().add(name, keytype, entry[keytype])
        known = self

        class Policy(paramiko.MissingHostKeyPolicy):
            def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
                if not known.accept_new:
                    raise _UnknownKey(hostname, key)
                _append_known_host(known.path, hostname, key)
                client.get_host_keys().add(hostname, key.get_name(), key)

        client.set_missing_host_key_policy(Policy())


def _append_known_host(path: Path, hostname: str, key: Any) -> None:
    import paramiko

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        known = paramiko.HostKeys()
        for lineno, line in enumerate(f.read().splitlines(), 1):
            with contextlib.suppress(paramiko.SSHException, ValueError):
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
                if entry is not None:
                    for name in entry.hostnames:
                        known.add(name, entry.key.get_name(), entry.key)
        existing = known.lookup(hostname)
        if existing is not None:
            if existing.get(key.get_name()) == key:
                return
            # another process recorded a different key for this host meanwhile: that is a changed key
            raise paramiko.BadHostKeyException(hostname, key, next(iter(existing.values())))
        f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


# --- fan-out ---------------------------------------------------------------------------------------------------


def fabric_config(settings: SshSettings) -> Any:
    """A Fabric Config that reads settings.ssh_config (or the user's and system's ssh_config files)."""
    import fabric

    if settings.ssh_config is None:
        return fabric.Config()
    path = Path(settings.ssh_config).expanduser()
    if not path.is_file():
        raise UserError(f"{path}: ssh_config not found; check the path")
    return fabric.Config(runtime_ssh_path=str(path))


def open_host(target: Target, settings: SshSettings, known_hosts: KnownHosts | None = None) -> Host:
    """A connected Host for the target: LocalHost for a local target, else SshHost (raises RemoteError).
    Pass one KnownHosts when opening many hosts."""
    if target.local:
        return LocalHost(target.name, settings)
    return SshHost(target, settings, known_hosts)


class HostPool:
    """Connections kept open across fan-outs, for loops that ask the same hosts again and again (`train --join`
    polls every host each interval: a new connection each time costs a TCP handshake, a key exchange and a key
    login per host and round). A connection that broke is dropped, and the next round opens a new one."""

    def __init__(self) -> None:
        self._hosts: dict[str, Host] = {}
        self._lock = threading.Lock()

    def get(self, target: Target, settings: SshSettings, known_hosts: KnownHosts | None) -> Host:
        with self._lock:
            host = self._hosts.pop(target.name, None)
        if host is not None and (not isinstance(host, SshHost) or host.alive()):
            return host
        if host is not None:
            host.close()
        return open_host(target, settings, known_hosts)

    def put(self, host: Host) -> None:
        with self._lock:
            old = self._hosts.pop(host.name, None)
            self._hosts[host.name] = host
        if old is not None and old is not host:
            old.close()

    def close(self) -> None:
        with self._lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            host.close()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_on_all(
    targets: Sequence[Target],
    fn: Callable[[Host], T],
    settings: SshSettings,
    progress: Callable[[HostResult[T]], None] | None = None,
    fail_fast: bool = False,
    pool: HostPool | None = None,
) -> dict[str, HostResult[T]]:
    """Connect to each target and call fn(host), at most settings.parallel at once, closing each connection
    after (or, with a `pool`, keeping it there for the next fan-out unless it broke). Returns a result per host,
    in target order; never raises for a host's failure (see check_all). With fail_fast, hosts not yet started
    when one fails are skipped. `progress` is called (from worker threads) as each host finishes."""
    names = [t.name for t in targets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"host {dupes[0]} is listed twice; name each host once")
    known_hosts = None
    if any(not t.local for t in targets):
        fabric_config(settings)  # a missing ssh_config is one error, not one per host
        known_hosts = KnownHosts(settings)
    failed = threading.Event()
    first_failure: list[str] = []
    lock = threading.Lock()

    def one(target: Target) -> HostResult[T]:
        start = time.monotonic()
        if fail_fast and failed.is_set():
            result: HostResult[T] = HostResult(target.name, False, error=f"{target.name}: not attempted: "
                                               f"{first_failure[0]} failed first", skipped=True, finished=start)
        else:
            host: Host | None = None
            keep = False  # give the connection back to the pool
            try:
                host = pool.get(target, settings, known_hosts) if pool else open_host(target, settings, known_hosts)
                value = fn(host)
                now = time.monotonic()
                result = HostResult(target.name, True, value=value, seconds=now - start, finished=now)
                keep = pool is not None
            except Exception as e:  # noqa: BLE001 - every failure becomes this host's result
                now = time.monotonic()
                if isinstance(e, RemoteError):
                    text = str(e)
                elif isinstance(e, UserError):
                    text = f"{target.name}: {' '.join(str(e).split())}"
                else:  # a bug rather than a fault of the host: keep the type; the exception is in the result
                    text = f"{target.name}: {_one_line(e)}"
                result = HostResult(target.name, False, error=text, seconds=now - start, finished=now, exception=e)
                keep = pool is not None and host is not None and not isinstance(e, ConnectionLost)
                with lock:
                    if not first_failure:
                        first_failure.append(target.name)
                failed.set()
            finally:
                if host is not None:
                    if keep:
                        pool.put(host)  # type: ignore[union-attr]
                    else:
                        host.close()
        if progress is not None:
            progress(result)
        return result

    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(settings.parallel, len(targets)), thread_name_prefix="ssh") as executor:
        results = list(executor.map(one, targets))
    return {r.host: r for r in results}


def check_all(results: Mapping[str, HostResult[T]]) -> dict[str, T]:
    """The values of a fan-out, or ClusterError listing every failed host (root cause first)."""
    if any(not r.ok for r in results.values()):
        raise ClusterError(results)
    return {name: r.value for name, r in results.items()}  # type: ignore[misc]


@contextlib.contextmanager
def rich_progress(
    description: str, total: int, line: Callable[[HostResult[Any]], str | None] | None = None
) -> Iterator[Callable[[HostResult[Any]], None]]:
    """A progress callback for run_on_all that draws a rich progress bar (on stderr) while hosts finish, and
    prints `line(result)` above the bar for each host that finishes (a line per host: what it did, or why not)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    failures = 0
    console = Console(stderr=True)
    # Not on a terminal (a pipe, a log file, CI) there is no bar to redraw: only the lines.
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        lock = threading.Lock()

        def update(result: HostResult[Any]) -> None:
            nonlocal failures
            with lock:
                failures += 0 if result.ok else 1
                suffix = f" ({failures} failed)" if failures else ""
                bar.update(task, advance=1, description=description + suffix)
                text = line(result) if line is not None else None
                if text:
                    bar.console.print(text, markup=False, highlight=False)

        yield update


# --- helpers ---------------------------------------------------------------------------------------------------


class _LineSplitter:
    """Bytes of a stream -> whole lines for the callback; the first line is the stream's header (pid, group)."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self.on_line = on_line
        self.buf = b""
        self.header: tuple[int, int] | None = None
        self.header_seen = False

    def feed(self, data: bytes) -> None:
        self.buf += data
        *complete, self.buf = self.buf.split(b"\n")
        for raw in complete:
            self._line(_decode(raw))

    def flush(self) -> None:
        if self.buf:
            self._line(_decode(self.buf))
            self.buf = b""

    def _line(self, line: str) -> None:
        if not self.header_seen:
            self.header_seen = True
            words = line.split()
            if len(words) == 3 and words[0] == _STREAM_HEADER and words[1].isdigit():
                self.header = (int(words[1]), int(words[2]) if words[2].isdigit() else -1)
                return
        self.on_line(line)


def command_text(command: Sequence[str] | str, cwd: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The shell text for a command: argv quoted with shlex.join (and exec'd), a script as is; `cd` and
    `export` lines (quoted) before it."""
    if isinstance(command, str):
        body = command
    else:
        argv = list(command)
        if not argv:
            raise ValueError("empty command")
        body = "exec " + shlex.join(argv)  # no shell left between: a signal that kills argv is seen as such
    lines = []
    if cwd is not None:
        lines.append(f"cd -- {shlex.quote(_home_relative(cwd))} || exit 1")
    for name, value in (env or {}).items():
        if not name or name[0].isdigit() or any(c not in _ENV_NAME for c in name):
            raise ValueError(f"environment variable name {name!r} is not valid")
        lines.append(f"export {name}={shlex.quote(str(value))}")
    return "\n".join(lines + [body])


def _home_relative(path: str) -> str:
    """`~` and `~/x` as paths relative to the home directory (where sessions start and sftp resolves relative
    paths), since a quoted `~` is not expanded."""
    path = str(path)
    if path == "~":
        return "."
    if path.startswith("~/"):
        return path[2:] or "."
    if path.startswith("~"):
        raise UserError(f"{path}: ~user paths are not supported; give an absolute path or one relative to home")
    return path


def _temp_name(path: str) -> str:
    head, _, tail = path.rpartition("/")
    return f"{head}/.{tail}.{uuid.uuid4().hex[:8]}.tmp" if head else f".{tail}.{uuid.uuid4().hex[:8]}.tmp"


def _scan(root: Path, exclude: Sequence[str]) -> tuple[dict[str, tuple[int, int, int]], set[str], list[str]]:
    """The files (size, mtime, mode) and directories under `root`, and the symlinks that point out of it. A
    symlink is followed only to something inside `root`: a link to ~/.ssh/id_rsa in a project must never be
    uploaded to every host."""
    files: dict[str, tuple[int, int, int]] = {}
    dirs: set[str] = set()
    outside: list[str] = []
    top = os.path.realpath(root)

    def inside(path: str) -> bool:
        return os.path.commonpath([top, os.path.realpath(path)]) == top

    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)

        def rel(name: str) -> str:
            return name if rel_dir == "." else f"{rel_dir}/{name}"

        kept = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            if any(fnmatch.fnmatch(d, p) for p in exclude):
                continue
            if os.path.islink(full):  # os.walk does not descend into linked directories; say those that lead out
                if not inside(full):
                    outside.append(rel(d))
                continue
            kept.append(d)
        dirnames[:] = kept
        for d in dirnames:
            dirs.add(rel(d))
        for name in filenames:
            if any(fnmatch.fnmatch(name, p) for p in exclude):
                continue
            full = os.path.join(dirpath, name)
            if os.path.islink(full) and not inside(full):
                outside.append(rel(name))
                continue
            try:
                st = os.stat(full)
            except OSError:
                continue  # a dangling symlink
            if stat.S_ISREG(st.st_mode):
                files[rel(name)] = (st.st_size, int(st.st_mtime), stat.S_IMODE(st.st_mode))
    return files, dirs, outside


def _socket_cause(e: BaseException, address: str) -> str:
    code = getattr(e, "errno", None)
    if code == errno.ECONNREFUSED:
        return f"connection refused at {address} (no SSH server listening there)"
    if code == errno.EHOSTUNREACH:
        return f"no route to host {address}"
    if code == errno.ENETUNREACH:
        return f"network unreachable for {address}"
    if isinstance(e, (TimeoutError, socket.timeout)):
        return f"no answer from {address} (connect timeout)"
    return f"{address}: {getattr(e, 'strerror', None) or e}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _tail(text: str, lines: int = 3, width: int = 300) -> str:
    tail = " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())
    return tail[-width:]


def _short(command: str, width: int = 120) -> str:
    one = " ".join(command.split())
    return one if len(one) <= width else one[: width - 3] + "..."


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
