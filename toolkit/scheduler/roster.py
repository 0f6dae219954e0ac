"""What the scheduler knows of each host, one record per host (torch elastic's `_RendezvousState` and torchft's
lighthouse `State` keep theirs the same way): where its node ids run, its agent's connection and when it was last
heard, whether it is a spare, whether it runs the scheduler, whether it was replaced (by which spare, in which
order, why) and whether it waits for a spare; and beside them each rank: its member (the live incarnation that
holds it), the connections, the ranks done, the incarnations fenced, the commits. Pure data that keeps its own
invariants: the membership (toolkit.scheduler.membership) changes it through the mutators here, so that no decision
has to keep nine structures consistent by hand.

Invariants (`problems(roster)` names any broken one; tests/test_roster.py drives them on a fake clock):
- `node_host[n] == h` exactly when `n` is in `hosts[h].node_ids` (worker node ids only, in rank order);
- `agents[h] == p` exactly when `hosts[h].agent == p` (the connected agents, in the order they connected);
- a replaced host has no agent, is not watched (`heard_at` None), waits for nothing and is never connected again;
- a host waiting for a spare is watched;
- `connected_members` counts the members with a connection; each member is under its own rank.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from toolkit.contracts import protocol


def rank_of(node_id: str) -> int | None:
    """The rank in a worker node id (`worker_<rank>`), None for anything else (`sched`)."""
    prefix = protocol.worker_node_id(0)[:-1]
    digits = node_id[len(prefix):]
    if node_id.startswith(prefix) and digits.isascii() and digits.isdigit():  # isdigit alone takes "²"
        return int(node_id[len(prefix):])
    return None


class Fact(str, enum.Enum):
    """A kind of persisted fact, kept one record per rank (MEMBER, DONE, COMMIT), per incarnation (FENCED) or per
    replacement (REPLACED, by its number): `Roster.unsaved` holds (Fact, rank | incarnation | number)."""

    MEMBER = "member"
    DONE = "done"
    FENCED = "fenced"
    COMMIT = "commit"
    REPLACED = "replaced"

    __str__ = str.__str__
    __format__ = str.__format__


class PeerRole(str, enum.Enum):
    """What a connection is once it said who it is (prints as its value)."""

    WORKER = "worker"
    AGENT = "agent"
    FINISHED = "finished"  # a worker that said done: its later messages and EOF mean nothing

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass
class Member:
    """The live incarnation that holds a rank.

    `incarnation` is random per process (toolkit.contracts.protocol); `last_seen` is when it last registered or sent
    anything on its current connection (for a restored member: when the server started listening); `peer` is None only
    for a restored member that has not reconnected yet; `step` is its last heartbeat's. Only `to_json`'s fields are
    persisted."""

    rank: int
    node_id: str
    incarnation: str
    pid: int
    host: str
    addr: str
    last_seen: float
    peer: int | None = None  # its connection; None while it has not (re)connected
    step: int | None = None
    recovery: str = "unknown"  # how it recovers (P.RECOVERY_IN_PLACE / RECOVERY_RESTART), as it registered
    vouched_at: float | None = None  # when its agent last said this very process runs, not stopped
    busy_said: bool = False  # its silence while vouched for was logged (until it is heard again)

    def to_json(self) -> dict[str, Any]:
        """The persisted fields (Membership.snapshot): who holds the rank and where it runs. Liveness is not
        persisted: a restarted scheduler gives every restored member node_timeout to reconnect."""
        return {"rank": self.rank, "node_id": self.node_id, "incarnation": self.incarnation, "pid": self.pid,
                "host": self.host, "addr": self.addr, "recovery": self.recovery}


@dataclass(frozen=True)
class Peer:
    """What a connection is, once it said who it is: a worker (of `rank`), an agent (of `host`), or a worker that
    said `done`, whose later messages and EOF mean nothing."""

    role: PeerRole
    rank: int | None = None
    host: str | None = None
    addr: str = ""


@dataclass
class RosterHost:
    """One host as the scheduler knows it (RosterHost, not the launcher's jobrecord.HostRecord: where it was deployed).

    `heard_at` is since when its agent is unheard: while connected, its last message (agents heartbeat); while
    not, its disconnection (or, for a host the plan put workers on, the time peers could first connect); None while
    it is not watched (never placed and never connected, or replaced). `hello_seq` and `gone_seq` order hosts found
    lost at the same moment: disconnected ones in the order they went, then connected ones in the order they first
    said hello."""

    name: str
    node_ids: list[str] = field(default_factory=list)  # the worker node ids placed here, in rank order
    agent: int | None = None  # its agent's connection (a server peer id)
    heard_at: float | None = None
    spare: bool = False  # its agent said it is a spare (it holds the standby files)
    runs_scheduler: bool = False  # its agent supervises the scheduler: never replaced
    took_over: bool = False  # it took another host's ranks (a spare is used once)
    replaced_by: str | None = None  # the spare that took its ranks: fenced for good
    replaced_seq: int = 0  # 1 up, the order of replacements
    replaced_reason: str = ""
    replaced_node_ids: list[str] = field(default_factory=list)  # the node ids it held when it was replaced
    waiting_for_spare: bool = False  # found lost with no spare free (said once)
    hello_seq: int | None = None
    gone_seq: int = 0

    @property
    def connected(self) -> bool:
        """Its agent has a connection to the scheduler."""
        return self.agent is not None

    @property
    def fenced(self) -> bool:
        """It was replaced: its agent and workers are refused for good."""
        return self.replaced_by is not None

    @property
    def unheard_since(self) -> float | None:
        """Since when its agent has not been heard (see `heard_at`)."""
        return self.heard_at


class Roster:
    """Every host the scheduler knows, by name (`hosts`), with two indexes kept by the mutators: `node_host`
    (node id -> host, the plan's placement after agents' hellos and replacements) and `agents` (host -> its
    connected agent's peer). `placement` is the plan's (node id -> host); `spares` the inventory's spare hosts, in
    the order they are used (spares whose agents say so later follow, in hello order).

    And every rank: `members` (rank -> its live incarnation), `peers` (connection -> what it is), `done` (ranks that
    finished), `fenced` (incarnations declared dead, for good), `commits` (rank -> its highest committed step), and
    `connected_members`, the members with a connection, kept by `admit`, `reconnect` and `remove` (so a formation
    check costs nothing).

    `changes` counts the calls of the mutators below but `heard` (an agent's heartbeat), `wait_for_spare` and
    `reconnect`: a decision cached from the hosts and members (membership's lost-host check) is stale when it moved.

    `unsaved`: the persisted facts touched since the state was last written, marked by `admit`, `reconnect`,
    `remove` and `replace`, and by whoever adds to `done`, `fenced` or `commits` (the membership); the server clears
    it once the state is written. A mark too many costs a comparison; a mark missing would leave a change unwritten
    until the next whole rewrite (tests/test_membership_trace.py holds the marks to the whole snapshot at every
    step)."""

    def __init__(self, placement: Mapping[str, str] | None = None, spares: Sequence[str] = ()) -> None:
        self.hosts: dict[str, RosterHost] = {}
        self.node_host: dict[str, str] = {}
        self.agents: dict[str, int] = {}
        self.spare_order: list[str] = list(spares)
        self._replaced: list[str] = []  # replaced hosts, in order
        self._seq = 0
        self.members: dict[int, Member] = {}
        self.peers: dict[int, Peer] = {}
        self.done: set[int] = set()
        self.fenced: set[str] = set()
        self.commits: dict[int, int] = {}
        self.connected_members = 0
        self.unsaved: set[tuple[Fact, int | str]] = set()
        self.changes = 0
        for node_id, host in (placement or {}).items():
            self.place(node_id, host)

    # -- queries

    def record(self, host: str) -> RosterHost:
        """The record of `host`, created (unwatched, not connected) if it is new."""
        rec = self.hosts.get(host)
        if rec is None:
            rec = self.hosts[host] = RosterHost(host)
        return rec

    def host_of(self, node_id: str) -> str | None:
        """The host `node_id` is placed on, None if it is placed nowhere."""
        return self.node_host.get(node_id)

    def agent_at(self, node_id: str) -> int | None:
        """The connected agent of the host `node_id` is placed on: where a kill of it goes."""
        host = self.node_host.get(node_id)
        return self.agents.get(host) if host is not None else None

    def replaced_by(self, host: Any) -> str | None:
        """The spare that took `host`'s ranks, None if it was not replaced."""
        rec = self.hosts.get(host) if isinstance(host, str) else None
        return rec.replaced_by if rec is not None else None

    def worker_hosts(self) -> dict[str, list[str]]:
        """Host -> the worker node ids it holds now (in rank order), hosts in the order of their first rank."""
        holding = [rec for rec in self.hosts.values() if rec.node_ids]
        holding.sort(key=lambda rec: rank_of(rec.node_ids[0]) or 0)
        return {rec.name: list(rec.node_ids) for rec in holding}

    def replacements(self) -> list[dict[str, Any]]:
        """The replacements in order, as persisted: {host, by, node_ids, reason}."""
        return [{"host": rec.name, "by": rec.replaced_by, "node_ids": list(rec.replaced_node_ids),
                 "reason": rec.replaced_reason} for rec in (self.hosts[h] for h in self._replaced)]

    def free_spares(self) -> list[str]:
        """Spare hosts whose agent is connected and said it is a spare, that hold no ranks and never took any and
        were not replaced, in the order they are used."""
        out = []
        for host in self.spare_order:
            rec = self.hosts.get(host)
            if (rec is not None and rec.connected and rec.spare and not rec.took_over and not rec.fenced
                    and not rec.node_ids):
                out.append(host)
        return out

    def unheard_for(self, now: float, timeout: float) -> list[RosterHost]:
        """The watched hosts unheard for `timeout` at `now`: disconnected ones in the order they went, then
        connected ones in the order they first said hello."""
        stale = [rec for rec in self.hosts.values() if rec.heard_at is not None and now - rec.heard_at >= timeout]
        return sorted(stale, key=lambda rec: (rec.connected, rec.hello_seq if rec.connected else rec.gone_seq))

    # -- mutators

    def place(self, node_id: str, host: str, keep: bool = False) -> None:
        """`node_id` runs on `host` from now on (the plan's placement, an agent's hello, a replacement); with
        `keep`, only if it is placed nowhere yet (a worker's own word yields to the placement known)."""
        self.changes += 1
        old = self.node_host.get(node_id)
        if old == host or (keep and old is not None):
            return
        rank = rank_of(node_id)
        if old is not None and rank is not None:
            self.hosts[old].node_ids.remove(node_id)
        self.node_host[node_id] = host
        rec = self.record(host)
        if rank is not None:
            bisect.insort(rec.node_ids, node_id, key=lambda n: rank_of(n) or 0)

    def start_clock(self, host: str, now: float) -> None:
        """Peers can connect from `now`: `host` (placed by the plan) has host_timeout from then to say hello. Not
        for a host watched already, connected or replaced."""
        self.changes += 1
        rec = self.record(host)
        if rec.heard_at is None and not rec.connected and not rec.fenced:
            self._seq += 1
            rec.heard_at, rec.gone_seq = now, self._seq

    def connect_agent(self, host: str, peer: int, spare: bool, now: float, scheduler: bool = False) -> int | None:
        """`host`'s agent said hello on `peer` at `now` (`spare`: it says it is one; `scheduler`: it supervises the
        scheduler, which then runs there, not on the host that said so before). Returns its previous connection,
        which `peer` replaces (the caller closes it), or None."""
        self.changes += 1
        rec = self.record(host)
        rec.heard_at, rec.waiting_for_spare, rec.spare = now, False, spare
        if scheduler:
            for other in self.hosts.values():
                other.runs_scheduler = other is rec
        if rec.hello_seq is None:
            self._seq += 1
            rec.hello_seq = self._seq
        if spare and host not in self.spare_order:
            self.spare_order.append(host)
        old, rec.agent = rec.agent, peer
        self.agents[host] = peer
        return old

    def heard(self, host: str, peer: int, now: float) -> bool:
        """`host`'s agent said something on `peer` at `now`; False (and nothing changes) if `peer` is not its
        current connection."""
        rec = self.hosts.get(host)
        if rec is None or rec.agent != peer:
            return False
        rec.heard_at, rec.waiting_for_spare = now, False
        return True

    def disconnect_agent(self, host: str, peer: int, now: float) -> bool:
        """`host`'s agent's connection `peer` ended at `now`: unheard from then. False (and nothing changes) if
        `peer` is not its current connection."""
        rec = self.hosts.get(host)
        if rec is None or rec.agent != peer:
            return False
        self._seq += 1
        self.changes += 1
        rec.agent, rec.heard_at, rec.gone_seq = None, now, self._seq
        del self.agents[host]
        return True

    def replace(self, host: str, spare: str, reason: str, node_ids: Sequence[str] | None = None) -> int | None:
        """`spare` takes `host`'s worker node ids (or `node_ids`, for a restored replacement): `host` is fenced
        for good (unwatched, its agent dropped) and the replacement gets the next number. Returns the dropped
        agent's peer (the caller tells it to stop), or None."""
        self.changes += 1
        rec = self.record(host)
        moved = list(rec.node_ids if node_ids is None else node_ids)
        self._replaced.append(host)
        rec.replaced_by, rec.replaced_seq, rec.replaced_reason = spare, len(self._replaced), reason
        rec.replaced_node_ids = moved
        rec.waiting_for_spare, rec.heard_at = False, None
        agent, rec.agent = rec.agent, None
        self.agents.pop(host, None)
        self.record(spare).took_over = True
        self.unsaved.add((Fact.REPLACED, rec.replaced_seq))
        for node_id in moved:
            self.place(node_id, spare)
        return agent

    def wait_for_spare(self, host: str) -> bool:
        """`host` is lost and no spare is free: True the first time (say so once), False while it still waits."""
        rec = self.record(host)
        if rec.waiting_for_spare:
            return False
        rec.waiting_for_spare = True
        return True

    def admit(self, member: Member) -> None:
        """`member` holds its rank from now on (the rank is free: its holder was removed)."""
        self.changes += 1
        self.members[member.rank] = member
        self.connected_members += member.peer is not None
        self.unsaved.add((Fact.MEMBER, member.rank))

    def reconnect(self, member: Member, peer: int, addr: str, now: float) -> int | None:
        """`member` (re)connected on `peer` from `addr` at `now`; returns its previous connection, or None."""
        old = member.peer
        self.connected_members += old is None
        member.peer, member.addr, member.last_seen = peer, addr, now
        self.unsaved.add((Fact.MEMBER, member.rank))  # its address is persisted
        return old

    def remove(self, member: Member) -> bool:
        """`member` leaves its rank; False (and nothing changes) if it no longer holds it."""
        if self.members.get(member.rank) is not member:
            return False
        self.changes += 1
        del self.members[member.rank]
        self.connected_members -= member.peer is not None
        self.unsaved.add((Fact.MEMBER, member.rank))
        return True


def problems(roster: Roster) -> list[str]:
    """Every broken invariant of `roster` (module docstring), named; empty when it is sound. For tests."""
    out = [f"{n} -> {h}, not in its record" for n, h in roster.node_host.items()
           if rank_of(n) is not None and n not in roster.hosts[h].node_ids]
    for rec in roster.hosts.values():
        if any(roster.node_host.get(n) != rec.name for n in rec.node_ids):
            out.append(f"{rec.name}: holds {rec.node_ids}, placed elsewhere")
        if rec.node_ids != sorted(rec.node_ids, key=lambda n: rank_of(n) or 0):
            out.append(f"{rec.name}: node ids out of rank order {rec.node_ids}")
        if roster.agents.get(rec.name) != rec.agent:
            out.append(f"{rec.name}: agent {rec.agent}, index {roster.agents.get(rec.name)}")
        if rec.fenced and (rec.connected or rec.heard_at is not None or rec.waiting_for_spare):
            out.append(f"{rec.name}: replaced, yet connected, watched or waiting")
        if rec.waiting_for_spare and rec.heard_at is None:
            out.append(f"{rec.name}: waits for a spare unwatched")
    connected = sum(m.peer is not None for m in roster.members.values())
    if connected != roster.connected_members:
        out.append(f"{roster.connected_members} members counted connected, {connected} are")
    if any(rank != m.rank for rank, m in roster.members.items()):
        out.append("a member under another rank")
    if sum(rec.runs_scheduler for rec in roster.hosts.values()) > 1:
        out.append("more than one host runs the scheduler")
    return out
