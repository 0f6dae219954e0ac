"""The scheduler's decisions: who is a member of the job, when a member is dead, when a generation is formed, when
the job has finished or failed. Pure: no sockets, no clock, no files. Each event (a registration, a heartbeat, an
agent's report, a lost connection, the passing of time) is a method call with the time; it returns the actions
the server then applies (send a message, close a connection, log, exit) and updates the state that the server
persists (`snapshot()`, `dirty`). Modelled on torch elastic's rendezvous, where a state handler returns an action
and an executor applies it.

Peers are the server's connection ids: the membership knows which peer is which worker or agent, never a socket.

The rules, in one place:
- A rank is held by one live incarnation. Its second claimant is rejected (retry later) until the holder is known
  dead: its connection closed, its agent reported its exit, or it was unheard for node_timeout. A member is heard
  through its own heartbeats, and through its agent's, which vouch for the children running and not stopped: one
  busy in a call that holds its GIL is alive (waited for up to topo_timeout), a SIGSTOPped one is not.
- A member whose connection closed is dead at once (a new generation), but its process is killed (fenced) only if
  its agent has not reported its exit within node_timeout: a failing script's own exit is its first cause, and a
  kill in between would hide it.
- A dead incarnation is fenced for good: if it comes back (SIGCONT, a healed partition) it is told to exit.
- A death while the job is formed moves it to a new generation, announced to every member; while it is gathering,
  the death only removes the member (one generation per fault, not a cascade).
- A generation is formed once every rank has a connected member; the formation has a deadline (topo_timeout)
  that fails the job, naming who never came and where it was expected.
- A host whose ranks are all dead and whose agent has been gone for host_timeout (once the job has formed) is lost:
  a free spare host (an agent that said `spare` in its hello) takes its node ids and ranks (`takeover`), and the
  lost host is fenced for good (persisted): its agent is stopped if it comes back, its workers told to exit. The
  operator's `replace` does the same at once, for a host alive or not. No spare free: the job shrinks if it may
  (toolkit.scheduler.elastic: --min-workers, the survivors' memory), its ranks benched and the next generation
  formed without them, the survivors serving their logical ranks; otherwise it waits, as before, said in one line.
  A benched rank's worker registering again (its host back) takes it into the next generation (grow).
- A host the replica check found corrupt twice is fenced at once (counted and persisted by
  toolkit.scheduler.corrupthosts: a relaunched rank's own count starts from zero): a free spare takes its ranks;
  with none, an elastic job shrinks without it as for a lost host (its live workers told to exit, its agent to
  stop), else fails. A host so benched is quarantined: it rejoins only once the operator starts its agent again
  (`shrink_fenced`).
- When every rank is done the job has finished; when an agent gives up on a process, it has failed. A death after
  some rank is done forms no generation (the finished ranks are gone): an in-place member has finished too (a
  rank is done only after the final barrier), any other fails the job at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from toolkit.contracts import envvars, protocol
from toolkit.contracts import messages as wire
from toolkit.scheduler import corrupthosts, elastic
from toolkit.scheduler.actions import (  # also re-exported
    CAUSE_CLOSED,
    CAUSE_FENCED,
    CAUSE_NOT_BACK,
    CAUSE_REPLACED,
    CAUSE_SILENCE,
    CAUSE_STUCK,
    Action,
    Close,
    DropKeys,
    Exit,
    Log,
    Note,
    NoteKind,
    Send,
)
from toolkit.scheduler.corrupthosts import CorruptHosts, Fence
from toolkit.scheduler.liveness import alive_though_silent, expiry, kill_unreported, vouch, vouched
from toolkit.scheduler.roster import Fact, Member, Peer, PeerRole, Roster, rank_of  # also re-exported
from toolkit.scheduler.sparehosts import Lost, LostCheck, Refusal, choose_spare, fenced_host_spare, find_lost
from toolkit.scheduler.state import JobStatus
from toolkit.scheduler.watchdog import Watchdog

EXIT_OK = 0
EXIT_FAILED = 1  # a node gave up: the job failed
EXIT_FORMATION = 3  # MS_TOPO_TIMEOUT passed before every worker registered

RUNNING, FINISHED, FAILED = JobStatus.RUNNING, JobStatus.FINISHED, JobStatus.FAILED
INFO, WARNING, ERROR = logging.INFO, logging.WARNING, logging.ERROR




def how(code: Any, sig: Any) -> str:
    """How a process ended, in the agent's words (procs.ExitStatus.describe): "killed by SIGKILL" when a signal is
    named, else "exit code N"."""
    return f"killed by {sig}" if sig else f"exit code {code}"


@dataclass(frozen=True)
class Registration:
    """A well-formed `register` of a rank of this job: who claims it, from where, and how it recovers."""

    node_id: str
    rank: int
    incarnation: str
    pid: int
    host: str
    recovery: str  # P.RECOVERY_IN_PLACE, P.RECOVERY_RESTART, or "unknown"
    where: str  # "pid N on host, addr", for the log


def validate_register(peer: int, addr: str, msg: Mapping[str, Any], world_size: int) -> Registration | list[Action]:
    """`msg` as a Registration, or the refusal (`reject`, no retry, the connection closed) of a malformed message
    (wire.Register.from_msg) or of a world size or rank that is not the job's (render the job again)."""
    try:
        reg = wire.Register.from_msg(msg)
    except protocol.ProtocolError as e:
        return [Log(WARNING, f"rejected malformed registration from {addr}"),
                Send(peer, wire.Reject(str(e)), close=True)]
    if reg.world_size != world_size or not 0 <= reg.rank < world_size:
        reason = (f"{reg.node_id} claims rank {reg.rank} of {reg.world_size} workers, but the job has {world_size} "
                  f"({envvars.MS_WORKER_NUM}); render the job again")
        return [Log(WARNING, f"rejected {reg.node_id} from {addr}: {reason}"),
                Send(peer, wire.Reject(reason), close=True)]
    return Registration(reg.node_id, reg.rank, reg.incarnation, reg.pid, reg.host, reg.recovery,
                        f"pid {reg.pid} on {reg.host}, {addr}")


def refuse_register(peer: int, reg: Registration, roster: Roster, status: str, now: float) -> list[Action]:
    """The refusal of a well-formed registration, each with the connection closed after the answer, or [] to take
    it: a replaced host's worker or a fenced incarnation (`fenced`: it must exit); a job that has ended or a rank
    already done (`reject`, no retry); a rank held by another incarnation not yet known dead (`reject` with retry:
    a relaunched worker retries until the holder's death is established)."""
    node_id, pid, host, where = reg.node_id, reg.pid, reg.host, reg.where
    by = roster.replaced_by(host)
    if by is not None:
        return [Log(WARNING, f"fenced {node_id} ({where}): host {host} was replaced by {by}; told it to exit"),
                Note(NoteKind.FENCED, {"node_id": node_id, "pid": pid, "host": host}),
                Send(peer, wire.Fenced(f"host {host} was replaced by {by}: its processes may not rejoin the job"),
                     close=True)]
    if reg.incarnation in roster.fenced:
        return [Log(WARNING, f"fenced {node_id} ({where}): that incarnation was declared dead; told it to exit"),
                Note(NoteKind.FENCED, {"node_id": node_id, "pid": pid, "host": host}),
                Send(peer, wire.Fenced(f"{node_id} (pid {pid}) was declared dead; a replacement takes its place"),
                     close=True)]
    if status != RUNNING:
        return [Send(peer, wire.Reject(reason=f"the job has {status}", retry=False), close=True)]
    if reg.rank in roster.done:
        return [Send(peer, wire.Reject(reason=f"{node_id} already finished", retry=False), close=True)]
    current = roster.members.get(reg.rank)
    if current is not None and current.incarnation != reg.incarnation:
        reason = (f"{node_id} is held by a live process (pid {current.pid} on {current.host}, {current.addr}, "
                  f"heard from {now - current.last_seen:.1f} s ago)")
        return [Log(WARNING, f"rejected {node_id} from {where}: {reason}"),
                Send(peer, wire.Reject(reason=reason, retry=True), close=True)]
    return []


