"""`SshHost`: a host over SSH through Fabric, with what Fabric lacks made good here once: strict host keys
(toolkit.launcher.remote.hostkeys), TCP options that notice a dead peer, keepalives, and a bound on every call (a
watchdog closes a connection whose host stopped answering, since paramiko waits without bound in several places).

The bounds (SshSettings): connecting, `connect_timeout` per step; opening a channel, `dead_after`; a command, its
timeout, enforced on the host by `timeout(1)` and guarded here by a watchdog; an sftp transfer, 2 x dead_after plus
its size at MIN_TRANSFER_RATE; the liveness probe, dead_after. A connection whose data goes unacknowledged for
dead_after is ended by the kernel (TCP_USER_TIMEOUT; keepalives every keepalive_interval keep data flowing).
Connecting, commands and transfers turn paramiko's and the socket's exceptions into the RemoteError kind that names
the cause (toolkit.launcher.remote.results)."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shlex
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from toolkit.launcher.remote.host import Host, LineSplitter
from toolkit.launcher.remote.hostkeys import KeyNotInKnownHosts, KnownHosts
from toolkit.launcher.remote.results import (
    AuthenticationFailed,
    ChangedHostKey,
    CommandFailed,
    CommandResult,
    ConnectionLost,
    HostStalled,
    HostUnreachable,
    UnknownHostKey,
    decode_output,
    short_command,
)
from toolkit.launcher.remote.sshsettings import (
    DEFAULT_CONNECT_TIMEOUT,
    SshSettings,
    Target,
    fabric_config,
)

MIN_TRANSFER_RATE = 1e6  # bytes/s an sftp transfer may not fall below before it counts as stalled
_KILL_AFTER = 1.0  # s between a timed-out command's SIGTERM and SIGKILL (`timeout -k`)


class SshHost(Host):
    """A host over SSH (Fabric): connected when constructed (so an unreachable host, a failed login or a bad
    host key raise here, as one line), with keepalives and bounded waits from then on.

    Construction raises HostUnreachable, AuthenticationFailed (also for a key file that does not exist),
    UnknownHostKey or ChangedHostKey, having closed whatever it opened. ssh_config is honoured (HostName, User,
    Port, IdentityFile, ProxyJump; every hop gets the same host-key checks). Keys: the target's key_file, then
    settings.identity_files, then ssh_config's IdentityFile entries that exist; when any is given, only those
    are offered (no default keys, no agent), else paramiko's defaults and the agent. `stalled` is set once a
    liveness probe went unanswered on an open connection: later failures are then HostStalled."""

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
        """Connect (see `_connect`) and start keepalives; on any failure close everything first, then raise."""
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
        """Open the connection, turning each way it can fail into one line with its remedy: an unknown or
        changed host key, a refused login or no key to offer, an address that does not resolve, refuses, has no
        route or does not answer within connect_timeout, or an SSH handshake that fails."""
        import paramiko

        conn = self._conn
        user = conn.user
        try:
            if not conn.gateway:  # through ProxyJump/ProxyCommand, Fabric makes the socket
                conn.connect_kwargs["sock"] = self._socket()
            conn.open()
        except KeyNotInKnownHosts as e:
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
            cause = _socket_cause(next(iter(e.errors.values())), self.address)
            raise HostUnreachable(self.name, f"unreachable: {cause}") from None
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
        """Run under the host's `timeout -k 1 T /bin/sh -c TEXT`, which ends the command (and what it started in
        its group) on the host. Here the wait is bounded by T + 1 s + dead_after (then the result says timed out),
        and a watchdog one dead_after later closes the connection if even that wait hangs. Exit 124 or 137 after
        at least T seconds counts as timed out. A failure with no answer to the liveness probe is a lost
        connection (a result, not an exception) or, if the connection stalled, HostStalled; an SSH error on a
        live connection is CommandFailed."""
        import paramiko

        timeout = self.settings.command_timeout if timeout is None else timeout
        # Closing the channel would not stop the remote command: the host's own `timeout` kills its process group;
        # the local bound only guards against a host that stops answering.
        sent = f"exec timeout -k {_KILL_AFTER:g} {timeout:g} /bin/sh -c {shlex.quote(text)}"
        guard = timeout + _KILL_AFTER + self.settings.dead_after
        start = time.monotonic()
        try:
            with self._bounded(guard + self.settings.dead_after, f"command {short_command(text)}"):
                code, out, err, finished = self._exec(sent, guard)
        except (paramiko.SSHException, EOFError, OSError) as e:
            if self.alive():
                raise CommandFailed(self.name, f"SSH error while running {short_command(text)}: {e}") from None
            if self.stalled:
                what = f"command {short_command(text)}"
                raise HostStalled(self.name, _stalled(what, self.settings.dead_after)) from None
            return CommandResult(self.name, text, None, "", "", connection_lost=True)
        if not finished:
            lost = not self.alive()
            if self.stalled:  # up, but nothing answers: not the command's timeout
                raise HostStalled(self.name, _stalled(f"command {short_command(text)}", guard))
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
                    return -1, decode_output(b"".join(out)), decode_output(b"".join(err)), False
                poller.poll(None if left is None else max(1, int(left * 1000)))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            finished = chan.status_event.wait(left)  # a command may close its output before it exits
            code = chan.exit_status if finished else -1
            return code, decode_output(b"".join(out)), decode_output(b"".join(err)), finished
        finally:
            chan.close()

    def _stream_text(self, text: str, lines: LineSplitter, stop: threading.Event,
                     poll: float) -> tuple[int | None, str, bool, bool]:
        """Stream over a new channel: opening it is bounded (2 x dead_after, HostStalled past that); reading is
        not, since a dead peer closes the transport (TCP_USER_TIMEOUT) and so the channel. On stop the command
        is killed on the host (`_end_stream`) if the transport is still up. After the output ends, the exit
        status is awaited for dead_after; none in that time comes back as not finished."""
        import paramiko

        with self._bounded(2 * self.settings.dead_after, f"starting {short_command(text)}"):
            try:
                chan = self._conn.transport.open_session(timeout=self.settings.dead_after)
                chan.exec_command(text)
            except (paramiko.SSHException, OSError, EOFError) as e:
                cause = e or type(e).__name__
                raise ConnectionLost(self.name, f"could not start {short_command(text)}: {cause}") from None
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
                return None, decode_output(b"".join(err)), True, True
            finished = chan.status_event.wait(self.settings.dead_after)
            code = chan.exit_status if finished and chan.exit_status != -1 else None
            return code, decode_output(b"".join(err)), finished and code is not None, False
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
        """sftp to a temp name beside `remote` (chmod first, pipelined writes), optional utime, then
        posix_rename over it; the temp file is removed on any failure. Bounded by the file's size."""
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
        """As `_put_file`, from memory: chmod before the data, rename over `remote`, temp file removed on failure."""
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
        """One sftp mkdir; an existing path is an error (CommandFailed), callers create only what is missing."""
        with self._sftp_errors(f"creating {remote}") as sftp:
            sftp.mkdir(remote)

    def _lost(self) -> bool:
        """Whether the connection is gone: a liveness probe, bounded by dead_after."""
        return not self.alive()

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


def _socket_cause(e: BaseException, address: str) -> str:
    """Why a TCP connection to `address` failed, in words: refused, no route, network unreachable, timed out, or
    the OS's own message."""
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


def _temp_name(path: str) -> str:
    """A hidden, unique name beside `path` for an atomic sftp write (write there, then rename over `path`)."""
    head, _, tail = path.rpartition("/")
    return f"{head}/.{tail}.{uuid.uuid4().hex[:8]}.tmp" if head else f".{tail}.{uuid.uuid4().hex[:8]}.tmp"


def _stalled(what: str, seconds: float) -> str:
    """The cause text of a HostStalled: what got no answer, and within which bound."""
    return (f"stopped answering: {what} got no answer within {seconds:g} s (the host, its SSH session or the network "
            "stalled); the connection was closed")
