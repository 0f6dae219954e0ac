"""Names of the environment variables of the process contract (docs/architecture.md), and the values a process
assumes when one is not set, in one place: the plan, the scheduler and the worker runtime all read them from here.
Also the Slurm variables fleet reads inside an allocation, and the intervals a job's size stretches.

At a thousand ranks and more, the messages every rank sends the scheduler each interval (its heartbeat; NCCL's
monitor thread checking the store for a dump signal) are most of the scheduler's steady work, all of it on one Python
thread. `heartbeat_interval` stretches the heartbeat's past HEARTBEATS_PER_S ranks (every 2 s at 4096 ranks; the agents'
by the same factor), and
`nccl_coord_check_ms` the store check's past NCCL_CHECKS_PER_S (every 8 s at 4096), so that each kind stays at about
that many messages a second.
"""

import math
from typing import Callable, Mapping

# Defaults of the contract (msrun's where it has one)
DEFAULT_SCHED_PORT = 8118  # MS_SCHED_PORT; the job's store listens on the next port
DEFAULT_TOPO_TIMEOUT = 600  # s, MS_TOPO_TIMEOUT: for every worker to join
DEFAULT_NODE_TIMEOUT = 6.0  # s, MS_NODE_TIMEOUT: heartbeat silence after which a worker is dead
DEFAULT_HEARTBEAT_INTERVAL = 1.0  # s, TOOLKIT_HEARTBEAT_INTERVAL
DEFAULT_AGENT_HEARTBEAT = 1.0  # s between an agent's heartbeats, stretched as the workers' (the scheduler's `welcome`)
DEFAULT_HOST_TIMEOUT = 60.0  # s, TOOLKIT_HOST_TIMEOUT: a host whose ranks are dead and whose agent is gone this long
#                             is lost for good: a spare takes its ranks (only once the job has formed)
HEARTBEATS_PER_S = 2048  # workers' heartbeats the scheduler gets a second, at most (and node_timeout allowing)
NCCL_CHECKS_PER_S = 512  # NCCL monitors' store checks the scheduler gets a second, at most
DEFAULT_STRAGGLER_FACTOR = 1.5  # TOOLKIT_STRAGGLER_FACTOR: own work per step vs the others' median that names a
#                                 straggler (between nvidia-resiliency-ext's 1.33, its score 0.75, and DLRover's 2)

# MindSpore dynamic networking (msrun's set)
MS_ROLE = "MS_ROLE"
MS_SCHED_HOST = "MS_SCHED_HOST"
MS_SCHED_PORT = "MS_SCHED_PORT"
MS_WORKER_NUM = "MS_WORKER_NUM"
MS_NODE_ID = "MS_NODE_ID"
MS_TOPO_TIMEOUT = "MS_TOPO_TIMEOUT"
MS_NODE_TIMEOUT = "MS_NODE_TIMEOUT"
MS_ENABLE_RECOVERY = "MS_ENABLE_RECOVERY"
MS_RECOVERY_PATH = "MS_RECOVERY_PATH"
RANK_ID = "RANK_ID"
RANK_SIZE = "RANK_SIZE"
DEVICE_ID = "DEVICE_ID"

ROLE_SCHED = "MS_SCHED"
ROLE_WORKER = "MS_WORKER"

# torchrun's set
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"  # hosts that run workers (torchrun: its agents, one per node)
ROLE_NAME = "ROLE_NAME"  # torchrun's worker role; one role here, named as torchrun's default
ROLE_RANK = "ROLE_RANK"  # rank among the workers of the role: every worker has the one role, so RANK
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"  # workers of the role: WORLD_SIZE
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"  # --max-restarts (toolkit's budget is per process)
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"  # the job's name (torchrun: --rdzv-id)
DEFAULT_ROLE_NAME = "default"  # torchrun's --role default
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # set by the agent per process incarnation (torch's @record)
OMP_NUM_THREADS = "OMP_NUM_THREADS"
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"  # set by the agent: the interface toward the scheduler
# set to 1 by the agent unless the user set them: gloo's bootstrap reads its peers with multi_get, 128 at a time, and
# a rank's value does not grow with the world size (toolkit.train.store; every rank must agree on both)
GLOO_ENABLE_STORE_V2_API = "GLOO_ENABLE_STORE_V2_API"
GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER = "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"
# set to 1 by the agent unless the user set it: torch backs each CPU tensor of 2 MB or more with transparent huge
# pages (madvise), so a killed worker's memory is released ~6x faster and its peers see the death sooner
# (toolkit.standby faults its heap in the same way)
THP_MEM_ALLOC_ENABLE = "THP_MEM_ALLOC_ENABLE"
TORCH_NCCL_COORD_CHECK_MILSEC = "TORCH_NCCL_COORD_CHECK_MILSEC"  # set by the plan: nccl_coord_check_ms

# the training script's data and checkpoints
DATA_PATH = "DATA_PATH"
CKPT_DIR = "CKPT_DIR"

