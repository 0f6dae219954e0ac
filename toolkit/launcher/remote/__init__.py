"""The doing layer's transport: one `Host` per machine (SSH through Fabric, or this machine without SSH) and a
bounded parallel fan-out that returns a result per host.

Fabric on its own accepts any host key (it hard-codes paramiko's AutoAddPolicy and reads no known_hosts file) and
an open connection to a host that drops off the network hangs for an hour; both are fixed here, in one place, so
every task gets strict host keys and bounded waits. Every failure becomes one line naming the host and the cause.

- settings.py  how to reach hosts (SshSettings, Target, ssh_config)
- host.py      the Host interface and what every transport shares (argv quoting, preflight, streams)
- ssh.py       SshHost (Fabric, with bounds and keepalives); local.py: LocalHost (no SSH)
- hostkeys.py  strict host keys against known_hosts
- transfer.py  copying a project (incremental, never following links out of it)
- group.py     many hosts at once (run_on_all, check_all, HostPool, open_host)
- results.py   results and one-line errors; progress.py: the progress bar
"""

from toolkit.launcher.remote.group import HostPool, check_all, open_host, run_on_all
from toolkit.launcher.remote.host import Host, command_text
from toolkit.launcher.remote.hostkeys import KnownHosts
from toolkit.launcher.remote.local import LocalHost
from toolkit.launcher.remote.progressbar import rich_progress
from toolkit.launcher.remote.results import (
    AuthenticationFailed,
    ChangedHostKey,
    ClusterError,
    CommandFailed,
    CommandResult,
    ConnectionLost,
    HostResult,
    HostStalled,
    HostUnreachable,
    PreflightFailed,
    RemoteError,
    SyncStats,
    UnknownHostKey,
)
from toolkit.launcher.remote.ssh import SshHost
from toolkit.launcher.remote.sshsettings import (
    DEFAULT_EXCLUDE,
    LOCALHOST,
    SshSettings,
    Target,
    fabric_config,
)

__all__ = ["DEFAULT_EXCLUDE", "LOCALHOST", "AuthenticationFailed", "ChangedHostKey", "ClusterError", "CommandFailed",
           "CommandResult", "ConnectionLost", "Host", "HostPool", "HostResult", "HostStalled", "HostUnreachable",
           "KnownHosts", "LocalHost", "PreflightFailed", "RemoteError", "SshHost", "SshSettings", "SyncStats", "Target",
           "UnknownHostKey", "check_all", "command_text", "fabric_config", "open_host", "rich_progress", "run_on_all"]
