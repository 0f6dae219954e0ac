"""What `fleet` and `fab` do, one module per command: plan and deploy (`deploy`), check the hosts (`check`), start
and watch (`start`, `join`), ask (`status`, `logs`), stop (`stop`). Shared by them: the job's hosts and SSH
settings (`hosts`), the shell snippets run on a host and the parsers of what they print (`scripts`), and the
terminal output (`output`). The command line (toolkit.cli) calls only what this package exports."""

from toolkit.tasks.check import Limits, check
from toolkit.tasks.deploy import deploy, show_plan
from toolkit.tasks.logs import LOG_LINES, logs
from toolkit.tasks.start import train
from toolkit.tasks.status import status
from toolkit.tasks.stop import restart, stop

__all__ = ["LOG_LINES", "Limits", "check", "deploy", "logs", "restart", "show_plan", "status", "stop", "train"]
