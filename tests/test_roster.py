"""The scheduler's record of each host (toolkit.scheduler.roster), on a fake clock: when a host counts as unheard,
where its node ids are, which spare is free, what a replacement leaves behind, and that any sequence of events
keeps the roster's invariants, and that any sequence of the membership's events keeps them too and never leaves
work for `tick` before `next_deadline()` (hypothesis state machines). The decisions built on it are in
tests/test_membership.py and tests/test_membership_trace.py."""

from __future__ import annotations

import copy

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from toolkit.contracts import protocol as P
from toolkit.scheduler.membership import RUNNING, Membership
from toolkit.scheduler.roster import Member, PeerRole, Roster, problems


def fenced_hosts(roster: Roster) -> dict[str, str]:
    """Every replaced host -> the spare that took its ranks, in the order they were replaced."""
    return {r["host"]: str(r["by"]) for r in roster.replacements()}

PLAN = {"sched": "hostA", "worker_0": "hostA", "worker_1": "hostA", "worker_2": "hostB", "worker_3": "hostB"}


def test_a_host_is_unheard_since_its_agents_last_word_or_its_disconnection() -> None:
    r = Roster(PLAN)
    assert r.unheard_for(1e9, 0.0) == []  # nobody is watched before peers can connect
    r.start_clock("hostA", 1.0)
    r.start_clock("hostB", 1.0)
    assert r.connect_agent("hostA", 7, spare=False, now=2.0) is None
    assert r.hosts["hostA"].connected and r.hosts["hostA"].unheard_since == 2.0
    assert r.hosts["hostB"].unheard_since == 1.0  # never said hello: its clock runs from the start
    assert r.heard("hostA", 7, 5.0) and r.hosts["hostA"].unheard_since == 5.0
    assert not r.heard("hostA", 99, 6.0) and r.hosts["hostA"].unheard_since == 5.0  # not its connection
    assert not r.disconnect_agent("hostA", 99, 6.0) and r.hosts["hostA"].connected
    assert r.disconnect_agent("hostA", 7, 8.0)
    assert not r.hosts["hostA"].connected and r.hosts["hostA"].unheard_since == 8.0 and "hostA" not in r.agents
    r.start_clock("hostA", 9.0)  # a clock already running is not restarted
    assert r.hosts["hostA"].unheard_since == 8.0
    assert [rec.name for rec in r.unheard_for(11.0, 3.0)] == ["hostB", "hostA"]
    assert [rec.name for rec in r.unheard_for(10.9, 3.0)] == ["hostB"]  # the bound is >=
    assert problems(r) == []


def test_hosts_found_lost_together_go_disconnected_first_in_the_order_they_went_then_connected_by_hello() -> None:
    r = Roster()
    for peer, host in enumerate(("c", "b", "a", "d"), 1):
        r.connect_agent(host, peer, spare=False, now=0.0)
    r.disconnect_agent("a", 3, 1.0)
    r.disconnect_agent("c", 1, 1.0)
    r.connect_agent("c", 5, spare=False, now=0.0)  # back: ordered by its first hello again
    assert [rec.name for rec in r.unheard_for(100.0, 1.0)] == ["a", "c", "b", "d"]


def test_placement_moves_node_ids_and_keeps_each_hosts_in_rank_order() -> None:
    r = Roster({"worker_10": "h2", "worker_2": "h2", "worker_1": "h1", "sched": "h1"})
    assert r.worker_hosts() == {"h1": ["worker_1"], "h2": ["worker_2", "worker_10"]}
    r.place("worker_1", "h2")  # an agent's hello says where it runs
    r.place("worker_2", "h9", keep=True)  # a worker's own word yields to the placement known
    r.place("worker_3", "h9", keep=True)
    assert r.worker_hosts() == {"h2": ["worker_1", "worker_2", "worker_10"], "h9": ["worker_3"]}
    assert r.host_of("worker_1") == "h2" and r.host_of("sched") == "h1" and r.host_of("worker_7") is None
    r.connect_agent("h2", 4, spare=False, now=0.0)
    assert r.agent_at("worker_10") == 4 and r.agent_at("worker_3") is None and r.agent_at("nowhere") is None
    assert problems(r) == []


def test_a_replacement_fences_the_host_moves_its_ranks_and_uses_the_spare_up() -> None:
    r = Roster(PLAN, spares=("s1",))
    r.connect_agent("hostB", 2, spare=False, now=0.0)
    r.connect_agent("s1", 3, spare=True, now=0.0)
    r.connect_agent("s2", 4, spare=True, now=0.0)
    r.wait_for_spare("hostB")
    assert r.free_spares() == ["s1", "s2"]
    assert r.replace("hostB", "s1", "lost") == 2  # its agent, for the caller to stop
    rec = r.hosts["hostB"]
    assert rec.fenced and not rec.connected and rec.unheard_since is None and not rec.waiting_for_spare
    assert r.replaced_by("hostB") == "s1" and r.replaced_by("hostA") is None and r.replaced_by(None) is None
    assert r.worker_hosts() == {"hostA": ["worker_0", "worker_1"], "s1": ["worker_2", "worker_3"]}
    assert r.free_spares() == ["s2"]  # s1 holds ranks now
    r.start_clock("hostB", 5.0)  # a replaced host is never watched again
    assert rec.unheard_since is None
    assert r.replace("s1", "s2", "by hand") == 3
    assert r.replacements() == [
        {"host": "hostB", "by": "s1", "node_ids": ["worker_2", "worker_3"], "reason": "lost"},
        {"host": "s1", "by": "s2", "node_ids": ["worker_2", "worker_3"], "reason": "by hand"}]
    assert [r.hosts[h].replaced_seq for h in ("hostB", "s1")] == [1, 2]
    assert fenced_hosts(r) == {"hostB": "s1", "s1": "s2"} and r.free_spares() == []
    assert problems(r) == []


