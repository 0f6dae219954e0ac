"""What remote calls return and raise: one `CommandResult` per command, one `HostResult` per host of a fan-out,
and one-line errors naming the host and the cause (`RemoteError` and its kinds, `ClusterError` for many hosts)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, Sequence, TypeVar

from toolkit.errors import UserError

T = TypeVar("T")


class RemoteError(UserError):
    """One host failed; the message is `<host>: <cause>` on one line.

    The base of every per-host error below: catch it to treat any host's failure alike. `host` is the inventory
    name, `cause` the text after it, which ends with what to do where the fix is the user's. In a fan-out
    (`run_on_all`) it becomes that host's `HostResult.error` instead of propagating; `check_all` turns those
    into one ClusterError. Being a UserError, the command line prints it as one line and exits 2."""

    def __init__(self, host: str, cause: str) -> None:
        super().__init__(f"{host}: {cause}")
        self.host = host
        self.cause = cause


class HostUnreachable(RemoteError):
    """No SSH session could be opened: the name does not resolve, the connection is refused, there is no route,
    nothing answered within the connect timeout, or the SSH handshake (banner, key exchange) failed.

    Raised by SshHost's constructor, so before anything ran on the host (`train` counts such a host as never
    started). The user should check the host is up and its address (ansible_host / HostName) and port; a slow
    network may need a longer connect timeout (-t or ssh_config's ConnectTimeout)."""


class AuthenticationFailed(RemoteError):
    """The SSH server refused the login, there was no key to offer, or a configured key file does not exist.

    Raised by SshHost's constructor, before anything ran. The user should fix the key named in the message
    (inventory key file, --identity / -i, IdentityFile) or the host's authorized_keys for that user."""


class UnknownHostKey(RemoteError):
    """The host's key is not in known_hosts and accepting new keys was not asked for (strict host keys).

    Raised by SshHost's constructor (also for a ProxyJump hop), before any authentication. The message gives the
    key's fingerprint: the user should verify it and add it (`ssh-keyscan HOST >> known_hosts`), or pass
    --accept-new-host-keys to record keys seen for the first time."""


class ChangedHostKey(RemoteError):
    """The host presented a key other than the one known_hosts holds for it: possibly someone in the middle.

    Always refused, whatever --accept-new-host-keys says (also when another process recorded a different key
    for a new host a moment earlier). Raised by SshHost's constructor, before any authentication. If the host
    was reinstalled, the user removes the old key (`ssh-keygen -R`, as the message spells out) and connects
    again; otherwise the user should find out who answers at that address."""


class ConnectionLost(RemoteError):
    """An open connection went away during a call (host down, rebooted, or cut off): not the command's failure.

    Raised by `CommandResult.check()` for a result with `connection_lost`, by transfers (sftp, the listing of a
    sync) and by `Host.detach`. Whether the command ran on the host is unknown. `run_on_all` drops such a
    connection from a HostPool rather than reusing it. The user should retry once the host answers (for
    `stop`: run it again, the job may still run there)."""


class CommandFailed(RemoteError):
    """A command or file operation on a reachable host failed: non-zero exit, killed by a signal, timed out, or
    an sftp/SSH error on a live connection (no space, permission denied, a missing directory).

    Raised by `CommandResult.check()` (so by `Host.run(check=True)`), by transfers, by `Host.detach` and by
    LocalHost's file operations. The message ends with the command (shortened) and the last lines of its
    output; the user should act on those."""


class PreflightFailed(RemoteError):
    """`Host.preflight` found the host unfit before anything was started: no such python, python cannot import
    toolkit, the workdir cannot be created or written, or a port the job needs is in use.

    Nothing was started on that host (`train` does not try to stop the job there). The message names the one
    thing missing and the fix: install Python or toolkit there (or set python= / --python), choose a writable
    --workdir, or stop what listens on the port (or choose another --master-port)."""


class HostStalled(RemoteError):
    """The host (its sshd session, or the network) stopped answering within the call's bound.

    Raised by SshHost when a watchdog fired (a command, an sftp transfer or a channel request past its bound)
    or when the liveness probe got no answer within `dead_after` on a connection that still looked up (a
    stopped sshd session, a silent firewall). The connection has been closed; whether the command ran is
    unknown. The user should check the host and the network, then run the command again."""


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
        """Whether the command exited 0 (False for a lost connection, a timeout, a signal or a stop)."""
        return self.exit_code == 0

    def describe(self) -> str:
        """The cause in a few words, for a one-line error."""
        if self.connection_lost:
            return "connection lost while running a command (host down or cut off)"
        if self.timed_out:
            return f"command timed out: {short_command(self.command)}"
        if self.stopped:
            return f"command stopped on request: {short_command(self.command)}"
        tail = output_tail(self.stderr) or output_tail(self.stdout)
        how = f"killed by {self.signal}" if self.signal else (
            "ended without an exit status" if self.exit_code is None else f"exited with {self.exit_code}")
        return f"command {how}: {short_command(self.command)}" + (f": {tail}" if tail else "")

    def check(self) -> CommandResult:
        """Return self if the command succeeded, else raise the matching one-line error: ConnectionLost when the
        connection was lost, CommandFailed for every other failure (exit status, timeout, signal, stop)."""
        if self.ok:
            return self
        if self.connection_lost:
            raise ConnectionLost(self.host, self.describe())
        raise CommandFailed(self.host, self.describe())


@dataclass(frozen=True)
class SyncStats:
    """What one copy to a host did (`Host.sync_dir`, deploy's upload of the rendered files); deploy sums them over
    the hosts for its summary line and warns about every path in `outside`."""

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
    follows.

    Raised by `check_all` (and by tasks that inspect a fan-out's results first) with the whole result map;
    skipped hosts (fail_fast) are listed after the attempted ones. `results` keeps every host's result, `failures`
    the failed ones in that order. The user should fix the root cause first: the later failures are often its
    consequences. Constructing it from results without a failure is a bug (ValueError)."""

    def __init__(self, results: Mapping[str, HostResult[Any]]) -> None:
        self.results = dict(results)
        failed = [r for r in results.values() if not r.ok]
        attempted = sorted((r for r in failed if not r.skipped), key=lambda r: r.finished)
        self.failures = tuple(attempted + [r for r in failed if r.skipped])
        if not self.failures:
            raise ValueError("ClusterError needs at least one failed host")
        super().__init__("\n".join(failure_lines(self.failures, len(results))))

    @property
    def root_cause(self) -> HostResult[Any]:
        """The earliest attempted failure (a skipped host only if every failed host was skipped)."""
        return self.failures[0]


def failure_lines(failures: Sequence[HostResult[Any]], total: int) -> list[str]:
    """ClusterError's text, one fact one line: the root cause first (the earliest failure), with the other hosts
    that failed the same way ("also on b, c"), then one line per other way of failing, naming its hosts."""
    same: dict[str, list[str]] = {}
    for r in failures:
        error = r.error or f"{r.host}: failed"
        same.setdefault(error.removeprefix(f"{r.host}: "), []).append(r.host)
    root = failures[0]
    root_fact = (root.error or "").removeprefix(f"{root.host}: ")
    also = [h for h in same.pop(root_fact, []) if h != root.host]
    lines = [f"{len(failures)} of {total} hosts failed; root cause: {root.error}"
             + (f" (also on {', '.join(also)})" if also else "")]
    lines += [f"  {', '.join(hosts)}: {fact}" for fact, hosts in same.items()]
    return lines


def signal_name(number: int) -> str:
    """"SIGKILL" for 9; "signal N" for a number without a name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def decode_output(data: bytes) -> str:
    """Remote output as text; bytes that are not UTF-8 become U+FFFD rather than an error."""
    return data.decode("utf-8", errors="replace")


def output_tail(text: str, lines: int = 3, width: int = 300) -> str:
    """The last non-blank `lines` of output joined with " | ", at most `width` characters: the gist of an error
    for a one-line message."""
    tail = " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())
    return tail[-width:]


def short_command(command: str, width: int = 120) -> str:
    """A command on one line (whitespace collapsed), cut to `width` characters, for messages."""
    one = " ".join(command.split())
    return one if len(one) <= width else one[: width - 3] + "..."
