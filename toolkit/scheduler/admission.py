"""Who may wait to authenticate: the scheduler's bound on connections that have not proved the job token yet, made
so that a flood of them cannot be turned against the job's own workers. Pure: ids, addresses and a clock in, the id
to close out; the server (toolkit.scheduler.server) owns the sockets.

Each source (an address; every loopback address is one source, this host) may open RATE new connections a second, in a
burst of BURST at most; a connection beyond that is *surplus*. A full table never refuses a newcomer within its rate.
When the newcomer's source holds its share (half the table), its own oldest surplus connection is closed, else its own
oldest. When the whole table is full, the oldest surplus connection of anyone is closed, else, for a newcomer within its
rate, its own source's oldest, or the oldest of all when its source has none waiting; a surplus newcomer finding no
surplus to close is closed itself (refused). A candidate whose whole hello is already waiting to be read (`ready`: the
loop was busy accepting) is passed over, so a worker that answered is read, not evicted. So a flood from other sources
only ever evicts itself: beyond its rate its surplus, within it its own oldest; another source's connection goes only to
make room for a source with nothing waiting (a flood from many addresses, one connection each).

What this does not give: a flood from the very source of a worker (another user on the worker's host, over loopback)
spends that source's rate, and the worker's connections are then surplus among the flood's, evicted as fast as the flood
opens new ones (as before this rate); the worker reconnects (toolkit.train.store, toolkit.train.channel) and gets in
when its hello is read before the flood evicts it. The limits follow the job's size (`Limits.for_job`): every worker
reconnects its store after each formation, all at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MIN_TOTAL = 256  # connections waiting to authenticate, at the least
PER_WORKER = 2  # ... and per worker: its store connection and its control connection may both be reconnecting
RESERVE_FDS = 64  # descriptors the scheduler keeps for its files, listeners and log
MIN_FIT = 16  # the table never shrinks below this, however few descriptors there are
RATE = 64.0  # new connections a second one source may open within its rate
BURST = 64  # ... at once, after a quiet time (a host of 8 workers reconnects 17 connections at once)
LOOK = 4  # candidates looked at for a whole hello waiting unread, at most, per eviction
LOOPBACK = "loopback"  # the source of every loopback address (127.0.0.0/8, ::1): this host


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


def source(ip: str) -> str:
    """The source a connection counts against: its address, but every loopback address is this one host (a local
    flood from random 127.x.y.z is one source)."""
    if ip.startswith("127.") or ip in ("::1", "0:0:0:0:0:0:0:1") or ip.startswith("::ffff:127."):
        return LOOPBACK
    return ip


@dataclass
class _Bucket:
    tokens: float
    at: float


class Admission:
    """The connections waiting to authenticate, oldest first, each with its source, deadline and whether it came
    within its source's rate.

    `admit` records a newcomer and says which one to close to make room (if any; the newcomer itself when it is
    refused); `done` forgets one that authenticated or closed; `expired` hands out those past their deadline. Every
    operation is O(1) per connection it touches (dicts keep the order of arrival), so a flood costs the loop no
    scans."""

    def __init__(self, limits: Limits, timeout: float, rate: float = RATE, burst: int = BURST) -> None:
        self.limits = limits
        self.timeout = timeout
        self.rate, self.burst = rate, burst
        self.waiting: dict[int, tuple[str, float]] = {}  # id -> (source, deadline), in order of arrival
        self.by_address: dict[str, dict[int, None]] = {}  # source -> its waiting ids, in order of arrival
        self.surplus: dict[int, None] = {}  # the waiting ids beyond their source's rate, in order of arrival
        self.surplus_by: dict[str, dict[int, None]] = {}  # source -> its surplus ids, in order of arrival
        self.buckets: dict[str, _Bucket] = {}  # source -> its rate's tokens (only sources seen lately)

    def __len__(self) -> int:
        return len(self.waiting)

    def admit(self, conn: int, address: str, now: float, ready: Callable[[int], bool] = lambda _c: False
              ) -> int | None:
        """Record `conn` (from `address`, deadline `timeout` from `now`) and return the id of the connection to close
        to make room for it (module docstring), None if there is room; `conn` itself when it is refused (then it is
        not recorded). `ready(id)`: whether that connection's whole hello waits unread (it is passed over). The one
        returned is already forgotten."""
        src = source(address)
        within = self._spend(src, now)
        mine = self.by_address.get(src)
        victim = None
        if mine is not None and len(mine) >= self.limits.per_address:
            victim = self._choose(self.surplus_by.get(src, {}), mine, ready)  # its own: surplus first
        elif len(self.waiting) >= self.limits.total:
            victim = self._choose(self.surplus, (mine or self.waiting) if within else {}, ready)
        else:
            victim = -1  # room
        if victim is None:
            return conn  # a surplus newcomer and no surplus to close: refused
        if victim != -1:
            self.done(victim)
        self.waiting[conn] = (src, now + self.timeout)
        self.by_address.setdefault(src, {})[conn] = None
        if not within:
            self.surplus[conn] = None
            self.surplus_by.setdefault(src, {})[conn] = None
        return victim if victim != -1 else None

    def _spend(self, src: str, now: float) -> bool:
        """Take one of `src`'s tokens if it has one: whether the newcomer is within its source's rate. Sources with
        nothing waiting are forgotten once the map outgrows the table (their buckets would be full again soon)."""
        bucket = self.buckets.get(src)
        if bucket is None:
            if len(self.buckets) > 2 * self.limits.total:
                for idle in [s for s in self.buckets if s not in self.by_address]:
                    del self.buckets[idle]
            bucket = self.buckets[src] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        return False

    @staticmethod
    def _choose(first: dict[int, None], then: dict[int, None], ready: Callable[[int], bool]) -> int | None:
        """The oldest of `first`, else of `then`, passing over up to LOOK whose hello waits unread (when all of
        those are ready, the oldest goes: a ready hello is read at once, so few can be); None if both are empty."""
        for pool in (first, then):
            if not pool:
                continue
            looked = []
            for conn in pool:
                if len(looked) == LOOK:
                    break
                if not ready(conn):
                    return conn
                looked.append(conn)
            return looked[0]
        return None

    def done(self, conn: int) -> None:
        """Forget `conn` (it authenticated, or it is closed); nothing if it is not waiting."""
        entry = self.waiting.pop(conn, None)
        if entry is None:
            return
        for table in (self.by_address, self.surplus_by):
            mine = table.get(entry[0])
            if mine is not None and conn in mine:
                del mine[conn]
                if not mine:
                    del table[entry[0]]
        self.surplus.pop(conn, None)

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
