"""Who may wait to authenticate: the scheduler's bound on connections that have not proved the job token yet, made
so that a flood of them cannot be turned against the job's own workers. Pure: ids, addresses and a clock in, the id
to close out; the server (toolkit.scheduler.server) owns the sockets.

A full table never refuses the newcomer (which may be a worker reconnecting after a fault, carrying the token): it
closes the oldest connection still waiting, from the newcomer's own address if that address holds its share, else
from anyone. A worker answers the challenge within milliseconds, so it is among the newest and is not the one
closed; an idle flood only ever evicts itself. One address holds at most half the table, so a flood from one host
leaves the rest to the others. The limits follow the job's size (`Limits.for_job`): every worker reconnects its
store after each formation, all at once."""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOTAL = 256  # connections waiting to authenticate, at the least
PER_WORKER = 2  # ... and per worker: its store connection and its control connection may both be reconnecting
RESERVE_FDS = 64  # descriptors the scheduler keeps for its files, listeners and log
MIN_FIT = 16  # the table never shrinks below this, however few descriptors there are


@dataclass(frozen=True)
class Limits:
    """How many connections may wait to authenticate: `total`, and `per_address` from any one address."""

    total: int
    per_address: int

    @classmethod
    def for_job(cls, world_size: int, hosts: int, nofile: int) -> Limits:
        """Room for every worker and agent to (re)connect at once, twice over (MIN_TOTAL at least), within what the
        descriptor limit `nofile` leaves once every member holds its connections (two per worker, one per agent)
        and RESERVE_FDS (never below MIN_FIT); half of it per address."""
        members = 2 * world_size + hosts
        total = max(MIN_TOTAL, PER_WORKER * members)
        total = max(MIN_FIT, min(total, nofile - members - RESERVE_FDS))
        return cls(total, max(1, total // 2))

    @staticmethod
    def fds_needed(world_size: int, hosts: int) -> int:
        """Descriptors a job of that size needs for its members' connections and the reserve, before any waiting
        connection: what the scheduler says when its limit is lower."""
        return 2 * world_size + hosts + RESERVE_FDS + MIN_FIT


class Admission:
    """The connections waiting to authenticate, oldest first, each with its address and deadline.

    `admit` records a newcomer and says which one to close to make room (if any); `done` forgets one that
    authenticated or closed; `expired` hands out those past their deadline. Every operation is O(1) per connection
    it touches (dicts keep the order of arrival), so a flood costs the loop no scans."""

    def __init__(self, limits: Limits, timeout: float) -> None:
        self.limits = limits
        self.timeout = timeout
        self.waiting: dict[int, tuple[str, float]] = {}  # id -> (address, deadline), in order of arrival
        self.by_address: dict[str, dict[int, None]] = {}  # address -> its waiting ids, in order of arrival

    def __len__(self) -> int:
        return len(self.waiting)

    def admit(self, conn: int, address: str, now: float) -> int | None:
        """Record `conn` (from `address`, deadline `timeout` from `now`) and return the id of the connection to close
        to make room for it: the oldest of its address if that address already holds `per_address`, else the oldest
        of all if `total` are waiting, else None. The one returned is already forgotten."""
        victim = None
        mine = self.by_address.get(address)
        if mine is not None and len(mine) >= self.limits.per_address:
            victim = next(iter(mine))
        elif len(self.waiting) >= self.limits.total:
            victim = next(iter(self.waiting))
        if victim is not None:
            self.done(victim)
        self.waiting[conn] = (address, now + self.timeout)
        self.by_address.setdefault(address, {})[conn] = None
        return victim

    def done(self, conn: int) -> None:
        """Forget `conn` (it authenticated, or it is closed); nothing if it is not waiting."""
        entry = self.waiting.pop(conn, None)
        if entry is None:
            return
        mine = self.by_address[entry[0]]
        del mine[conn]
        if not mine:
            del self.by_address[entry[0]]

    def expired(self, now: float) -> list[int]:
        """The connections whose deadline has passed, oldest first, forgotten (the caller closes them). Deadlines
        follow the order of arrival, so this stops at the first one still in time."""
        out = []
        for conn, (_, deadline) in self.waiting.items():
            if deadline > now:
                break
            out.append(conn)
        for conn in out:
            self.done(conn)
        return out

    def next_deadline(self) -> float | None:
        """The oldest waiting connection's deadline, or None."""
        return next((deadline for _, deadline in self.waiting.values()), None)