def host_of(roster: Roster, member: Member) -> str:
    """The host a member runs on as the operator names it (the plan's, or its agent's), else as the worker
    named itself (its hostname, which need not be the inventory's name)."""
    return roster.host_of(member.node_id) or str(member.host)


def gave_up_reason(agent: Peer, msg: wire.GaveUp) -> str:
    """Why the job fails when an agent's process passed its max restarts (`gave_up`): the node, the host, how it
    ended and the last 5 lines of its log tail (at most 2000 characters)."""
    last = " | ".join(line for line in msg.log_tail.strip().splitlines()[-5:])[-2000:]
    said = msg.cause or how(msg.code, msg.signal)
    return f"{msg.node_id} on {agent.host} failed after its last allowed restart ({said})" + (
        f"; last log lines: {last}" if last else "")


def heartbeat(m: Membership, member: Member, beat: wire.Heartbeat, now: float) -> list[Action]:
    """A worker's heartbeat: its step (kept when it says none), the logical ranks its memory holds (`capacity`, for a
    shrink), its progress for the watchdog, and its pace figures in a Note for the ledger and the stragglers."""
    member.step = beat.step if beat.step is not None else member.step
    if beat.capacity is not None:
        m.capacity[member.rank] = beat.capacity
    m.watchdog.heard(member.rank, member.node_id, member.step, beat, now)
    return [Note(NoteKind.PACE, {"rank": member.rank, "node_id": member.node_id, "host": host_of(m.roster, member),
                                 "pid": member.pid, "step": member.step, **beat.pace()})]


def recovered(member: Member, msg: wire.Recovered) -> list[Action]:
    """A worker's `recovered` report: its log line (generation, step, where the state came from and how long it
    took; fields of the wrong type show as None or "?") and a Note for the ledger."""
    origin = {"peer": f"rank {msg.from_rank}'s memory", "checkpoint": f"the checkpoint of rank {msg.from_rank}",
              "initial": "the initial state"}.get(msg.source or "", "?")
    return [Log(INFO, f"{member.node_id} trains again in generation {msg.generation} from step {msg.step}, taken "
                      f"from {origin} in {msg.seconds} s; {msg.recomputed} step(s) recomputed"),
            Note(NoteKind.RECOVERED, {"node_id": member.node_id, "rank": member.rank, "generation": msg.generation,
                                      "step": msg.step, "source": msg.source, "recomputed": msg.recomputed,
                                      "seconds": msg.seconds})]


def corrupted(m: Membership, member: Member, report: wire.Corruption, now: float) -> list[Action]:
    """A worker's `corruption` report (the replica check found a rank's state corrupt): its log line and a Note for
    the ledger, its ranks counted (corrupthosts.CorruptHosts.found); one naming ranks outside the job is logged and
    ignored. Ranks found corrupt twice lose their hosts (`fence_corrupt`)."""
    if not report.within(m.world_size):
        return [Log(WARNING, f"{member.node_id} sent a malformed 'corruption' (ranks that are not among the job's "
                             f"{m.world_size}; ignored)")]
    finding = m.corrupt.found(report, member.node_id, m.roster)
    m.dirty |= finding.counted
    return finding.actions + (fence_corrupt(m, finding.fence, now) if finding.fence is not None else [])


def fence_corrupt(m: Membership, fence: Fence, now: float) -> list[Action]:
    """The hosts of the ranks in `fence.report` (corrupthosts.hosts_to_fence: none when the report is of another
    generation, the job is not running formed with every rank training, or a rank has moved) are not to be trusted
    with the job's state: each one's ranks go to a free spare at once, as `fleet replace` does (its workers fenced,
    the others re-forming with the spare's, which take the state from a peer). Where no spare can take them
    (spares.fenced_host_spare), the job shrinks without the host if it may (`shrink_fenced`), else stops with one
    line naming the host, why, why it could not shrink, and what to do."""
    hosts = corrupthosts.hosts_to_fence(fence.report, m.roster, m.corrupt.quarantined, m.generation, m.formed,
                                        m.status)
    if isinstance(hosts, Log):
        return [hosts]
    out: list[Action] = []
    for host in hosts:
        spare = fenced_host_spare(m.roster, host)
        if isinstance(spare, Refusal):
            out += shrink_fenced(m, host, f"{fence.why}, and {spare.reason}", now)
            if m.status != RUNNING:
                return out
            continue
        out += m._take_over(host, spare, f"fenced: {fence.why}", now)
    return out


def shrink_fenced(m: Membership, host: str, why: str, now: float) -> list[Action]:
    """Host `host` is fenced for corruption and no spare can take its ranks (`why` says both): if the survivors may
    go on without it (elastic.shrink_refusal, as for a lost host) its ranks are benched, its live workers fenced
    (told to exit: they are alive, unlike a lost host's), its agent told to stop, and the survivors re-form in place
    without it; otherwise the job stops with one line saying why it could not shrink. Nor on the scheduler's own host
    (stopping that agent stops the scheduler), or one holding no worker of the job.

    The host is `quarantined` (persisted): it does not come back by itself. Its workers' registrations are refused;
    the first hello of its agent after the fence, if that agent was not connected when it was fenced (so it never
    got its `stop`), is answered `stop`; the hello of an agent after that one can only come from an agent started
    again by the operator (`fleet restart --host`), which ends the quarantine: its workers grow the job back. A
    free spare found later may take its ranks as for any lost host (the scheduler's scan, after host_timeout)."""
    rec = m.roster.hosts.get(host)
    if rec is None or not rec.node_ids or rec.runs_scheduler:
        return m._fail(f"host {host} is fenced: {why}", EXIT_FAILED)
    slots = [r for r in (rank_of(n) for n in rec.node_ids) if r is not None]
    survivors = [s for s in elastic.active(m.world_size, m.benched) if s not in slots]
    refusal = elastic.shrink_refusal(survivors, m.world_size, m.min_workers, m.logical_world, m.capacity)
    if refusal is not None:
        return m._fail(f"host {host} is fenced: {why}; not shrinking instead: {refusal}", EXIT_FAILED)
    m.benched = sorted(set(m.benched) | set(slots))
    agent = rec.agent
    m.corrupt.quarantined[host] = agent is None  # its stop is owed to the next hello of its agent
    m.dirty = True
    out: list[Action] = [
        Log(WARNING, f"host {host} is fenced: {why}: shrinking to {len(survivors)} of {m.world_size} workers, "
                     f"serving {m.logical_world} logical ranks; it stays out until the operator starts it again "
                     f"('fleet restart --host {host}')"),
        Note(NoteKind.SHRINK, {"host": host, "slots": slots, "workers": len(survivors), "world_size": m.world_size,
                               "generation": m.generation, "fenced": True})]
    if agent is not None:
        m.roster.peers.pop(agent, None)
        m.roster.disconnect_agent(host, agent, now)
        out.append(Send(agent, wire.Stop(f"host {host} is fenced: {why}: it is out of the job until the operator "
                                         "starts it again"), close=True))
    for node_id in list(rec.node_ids):
        member = m.roster.members.get(rank_of(node_id) or 0)
        if member is not None and member.node_id == node_id:
            out += m._death(member, f"its host {host} is fenced for corruption", kill=False, now=now,
                            cause=CAUSE_FENCED)
    return out + m._maybe_form(now)


