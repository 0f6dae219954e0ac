"""Many hosts at once: a bounded parallel fan-out that returns a result per host (`run_on_all`, `check_all`), and a
pool of open connections for loops that ask the same hosts again and again (`HostPool`).

The tasks (toolkit.launcher.tasks) reach hosts only through these. A fan-out never lets one host's failure escape as an
exception: each becomes that host's HostResult, so a task can report every host, roll back the ones that started,
or raise one ClusterError (`check_all`) with the root cause first."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, Mapping, Sequence, TypeVar

from toolkit.errors import UserError
from toolkit.launcher.remote.host import Host
from toolkit.launcher.remote.hostkeys import KnownHosts
from toolkit.launcher.remote.local import LocalHost
from toolkit.launcher.remote.results import (
    ClusterError,
    ConnectionLost,
    HostResult,
    RemoteError,
)
from toolkit.launcher.remote.ssh import SshHost
from toolkit.launcher.remote.sshsettings import SshSettings, Target, fabric_config

T = TypeVar("T")


def open_host(target: Target, settings: SshSettings, known_hosts: KnownHosts | None = None) -> Host:
    """A connected Host for the target: LocalHost for a local target, else SshHost (raises RemoteError).
    Pass one KnownHosts when opening many hosts.

    For SSH, connecting is bounded by the connect timeout and checks the host key strictly; it raises
    HostUnreachable, AuthenticationFailed, UnknownHostKey or ChangedHostKey, and UserError for a missing
    ssh_config. The caller closes the host."""
    if target.local:
        return LocalHost(target.name, settings)
    return SshHost(target, settings, known_hosts)


class HostPool:
    """Connections kept open across fan-outs, for loops that ask the same hosts again and again (`train --join`
    polls every host each interval: a new connection each time costs a TCP handshake, a key exchange and a key
    login per host and round). A connection that broke is dropped, and the next round opens a new one.

    Used by `train --join` and `collect_status` through run_on_all's `pool`. Thread-safe: a host is taken out of
    the pool while a worker uses it, so two threads never share a connection. Close it (or use `with`) to close
    every pooled connection."""

    def __init__(self) -> None:
        self._hosts: dict[str, Host] = {}
        self._lock = threading.Lock()

    def get(self, target: Target, settings: SshSettings, known_hosts: KnownHosts | None) -> Host:
        """The pooled connection to `target`, taken out of the pool, if it still answers; else a new one.

        A pooled SshHost is probed first (`alive()`, one round trip bounded by dead_after); one that fails the
        probe is closed. Opening a new one raises as `open_host` does."""
        with self._lock:
            host = self._hosts.pop(target.name, None)
        if host is not None and (not isinstance(host, SshHost) or host.alive()):
            return host
        if host is not None:
            host.close()
        return open_host(target, settings, known_hosts)

    def put(self, host: Host) -> None:
        """Keep `host` for the next fan-out; an older connection kept under the same name is closed."""
        with self._lock:
            old = self._hosts.pop(host.name, None)
            self._hosts[host.name] = host
        if old is not None and old is not host:
            old.close()

    def close(self) -> None:
        """Close every pooled connection and empty the pool (it may be used again afterwards)."""
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
    when one fails are skipped. `progress` is called (from worker threads) as each host finishes.

    A failure's `error` is one line starting with the host's name: a RemoteError's or UserError's text, or for
    anything else (a bug, not the host's fault) the exception's type and message, with the exception kept in
    `HostResult.exception`. Each host's calls are bounded by `settings` (connect timeout, command timeouts,
    dead_after), so the fan-out ends even when hosts vanish. known_hosts is read once for all targets. Raises
    UserError, before connecting anywhere, for a host listed twice, a missing ssh_config or an unreadable
    known_hosts. With a pool, a connection is kept after a failure too, unless it was lost."""
    known_hosts = _check_targets(targets, settings)
    if not targets:
        return {}
    fan_out = _FanOut(fn, settings, known_hosts, pool, progress, fail_fast)
    with ThreadPoolExecutor(max_workers=min(settings.parallel, len(targets)), thread_name_prefix="ssh") as executor:
        results = list(executor.map(fan_out.one, targets))
    return {r.host: r for r in results}


