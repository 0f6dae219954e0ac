"""What the scheduler reads from its environment (the process contract, docs/architecture.md), validated once:
a bad value is one line naming the variable, and nothing is started."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from toolkit.contracts import envvars
from toolkit.contracts.logical import MAX_LOGICAL_RANKS
from toolkit.errors import UserError

TOOLKIT_EXPECTED = envvars.TOOLKIT_EXPECTED


class ConfigError(UserError):
    """The scheduler's environment is incomplete or wrong; nothing was started."""


@dataclass(frozen=True)
class Config:
    """Everything the scheduler reads from its environment, validated once."""

    job: str
    host: str
    port: int
    store_port: int
    world_size: int
    topo_timeout: float
    node_timeout: float
    recovery: bool
    recovery_path: Path | None
    token: str = field(repr=False)
    expected: Mapping[str, str] = field(default_factory=dict, hash=False)
    straggler_factor: float = envvars.DEFAULT_STRAGGLER_FACTOR
    host_timeout: float = envvars.DEFAULT_HOST_TIMEOUT  # 0: no automatic replacement by a spare
    spares: tuple[str, ...] = ()  # the inventory's spare hosts, in the order they are used
    metrics: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint; None: not served
    max_restarts: int | None = None  # each process's restarts allowed (TORCHELASTIC_MAX_RESTARTS), for the metrics
    min_workers: int | None = None  # TOOLKIT_MIN_WORKERS: how far the job may shrink; None: it never does
    logical_ranks: int = 0  # the job's logical ranks L (TOOLKIT_LOGICAL_RANKS); 0 here: the world size (from_env)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Config":
        """Read and validate `env` (the process's environment; reads the token file and the TOOLKIT_EXPECTED file).

        Raises ConfigError, one line naming the variable, for: an MS_ROLE other than MS_SCHED (unset counts as
        MS_SCHED); a port outside 1-65535, or MASTER_PORT equal to MS_SCHED_PORT; MS_WORKER_NUM unset or below 1;
        TOOLKIT_LOGICAL_RANKS below MS_WORKER_NUM or above contracts.logical.MAX_LOGICAL_RANKS;
        timeouts not positive and finite; recovery on without MS_RECOVERY_PATH; a token file unset, unreadable or
        empty; an expected-hosts file that is not a JSON object of strings. Defaults: MS_SCHED_PORT and the
        timeouts from toolkit.contracts.envvars, MASTER_PORT that port plus 1, job "job", host 127.0.0.1, recovery
        off."""
        role = env.get(envvars.MS_ROLE, envvars.ROLE_SCHED)
        if role != envvars.ROLE_SCHED:
            raise ConfigError(f"{envvars.MS_ROLE}={role}: the scheduler runs where "
                              f"{envvars.MS_ROLE}={envvars.ROLE_SCHED}")
        port, store_port = _ports(env)
        world = _world_size(env)
        topo = _float(env, envvars.MS_TOPO_TIMEOUT, envvars.DEFAULT_TOPO_TIMEOUT)
        node = _float(env, envvars.MS_NODE_TIMEOUT, envvars.DEFAULT_NODE_TIMEOUT)
        if not (0 < topo < math.inf and 0 < node < math.inf):
            raise ConfigError(f"{envvars.MS_TOPO_TIMEOUT} and {envvars.MS_NODE_TIMEOUT} must be positive, finite "
                              "seconds")
        factor, host_timeout = _straggler_and_host_timeout(env)
        recovery = env.get(envvars.MS_ENABLE_RECOVERY, "0").strip().lower() in ("1", "true", "yes", "on")
        rpath = env.get(envvars.MS_RECOVERY_PATH)
        if recovery and not rpath:
            raise ConfigError(f"{envvars.MS_ENABLE_RECOVERY}=1 needs {envvars.MS_RECOVERY_PATH}: the directory for the "
                              "state")
        return cls(
            job=env.get(envvars.TOOLKIT_JOB) or "job",
            host=env.get(envvars.MS_SCHED_HOST) or "127.0.0.1",
            port=port,
            store_port=store_port,
            world_size=world,
            topo_timeout=topo,
            node_timeout=node,
            recovery=recovery,
            recovery_path=Path(rpath) if rpath else None,
            token=_token(env),
            expected=MappingProxyType(_expected_hosts(env.get(TOOLKIT_EXPECTED))),
            straggler_factor=factor,
            host_timeout=host_timeout,
            spares=tuple(n for n in env.get(envvars.TOOLKIT_SPARES, "").split(",") if n),
            metrics=_metrics(env),
            max_restarts=_int(env, envvars.TORCHELASTIC_MAX_RESTARTS, -1) if env.get(
                envvars.TORCHELASTIC_MAX_RESTARTS) else None,
            min_workers=_min_workers(env, world),
            logical_ranks=_logical_ranks(env, world),
        )