class Membership:
    """See the module docstring. `boot` names this scheduler start in the store prefixes; `expected` maps node ids
    to the host the plan put them on (for the formation-timeout message).

    Every event method takes the time and returns the actions (Send, Close, Log, Exit, DropKeys) the server applies
    in order. What peers send is treated as hostile: a malformed message is rejected, ignored or logged, and field
    sizes are bounded before they are kept. `expected` also tells where a dead worker's agent is before that agent
    has said hello; `address` (the control server's host:port) is named in the formation-timeout message; `now`
    starts the first formation's clock, which `started` restarts once peers can connect.

    What the server reads back: `dirty` (the membership changed: persist before sending what depends on it),
    `commits_dirty` (only commit progress changed: persisted at the server's own pace), `next_deadline()` (when to
    call `tick`), `snapshot()` (what to persist) and `roster.unsaved` (which of its records changed: a write
    costs those, state.changes)."""

    def __init__(self, job: str, world_size: int, node_timeout: float, topo_timeout: float, boot: str,
                 address: str, expected: Mapping[str, str] | None = None, now: float = 0.0,
                 host_timeout: float = envvars.DEFAULT_HOST_TIMEOUT, spares: Sequence[str] = (),
                 min_workers: int | None = None, logical_world: int | None = None) -> None:
        self.job, self.world_size, self.boot, self.address = job, world_size, boot, address
        # elastic (issue 42): how far the job may shrink, its L logical ranks, the slots benched (their host lost,
        # no spare), the assignment of the last formed generation (persisted when it is not the plain one), the
        # formed generation's world and the logical ranks each slot said its memory holds
        self.min_workers = world_size if min_workers is None else min_workers
        self.logical_world = world_size if logical_world is None else logical_world
        self.benched: list[int] = []
        self.assignment: list[list[Any]] | None = None
        self.world: elastic.World | None = None
        self.capacity: dict[int, int] = {}
        self.corrupt = CorruptHosts()  # the replica check's findings, and the hosts fenced for them and benched
        self.node_timeout, self.topo_timeout = node_timeout, topo_timeout
        self.host_timeout = host_timeout  # <= 0: no automatic replacement (the operator's `replace` only)
        # the agents' heartbeat interval (their `welcome`), stretched as the workers' at thousands of ranks
        self.agent_beat = envvars.heartbeat_interval(world_size, envvars.DEFAULT_AGENT_HEARTBEAT, node_timeout)
        # which rank stopped making progress while its peers wait for it (judged while formed and running)
        self.watchdog = Watchdog(envvars.heartbeat_interval(world_size, envvars.DEFAULT_HEARTBEAT_INTERVAL,
                                                            node_timeout))
        self.roster = Roster(expected, spares)  # every host and every rank: members, peers, done, fenced, commits
        # incarnations of restart-recovery members (torchrun-style scripts) that held the generation a death ended:
        # they exit EXIT_REJOIN to be relaunched, so the next generation does not count them, and their exit is
        # no fault (listed as relaunched with the incident, not as a death)
        self.leaving: set[str] = set()
        self.unreported: dict[str, tuple[int, float]] = {}  # node_id -> (pid, when to kill it): its connection
        # closed, its agent has not reported its exit yet
        self.generation = 0
        self.formed = False
        self.status = RUNNING
        self.failure = ""
        self.ever_registered = False
        self.ever_formed = False
        self.unmanaged = False
        self.gather_since: float | None = now
        self.hb_check_at = math.inf  # no member's heartbeat can expire before this
        self.lost_check = LostCheck()  # when the scan for lost hosts may find one
        self.dirty = False  # membership changed: persist before what depends on it is sent
        self.commits_dirty = False  # only commits changed: persisted at the server's own pace

    # -- what the server asks

    def next_deadline(self) -> float:
        """The earliest time `tick` may have work: the next possible heartbeat expiry (while there are members)
        and the formation deadline (while gathering, running and not unmanaged); inf when there is neither."""
        deadlines = [self.hb_check_at] if self.roster.members else []
        if self.status == RUNNING:
            deadlines += [due for _, due in self.unreported.values()]
        if self.gather_since is not None and not self.unmanaged and self.status == RUNNING:
            deadlines.append(self.gather_since + self.topo_timeout)
        if self.status == RUNNING:  # a host may be found lost then (at once if the roster changed since the scan)
            deadlines.append(self.lost_check.deadline(self.roster))
        if self.status == RUNNING and self.formed:
            deadlines.append(self.watchdog.due())
        return min(deadlines, default=math.inf)

    def snapshot(self) -> dict[str, Any]:
        """The state to persist (MS_ENABLE_RECOVERY): what a restarted scheduler needs to go on with the job.

        `committed_step` is the lowest step every rank has committed a checkpoint of, None until each rank has."""
        committed = min(self.roster.commits.values()) if len(self.roster.commits) == self.world_size else None
        return {
            "job": self.job, "world_size": self.world_size, "status": self.status, "failure": self.failure,
            "generation": self.generation, "formed": self.formed,
            "members": [m.to_json() for m in sorted(self.roster.members.values(), key=lambda m: m.rank)],
            "done": sorted(self.roster.done), "fenced": sorted(self.roster.fenced),
            "commits": {str(r): s for r, s in sorted(self.roster.commits.items())}, "committed_step": committed,
            "replaced": self.roster.replacements(),  # then what an elastic job adds, only when it has it
            **({"benched": list(self.benched)} if self.benched else {}),
            **self.corrupt.snapshot(),
            **({"assignment": self.assignment} if self.assignment is not None else {}),
        }

    def restore(self, state: Mapping[str, Any], now: float) -> list[Action]:
        """Go on with a job a previous scheduler ran (its persisted snapshot): members get node_timeout to
        reconnect before they are declared dead.

        A job that had already finished or failed is not resumed: only its fenced incarnations are kept (none of its
        stale processes may register; its replaced hosts are not: the new run runs as deployed), this run starts at
        generation 0, and the one log line says so. Otherwise the
        generation, whether it was formed, the done ranks, fenced incarnations, commits, replaced hosts (still fenced,
        their ranks still on the spares) and members come back, the members without a connection. `state` must have
        passed state.load's checks; returns the log actions."""
        if state.get("status") != RUNNING:
            self.roster.fenced = set(state.get("fenced", []))
            finished = state.get("status") == FINISHED
            return [Log(INFO, f"the previous run of job {self.job} {state.get('status')} (committed step "
                              f"{state.get('committed_step')}): this run starts at generation 0, its workers resume "
                              "from their own checkpoints" + ("; 'fleet train --fresh' starts a finished job over"
                                                              if finished else ""))]
        self.generation = int(state["generation"])
        self.formed = bool(state["formed"])
        self.gather_since = None if self.formed else now
        self.roster.done = {int(r) for r in state.get("done", [])}
        self.roster.fenced = set(state.get("fenced", []))
        self.benched = elastic.read_benched(state.get("benched"), self.world_size)
        self.corrupt.restore(state)
        self.assignment = state.get("assignment")
        if self.formed:
            self.world = elastic.plan_world(elastic.active(self.world_size, self.benched), self.logical_world,
                                            elastic.previous(self.assignment, self.world_size, self.logical_world))
        self.roster.commits = {int(r): int(s) for r, s in state.get("commits", {}).items()}
        for r in state.get("replaced", []):  # the hosts fenced, and where their ranks went
            self.roster.replace(r["host"], r["by"], str(r.get("reason", "")), node_ids=r["node_ids"])
        for m in state.get("members", []):
            self.roster.admit(Member(int(m["rank"]), m["node_id"], m["incarnation"], int(m["pid"]), m["host"],
                                     m["addr"], now, None, recovery=str(m.get("recovery", "unknown"))))
            self.roster.place(m["node_id"], m["host"], keep=True)
        self.ever_registered = bool(self.roster.members) or bool(self.roster.fenced)
        self.ever_formed = self.formed or self.generation > 0
        self.hb_check_at = now + self.node_timeout
        waiting = len(self.roster.members)
        return [Log(INFO, f"resumed job {self.job} from its persisted state: generation {self.generation} "
                          f"({'formed' if self.formed else 'gathering'}), {waiting} members waiting to "
                          f"reconnect within {self.node_timeout:g} s"),
                Note(NoteKind.RESTORED, {"generation": self.generation, "members": waiting})]

    def started(self, now: float) -> None:
        """Peers can reach the server from now: deadlines count from here, not from the server's own start.

        Restarts the formation clock (if gathering) and every restored member's heartbeat clock."""
        if self.gather_since is not None:
            self.gather_since = now
        for member in self.roster.members.values():
            member.last_seen = now
        self.hb_check_at = now + self.node_timeout if self.roster.members else math.inf
        for host in self.roster.worker_hosts():  # no agent is connected yet: each has host_timeout to say hello
            self.roster.start_clock(host, now)

    # -- events

    def register(self, peer: int, addr: str, msg: Mapping[str, Any], now: float) -> list[Action]:
        """A worker's authenticated `register` on connection `peer` from `addr`.

        Refused (`validate_register`, `refuse_register`), each with the connection closed after the answer: a
        malformed message or a world size or rank that is not the job's; a replaced host's worker or a fenced
        incarnation; a job that has ended or a rank already done; a rank held by another incarnation not yet known
        dead (retry later).

        The same incarnation again is a reconnect: it takes over from its old connection (closed) with no change of
        generation. A new incarnation becomes the rank's member (`dirty`). Either is answered `welcome`, then
        `formed` if the generation is formed; otherwise the generation forms if this was the last rank missing."""
        reg = validate_register(peer, addr, msg, self.world_size)
        if not isinstance(reg, Registration):
            return reg
        refused = refuse_register(peer, reg, self.roster, self.status, now) or self.corrupt.refuse(
            peer, reg.node_id, self.roster.host_of(reg.node_id), reg.host, reg.pid, reg.where)
        if refused:
            return refused
        node_id, rank, inc, pid, host, where = reg.node_id, reg.rank, reg.incarnation, reg.pid, reg.host, reg.where
        current = self.roster.members.get(rank)
        out: list[Action] = []
        self.roster.peers[peer] = Peer(PeerRole.WORKER, rank=rank, addr=addr)
        self.ever_registered = True
        if current is not None:
            old = self.roster.reconnect(current, peer, addr, now)
            if old is not None and old != peer:
                self.roster.peers.pop(old, None)
                out.append(Close(old))
            out.append(Log(INFO, f"{node_id} reconnected ({where}), generation {self.generation}"))
        else:
            recovery = reg.recovery
            if rank in self.benched:  # its host is back (or a spare took it): the next generation grows
                out += grow(self, rank, host, now)
            self.roster.admit(Member(rank, node_id, inc, pid, host, addr, now, peer, recovery=recovery))
            self.hb_check_at = min(self.hb_check_at, now + self.node_timeout)
            self.roster.place(node_id, host, keep=True)
            out.append(Log(INFO, f"registered {node_id} ({where}, {recovery} recovery): {len(self.roster.members)} of "
                                 f"{self.world_size}"))
            self.dirty = True
        out.append(Send(peer, wire.Welcome(rank=rank, world_size=self.world_size, generation=self.generation,
                                           job=self.job)))
        if self.formed:
            out.append(Send(peer, formed(self, rank)))
        else:
            out += self._maybe_form(now)
        return out

    def agent_hello(self, peer: int, addr: str, msg: Mapping[str, Any], now: float = 0.0) -> list[Action]:
        """An agent's authenticated `agent_hello` on connection `peer`: the agent of `host`, supervising `node_ids`.

        A malformed hello (host of 1 to 256 characters, a list of at most 4096 node ids) is rejected without retry.
        Otherwise the node ids (strings of at most 256 characters) are recorded as on `host`, which is where a dead
        worker's `kill` goes; a newer connection of the same host's agent replaces the old one (closed). Answered
        `welcome {beat}` (the agent's heartbeat interval), followed at once by `finished` or `stop` if the job has
        already ended, so an agent that reconnects after the end still learns it.

        The agent of a replaced host is refused for good: `welcome` then `stop` (its agent stops its children and
        exits), and it is not recorded; so is the agent of a host fenced for corruption that never got its `stop`
        (corrupthosts.CorruptHosts.hello). A spare host's agent (`spare: true`) is recorded as a spare; one that was
        handed a takeover is sent it again (it may have restarted), and a lost host waiting for a spare is served."""
        try:
            hello = wire.AgentHello.from_msg(msg)
        except protocol.ProtocolError as e:
            return [Send(peer, wire.Reject(str(e)), close=True)]
        host, names = hello.host, list(hello.node_ids)
        by = self.roster.replaced_by(host)
        if by is not None:
            reason = (f"host {host} was replaced by {by} in job {self.job}: it is fenced and may not rejoin; "
                      "its processes are stopped")
            return [Log(WARNING, f"refused the agent of {host} ({addr}): the host was replaced by {by}; told it to "
                                 "stop its processes"),
                    Note(NoteKind.REFUSED, {"host": host, "by": by}),
                    Send(peer, wire.Welcome()), Send(peer, wire.Stop(reason=reason), close=True)]
        back = self.corrupt.hello(peer, host, addr, self.job)  # a host fenced for corruption and benched
        self.dirty |= back is not None
        refused, out = back or (False, [])
        if refused:
            return out
        self.roster.peers[peer] = Peer(PeerRole.AGENT, host=host, addr=addr)
        old = self.roster.connect_agent(host, peer, hello.spare is True, now,
                                        scheduler=any(rank_of(n) is None for n in names))
        if old is not None and old != peer:
            self.roster.peers.pop(old, None)
            out.append(Close(old))
        for node_id in names:
            self.roster.place(node_id, host)
        out += [Log(INFO, f"agent of {host} connected from {addr}, supervising {', '.join(names) or 'nothing'}"),
                Send(peer, wire.Welcome(beat=self.agent_beat))]
        if self.status == FINISHED:
            out.append(Send(peer, wire.Finished()))
        elif self.status == FAILED:
            out.append(Send(peer, wire.Stop(reason=self.failure)))
        else:
            for seq, r in enumerate(self.roster.replacements(), 1):
                if r["by"] == host and not set(r["node_ids"]) <= set(names):
                    out.append(Send(peer, wire.TakeOver(r["host"], tuple(r["node_ids"]), seq)))
            out += self._check_lost(now)
        return out

    def message(self, peer: int, msg: Mapping[str, Any], now: float) -> list[Action]:
        """Any later message of an identified peer.

        From an agent: `exited` (a child's death or clean end), `gave_up` (the job fails); `heartbeat` vouches for the
        members it names running (`liveness.vouch`); anything else is logged. From a worker, only the rank's current
        connection counts (a replaced or finished one is ignored), and any message refreshes `last_seen`: `heartbeat`
        records the step; `commit` raises the rank's committed step, never lowers it (`commits_dirty`); `recovered`
        is logged; `done` retires the member without a new generation and may finish the job; an unknown op is
        logged and ignored. Messages of a peer that never said hello are ignored; a malformed one (messages.decode)
        is ignored, and logged when a worker sent it."""
        who = self.roster.peers.get(peer)
        op = msg["op"]
        if who is None or who.role == PeerRole.FINISHED:
            return []
        try:
            typed: wire.Message | protocol.ProtocolError = wire.decode(msg)
        except protocol.ProtocolError as e:
            if who.role == PeerRole.AGENT:
                return []  # an exited that names no process: nothing to act on
            typed = e
        if who.role == PeerRole.AGENT:
            if who.host is not None:
                self.roster.heard(who.host, peer, now)
            if isinstance(typed, wire.Exited):
                return self._exited(who, typed, now)
            if isinstance(typed, wire.GaveUp):
                return self._fail(gave_up_reason(who, typed), EXIT_FAILED)
            if isinstance(typed, wire.Heartbeat):
                vouch(self.roster, who.host, typed.running, now)
                return []
            return [Log(WARNING, f"agent of {who.host} sent unknown op {op[:40]!r} (ignored)")]
        member = self.roster.members.get(who.rank) if who.rank is not None else None
        if member is None or member.peer != peer:
            return []
        member.last_seen, member.busy_said = now, False
        if isinstance(typed, protocol.ProtocolError):
            return [Log(WARNING, f"{member.node_id} sent a malformed {op[:40]!r} ({typed}; ignored)")]
        if isinstance(typed, wire.Heartbeat):
            return heartbeat(self, member, typed, now)
        if isinstance(typed, wire.Commit):
            step = typed.step
            if step is not None and step > self.roster.commits.get(member.rank, -1):
                self.roster.commits[member.rank] = step
                self.roster.unsaved.add((Fact.COMMIT, member.rank))
                self.commits_dirty = True
            return []
        if isinstance(typed, wire.Recovered):
            return recovered(member, typed)
        if isinstance(typed, wire.Corruption):
            return corrupted(self, member, typed, now)
        if isinstance(typed, wire.Done):
            self.watchdog.forget(member.rank)  # a finished rank is not stuck
            self.roster.peers[peer] = Peer(PeerRole.FINISHED, rank=member.rank, addr=who.addr)
            out: list[Action] = [Log(INFO, f"{member.node_id} finished (pid {member.pid} on {member.host})")]
            self.dirty |= self.roster.remove(member)  # it leaves without a generation change
            return out + self._mark_done(member.rank)
        return [Log(WARNING, f"{member.node_id} sent unknown op {op[:40]!r} (ignored)")]

    def lost(self, peer: int, reason: str, now: float) -> list[Action]:
        """A connection ended. For a worker that had not said `done` this is its death: the kernel closes the socket
        of a process that exits, so this is as immediate as its agent's `exited` report.

        Only the rank's current connection counts (one its own reconnect replaced does not). Its process is not
        killed now: if its agent has not reported its exit within node_timeout, `tick` has it killed (fencing comes
        after the process's own cause). An agent's connection ending only forgets the agent: its workers are judged
        by their own connections and heartbeats. A finished worker's EOF means nothing."""
        who = self.roster.peers.pop(peer, None)
        if who is None:
            return []
        if who.role == PeerRole.WORKER and who.rank is not None:
            member = self.roster.members.get(who.rank)
            if member is not None and member.peer == peer:
                if self.status == RUNNING:
                    self.unreported[member.node_id] = (member.pid, now + self.node_timeout)
                return self._death(member, reason, kill=False, now=now)
        elif who.role == PeerRole.AGENT and who.host is not None and self.roster.disconnect_agent(who.host, peer, now):
            return [Log(INFO, f"agent of {who.host} disconnected ({reason})"),
                    Note(NoteKind.AGENT_LOST, {"host": who.host, "reason": reason})]
        return []

    def tick(self, now: float) -> list[Action]:
        """The passing of time: heartbeats that stopped, a formation that took too long.

        Does nothing once the job has ended. A member silent for node_timeout (no message, or a restored member that
        did not reconnect) is declared dead, its agent told to kill it (`_death`), unless its agent vouched for it
        within node_timeout (`liveness.alive_though_silent`). A member whose connection closed and whose exit its
        agent has not reported within node_timeout is killed (`liveness.kill_unreported`). A gathering generation
        past topo_timeout fails the job (`_formation_timeout`), unless its workers were found to be unmanaged
        scripts."""
        out: list[Action] = []
        if self.status != RUNNING:
            return out
        if now >= self.hb_check_at:
            # Heartbeats and vouches only move expiries later, so the earliest expiry found here is a safe bound for
            # the next scan: with hundreds of members, most calls skip the scan.
            for member in list(self.roster.members.values()):
                silent = now - member.last_seen
                if silent < self.node_timeout or alive_though_silent(member, silent, now, self.node_timeout,
                                                                     self.topo_timeout, out):
                    continue
                what = "did not reconnect" if member.peer is None else "sent no heartbeat"
                timeout = f"{envvars.MS_NODE_TIMEOUT}={self.node_timeout:g}"
                out += self._death(member, f"{what} for {silent:.1f} s ({timeout})", kill=True, now=now,
                                   cause=CAUSE_NOT_BACK if member.peer is None else CAUSE_SILENCE, silent_for=silent)
            self.hb_check_at = min((expiry(m, self.node_timeout, self.topo_timeout)
                                    for m in self.roster.members.values()), default=math.inf)
        out += kill_unreported(self.roster, self.unreported, now, self.node_timeout)
        if self.formed and now >= self.watchdog.due():
            for stuck in self.watchdog.check(now, lambda rank, since: vouched(self.roster.members.get(rank), now,
                                                                             self.node_timeout, since)):
                member = self.roster.members.get(stuck.rank)
                if member is not None and member.node_id == stuck.node_id:
                    out += self._death(member, stuck.reason(), kill=True, now=now, cause=CAUSE_STUCK,
                                       silent_for=stuck.stalled)  # it failed when the job's steps stopped
        out += self._check_lost(now)
        if (self.status == RUNNING and self.gather_since is not None and not self.unmanaged
                and now >= self.gather_since + self.topo_timeout):
            out += self._formation_timeout()
        return out

    def replace(self, peer: int, msg: Mapping[str, Any], now: float) -> list[Action]:
        """The operator's `replace {host, spare}` (fleet replace, on its own authenticated connection `peer`): the
        spare (`spare`, or the first free one) takes `host`'s ranks now, whether `host` is alive or not, exactly as
        for a lost host (`_take_over`). Answered on `peer`, which is then closed: `welcome {host, spare, node_ids}`,
        or `reject {reason}` naming what to do when the job has ended or some rank finished, `host` runs no worker,
        runs the scheduler or was replaced already, or the spare is unknown, not connected, in use, or there is
        none."""
        try:
            request = wire.Replace.from_msg(msg)
        except protocol.ProtocolError as e:
            request, malformed = wire.Replace(str(msg.get("host"))[:256]), str(e)
        else:
            malformed = ""
        host, spare = request.host, request.spare
        hosts = self.roster.worker_hosts()
        reason = ""
        if self.status != RUNNING:
            reason = f"job {self.job} has {self.status}: nothing to replace"
        elif self.roster.done:
            reason = f"some ranks of job {self.job} have finished: a replacement could not rejoin them"
        elif not isinstance(host, str) or host not in hosts or self.roster.replaced_by(host) is not None:
            by = self.roster.replaced_by(host)
            what = f"was already replaced by {by}" if by is not None else "runs no worker of the job"
            reason = f"host {str(host)[:256]} {what}; the hosts with workers: {', '.join(sorted(hosts))}"
        elif self.roster.hosts[host].runs_scheduler:
            reason = f"host {host} runs the scheduler: it cannot be replaced while the job runs"
        reason = reason or malformed
        chosen = choose_spare(self.roster, spare, str(host)) if not reason else Refusal(reason)
        if isinstance(chosen, Refusal):
            return [Log(WARNING, f"refused to replace {str(host)[:256]}: {chosen.reason}"),
                    Send(peer, wire.Reject(reason=chosen.reason, retry=False), close=True)]
        node_ids = hosts[str(host)]
        return ([Send(peer, wire.Welcome(host=host, spare=chosen, node_ids=tuple(node_ids)), close=True)]
                + self._take_over(host, chosen, "replaced by the operator (fleet replace)", now))

    # -- decisions

    def _check_lost(self, now: float) -> list[Action]:
        """Hand each lost host's ranks to a free spare, while the job has formed and runs with no rank finished and
        automatic replacement is on (host_timeout > 0); which hosts are lost and which spare is free is decided in
        sparehosts.py. Without a free spare the host waits (said once), as it would without spares: the job goes on if
        its agent comes back.

        The scan of every host runs only when the roster changed since the last one (a member left, an agent came or
        went, a spare was taken) or when the earliest host found unheard then may have become lost: heartbeats only
        move that later, so at a thousand ranks most passes cost nothing here."""
        if self.host_timeout <= 0 or self.status != RUNNING or not self.ever_formed or self.roster.done:
            self.lost_check.idle(self.roster)
            return []
        if not self.lost_check.due(self.roster, now):
            return []
        changes = self.roster.changes  # what the scan's own takeovers change is looked at again next pass
        out: list[Action] = []
        for lost in find_lost(self.roster, now, self.host_timeout):
            host, since = lost.host, lost.since
            spare = choose_spare(self.roster, None, host)
            if isinstance(spare, Refusal):
                out += shrink_or_wait(self, lost, now)
                continue
            out += self._take_over(host, spare, f"its agent unheard for {now - since:.1f} s and its workers dead "
                                                  f"(TOOLKIT_HOST_TIMEOUT={self.host_timeout:g})", now)
        self.lost_check.scanned(self.roster, changes, now, self.host_timeout)
        return out

    def _take_over(self, host: str, spare: str, reason: str, now: float) -> list[Action]:
        """`spare` takes `host`'s node ids and ranks: the replacement is recorded (`dirty`: persisted before the
        takeover is sent), `host` is fenced for good (its agent, if connected, told to stop and dropped; its live
        members declared dead, which moves a formed job to a new generation), its node ids are placed on `spare`,
        and `spare`'s agent is sent `takeover {host, node_ids, seq}` (seq: the replacement's number, 1 up, which
        orders replacements for `fleet status`). The spare's workers then register for the ranks like any
        replacement and recover as the job's mode allows (in place from a peer, or a restart from checkpoints)."""
        node_ids, agent = list(self.roster.hosts[host].node_ids), self.roster.hosts[host].agent
        self.corrupt.forget(host)  # a spare takes a host benched for corruption: replaced for good
        self.dirty = True
        out: list[Action] = [
            Log(WARNING, f"host {host} replaced by spare {spare}: {reason}; {spare} takes {', '.join(node_ids)}; "
                         f"{host} is fenced: its agent and workers are refused from now on"),
            Note(NoteKind.REPLACED, {"host": host, "by": spare, "node_ids": node_ids, "reason": reason})]
        if agent is not None:
            self.roster.peers.pop(agent, None)
            out.append(Send(agent, wire.Stop(f"host {host} was replaced by {spare} ({reason}): it is fenced from the "
                                             "job"), close=True))
        for node_id in node_ids:
            member = self.roster.members.get(rank_of(node_id) or 0)
            if member is not None and member.node_id == node_id:
                out += self._death(member, f"its host {host} was replaced by {spare}", kill=False, now=now,
                                   cause=CAUSE_REPLACED)
        self.roster.replace(host, spare, reason)  # after the deaths, which name the host their ranks ran on
        out.append(Send(self.roster.agents[spare],
                        wire.TakeOver(host, tuple(node_ids), self.roster.hosts[host].replaced_seq)))
        return out

    def _maybe_form(self, now: float) -> list[Action]:
        """Form the current generation once world_size members are connected, none of them `leaving` (a restart
        recovery member about to exit for its relaunch: counted, the generation formed with it and its exit began
        another, a phantom incident): tell each `formed` with the
        generation's store prefix, stop the formation clock, mark the state `dirty`, and drop the store keys of
        every earlier generation of this scheduler start (DropKeys). Nothing once formed or once the job has ended.
        (A death after a rank is done never gets here: `death_after_done`.)"""
        if self.formed or self.status != RUNNING:
            return []
        leaving = sum(1 for m in self.roster.members.values() if m.peer is not None and m.incarnation in self.leaving) \
            if self.leaving else 0
        slots = elastic.active(self.world_size, self.benched)
        if self.roster.connected_members - leaving < len(slots):
            return []
        self.world = elastic.plan_world(slots, self.logical_world,
                                        elastic.previous(self.assignment, self.world_size, self.logical_world))
        self.assignment = elastic.assignment_doc(self.world)
        self.formed = self.ever_formed = True
        self.dirty = True
        self.watchdog.formed()
        since = self.gather_since if self.gather_since is not None else now
        self.gather_since = None
        prefix = protocol.store_prefix(self.job, self.boot, self.generation)
        serving = f", serving {self.logical_world} logical ranks" if self.logical_world != len(slots) else ""
        out: list[Action] = [Log(INFO, f"generation {self.generation} formed: {len(slots)} workers{serving} in "
                                       f"{now - since:.3f} s; store prefix {prefix}"),
                             Note(NoteKind.FORMED, {"generation": self.generation, "seconds": now - since,
                                             "recovery": sorted({m.recovery for m in self.roster.members.values()}),
                                             "workers": len(slots), "logical_world": self.logical_world,
                                             # which process serves which logical ranks, when not the plain way
                                             **({"logical": {protocol.worker_node_id(s): list(p) for s, p in
                                                             self.world.by_slot().items()}}
                                                if self.assignment is not None else {})})]
        out += [Send(m.peer, formed(self, m.rank))
                for m in self.roster.members.values() if m.peer is not None]
        if self.generation > 0:  # the generations before are over: their store keys can go
            out += [DropKeys(protocol.store_prefix(self.job, self.boot, g)) for g in range(self.generation)]
        return out

    def _death(self, member: Member, reason: str, kill: bool, now: float, cause: str = CAUSE_CLOSED,
               silent_for: float = 0.0) -> list[Action]:
        """Declare `member` dead: fence its incarnation, have its agent kill it if it may still exist, and, if the
        job was formed, move everyone to a new generation.

        Nothing unless `member` still holds its rank (one death per incarnation). The member leaves and its
        incarnation is fenced for good (`dirty`); its connection, if any, gets `fenced` and is closed; with `kill`
        (not when its agent reported the exit) its host's agent, if connected, is told to SIGKILL the pid. While the
        job runs: formed, it moves to generation+1, announced by `generation` to every connected member, and gathers
        again from `now`; still gathering, the member is only removed (one generation per fault). The left
        generation's store keys go when the next one forms."""
        if not self.roster.remove(member):
            return []
        self.watchdog.forget(member.rank)
        relaunched = member.incarnation in self.leaving
        self.leaving.discard(member.incarnation)
        self.roster.fenced.add(member.incarnation)
        self.roster.unsaved.add((Fact.FENCED, member.incarnation))
        self.dirty = True
        out: list[Action] = [Note(NoteKind.DEATH, {
            "node_id": member.node_id, "rank": member.rank, "host": host_of(self.roster, member), "pid": member.pid,
            "cause": cause, "reason": reason, "silent_for": silent_for, "step": member.step,
            "recovery": member.recovery, "relaunched": relaunched,
            "begins": self.formed and self.status == RUNNING and not self.roster.done and not relaunched,
            "generation": self.generation + 1 if self.formed and self.status == RUNNING and not self.roster.done
            else self.generation})]
        agent = self.roster.agent_at(member.node_id)
        if member.peer is not None:
            self.roster.peers.pop(member.peer, None)
            # a stuck rank is told nothing: the word would end it before its agent has its stacks written (its
            # connection closes when the agent kills it, and is ignored meanwhile)
            if not (cause == CAUSE_STUCK and kill and agent is not None):
                out.append(Send(member.peer, wire.Fenced(reason=f"declared dead: {reason}"), close=True))
        if kill and agent is not None:
            out.append(Send(agent, wire.Kill(member.node_id, member.pid, cause, dump=cause == CAUSE_STUCK)))
        if self.status != RUNNING:
            return out
        if self.roster.done:
            return out + death_after_done(self, member, reason)
        if self.formed:
            out.append(Log(WARNING, f"{member.node_id} (pid {member.pid} on {member.host}) is dead: {reason}; "
                                    f"generation {self.generation + 1} begins, waiting for its replacement"))
            out += self._begin_generation(now)
        else:
            out.append(Log(WARNING, f"{member.node_id} (pid {member.pid} on {member.host}) is dead: {reason}; "
                                    f"generation {self.generation} still gathering"))
        return out

    def _begin_generation(self, now: float) -> list[Action]:
        """Leave the formed generation for the next (gathering from `now`), announced by `generation` to every
        connected member: a death's, or a grow's at the members' next step boundary."""
        self.generation += 1
        self.formed = False
        self.gather_since = now
        self.dirty = True
        # the connected ones: told of the generation below, they exit (a restored member that has not
        # reconnected after a restart of the job is no process that leaves: its absence is judged as such)
        self.leaving |= {m.incarnation for m in self.roster.members.values()
                         if m.recovery == protocol.RECOVERY_RESTART and m.peer is not None}
        return [Send(m.peer, wire.Generation(generation=self.generation))
                for m in self.roster.members.values() if m.peer is not None]

    def _mark_done(self, rank: int) -> list[Action]:
        """Record `rank` as done (`dirty`). Once every rank is, the job has finished (once): its agents are told
        `finished` and the scheduler exits EXIT_OK."""
        if rank not in self.roster.done:
            self.roster.done.add(rank)
            self.roster.unsaved.add((Fact.DONE, rank))
            self.dirty = True
        slots = elastic.active(self.world_size, self.benched)
        if not set(slots) <= self.roster.done or self.status != RUNNING:
            return []
        self.status = FINISHED
        return ([Log(INFO, f"all {len(slots)} workers finished: job {self.job} done"), Note(NoteKind.FINISHED)]
                + [Send(agent, wire.Finished()) for agent in self.roster.agents.values()] + [Exit(EXIT_OK)])

    def _fail(self, reason: str, code: int) -> list[Action]:
        """Fail the job, once (later calls do nothing): keep `reason` (persisted, and sent to agents that connect
        later), send `stop` to every agent and connected member, and exit with `code`."""
        if self.status != RUNNING:
            return []
        self.status = FAILED
        self.failure = reason
        self.dirty = True
        return ([Log(ERROR, f"job {self.job} failed: {reason}"), Note(NoteKind.FAILED, {"reason": reason})]
                + [Send(agent, wire.Stop(reason=reason)) for agent in self.roster.agents.values()]
                + [Send(m.peer, wire.Stop(reason=reason))
                   for m in self.roster.members.values() if m.peer is not None]
                + [Exit(code)])

    def _exited(self, agent: Peer, msg: wire.Exited, now: float) -> list[Action]:
        """An agent's report that a child exited (`exited {node_id, pid, code, signal}`).

        Not a worker of this job (the scheduler, a rank out of range): logged only. Exit 0 without a signal is a
        clean end: the rank is done (its member retired if the pid is the current one). Any other end of the
        current member's pid is its death, at once instead of after node_timeout, with no kill (the process is
        gone). Another pid (an incarnation already replaced, or never registered) is logged only. Its cause is the
        agent's `cause` (the first cause: the script's error, or the fencing that killed it) if given, else the code
        or signal; a kill waiting for this report is dropped."""
        node_id, pid, code, sig = msg.node_id, msg.pid, msg.code, msg.signal
        said = msg.cause or how(code, sig)
        if self.unreported.get(node_id, (None,))[0] == pid:
            del self.unreported[node_id]
        rank = rank_of(node_id)
        if rank is None or rank >= self.world_size:
            return [Log(INFO, f"agent of {agent.host}: {node_id} (pid {pid}) exited: {said}")]
        member = self.roster.members.get(rank)
        if code == 0 and sig is None:
            out: list[Action] = [Log(INFO, f"{node_id} (pid {pid} on {agent.host}) exited 0")]
            if member is not None and member.pid == pid and self.roster.remove(member):
                self.dirty = True  # it ended cleanly: it leaves without a generation change
            return out + self._mark_done(rank)
        note = Note(NoteKind.EXITED, {"node_id": node_id, "rank": rank, "host": agent.host, "pid": pid, "code": code,
                               "signal": sig, "cause": said})
        if member is not None and member.pid == pid:
            return [note] + self._death(member, f"its agent on {agent.host} saw it end: {said}",
                                        kill=False, now=now, cause=said)
        return [note, Log(INFO, f"{node_id} (pid {pid} on {agent.host}) exited: {said}")]

    def _formation_timeout(self) -> list[Action]:
        """The formation deadline passed with ranks missing (neither done nor connected).

        If no worker ever registered and every missing one's host has a connected agent, they are taken to be
        scripts that never ask for a process group: the formation clock stops (`unmanaged`: no heartbeats or
        generations) and their agents' exit reports end the job. Otherwise the job fails with EXIT_FORMATION,
        naming each missing worker, the host it was expected on and the address it should reach."""
        members = self.roster.members
        missing = [r for r in elastic.active(self.world_size, self.benched)
                   if r not in self.roster.done and (r not in members or members[r].peer is None)]
        attested = [r for r in missing if self.roster.agent_at(protocol.worker_node_id(r)) is not None]
        if not self.ever_registered and missing and len(attested) == len(missing):
            self.unmanaged = True
            self.gather_since = None
            return [Log(WARNING, f"no worker registered within {envvars.MS_TOPO_TIMEOUT}={self.topo_timeout:g} s, "
                                 "but every one runs under its agent: treating them as scripts that never form a "
                                 "process group (no heartbeats or generations; their agents' exit reports end the "
                                 "job)")]
        names = []
        for r in missing:
            node_id = protocol.worker_node_id(r)
            host = self.roster.host_of(node_id)
            names.append(f"{node_id} (expected on {host})" if host else node_id)
        what = f"re-forming generation {self.generation}" if self.ever_formed else "cluster formation"
        reason = (f"{what} timed out after {self.topo_timeout:g} s ({envvars.MS_TOPO_TIMEOUT}): {len(missing)} of "
                  f"{self.world_size} workers never registered: {', '.join(names)}; check their logs "
                  f"(logs/worker_<rank>.log) and that they reach {self.address}")
        return self._fail(reason, EXIT_FORMATION)


