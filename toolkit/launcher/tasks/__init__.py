"""What `fleet` and `fab` do, one module per command: plan and deploy, and record a deploy the playbooks made
(`deploy`), check the hosts (`check`), start and watch (`start`, `train --join`; `run` deploys, starts and watches in
one), ask (`status`, `logs`, `report`), watch live (`watch`: `status --watch`), stop (`stop`), hand a host's ranks to
a spare (`replace`), give a degraded elastic job a new host (`grow`). A command imports no other command: what they
share lives below them, in toolkit.launcher.jobhosts (the job's hosts and SSH settings, the shell snippets run there,
reading and judging their state, starting, following and stopping the job, deploying it, the terminal output) and
toolkit.launcher.jobhosts.preflight. The command line (toolkit.launcher.cli) calls only what this package exports."""

from toolkit.launcher.jobhosts.streams import RankFilter
from toolkit.launcher.tasks.check import Limits, check
from toolkit.launcher.tasks.deploy import deploy, record_deploy, show_plan
from toolkit.launcher.tasks.grow import grow
from toolkit.launcher.tasks.logs import LOG_LINES, logs
from toolkit.launcher.tasks.replace import replace
from toolkit.launcher.tasks.report import report
from toolkit.launcher.tasks.run import run
from toolkit.launcher.tasks.start import train
from toolkit.launcher.tasks.status import status
from toolkit.launcher.tasks.stop import restart, stop
from toolkit.launcher.tasks.watch import WATCH_INTERVAL, watch

__all__ = ["LOG_LINES", "WATCH_INTERVAL", "Limits", "RankFilter", "check", "deploy", "grow", "logs", "record_deploy",
           "replace", "report", "restart", "run", "show_plan", "status", "stop", "train", "watch"]