def _logical_ranks(env: Mapping[str, str], world: int) -> int:
    """TOOLKIT_LOGICAL_RANKS (default: the world size): ConfigError when it is below the world size (a worker would
    serve no logical rank) or above MAX_LOGICAL_RANKS."""
    value = _int(env, envvars.TOOLKIT_LOGICAL_RANKS, world)
    if not world <= value <= MAX_LOGICAL_RANKS:
        raise ConfigError(f"{envvars.TOOLKIT_LOGICAL_RANKS}={value}: give {world} to {MAX_LOGICAL_RANKS} logical ranks "
                          f"(at least the {world} workers: each serves one or more; --logical-ranks of fleet train)")
    return value


def _ports(env: Mapping[str, str]) -> tuple[int, int]:
    """(MS_SCHED_PORT, MASTER_PORT): the control server's port and the store's (default: the next one). ConfigError
    for a port outside 1-65535 or the two the same."""
    port = _int(env, envvars.MS_SCHED_PORT, envvars.DEFAULT_SCHED_PORT)
    store_port = _int(env, envvars.MASTER_PORT, port + 1)
    for name, value in ((envvars.MS_SCHED_PORT, port), (envvars.MASTER_PORT, store_port)):
        if not 1 <= value <= 65535:
            raise ConfigError(f"{name}={value}: not a TCP port (1-65535)")
    if store_port == port:
        raise ConfigError(f"{envvars.MASTER_PORT}={store_port} equals {envvars.MS_SCHED_PORT}: the store needs its "
                          "own port")
    return port, store_port


def _world_size(env: Mapping[str, str]) -> int:
    """MS_WORKER_NUM, required: ConfigError when it is unset or below 1."""
    if envvars.MS_WORKER_NUM not in env:
        raise ConfigError(f"{envvars.MS_WORKER_NUM} is not set: give the total number of workers")
    world = _int(env, envvars.MS_WORKER_NUM, 0)
    if world < 1:
        raise ConfigError(f"{envvars.MS_WORKER_NUM}={world}: a job needs at least 1 worker")
    return world


def _min_workers(env: Mapping[str, str], world: int) -> int | None:
    """TOOLKIT_MIN_WORKERS (None when unset or empty): ConfigError unless it is 1 to MS_WORKER_NUM."""
    if not env.get(envvars.TOOLKIT_MIN_WORKERS, "").strip():
        return None
    n = _int(env, envvars.TOOLKIT_MIN_WORKERS, world)
    if not 1 <= n <= world:
        raise ConfigError(f"{envvars.TOOLKIT_MIN_WORKERS}={n}: give 1 to {world} ({envvars.MS_WORKER_NUM}), the "
                          "fewest workers the job may shrink to (--min-workers)")
    return n


def _straggler_and_host_timeout(env: Mapping[str, str]) -> tuple[float, float]:
    """(TOOLKIT_STRAGGLER_FACTOR, TOOLKIT_HOST_TIMEOUT): ConfigError for a factor not above 1 or a timeout that is
    negative or infinite."""
    factor = _float(env, envvars.TOOLKIT_STRAGGLER_FACTOR, envvars.DEFAULT_STRAGGLER_FACTOR)
    if not 1 < factor < math.inf:
        raise ConfigError(f"{envvars.TOOLKIT_STRAGGLER_FACTOR}={factor:g}: give a factor above 1 (e.g. 1.5: a rank "
                          "whose own work per step takes 1.5x the others' median is a straggler)")
    host_timeout = _float(env, envvars.TOOLKIT_HOST_TIMEOUT, envvars.DEFAULT_HOST_TIMEOUT)
    if not 0 <= host_timeout < math.inf:
        raise ConfigError(f"{envvars.TOOLKIT_HOST_TIMEOUT}={host_timeout:g}: give 0 or more seconds (0: a spare takes "
                          "a lost host's ranks only when the operator asks, with fleet replace)")
    return factor, host_timeout


def _metrics(env: Mapping[str, str]) -> tuple[str, int] | None:
    """TOOLKIT_METRICS_ADDRESS as (host, port), None when unset or empty; ConfigError when it is not [HOST:]PORT."""
    raw = env.get(envvars.TOOLKIT_METRICS_ADDRESS, "").strip()
    if not raw:
        return None
    try:
        return envvars.metrics_address(raw)
    except ValueError as e:
        raise ConfigError(f"{envvars.TOOLKIT_METRICS_ADDRESS}={e}") from None


def _token(env: Mapping[str, str]) -> str:
    """The job token, from the file TOOLKIT_TOKEN_FILE names. ConfigError when it is unset, unreadable or empty."""
    token_file = env.get(envvars.TOOLKIT_TOKEN_FILE)
    if not token_file:
        raise ConfigError(f"{envvars.TOOLKIT_TOKEN_FILE} is not set: workers register with the job token in that file")
    try:
        token = Path(token_file).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{envvars.TOOLKIT_TOKEN_FILE}={token_file}: cannot read the job token "
                          f"({e.strerror})") from None
    if not token:
        raise ConfigError(f"{envvars.TOOLKIT_TOKEN_FILE}={token_file}: the token file is empty; render the job again")
    return token


_int, _float = envvars.readers(ConfigError)  # the env contract's readers, raising this process's error


def _expected_hosts(path: str | None) -> dict[str, str]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{TOOLKIT_EXPECTED}={path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ConfigError(f"{TOOLKIT_EXPECTED}={path}: expected a JSON object mapping node ids to host names")
    return data
