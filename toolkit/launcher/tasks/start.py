"""`train`: start the job on every host at once, all or nothing, after checking what was typed against the job record
and what its previous run left.

Starting a host means running its launch.sh, which starts the host's agent detached and returns (or says the agent
already runs); the agents then start and supervise the processes. So `train` returns once every agent runs, not
when the job is formed; `--join` waits for the end. The starting itself is toolkit.launcher.jobhosts.launch's (shared
with `run`)."""

from __future__ import annotations

from toolkit.launcher.jobhosts.launch import start_job
from toolkit.launcher.jobhosts.streams import RankFilter
from toolkit.launcher.settings import Request


def train(request: Request, join: bool = False, join_timeout: float | None = None, fresh: bool = False,
          again: bool = False, check: bool = True, stream: RankFilter | None = None) -> None:
    """`fleet train`: start the deployed job (deploying it first if it never was) and, with `join`, wait for its
    end; `fresh`, `again` and `check` as toolkit.launcher.jobhosts.launch.start_job takes them, which also says what it
    raises; `stream`: whose output --join shows (jobhosts.streams.RankFilter)."""
    start_job(request, join=join, join_timeout=join_timeout, fresh=fresh, again=again, check=check, stream=stream)
