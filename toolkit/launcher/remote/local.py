"""`LocalHost`: this machine as a Host, without SSH (local mode): the same commands through /bin/sh, started in the
home directory like an SSH session, so tasks behave the same with and without hosts."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import uuid
from pathlib import Path

from toolkit import atomicfile
from toolkit.launcher.remote.host import Host, LineSplitter
from toolkit.launcher.remote.results import CommandFailed, CommandResult, decode_output, signal_name
from toolkit.launcher.remote.sshsettings import LOCALHOST, SshSettings


class LocalHost(Host):
    """This machine, without SSH (local mode): the same commands through /bin/sh, started in the home
    directory like an SSH session, so tasks behave the same with and without hosts.

    Each command gets its own session (process group), so a timeout or a stop kills everything it started and
    nothing else. There is no connection to lose and no host to stall: results never have `connection_lost`,
    and HostStalled is never raised; file errors raise CommandFailed. Made by `open_host` for a local Target."""

    def __init__(self, name: str = LOCALHOST, settings: SshSettings | None = None) -> None:
        self.name = name
        self.settings = settings or SshSettings()
        self.home = Path.home()

    def _path(self, path: str) -> Path:
        """A host path as the local Path it means: relative to home, absolute as is (Path's `/` keeps those)."""
        return self.home / path

    def _run_text(self, text: str, timeout: float | None) -> CommandResult:
        """Run under /bin/sh in home, in a new session; past `timeout` (None: command_timeout) its whole process
        group gets SIGKILL and the result says timed out. Output is collected in memory."""
        timeout = self.settings.command_timeout if timeout is None else timeout
        proc = subprocess.Popen(["/bin/sh", "-c", text], cwd=self.home, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return CommandResult(self.name, text, None, decode_output(out), decode_output(err), timed_out=True)
        code = proc.returncode
        if code < 0:
            return CommandResult(self.name, text, None, decode_output(out), decode_output(err),
                                 signal=signal_name(-code))
        return CommandResult(self.name, text, code, decode_output(out), decode_output(err))

    def _stream_text(self, text: str, lines: LineSplitter, stop: threading.Event,
                     poll: float) -> tuple[int | None, str, bool, bool]:
        """Read stdout and stderr with poll(2), at most `poll` s at a time between looks at `stop`. On stop (or
        an exception) the session gets SIGTERM, then SIGKILL if it has not ended within dead_after. Always
        `finished`: the exit status is known (negative for a signal)."""
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
        return code, decode_output(b"".join(err)), True, stopped

    def _put_file(self, local: Path, remote: str, mode: int, mtime: int | None) -> None:
        """Copy through a temp file created 0600 (so never looser than `mode` while data lands), then chmod,
        utime and rename over the destination; CommandFailed on an OSError."""
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
        """toolkit.atomicfile's write (mode set before the data lands); CommandFailed on an OSError."""
        dest = self._path(remote)
        try:
            atomicfile.write(dest, data, mode=mode)
        except OSError as e:
            raise CommandFailed(self.name, f"cannot write {dest}: {e.strerror}") from None

    def _mkdir(self, remote: str) -> None:
        """Create one directory (an existing one is fine); CommandFailed on an OSError."""
        try:
            self._path(remote).mkdir(exist_ok=True)
        except OSError as e:
            raise CommandFailed(self.name, f"cannot create {self._path(remote)}: {e.strerror}") from None