# toolkit's own
TOOLKIT_JOB = "TOOLKIT_JOB"
TOOLKIT_TOKEN_FILE = "TOOLKIT_TOKEN_FILE"  # noqa: S105 - a variable's name, not a secret
TOOLKIT_AGENT_SOCKET = "TOOLKIT_AGENT_SOCKET"
TOOLKIT_STEP_FILE = "TOOLKIT_STEP_FILE"  # set by the agent: where the worker keeps its latest step (stepfile)
TOOLKIT_HEARTBEAT_INTERVAL = "TOOLKIT_HEARTBEAT_INTERVAL"
TOOLKIT_RECOVERY = "TOOLKIT_RECOVERY"  # worker: "restart" (--torchrun-script) forces restart recovery; default auto
TOOLKIT_STRAGGLER_FACTOR = "TOOLKIT_STRAGGLER_FACTOR"  # scheduler: see DEFAULT_STRAGGLER_FACTOR
TOOLKIT_PACE = "TOOLKIT_PACE"  # worker: "0" turns step timing off (to measure what it costs); default on
TOOLKIT_VERIFY_EVERY = "TOOLKIT_VERIFY_EVERY"  # worker: steps between replica checks, 0 never, or auto (the default)
TOOLKIT_INJECT_CORRUPTION = "TOOLKIT_INJECT_CORRUPTION"  # worker: bits to flip, for tests (toolkit.train.inject);
#                             read from the env file only: the agent does not pass it on from its own environment
TOOLKIT_HOST = "TOOLKIT_HOST"  # worker: the inventory name of its host (what it registers as; a lost host is fenced)
TOOLKIT_HOST_TIMEOUT = "TOOLKIT_HOST_TIMEOUT"  # scheduler: see DEFAULT_HOST_TIMEOUT
TOOLKIT_MIN_WORKERS = "TOOLKIT_MIN_WORKERS"  # scheduler: how far a job may shrink when a host is lost with no spare
# (--min-workers, torchrun's --nnodes MIN:MAX); unset: MS_WORKER_NUM (it never shrinks)
TOOLKIT_SPARES = "TOOLKIT_SPARES"  # scheduler: the inventory's spare hosts, comma-separated, in the order they are used
TOOLKIT_EXPECTED = "TOOLKIT_EXPECTED"  # scheduler: JSON file {node_id: host}, for the formation-timeout message
TOOLKIT_LOGICAL_RANKS = "TOOLKIT_LOGICAL_RANKS"  # scheduler: the job's logical ranks L (fleet train --logical-ranks;
#                             default: MS_WORKER_NUM), sent to the workers in `formed` (toolkit.contracts.logical)
TOOLKIT_METRICS_ADDRESS = "TOOLKIT_METRICS_ADDRESS"  # scheduler: [HOST:]PORT of its Prometheus endpoint; unset: none
DEFAULT_METRICS_HOST = "127.0.0.1"  # where the endpoint listens when the address gives a port only

# Slurm's, read (never set) by fleet inside an allocation: its hosts and slots (toolkit/launcher/slurm.py)
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"  # the allocation's hosts, a hostlist: gpu[01-04,07]
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"  # tasks of each host, in order: 4(x3),2
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"  # --ntasks-per-node, when given: one count for every host
SLURM_JOB_ID = "SLURM_JOB_ID"


def metrics_address(text: str) -> tuple[str, int]:
    """`[HOST:]PORT` (`[V6]:PORT` for an IPv6 literal) of the scheduler's Prometheus endpoint, as (host, port); a
    port alone listens on DEFAULT_METRICS_HOST (this host only). ValueError saying what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]") if host.startswith("[") and host.endswith("]") else host
    if not sep:
        host = DEFAULT_METRICS_HOST
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: give [HOST:]PORT with a port from 1 to 65535 (e.g. 127.0.0.1:9464)")
    if not host or any(c.isspace() or c in "/[]" for c in host) or (":" in host and not text.startswith("[")):
        raise ValueError(f"{text!r}: give [HOST:]PORT, an IPv6 address in brackets ([::1]:9464)")
    return host, int(port)


def heartbeat_interval(world: int, configured: float, node_timeout: float) -> float:
    """TOOLKIT_HEARTBEAT_INTERVAL for a job of `world` ranks: `configured`, or longer past HEARTBEATS_PER_S
    ranks (the scheduler then gets about that many heartbeats a second), but never stretched past a third of
    `node_timeout`: a worker may miss two heartbeats and still be alive. Liveness is unchanged: a process that dies
    is noticed at once by its closed connection and its agent; the heartbeat only catches a silent one."""
    return max(configured, min(world / HEARTBEATS_PER_S, node_timeout / 3))


def nccl_coord_check_ms(world: int) -> int:
    """TORCH_NCCL_COORD_CHECK_MILSEC for a job of `world` ranks: how often NCCL's heartbeat monitor on every rank
    asks the job's store whether another rank signalled a debug dump. torch's 1000 ms up to NCCL_CHECKS_PER_S
    ranks, longer past that (a dump, which follows a collective timeout of minutes, starts seconds later; training
    never waits for it)."""
    return max(1000, math.ceil(1000 * world / NCCL_CHECKS_PER_S))


def read_int(env: Mapping[str, str], name: str, default: int, error: type[Exception] = ValueError) -> int:
    """The whole number in `env[name]` (`default` when unset or blank); `error` naming the variable and its value
    when it is not one. The one reader of numeric variables for every process (the scheduler's and the worker's
    error types differ, so the caller names its own)."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise error(f"{name}={raw!r}: expected a whole number") from None


def readers(error: type[Exception]) -> tuple[Callable[[Mapping[str, str], str, int], int],
                                             Callable[[Mapping[str, str], str, float], float]]:
    """(read_int, read_seconds) raising `error`: the scheduler's and the worker's error types differ, so each binds
    its own once (`_int, _float = envvars.readers(ConfigError)`) instead of wrapping the readers again."""

    def whole(env: Mapping[str, str], name: str, default: int) -> int:
        return read_int(env, name, default, error)

    def seconds(env: Mapping[str, str], name: str, default: float) -> float:
        return read_seconds(env, name, default, error)

    return whole, seconds


def read_seconds(env: Mapping[str, str], name: str, default: float, error: type[Exception] = ValueError) -> float:
    """A number of seconds in `env[name]`, as read_int reads whole numbers."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw.strip())
    except ValueError:
        raise error(f"{name}={raw!r}: expected a number of seconds") from None
