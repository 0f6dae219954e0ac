"""How to reach hosts (`SshSettings`, `Target`) and the ssh_config Fabric reads (`fabric_config`).

Plain values, checked when made (a bad flag is one UserError before any connection): the tasks build them from the
typed flags (deploy) or from the job record (every later command), and toolkit.launcher.remote reads them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.errors import UserError

DEFAULT_PARALLEL = 32
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_EXCLUDE = ("__pycache__", "*.pyc", ".git", ".venv", ".mypy_cache", ".pytest_cache")
LOCALHOST = "localhost"


@dataclass(frozen=True)
class SshSettings:
    """How to reach hosts. `dead_after` bounds every wait on an open connection: data unacknowledged for that
    long (TCP_USER_TIMEOUT, with keepalives so there always is data) or a channel not opened in that time means
    the host is gone.

    The bounds, together: opening a connection waits `connect_timeout` per step (TCP connect, banner, login); a
    command `command_timeout` unless the call gives its own; the liveness probe `dead_after`; a transfer
    2 x dead_after plus its size at toolkit.launcher.remote.ssh.MIN_TRANSFER_RATE. Host keys are strict: an unknown one
    is refused unless `accept_new_host_keys`, a changed one always. `parallel` caps the connections a fan-out
    opens at once. Raises UserError for a non-positive bound or parallel."""

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
        """`known_hosts` with `~` expanded (the file need not exist: with accept-new it is created)."""
        return Path(self.known_hosts).expanduser()


@dataclass(frozen=True)
class Target:
    """One host to reach: its inventory name, and what overrides ssh_config (None: ssh_config, then defaults).
    A `local` target runs on this machine without SSH.

    `name` is what every message and result is keyed by (unique within a fan-out); `hostname` is what SSH
    connects to, which may be an ssh_config alias. Raises UserError for an empty name or a port outside 1-65535."""

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
        """From anything shaped like toolkit.launcher.inventory.Host (name, address, port, user, key_file); an IPv6
        address's brackets are removed. Missing attributes are None (ssh_config decides)."""
        address = getattr(host, "address", None)
        return cls(
            name=host.name,
            hostname=address.removeprefix("[").removesuffix("]") if address else None,
            port=getattr(host, "port", None),
            user=getattr(host, "user", None),
            key_file=getattr(host, "key_file", None),
            local=local,
        )


def fabric_config(settings: SshSettings) -> Any:
    """A Fabric Config that reads settings.ssh_config (or the user's and system's ssh_config files).

    A new Config per call: Fabric's is not safe to share between the threads of a fan-out. Raises UserError when
    an explicit ssh_config does not exist (run_on_all calls this once up front, so that is one error, not one per
    host)."""
    import fabric

    if settings.ssh_config is None:
        return fabric.Config()
    path = Path(settings.ssh_config).expanduser()
    if not path.is_file():
        raise UserError(f"{path}: ssh_config not found; check the path")
    return fabric.Config(runtime_ssh_path=str(path))
