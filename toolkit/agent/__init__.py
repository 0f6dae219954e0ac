"""The per-host agent: `python -m toolkit.agent --job-dir DIR` supervises one host's processes of one job.

- policy.py      what to do when a process exits or the scheduler speaks (pure: facts in, a reaction out)
- supervisor.py  the event loop and the agent's life; it dispatches to the modules below
- processes.py   launching, exits and relaunches (applies policy), the operator's restart, fencing
- warmspare.py   whether a warm spare is wanted and may import now (pure); warmprocess.py applies it
- slots.py       what the agent knows of each process (Slot), bind_core's CPU sets
- control.py     the control socket's server (bounded conversations)
- progressinbox.py  the progress socket (the workers' datagrams, parsed)
- docwriter.py   when agent.json is rewritten
- link.py        the connection to the scheduler
- log.py         the agent's own log; reading the children's
- timers.py      the loop's deadlines
- commands.py    the command line (run, start, stop, status, restart) and the client side of the sockets

Its documents are defined in toolkit.contracts.hostspec (host.json, its input) and toolkit.contracts.agentdoc
(agent.json, agent.pid, the control and progress sockets).
"""

from toolkit.agent.commands import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USAGE,
    main,
    request,
    restart,
    run,
    running_agent,
    start,
    status,
    stop,
    with_overrides,
)
from toolkit.agent.slots import cpu_sets
from toolkit.contracts.hostspec import HostSpec, ProcSpec, RestartDecision, RestartPolicy
from toolkit.contracts.hostspec import load as load_spec

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_STOPPED", "EXIT_USAGE", "HostSpec", "ProcSpec", "RestartDecision",
           "RestartPolicy", "cpu_sets", "load_spec", "main", "request", "restart", "run", "running_agent", "start",
           "status", "stop", "with_overrides"]