def death_after_done(m: Membership, member: Member, reason: str) -> list[Action]:
    """A member died after other ranks finished: no new generation can form, the finished ranks are gone.
    A rank says `done` only after the final barrier, which every rank passes with its final checkpoint
    durable; so an in-place (toolkit.train) member that dies now has finished its training and counts as
    done. Any other member's state is unknown: the job fails at once, saying why, rather than waiting out
    the formation timeout."""
    finished = ", ".join(protocol.worker_node_id(r) for r in sorted(m.roster.done))
    who = f"{member.node_id} (pid {member.pid} on {member.host})"
    if member.recovery == protocol.RECOVERY_IN_PLACE:
        return [Log(WARNING, f"{who} is dead: {reason}, after {finished} finished: every rank had passed the "
                             "final barrier with its final checkpoint durable, so it counts as finished")
                ] + m._mark_done(member.rank)
    return m._fail(f"{who} is dead: {reason}, after {finished} finished; the finished ranks cannot form a "
                      "new generation with its replacement: start the job again (train --again)", EXIT_FAILED)


def formed(m: Membership, slot: int) -> wire.Formed:
    """The `formed` message for the worker in `slot`: the generation, its store prefix, and (elastic.World) the
    slot's rank in it, its world size, L and the assignment of logical ranks (the server adds the ledger's
    figures)."""
    world = m.world or elastic.plan_world(elastic.active(m.world_size, m.benched), m.logical_world, None)
    return wire.Formed(m.generation, protocol.store_prefix(m.job, m.boot, m.generation), **world.formed_fields(slot))


