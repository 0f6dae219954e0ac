"""What the agent's parts may ask of the Agent, and what the warm spare reads of the workers: two small typed ports
instead of a bundle of callbacks.

Why: Processes took twelve collaborators, six of them callables, and WarmSpare five lambdas that read
`agent.processes` before it was built; the objects called each other in a circle that no import showed. Now
Processes and WarmSpare are built with the AgentPort (the Agent is its one implementation; a test passes a recorder);
Processes builds its own WarmSpare, which reads the workers through the Workers port (slots.WorkersOf over
Processes' slots); nothing reaches an attribute not yet built.
All of it runs on the agent's loop thread.
"""

from __future__ import annotations

from typing import Protocol

from toolkit.contracts import messages as wire
from toolkit.contracts.agentdoc import AgentState
from toolkit.contracts.hostspec import ProcSpec


class AgentPort(Protocol):
    """The Agent as its parts see it: its state, and the four things it does for them."""

    @property
    def state(self) -> AgentState:
        """starting, running, finishing, ... (agentdoc.AgentState)."""

    @property
    def closing(self) -> bool:
        """Finishing or stopping: nothing is launched or relaunched any more."""

    def report(self, message: wire.Message, coalesce: str | None = None) -> None:
        """A message for the scheduler (toolkit.agent.link.SchedulerLink.report: never blocks, never raises)."""

    def write_doc(self) -> None:
        """Rewrite agent.json now: a state changed."""

    def finish(self, state: AgentState, reason: str | None) -> None:
        """Leave the loop with final `state` (succeeded, failed or stopped); only the first call counts."""

    def finish_now(self) -> None:
        """A finishing agent's last child exited: end now (failed if a process exited non-zero after the end)."""


class Workers(Protocol):
    """What the warm spare reads of this host's workers (toolkit.agent.slots.WorkersOf; a test passes its own)."""

    def template(self) -> ProcSpec:
        """The worker whose interpreter and env file a spare uses."""

    def cold_launches(self) -> list[float]:
        """The launch times of the workers relaunched cold that have not progressed since (they hold the spare)."""

    def largest_memory(self) -> int:
        """The private memory of the largest running worker, in bytes (what a spare faults in ahead)."""
