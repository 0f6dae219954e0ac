"""Which hosts are lost and which spare takes a host's ranks: the scheduler's spare-host decisions, pure functions
over its Roster (torchft's lighthouse `quorum_compute` in the same spirit: state in, a decision with its reason
out). The membership (toolkit.scheduler.membership) applies them: it fences the host and hands its ranks over.

- A host is lost when automatic replacement is on (host_timeout > 0), the job has formed and runs with no rank
  finished, its agent has been gone or silent for host_timeout (`>=`; a pulled cable closes no connection), it holds
  worker node ids, it is neither the scheduler's host nor replaced already, and none of its ranks is held by a
  member (they died: by silence, by not coming back, or with their connections).
- A spare is free when its agent is connected and said it is one, and it holds no ranks, never took any and was
  not replaced (Roster.free_spares: the inventory's order, then the order spares said hello). The operator may
  name one; otherwise the first free one is taken.
- A host the replica check found corrupt twice (a `corruption` report whose action is `fenced`) is not to be trusted
  with the job's state: its ranks go to the first free spare, as for `fleet replace`, unless it runs the scheduler
  (`fenced_host_spare`); with no spare free, the membership shrinks the job without it if it may.

Finding lost hosts scans every host; `LostCheck` says when that scan can find something, so that at a thousand ranks
most of the scheduler's passes skip it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from toolkit.scheduler.roster import Roster, rank_of


@dataclass(frozen=True)
class Lost:
    """A lost host: unheard `since`, its worker node ids (in rank order) all dead."""

    host: str
    since: float
    node_ids: list[str]


@dataclass(frozen=True)
class Refusal:
    """No spare for the host: `reason` says why and what to do."""

    reason: str


class LostCheck:
    """When find_lost can find a host it did not: once the roster changed since the last scan (a member left, an
    agent came or went, a spare was placed: `Roster.changes` moved), or when the earliest host still heard at that
    scan may have fallen silent for host_timeout. Heartbeats only move that time later, so it is a safe bound."""

    def __init__(self) -> None:
        self.at = math.inf  # no host still heard at the last scan can be lost before this
        self.changes = -1  # Roster.changes at the last scan

    def due(self, roster: Roster, now: float) -> bool:
        """Whether a scan at `now` may find a lost host."""
        return roster.changes != self.changes or now >= self.at

    def deadline(self, roster: Roster) -> float:
        """When the next scan is due: at once (-inf) if the roster changed since the last one."""
        return self.at if roster.changes == self.changes else -math.inf

    def scanned(self, roster: Roster, changes: int, now: float, host_timeout: float) -> None:
        """A scan ran at `now` on the roster as of `changes` (taken before it: what the scan's own takeovers change
        is looked at again by the next one)."""
        self.changes = changes
        self.at = min((rec.heard_at + host_timeout for rec in roster.hosts.values()
                       if rec.heard_at is not None and rec.heard_at + host_timeout > now), default=math.inf)

    def idle(self, roster: Roster) -> None:
        """No host is replaced now (the phase of the job): no scan is due until the caller asks again."""
        self.changes, self.at = roster.changes, math.inf


def find_lost(roster: Roster, now: float, host_timeout: float) -> list[Lost]:
    """The hosts lost at `now` (module docstring), in the order they are handled: disconnected ones in the order
    they went, then connected ones in the order they first said hello. The caller checks the job's phase (formed,
    running, no rank done) and that host_timeout > 0."""
    out = []
    for rec in roster.unheard_for(now, host_timeout):
        node_ids = list(rec.node_ids)
        if (node_ids and not rec.runs_scheduler and not rec.fenced
                and not any(rank_of(n) in roster.members for n in node_ids)):
            out.append(Lost(rec.name, float(rec.heard_at or 0.0), node_ids))
    return out


def choose_spare(roster: Roster, asked: Any, host: str) -> str | Refusal:
    """The spare to take `host`'s ranks: `asked` (a host name the operator named, or None for the first free one)
    if it is free, else a Refusal naming why (not a host name, not a spare of this job, its agent not connected,
    holding ranks, or none free) and what to do."""
    free = roster.free_spares()
    if asked is not None and not isinstance(asked, str):
        return Refusal("malformed replace: spare is not a host name")
    if asked is not None and asked not in free:
        why = ("it is not a spare host of this job (the inventory's [spares])" if asked not in roster.spare_order
               else "its agent is not connected" if asked not in roster.agents else "it already holds ranks")
        return Refusal(f"{asked[:256]} cannot take over {host}: {why}; free spares: {', '.join(free) or 'none'}")
    if not free:
        with_agent = [s for s in roster.spare_order if s in roster.agents]
        return Refusal(f"no spare is free to take over {host} (spares with an agent: "
                       f"{', '.join(with_agent) or 'none'}); add a host to the inventory's [spares], deploy and train")
    return str(asked) if asked is not None else free[0]


def fenced_host_spare(roster: Roster, host: str) -> str | Refusal:
    """The spare to take the ranks of `host`, which the replica check found corrupt twice (toolkit.train.replicas):
    the first free one, or a Refusal naming why none can (it holds no worker of the job, it runs the scheduler, or
    no spare is free) and what to do."""
    rec = roster.hosts.get(host)
    if rec is None or not rec.node_ids:
        return Refusal(f"host {host[:256]} holds no worker of the job (the report names a host the scheduler does not "
                       "place ranks on)")
    if rec.runs_scheduler:
        return Refusal(f"host {host} runs the scheduler: it cannot be replaced while the job runs; move the scheduler "
                       "off it (or replace the host) and train again")
    return choose_spare(roster, None, host)
