"""What the scheduler's decisions return (toolkit.scheduler.membership) and its server applies, in order: send a
message, close a connection, log, exit, drop a left generation's store keys, or hand a fact (a `Note`) to the
journal. One definition each, shared by the decision core, the server, the journal and the ledger (torch elastic's
rendezvous `_Action`, in the same spirit: a handler returns what to do, an executor does it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

from toolkit.contracts.messages import Message


class NoteKind(str, enum.Enum):
    """The kinds of fact a Note carries, by the name the ledger and the journal know them. A member prints and
    formats as its value (on 3.10 to 3.13 alike) and equals it, so a kind read back as a plain string still
    matches."""

    RESTORED = "restored"  # a restarted scheduler went on from its persisted state
    FENCED = "fenced"  # a fenced incarnation (or a replaced host's worker) tried to register
    REFUSED = "refused"  # a replaced host's agent said hello
    PACE = "pace"  # a worker's heartbeat figures
    DEATH = "death"  # a member was declared dead
    EXITED = "exited"  # an agent saw a worker end (not cleanly)
    AGENT_LOST = "agent_lost"  # an agent's connection ended
    FORMED = "formed"  # a generation formed
    RECOVERED = "recovered"  # a worker trains again after a recovery
    CORRUPTION = "corruption"  # the replica check found a rank's state corrupt (toolkit.train.replicas)
    REPLACED = "replaced"  # a spare took a host's ranks
    SHRINK = "shrink"  # a lost host's ranks left the world: the survivors serve its logical ranks (issue 42)
    GROW = "grow"  # a rank left out by a shrink is back: the next generation takes it in again
    FINISHED = "finished"  # every rank is done
    FAILED = "failed"  # the job failed

    __str__ = str.__str__
    __format__ = str.__format__


# Causes of a death in a `death` Note, as the ledger names them (the ledger may refine "connection closed" once the
# agent reports how the process ended, and name a host lost when its agent went at the same time).
CAUSE_CLOSED = "connection closed"
CAUSE_SILENCE = "heartbeat silence"
CAUSE_NOT_BACK = "did not reconnect"
CAUSE_REPLACED = "host replaced"
CAUSE_FENCED = "host fenced for corruption"
# the progress watchdog (toolkit.scheduler.watchdog): no progress while its peers waited for it
CAUSE_STUCK = "stuck (no progress while its peers waited)"


@dataclass(frozen=True)
class Send:
    """Send `message` to `peer`; with `close`, close the connection once it is written (and read nothing more)."""

    peer: int
    message: Message
    close: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.message, Message):  # the old Send(peer, op, fields): say so, not send garbage
            raise TypeError(f"Send carries a typed message (toolkit.contracts.messages), not {self.message!r}")

    @property
    def op(self) -> str:
        """The message's op."""
        return self.message.OP

    @property
    def fields(self) -> dict[str, Any]:
        """The message's wire fields (without the op)."""
        return self.message.encode()


@dataclass(frozen=True)
class Close:
    """Drop the connection now (a replaced one: nothing more to tell it)."""

    peer: int


@dataclass(frozen=True)
class Log:
    """Log `text` at `level` (a `logging` level) in the scheduler's log."""

    level: int
    text: str


@dataclass(frozen=True)
class Exit:
    """The scheduler's work is over: flush what is queued and exit with `code`."""

    code: int


@dataclass(frozen=True)
class DropKeys:
    """The job left the generations under `prefix` behind: their store keys can go."""

    prefix: str


@dataclass(frozen=True)
class Note:
    """A fact for the goodput ledger, the straggler tracking and the live view (toolkit.scheduler.journal): a
    death, a formed generation, a recovery, a heartbeat's pace figures. It changes nothing in the membership; the
    server hands it on with the time."""

    kind: NoteKind
    fields: Mapping[str, Any] = field(default_factory=dict)


Action = Send | Close | Log | Exit | DropKeys | Note
