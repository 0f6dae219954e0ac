"""Whether a member is alive: the scheduler's liveness rules, pure functions over its members and the clock (the
membership applies them on each `tick` and agent heartbeat).

- A member is heard through its own heartbeats and through its agent's, which vouch for the children running and
  not stopped: one busy in a call that holds its GIL is alive (waited for up to topo_timeout), a SIGSTOPped one is
  not.
- A member whose connection closed is dead at once, but its process is killed (fenced) only if its agent has not
  reported its exit within node_timeout: a failing script's own exit is its first cause, and a kill in between
  would hide it.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping

from toolkit.contracts import envvars
from toolkit.contracts import messages as wire
from toolkit.scheduler.actions import CAUSE_CLOSED, Action, Log, Send
from toolkit.scheduler.roster import Member, Roster, rank_of

WARNING = logging.WARNING


def vouch(roster: Roster, host: str | None, running: Mapping[str, int] | None, now: float) -> None:
    """An agent's heartbeat names its children running and not stopped (`running`: node_id -> pid, as
    messages.Heartbeat read it). Each entry counts for the member that is that very process (its registered pid) on
    that agent's host; anything else in it is ignored."""
    if host is None or running is None:
        return
    for node_id, pid in running.items():
        rank = rank_of(node_id)
        member = roster.members.get(rank) if rank is not None else None
        if member is not None and member.node_id == node_id and pid == member.pid and roster.host_of(node_id) == host:
            member.vouched_at = now


def vouched(member: Member | None, now: float, node_timeout: float, since: float = -math.inf) -> bool:
    """Whether `member` is connected and its agent vouched for it (running, not stopped) within node_timeout, and
    after `since`."""
    return member is not None and member.peer is not None and member.vouched_at is not None \
        and now - member.vouched_at < node_timeout and member.vouched_at > since


def alive_though_silent(member: Member, silent: float, now: float, node_timeout: float, topo_timeout: float,
                        out: list[Action]) -> bool:
    """Whether `member`, unheard for `silent` s (at least node_timeout), is alive anyway: connected, and its agent
    vouched for it within node_timeout (a call holding its GIL stops its heartbeat thread, not its process), for at
    most topo_timeout of silence. Says so once per silence (appended to `out`)."""
    if not vouched(member, now, node_timeout) or silent >= topo_timeout:
        return False
    if not member.busy_said:
        member.busy_said = True
        out.append(Log(WARNING, f"{member.node_id} (pid {member.pid} on {member.host}) sent no heartbeat for "
                                f"{silent:.1f} s, but its agent sees it running (not stopped): busy in a call that "
                                f"holds its GIL? waiting for it up to {envvars.MS_TOPO_TIMEOUT}={topo_timeout:g} s"))
    return True


def expiry(member: Member, node_timeout: float, topo_timeout: float) -> float:
    """The earliest time `member` can be found dead by silence, as far as is known now (see
    `alive_though_silent`)."""
    unheard = member.last_seen + node_timeout
    if member.vouched_at is None or member.peer is None:
        return unheard
    return max(unheard, min(member.vouched_at + node_timeout, member.last_seen + topo_timeout))


def kill_unreported(roster: Roster, unreported: dict[str, tuple[int, float]], now: float,
                    node_timeout: float) -> list[Action]:
    """Kill (fence) each process whose connection closed node_timeout ago and whose exit its agent has not reported:
    it may linger (stuck in its teardown) and hold its rank's place on its host."""
    out: list[Action] = []
    for node_id, (pid, due) in list(unreported.items()):
        if now < due:
            continue
        del unreported[node_id]
        agent = roster.agent_at(node_id)
        if agent is not None:
            out += [Log(WARNING, f"{node_id} (pid {pid}) closed its connection {node_timeout:g} s ago and its "
                                 "agent has not reported its exit: killing it (fencing)"),
                    Send(agent, wire.Kill(node_id=node_id, pid=pid, cause=CAUSE_CLOSED))]
    return out
