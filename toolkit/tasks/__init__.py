"""What `fleet` and `fab` do, one module per command: plan and deploy, and record a deploy the playbooks made
(`deploy`), check the hosts (`check`), start and watch (`start`, `train --join`; `run` deploys, starts and watches
in one), ask (`status`, `logs`, `report`), watch live (`watch`: `status --watch`), stop (`stop`), hand a host's ranks
to a spare (`replace`). A command imports no other command: what they share lives below them, in toolkit.jobhosts
(the job's hosts and SSH settings, the shell snippets run there, reading and judging their state, starting,
following and stopping the job, deploying it, the terminal output) and toolkit.check.gather. The command line
(toolkit.cli) calls only what this package exports."""

from toolkit.jobhosts.streams import RankFilter
from toolkit.tasks.check import Limits, check
from toolkit.tasks.deploy import deploy, record_deploy, show_plan
from toolkit.tasks.logs import LOG_LINES, logs
from toolkit.tasks.replace import replace
from toolkit.tasks.report import report
from toolkit.tasks.run import run
from toolkit.tasks.start import train
from toolkit.tasks.status import status
from toolkit.tasks.stop import restart, stop
from toolkit.tasks.watch import WATCH_INTERVAL, watch

__all__ = ["LOG_LINES", "WATCH_INTERVAL", "Limits", "RankFilter", "check", "deploy", "logs", "record_deploy", "replace",
           "report", "restart", "run", "show_plan", "status", "stop", "train", "watch"]
