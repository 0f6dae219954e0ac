"""The job's store core (toolkit.scheduler.kvstore), driven directly with a fake clock: who a write wakes, when
waits expire, what dropping a generation does, multi_get, and the bounds from the job's size. The store over real
sockets with real gloo groups is in tests/train/test_store.py."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

from toolkit.contracts import protocol as P
from toolkit.scheduler import kvstore, transport
from toolkit.scheduler.kvstore import KVStore, Reply

GEN = P.generation_prefix("job", "boot")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def key(generation: int, name: str) -> str:
    return P.store_prefix("job", "boot", generation) + name


class Client:
    """Requests of one connection (`peer`), with fresh ids."""

    def __init__(self, kv: KVStore, peer: int) -> None:
        self.kv, self.peer, self.next = kv, peer, 0

    def __call__(self, cmd: str, now: float = 0.0, **fields: Any) -> list[Reply]:
        self.next += 1
        return self.kv.request(self.peer, {"id": self.next, "cmd": cmd, **fields}, now)


def answered(replies: list[Reply]) -> dict[int, Reply]:
    return {r.peer: r for r in replies}


def test_a_set_wakes_only_the_waiters_of_its_key() -> None:
    kv = KVStore(generation_prefix=GEN)
    for peer in range(10, 30):  # 20 waiters on 20 keys, and 5 more on the key that will be set
        assert Client(kv, peer)("get", key=f"k{peer}", timeout=60) == []
    for peer in range(30, 35):
        assert Client(kv, peer)("get", key="k10", timeout=60) == []
    assert len(kv.waiters) == 25
    woken = answered(Client(kv, 1)("set", key="k10", value=b64("v")))
    assert set(woken) == {1, 10, 30, 31, 32, 33, 34}  # the writer and the six waiting for k10, nobody else
    assert all(r.ok for r in woken.values()) and woken[33].fields["value"] == b64("v")
    assert len(kv.waiters) == 19 and "k10" not in kv.waiting
    assert answered(Client(kv, 1)("set", key="k10", value=b64("w"))).keys() == {1}  # nobody waits for it any more


def test_a_wait_on_several_keys_wakes_on_the_last_one() -> None:
    kv = KVStore()
    waiter = Client(kv, 5)
    assert waiter("wait", keys=["a", "b", "c"], timeout=10) == []
    writer = Client(kv, 1)
    assert answered(writer("set", key="c", value=b64("1"))).keys() == {1}
    assert answered(writer("set", key="a", value=b64("1"))).keys() == {1}
    woken = answered(writer("set", key="b", value=b64("1")))
    assert woken.keys() == {1, 5} and woken[5].ok and woken[5].id == 1
    assert kv.waiters == {} and kv.waiting == {}


def test_a_key_deleted_while_others_are_awaited_is_awaited_again() -> None:
    kv = KVStore()
    writer = Client(kv, 1)
    writer("set", key="a", value=b64("1"))
    assert Client(kv, 5)("multi_get", keys=["a", "b"], timeout=10) == []
    writer("delete", key="a")
    assert answered(writer("set", key="b", value=b64("2"))).keys() == {1}  # a is gone: still waiting
    woken = answered(writer("set", key="a", value=b64("3")))
    assert [base64.b64decode(v) for v in woken[5].values] == [b"3", b"2"]


def test_waits_expire_in_deadline_order_and_answered_ones_never() -> None:
    kv = KVStore()
    timeouts = {10: 7.0, 11: 3.0, 12: 5.0, 13: 1.0, 14: 9.0}
    for peer, timeout in timeouts.items():
        Client(kv, peer)("wait", keys=[f"k{peer}"], timeout=timeout, now=0.0)
    Client(kv, 1)("set", key="k12", value=b64("x"))  # answers 12: its deadline must not fire
    assert kv.next_deadline() == 1.0
    assert [r.peer for r in kv.expire(0.5)] == []
    expired = kv.expire(7.0)
    assert [r.peer for r in expired] == [13, 11, 10]  # deadline order; 12 was answered
    assert all(not r.ok and r.fields["error"] == "timeout" for r in expired)
    assert expired[0].fields["keys"] == ["k13"]
    assert kv.next_deadline() == 9.0
    assert [r.peer for r in kv.expire(100.0)] == [14] and kv.next_deadline() == math.inf


def test_the_heap_of_answered_waits_stays_small() -> None:
    kv = KVStore()
    writer = Client(kv, 1)
    for i in range(5000):  # 5000 waits answered long before their deadlines
        Client(kv, 2)("get", key=f"k{i}", timeout=3600)
        writer("set", key=f"k{i}", value=b64("v"))
    assert len(kv._heap) <= 200  # compacted as it goes, not kept for an hour
    assert kv.next_deadline() == math.inf


def test_a_closed_connection_mid_wait_is_forgotten() -> None:
    kv = KVStore()
    Client(kv, 5)("multi_get", keys=["a", "b"], timeout=10)
    Client(kv, 6)("get", key="a", timeout=20)
    kv.forget(5)
    assert kv.next_deadline() == 20.0 and set(kv.waiting) == {"a"}
    assert answered(Client(kv, 1)("set", key="b", value=b64("1"))).keys() == {1}
    assert answered(Client(kv, 1)("set", key="a", value=b64("1"))).keys() == {1, 6}
    assert kv.expire(30.0) == []  # nothing left to time out, 5's entry is stale
    kv.forget(99)  # never waited: nothing to do


def test_dropping_a_generation_deletes_its_keys_only_and_fails_its_waiters() -> None:
    kv = KVStore(generation_prefix=GEN)
    writer = Client(kv, 1)
    for g in (1, 2, 11):
        for r in range(3):
            writer("set", key=key(g, f"/0//cpu//0/{r}"), value=b64(f"{g}.{r}"))
    writer("set", key="exception_dump", value=b64("x"))  # a key under no generation
    Client(kv, 5)("multi_get", keys=[key(1, "/0//cpu//0/0"), key(1, "/0//cpu//0/7")], timeout=60)
    Client(kv, 6)("get", key=key(2, "/0//cpu//0/9"), timeout=60)
    size = kv.size
    assert kv.drop_prefix(key(1, "")) == 3
    assert kv.drop_prefix(key(1, "")) == 0 and kv.drop_prefix(key(3, "")) == 0
    assert sorted(k for k in kv.data if "gen1/" in k) == []
    assert len(kv.data) == 7 and kv.size == size - 3 * (len(key(1, "/0//cpu//0/0")) + 3)
    assert kv.next_deadline() == -math.inf  # a reply is due now
    (over,) = kv.expire(0.0)
    assert (over.peer, over.ok, over.fields["error"], over.fields["keys"]) == (5, False, kvstore.GENERATION_OVER,
                                                                               [key(1, "/0//cpu//0/7")])
    assert set(kv.waiters) == {6} and kv.next_deadline() == 60.0  # generation 2's waiter still waits
    late = Client(kv, 7)
    for cmd, fields in (("set", {"key": key(1, "/x"), "value": b64("1")}), ("get", {"key": key(1, "/x"), "timeout": 1}),
                        ("wait", {"keys": [key(1, "/x")], "timeout": 1}), ("add", {"key": key(1, "/n"), "amount": 1})):
        (reply,) = late(cmd, **fields)
        assert not reply.ok and reply.fields["error"].startswith(kvstore.GENERATION_OVER), cmd
    assert key(1, "/x") not in kv.data


def test_multi_get_answers_in_key_order_at_once_or_once_all_exist() -> None:
    kv = KVStore()
    writer = Client(kv, 1)
    for name in ("c", "a", "b"):
        writer("set", key=name, value=b64(name.upper()))
    (now,) = Client(kv, 5)("multi_get", keys=["b", "c", "a", "b"], timeout=5)
    assert now.ok and [base64.b64decode(v) for v in now.values] == [b"B", b"C", b"A", b"B"]
    line = json.loads(now.message())
    assert line == {"op": P.KV_REPLY, "id": 1, "ok": True, "values": [b64("B"), b64("C"), b64("A"), b64("B")]}
    assert Client(kv, 6)("multi_get", keys=["a", "d", "e"], timeout=5) == []
    writer("set", key="e", value=b64("E"))
    woken = answered(writer("set", key="d", value=b64("D")))
    assert [base64.b64decode(v) for v in woken[6].values] == [b"A", b"D", b"E"]


def test_multi_get_times_out_naming_the_missing_keys() -> None:
    kv = KVStore()
    Client(kv, 1)("set", key="a", value=b64("1"))
    Client(kv, 5)("multi_get", keys=["a", "b", "c"], timeout=2, now=10.0)
    (reply,) = kv.expire(12.0)
    assert not reply.ok and reply.fields == {"error": "timeout", "keys": ["b", "c"]}


def test_multi_get_replies_are_bounded() -> None:
    kv = KVStore(max_bytes=1 << 30)
    writer = Client(kv, 1)
    big = base64.b64encode(bytes(P.MAX_STORE_VALUE)).decode()
    count = P.MAX_STORE_REPLY // len(big) + 1
    for i in range(count):
        assert writer("set", key=f"k{i}", value=big)[0].ok
    (reply,) = Client(kv, 5)("multi_get", keys=[f"k{i}" for i in range(count)], timeout=1)
    assert not reply.ok and "ask for fewer keys" in reply.fields["error"]
    assert reply.fields["limit"] == P.MAX_STORE_REPLY <= transport.MAX_OUTBUF  # the scheduler queues a whole reply
    (fits,) = Client(kv, 5)("multi_get", keys=[f"k{i}" for i in range(count - 1)], timeout=1)
    assert fits.ok and len(fits.message()) <= P.MAX_STORE_REPLY
    for bad in ({"keys": []}, {"keys": ["k"] * (P.MAX_STORE_KEYS + 1)}, {"keys": "k0"}, {"keys": ["k0", 7]}):
        (refused,) = Client(kv, 5)("multi_get", timeout=1, **bad)
        assert not refused.ok, bad


def test_the_bounds_grow_with_the_job() -> None:
    assert kvstore.bounds(8) == (kvstore.MAX_KEYS, kvstore.MAX_BYTES)
    keys, size = kvstore.bounds(4096)
    assert keys >= 16 * 4096 and size >= 8 * 4096 ** 2  # gloo's default bootstrap, 8 N^2 bytes, fits at 4096
    kv = KVStore(2, 100)
    writer = Client(kv, 1)
    assert writer("set", key="a", value=b64("x" * 40))[0].ok
    (full,) = writer("set", key="b", value=b64("x" * 80))
    assert not full.ok and "100 bytes" in full.fields["error"] and "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER" in \
        full.fields["error"]
    assert writer("set", key="b", value=b64("y"))[0].ok
    (full,) = writer("set", key="c", value=b64("z"))
    assert not full.ok and "2 keys" in full.fields["error"]
    assert writer("delete", key="a")[0].fields["deleted"] and kv.size == len("b") + 1


def test_values_are_kept_canonical_and_add_and_compare_set_still_work() -> None:
    kv = KVStore()
    c = Client(kv, 1)
    assert c("add", key="n", amount=5)[0].fields["value"] == 5
    assert c("add", key="n", amount=-2)[0].fields["value"] == 3
    (got,) = c("get", key="n", timeout=1)
    assert base64.b64decode(got.fields["value"]) == b"3"
    assert base64.b64decode(c("compare_set", key="n", expected=b64("3"), desired=b64("x"))[0].fields["value"]) == b"x"
    assert base64.b64decode(c("compare_set", key="n", expected=b64("3"), desired=b64("y"))[0].fields["value"]) == b"x"
    assert c("compare_set", key="m", expected=b64("q"), desired=b64("y"))[0].fields["value"] == b64("q")
    assert not c("add", key="n", amount=1)[0].ok  # "x" is not a number
    assert c("check", keys=["n", "m"])[0].fields["present"] is False
    assert kv.size == len("n") + 1
