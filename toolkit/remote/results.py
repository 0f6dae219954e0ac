"""What remote calls return and raise: one `CommandResult` per command, one `HostResult` per host of a fan-out,
and one-line errors naming the host and the cause (`RemoteError` and its kinds, `ClusterError` for many hosts)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, TypeVar

from toolkit.errors import UserError

T = TypeVar("T")


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