def shrink_or_wait(m: Membership, lost: Lost, now: float) -> list[Action]:
    """Host `lost.host` is lost and no spare is free: if the survivors may go on without it
    (elastic.shrink_refusal), its ranks are benched and the generation gathering since their deaths forms without
    them; otherwise the job waits for it (or a spare), said once with the reason. Nothing for a host whose ranks are
    benched already."""
    host, since = lost.host, lost.since
    slots = [r for r in (rank_of(n) for n in lost.node_ids) if r is not None]
    if set(slots) <= set(m.benched):
        return []
    survivors = [s for s in elastic.active(m.world_size, m.benched) if s not in slots]
    why = elastic.shrink_refusal(survivors, m.world_size, m.min_workers, m.logical_world, m.capacity)
    unheard = f"its agent unheard for {now - since:.1f} s, {', '.join(lost.node_ids)} dead"
    if why is not None:
        if not m.roster.wait_for_spare(host):
            return []
        return [Log(WARNING, f"host {host} is lost ({unheard}) and no spare is free: waiting for it to come back "
                             "('fleet restart --host' starts its agent) or for a spare"
                             + (f"; not shrinking: {why}" if m.min_workers < m.world_size else ""))]
    m.benched = sorted(set(m.benched) | set(slots))
    m.dirty = True
    out: list[Action] = [
        Log(WARNING, f"host {host} is lost ({unheard}) and no spare is free: shrinking to {len(survivors)} of "
                     f"{m.world_size} workers, serving {m.logical_world} logical ranks; it rejoins when its agent "
                     "is back ('fleet restart --host')"),
        Note(NoteKind.SHRINK, {"host": host, "slots": slots, "workers": len(survivors), "world_size": m.world_size,
                               "generation": m.generation})]
    return out + m._maybe_form(now)


def grow(m: Membership, slot: int, host: str, now: float) -> list[Action]:
    """A worker registers for benched `slot` (its host is back, or a spare took it): that slot and the other benched
    slots placed on the same host (its agent starts them together) are in the next generation's world, which begins
    now if the job is formed: the others re-form at their next step boundary and the newcomers take the state from
    a peer. One that never comes fails the formation as any missing worker does (MS_TOPO_TIMEOUT)."""
    where = m.roster.host_of(protocol.worker_node_id(slot)) or host
    back = sorted(s for s in m.benched if s == slot or m.roster.host_of(protocol.worker_node_id(s)) == where)
    m.benched = [s for s in m.benched if s not in back]
    m.dirty = True
    n, generation = m.world_size - len(m.benched), m.generation + (1 if m.formed else 0)
    out: list[Action] = [
        Log(INFO, f"{', '.join(protocol.worker_node_id(s) for s in back)} back on {where}: generation {generation} "
                  f"grows to {n} of {m.world_size} workers"),
        Note(NoteKind.GROW, {"host": where, "slots": back, "workers": n, "world_size": m.world_size,
                             "generation": generation})]
    return out + (m._begin_generation(now) if m.formed else [])