def _check_targets(targets: Sequence[Target], settings: SshSettings) -> KnownHosts | None:
    """What a fan-out checks before connecting anywhere: UserError for a host listed twice, a missing ssh_config or
    an unreadable known_hosts. Returns known_hosts read once for every SSH target (None: every target is local)."""
    names = [t.name for t in targets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"host {dupes[0]} is listed twice; name each host once")
    if all(t.local for t in targets):
        return None
    fabric_config(settings)  # a missing ssh_config is one error, not one per host
    return KnownHosts(settings)


class _FanOut(Generic[T]):
    """One run_on_all: calls fn on each target's host (from worker threads) and turns every outcome into that host's
    HostResult. Thread-safe: the first failure is recorded once, for fail_fast's "not attempted" lines."""

    def __init__(self, fn: Callable[[Host], T], settings: SshSettings, known_hosts: KnownHosts | None,
                 pool: HostPool | None, progress: Callable[[HostResult[T]], None] | None, fail_fast: bool) -> None:
        self.fn, self.settings, self.known_hosts, self.pool = fn, settings, known_hosts, pool
        self.progress, self.fail_fast = progress, fail_fast
        self.failed = threading.Event()
        self.first_failure: list[str] = []
        self.lock = threading.Lock()

    def one(self, target: Target) -> HostResult[T]:
        """This target's result: skipped under fail_fast once a host failed, else attempted; `progress` is told."""
        start = time.monotonic()
        if self.fail_fast and self.failed.is_set():
            result: HostResult[T] = HostResult(target.name, False, error=f"{target.name}: not attempted: "
                                               f"{self.first_failure[0]} failed first", skipped=True, finished=start)
        else:
            result = self._attempt(target, start)
        if self.progress is not None:
            self.progress(result)
        return result

    def _attempt(self, target: Target, start: float) -> HostResult[T]:
        """Connect (or take the pooled connection), call fn, and close the connection or give it back to the pool
        (kept after a failure too, unless the connection was lost). Never raises for the host's failure."""
        pool = self.pool
        host: Host | None = None
        keep = False  # give the connection back to the pool
        try:
            host = (pool.get(target, self.settings, self.known_hosts) if pool
                    else open_host(target, self.settings, self.known_hosts))
            value = self.fn(host)
            now = time.monotonic()
            keep = pool is not None
            return HostResult(target.name, True, value=value, seconds=now - start, finished=now)
        except Exception as e:  # noqa: BLE001 - every failure becomes this host's result
            now = time.monotonic()
            keep = pool is not None and host is not None and not isinstance(e, ConnectionLost)
            with self.lock:
                if not self.first_failure:
                    self.first_failure.append(target.name)
            self.failed.set()
            return HostResult(target.name, False, error=_error_text(target, e), seconds=now - start, finished=now,
                              exception=e)
        finally:
            if host is not None:
                if keep:
                    pool.put(host)  # type: ignore[union-attr]
                else:
                    host.close()


def _error_text(target: Target, e: Exception) -> str:
    """A host's failure as one line starting with its name: a RemoteError's own text (it names the host), a
    UserError's on one line, anything else (a bug rather than a fault of the host) with its type."""
    if isinstance(e, RemoteError):
        return str(e)
    if isinstance(e, UserError):
        text = " ".join(str(e).split())
        return text if text.startswith(f"{target.name}: ") else f"{target.name}: {text}"  # named once, not twice
    return f"{target.name}: {_one_line(e)}"


def check_all(results: Mapping[str, HostResult[T]]) -> dict[str, T]:
    """The values of a fan-out, or ClusterError listing every failed host (root cause first).

    All or nothing: one failed (or skipped) host raises, even if the others succeeded; the values are keyed by
    host name in the results' order."""
    if any(not r.ok for r in results.values()):
        raise ClusterError(results)
    return {name: r.value for name, r in results.items()}  # type: ignore[misc]


def _one_line(e: BaseException) -> str:
    """An unexpected exception as `Type: message` on one line (the type tells a bug from a fault)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