def test_a_free_spare_is_connected_said_so_holds_nothing_and_never_took_over() -> None:
    r = Roster({"worker_0": "s3"}, spares=("s2", "s1", "s3", "s4", "s5"))
    r.connect_agent("s1", 1, spare=True, now=0.0)
    r.connect_agent("s2", 2, spare=True, now=0.0)
    r.connect_agent("s3", 3, spare=True, now=0.0)  # holds a rank
    r.connect_agent("s4", 4, spare=False, now=0.0)  # its agent does not say it is a spare (no standby files)
    r.connect_agent("s6", 6, spare=True, now=0.0)  # not in the inventory: used after its spares
    assert r.free_spares() == ["s2", "s1", "s6"] and r.spare_order[-1] == "s6"
    r.disconnect_agent("s2", 2, 1.0)
    assert r.free_spares() == ["s1", "s6"]
    r.record("s1").took_over = True  # took a host's ranks that have moved on since: still used
    assert r.free_spares() == ["s6"]


def test_waiting_for_a_spare_is_said_once_until_the_host_is_heard_again() -> None:
    r = Roster(PLAN)
    r.start_clock("hostB", 0.0)
    assert r.wait_for_spare("hostB") and not r.wait_for_spare("hostB")
    r.connect_agent("hostB", 2, spare=False, now=1.0)
    assert not r.hosts["hostB"].waiting_for_spare and r.wait_for_spare("hostB")
    r.heard("hostB", 2, 2.0)
    assert not r.hosts["hostB"].waiting_for_spare


def test_one_host_runs_the_scheduler_the_last_to_say_so() -> None:
    r = Roster()
    r.connect_agent("a", 1, spare=False, now=0.0, scheduler=True)
    r.connect_agent("b", 2, spare=False, now=0.0, scheduler=True)
    r.connect_agent("a", 3, spare=False, now=1.0)  # a hello that names no scheduler changes nothing
    assert [h for h, rec in r.hosts.items() if rec.runs_scheduler] == ["b"] and problems(r) == []


def test_the_connected_members_are_counted_as_they_come_go_and_reconnect() -> None:
    r = Roster()
    restored = Member(0, "worker_0", "inc0", 10, "hostA", "a:1", 0.0)  # restored: no connection yet
    fresh = Member(1, "worker_1", "inc1", 11, "hostA", "a:2", 0.0, peer=5)
    r.admit(restored)
    r.admit(fresh)
    assert r.connected_members == 1
    assert r.reconnect(restored, 6, "a:3", 1.0) is None and r.connected_members == 2
    assert r.reconnect(restored, 7, "a:4", 2.0) == 6 and r.connected_members == 2
    assert (restored.peer, restored.addr, restored.last_seen) == (7, "a:4", 2.0)
    assert r.remove(fresh) and not r.remove(fresh) and r.connected_members == 1  # one removal per member
    r.admit(Member(1, "worker_1", "inc2", 12, "hostA", "a:5", 3.0))
    assert not r.remove(fresh) and r.connected_members == 1 and r.members[1].incarnation == "inc2"
    assert problems(r) == []


HOSTS = st.sampled_from(["hostA", "hostB", "s1", "s2"])
NODES = st.sampled_from(["sched", "worker_0", "worker_1", "worker_2", "worker_10"])


