"""The scheduler's table of connections waiting to authenticate (toolkit.scheduler.admission), driven directly with a
fake clock: a newcomer within its source's rate is never refused, a flood beyond its rate only ever evicts itself (its
surplus, never another source's worker), a hello waiting unread is passed over, one address holds at most half the
table, and the limits follow the job's size and the descriptors there are."""

from __future__ import annotations

from toolkit.scheduler.admission import MIN_FIT, MIN_TOTAL, RESERVE_FDS, Admission, Limits


def test_a_full_table_evicts_the_oldest_of_the_newcomers_address_and_never_the_newcomer() -> None:
    table = Admission(Limits(total=8, per_address=4), timeout=10.0)
    evicted = [table.admit(i, "10.0.0.9", now=0.1 * i) for i in range(1, 11)]  # a flood from one address
    assert evicted == [None] * 4 + [1, 2, 3, 4, 5, 6]  # each newcomer in, the oldest of the flood out
    assert list(table.waiting) == [7, 8, 9, 10]
    worker = table.admit(100, "10.0.0.9", now=1.1)  # a worker from the flooded address: the oldest stranger goes
    assert worker == 7 and 100 in table.waiting
    table.done(100)  # it proved the token
    assert 100 not in table.waiting and len(table) == 3


def test_one_address_cannot_take_the_table_from_the_others() -> None:
    table = Admission(Limits(total=8, per_address=4), timeout=10.0)
    for i in range(1, 101):  # a long flood from one address
        table.admit(i, "10.0.0.9", now=0.01 * i)
    others = [table.admit(200 + i, f"10.0.0.{i}", now=2.0) for i in range(1, 5)]
    assert others == [None] * 4  # the other half was free: nobody evicted
    assert table.admit(300, "10.0.0.5", now=2.1) == 97  # full: the oldest of all goes, which is the flood's
    assert len(table) == 8 and len(table.by_address["10.0.0.9"]) == 3


def test_expiry_is_in_order_of_arrival_and_stops_at_the_first_in_time() -> None:
    table = Admission(Limits(total=8, per_address=8), timeout=10.0)
    for i, t in enumerate([0.0, 1.0, 2.0, 3.0], start=1):
        table.admit(i, "a", now=t)
    assert table.next_deadline() == 10.0
    assert table.expired(11.5) == [1, 2]
    assert table.next_deadline() == 12.0 and list(table.waiting) == [3, 4]
    table.done(3)
    table.done(3)  # twice is harmless
    assert table.expired(100.0) == [4] and table.next_deadline() is None and table.by_address == {}


def test_limits_follow_the_job_size_within_the_descriptors() -> None:
    small = Limits.for_job(world_size=2, hosts=1, nofile=1 << 20)
    assert (small.total, small.per_address) == (MIN_TOTAL, MIN_TOTAL // 2)
    big = Limits.for_job(world_size=4096, hosts=512, nofile=1 << 20)  # every rank may reconnect its store at once
    assert big.total == 2 * (2 * 4096 + 512) and big.per_address == big.total // 2
    tight = Limits.for_job(world_size=4096, hosts=512, nofile=10000)  # what the members leave over
    assert tight.total == 10000 - (2 * 4096 + 512) - RESERVE_FDS
    assert Limits.for_job(world_size=4096, hosts=512, nofile=1024).total == MIN_FIT
    assert Limits.fds_needed(4096, 512) == 2 * 4096 + 512 + RESERVE_FDS + MIN_FIT


def test_a_flood_beyond_its_rate_only_evicts_itself_and_never_a_worker_of_another_source() -> None:
    """The red team's flood (round 3): connections opened as fast as the scheduler accepts them, from one address
    and from random loopback addresses (one source: this host). A worker of another host that connected first, and
    has not answered yet, stays; the flood's surplus is what goes."""
    table = Admission(Limits(total=8, per_address=4), timeout=10.0, rate=10.0, burst=2)
    assert table.admit(1, "10.0.0.1", now=0.0) is None  # the worker's connection, waiting for its hello
    assert table.admit(2, "10.0.0.2", now=0.0) is None  # another host's agent
    t, evicted = 0.0, []
    for i in range(100, 20_100):  # 20000 connections in 2 s: 10000 a second, from 3 addresses
        t += 1e-4
        address = ("10.0.0.9", f"127.{i % 250}.{i // 250 % 250}.{i % 7 + 1}", "10.0.0.8")[i % 3]
        out = table.admit(i, address, now=t)
        if out is not None and out != i:
            evicted.append(out)
    assert 1 in table.waiting and 2 in table.waiting  # within their rate: never evicted by the flood's surplus
    assert evicted and all(e >= 100 for e in evicted)  # only ever the flood itself
    assert len(table) <= 8 and len(table.by_address["loopback"]) <= 4  # every 127.x.y.z is one source


def test_a_surplus_newcomer_is_refused_when_only_connections_within_their_rate_wait() -> None:
    table = Admission(Limits(total=4, per_address=2), timeout=10.0, rate=1.0, burst=1)
    for i, address in enumerate(("a", "b", "c", "d")):
        assert table.admit(i, address, now=0.0) is None
    assert table.admit(10, "e", now=0.0) == 0  # within its rate (a first connection): the oldest of all goes
    assert table.admit(11, "e", now=0.0) == 11  # beyond it, with nothing beyond theirs to close: refused
    assert 11 not in table.waiting and len(table) == 4


def test_a_worker_whose_hello_waits_unread_is_passed_over() -> None:
    """The loop accepts a batch before it reads: a worker that answered meanwhile is not the one evicted."""
    table = Admission(Limits(total=8, per_address=3), timeout=10.0)
    for i in range(1, 4):
        table.admit(i, "10.0.0.9", now=0.1 * i)
    assert table.admit(4, "10.0.0.9", now=0.5, ready=lambda c: c == 1) == 2  # 1's hello is there: 2 goes instead
    assert list(table.waiting) == [1, 3, 4]
