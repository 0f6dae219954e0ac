"""`python -m toolkit.scheduler`: the job's one scheduler (started where MS_ROLE=MS_SCHED).

- config.py      the environment it reads (MS_SCHED_HOST/PORT, MASTER_PORT, MS_WORKER_NUM, timeouts, the token file)
- membership.py  its decisions (members, deaths, fencing, generations, the job's end), pure: events in, actions out
- actions.py     what those decisions return (Send, Close, Log, Exit, DropKeys, Note) for the server to apply
- roster.py      what it knows of each host (one record per host) and of each rank (members, peers, done), pure
- sparehosts.py  which hosts are lost and which spare takes a host's ranks, pure
- liveness.py    whether a silent member is alive, and the kill of a closed one whose exit went unreported, pure
- kvstore.py     the job's store that process groups bootstrap from, pure
- server.py      the loop: authentication, deadlines, signals, applying the actions, persisting the state
- transport.py   the connection table: listeners, connections, their bounds, rate-limited warnings
- state.py       the persisted state (MS_ENABLE_RECOVERY) and JobStatus: a restarted scheduler goes on with the job

Exit codes: 0 every worker done, 1 a node gave up (the job failed), 2 bad configuration or a busy port, 3 the
formation timed out, 128+signal.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import sys

from toolkit.contracts import envvars
from toolkit.scheduler.config import TOOLKIT_EXPECTED, Config, ConfigError
from toolkit.scheduler.membership import EXIT_FAILED, EXIT_FORMATION, EXIT_OK, Membership, rank_of
from toolkit.scheduler.server import Server
from toolkit.scheduler.state import STATE_FILE, StateError

EXIT_CONFIG = 2  # bad environment, port in use, unusable state: nothing was started
EXIT_TERMINATED = 128 + signal.SIGTERM

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_FORMATION", "EXIT_OK", "EXIT_TERMINATED", "STATE_FILE",
           "TOOLKIT_EXPECTED", "Config", "ConfigError", "Membership", "Server", "main", "rank_of"]

log = logging.getLogger("toolkit.scheduler")


def _warn_if_token_readable(path: str) -> None:
    """The token is the only thing keeping strangers out of the job; say so if others can read it."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        log.warning("%s=%s is readable by others (mode %o): chmod 600 it", envvars.TOOLKIT_TOKEN_FILE, path, mode)


def main() -> int:
    """The scheduler process: log to stdout, read the environment, warn if the token file is readable by others,
    and serve the job; returns the exit code (above). Configuration, a busy port and an unusable state file are
    one error line (in the log and on stderr) and EXIT_CONFIG."""
    logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                        format="%(asctime)s.%(msecs)03d sched %(levelname)s %(message)s", datefmt="%Y-%m-%dT%H:%M:%S")
    try:
        config = Config.from_env(os.environ)
        _warn_if_token_readable(os.environ[envvars.TOOLKIT_TOKEN_FILE])
        return Server(config).serve()
    except (ConfigError, StateError) as e:
        log.error("%s", e)
        print(f"scheduler: error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