class RosterMachine(RuleBasedStateMachine):
    """Any sequence of the membership's calls keeps the roster sound; a replaced host stays fenced."""

    def __init__(self) -> None:
        super().__init__()
        self.r = Roster({"worker_0": "hostA", "worker_2": "hostB"}, spares=("s1",))
        self.now = 0.0
        self.peers = 0
        self.fenced: set[str] = set()

    @rule(host=HOSTS, spare=st.booleans())
    def hello(self, host: str, spare: bool) -> None:
        if host in self.fenced:  # the membership refuses a replaced host's agent before it gets here
            return
        self.peers += 1
        self.r.connect_agent(host, self.peers, spare, self.now)

    @rule(host=HOSTS, dt=st.floats(0, 20), gone=st.booleans(), stale=st.booleans())
    def heard_or_gone(self, host: str, dt: float, gone: bool, stale: bool) -> None:
        """The host's agent speaks or its connection ends, on its current connection or (`stale`) an old one."""
        self.now += dt
        rec = self.r.hosts.get(host)
        peer = -1 if stale or rec is None or rec.agent is None else rec.agent
        changed = self.r.disconnect_agent(host, peer, self.now) if gone else self.r.heard(host, peer, self.now)
        assert changed == (peer != -1)
        if changed:
            assert rec is not None and rec.unheard_since == self.now and rec.connected != gone

    @rule(node=NODES, host=HOSTS)
    def place(self, node: str, host: str) -> None:
        if host not in self.fenced:
            self.r.place(node, host)

    @rule(host=HOSTS)
    def start_or_wait(self, host: str) -> None:
        self.r.start_clock(host, self.now)
        if self.r.hosts[host].unheard_since is not None:
            self.r.wait_for_spare(host)

    @rule(host=HOSTS, spare=HOSTS)
    def replace(self, host: str, spare: str) -> None:
        if host == spare or host in self.fenced or spare in self.fenced:
            return
        self.r.replace(host, spare, "test")
        self.fenced.add(host)

    @invariant()
    def sound(self) -> None:
        assert problems(self.r) == []
        assert set(fenced_hosts(self.r)) == self.fenced
        for host in self.fenced:
            assert host not in self.r.worker_hosts() and host not in self.r.free_spares()
            assert host not in [rec.name for rec in self.r.unheard_for(self.now, 0.0)]


TestRosterMachine = RosterMachine.TestCase
TestRosterMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class MembershipMachine(RuleBasedStateMachine):
    """The membership's events in any order, with random peers and times (4 ranks on hostA and hostB, spare s1,
    host_timeout on): the roster stays sound, each worker connection and its member agree, and `tick` never acts
    before `next_deadline()` (the server sleeps until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.m = Membership("job", 4, 3.0, 60.0, "boot", "a:1", {f"worker_{r}": "hostA" if r < 2 else "hostB"
                                                               for r in range(4)}, 0.0, host_timeout=10.0)
        self.m.started(0.0)
        self.now = 0.0
        self.next_peer = 100

    def _peer(self) -> int:
        self.next_peer += 1
        return self.next_peer

    @rule(rank=st.integers(0, 3), again=st.booleans(), host=st.sampled_from(["hostA", "hostB", "s1"]))
    def register(self, rank: int, again: bool, host: str) -> None:
        held = self.m.roster.members.get(rank)
        inc = held.incarnation if again and held is not None else f"inc{self.next_peer}"
        self.m.register(self._peer(), "a:2", {"op": P.REGISTER, "node_id": f"worker_{rank}", "rank": rank,
                                               "world_size": 4, "incarnation": inc, "pid": self.next_peer,
                                               "host": host, "recovery": P.RECOVERY_IN_PLACE}, self.now)

    @rule(host=st.sampled_from(["hostA", "hostB", "s1"]), sched=st.booleans())
    def agent_hello(self, host: str, sched: bool) -> None:
        names = {"hostA": ["worker_0", "worker_1"], "hostB": ["worker_2", "worker_3"], "s1": []}[host]
        self.m.agent_hello(self._peer(), "a:3", {"op": P.AGENT_HELLO, "host": host, "spare": host == "s1",
                                                 "node_ids": names + (["sched"] if sched else [])}, self.now)

    @rule(pick=st.integers(0, 50), op=st.sampled_from([P.HEARTBEAT, P.COMMIT, P.DONE, P.EXITED, "lost"]),
          step=st.integers(0, 20))
    def message_or_lost(self, pick: int, op: str, step: int) -> None:
        peers = sorted(self.m.roster.peers)
        if not peers:
            return
        peer = peers[pick % len(peers)]
        if op == "lost":
            self.m.lost(peer, "connection closed", self.now)
            return
        who = self.m.roster.peers[peer]
        member = self.m.roster.members.get(rank) if (rank := who.rank if who.rank is not None else step % 4) \
            in self.m.roster.members else None
        fields = {"step": step, "node_id": f"worker_{step % 4}", "pid": member.pid if member else step,
                  "code": step % 2, "running": {f"worker_{step % 4}": member.pid if member else 0}}
        self.m.message(peer, {"op": op, **fields}, self.now)

    @rule(host=st.sampled_from(["hostA", "hostB", "s1"]))
    def replace(self, host: str) -> None:
        self.m.replace(self._peer(), {"op": P.REPLACE, "host": host}, self.now)

    @rule(dt=st.floats(0.0, 15.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.m.tick(self.now)

    @invariant()
    def sound(self) -> None:
        m = self.m
        assert problems(m.roster) == []
        for rank, member in m.roster.members.items():  # (a worker's connection may outlive its member: retired)
            who = m.roster.peers.get(member.peer) if member.peer is not None else None
            assert member.peer is None or (who is not None and who.role == PeerRole.WORKER and who.rank == rank)
        assert not m.formed or m.gather_since is None

    @invariant()
    def no_work_before_the_deadline(self) -> None:
        due = self.m.next_deadline()
        if self.m.status != RUNNING or due - 1e-3 < self.now:
            return
        ahead = copy.deepcopy(self.m)
        assert ahead.tick(min(due - 1e-3, self.now + 1e5)) == [], due


TestMembershipMachine = MembershipMachine.TestCase
TestMembershipMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
