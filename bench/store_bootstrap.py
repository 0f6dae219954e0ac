#!/usr/bin/env python3
"""What one gloo bootstrap costs the scheduler's store, per generation, at hundreds and thousands of ranks.

Why: every generation (the first formation and every recovery) builds a new gloo group, and every rank finds its
peers through the job's store, served by the scheduler's one thread. gloo's default pattern is one `set` and 2N
requests per rank (a wait and a get for every peer) with values that carry 8 bytes per rank: O(N^2) requests and
O(N^3) bytes per generation. With GLOO_ENABLE_STORE_V2_API=1 and GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1 (what the
agent gives workers) and the store's `multi_get`, it is one `set` and N/128 requests per rank, and 154-byte values.
Not a test: it prints numbers.

    .venv/bin/python bench/store_bootstrap.py [--sizes 256,1024] [--baseline main] [--generations 2]
                                              [--procs 2] [--readers 32]

One real `python -m toolkit.scheduler` per row (MS_WORKER_NUM = N; no worker registers: only its store is used),
and --procs client processes that play the N ranks over plain asyncio sockets (no torch): per generation, each rank
opens a new authenticated store connection (as toolkit.train.runtime does after each `formed`), sets its key under
the generation's prefix, then reads every rank's key the way gloo does:
- `v2`: multi_get of 128 keys at a time (values of 154 bytes). A store without multi_get ("unknown store
  command") gets what gloo then falls back to: a wait and a get per key.
- `legacy`: gloo without the variables: a wait and a get per key, values of 154 + 8N bytes. Above --readers ranks
  only --readers ranks (spread evenly) read, the rest only set, and the scheduler's CPU is also shown scaled by
  N / readers ("est."): the full pattern moves 8N^3 bytes (8.7 GB at 1024) and would measure the clients.

Rows: the tree (this checkout, and with --baseline REV the store of that git revision, exported to a temporary
directory: "before"), the pattern, N; per generation (median of --generations): the scheduler's CPU seconds
(utime + stime from /proc, from the first connect to the last rank's last reply), wall seconds, the store requests
and reply MB, the clients' CPU seconds (all client processes: if near --procs x wall, the row measures the
clients), and connections the scheduler closed at accept (retried, as the store client does).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import resource
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolkit.contracts import envvars as E
from toolkit.contracts import protocol as P
from toolkit.freeports import free_port_pair

ROOT = Path(__file__).resolve().parents[1]
BATCH = 128  # keys per multi_get: what gloo asks for
VALUE = 154  # bytes of a rank's address with GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER (measured with torch 2.13)
TIMEOUT = 600.0  # s a rank's wait may take
HANDSHAKES = 48  # handshakes in flight over all client processes (the scheduler admits 64 per address)
RETRY = 0.05  # s before connecting again after the scheduler closed a connection at accept


# ---------------------------------------------------------------- a client process


class Rank:
    """One simulated rank's store connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.next = reader, writer, 0
        self.requests = 0
        self.received = 0

    async def call(self, cmd: str, **fields) -> dict:
        self.next += 1
        self.requests += 1
        self.writer.write(P.encode(P.KV, id=self.next, cmd=cmd, **fields))
        line = await self.reader.readline()
        self.received += len(line)
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"{cmd}: {reply.get('error')}")
        return reply


async def open_rank(port: int, token: str, rank: int, gate: asyncio.Semaphore, stats: dict) -> Rank:
    while True:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=P.MAX_STORE_REPLY)
            first = await reader.readline()
            if first:
                nonce = P.challenge_nonce(P.decode(first))
                hello, mine = P.hello(P.STORE_HELLO, token, nonce, node_id=P.worker_node_id(rank))
                writer.write(hello)
                reply = P.decode(await reader.readline())
                if reply.get("op") != P.WELCOME or not P.check_server(token, nonce, mine, reply):
                    raise RuntimeError(f"rank {rank}: the store refused: {reply}")
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return Rank(reader, writer)
            writer.close()  # closed at accept: the scheduler is at its limit of connections still to authenticate
        stats["refused"] += 1
        await asyncio.sleep(RETRY * (0.5 + random.random()))  # noqa: S311 - jitter, not a secret


async def bootstrap(r: Rank, rank: int, world: int, prefix: str, pattern: str, reads: bool, value: str,
                    stats: dict) -> None:
    keys = [f"{prefix}/0//cpu//0/{k}" for k in range(world)]
    await r.call("set", key=keys[rank], value=value)
    if not reads:
        return
    if pattern == "v2" and not stats["no_multi_get"]:
        try:
            for b in range(0, world, BATCH):
                reply = await r.call("multi_get", keys=keys[b:b + BATCH], timeout=TIMEOUT)
                assert len(reply["values"]) == len(keys[b:b + BATCH])
            return
        except RuntimeError as e:
            if "unknown store command" not in str(e):
                raise
            stats["no_multi_get"] = True
    for key in keys:
        await r.call("wait", keys=[key], timeout=TIMEOUT)
        await r.call("get", key=key, timeout=TIMEOUT)


async def generation(port: int, token: str, world: int, ranks: list[int], prefix: str, pattern: str,
                     readers: set[int], gate: asyncio.Semaphore) -> dict:
    size = VALUE if pattern == "v2" else VALUE + 8 * world
    value = base64.b64encode(secrets.token_bytes(size)).decode()  # any bytes will do
    stats = {"refused": 0, "no_multi_get": False}

    async def one(rank: int) -> Rank:
        r = await open_rank(port, token, rank, gate, stats)
        await bootstrap(r, rank, world, prefix, pattern, rank in readers, value, stats)
        return r

    done = await asyncio.gather(*(one(rank) for rank in ranks))
    end = time.monotonic()
    for r in done:
        r.writer.close()
    return {"end": end, "requests": sum(r.requests for r in done), "bytes": sum(r.received for r in done),
            "refused": stats["refused"], "fallback": stats["no_multi_get"]}


async def sim_main(port: int, token: str, world: int, ranks: list[int], pattern: str, readers: set[int],
                   handshakes: int) -> None:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    gate = asyncio.Semaphore(handshakes)
    print(json.dumps({"ready": True}), flush=True)
    while line := (await stdin.readline()).decode().split():
        before = resource.getrusage(resource.RUSAGE_SELF)
        result = await generation(port, token, world, ranks, f"bench/gen{line[1]}", pattern, readers, gate)
        after = resource.getrusage(resource.RUSAGE_SELF)
        result["cpu"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- the driver


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_serving(port: int, sched: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sched.poll() is not None:
            raise RuntimeError(f"the scheduler exited {sched.returncode} before serving")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)  # named poll: a foreign process offers no readiness signal
    raise RuntimeError("the scheduler did not serve within 60 s")


def one_row(tree: Path, world: int, pattern: str, procs: int, readers_max: int, generations: int,
            workdir: Path) -> dict:
    port = free_port_pair()
    token = secrets.token_hex(16)
    token_file = workdir / f"token-{port}"
    token_file.write_text(token)
    token_file.chmod(0o600)
    env = {**os.environ, E.MS_ROLE: E.ROLE_SCHED, E.MS_SCHED_HOST: "127.0.0.1", E.MS_SCHED_PORT: str(port),
           E.MASTER_ADDR: "127.0.0.1", E.MASTER_PORT: str(port + 1), E.MS_WORKER_NUM: str(world),
           E.MS_TOPO_TIMEOUT: "86400", E.MS_NODE_TIMEOUT: "6", E.MS_ENABLE_RECOVERY: "0", E.TOOLKIT_JOB: "bench",
           E.TOOLKIT_TOKEN_FILE: str(token_file), "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    log = open(workdir / f"scheduler-{port}.log", "w")
    sched = subprocess.Popen([sys.executable, "-m", "toolkit.scheduler"], env=env, stdout=log,
                             stderr=subprocess.STDOUT, cwd=tree, start_new_session=True)
    sims: list[subprocess.Popen] = []
    readers = set(range(world)) if pattern == "v2" or world <= readers_max else \
        {round(i * world / readers_max) for i in range(readers_max)}
    try:
        wait_serving(port + 1, sched)
        for i in range(procs):
            ranks = list(range(world))[i::procs]
            sims.append(subprocess.Popen(
                [sys.executable, __file__, "--sim", str(port + 1), token, str(world), ",".join(map(str, ranks)),
                 pattern, ",".join(map(str, sorted(readers))), str(max(1, HANDSHAKES // procs))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT))
        for s in sims:
            json.loads(s.stdout.readline())
        rows = []
        for g in range(generations):
            cpu0, start = cpu_seconds(sched.pid), time.monotonic()
            for s in sims:
                s.stdin.write(f"go {g}\n")
                s.stdin.flush()
            results = [json.loads(s.stdout.readline()) for s in sims]
            cpu = cpu_seconds(sched.pid) - cpu0
            rows.append({"cpu": cpu, "wall": max(r["end"] for r in results) - start,
                         "requests": sum(r["requests"] for r in results),
                         "mb": sum(r["bytes"] for r in results) / 1e6,
                         "client": sum(r["cpu"] for r in results), "refused": sum(r["refused"] for r in results),
                         "fallback": any(r["fallback"] for r in results)})
        med = {k: statistics.median(r[k] for r in rows) for k in ("cpu", "wall", "requests", "mb", "client")}
        med.update(refused=sum(r["refused"] for r in rows), fallback=rows[0]["fallback"],
                   scale=world / len(readers))
        return med
    finally:
        for s in sims:
            if s.stdin:
                s.stdin.close()
            try:
                s.wait(30)
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait(10)
        sched.terminate()
        try:
            sched.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(sched.pid, 9)
            sched.wait(10)
        log.close()


def export(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` of this repository, as files under `into` (git archive: the checkout is not
    touched)."""
    archive = subprocess.run(["git", "archive", rev, "toolkit"], cwd=ROOT, capture_output=True, check=True,  # noqa: S607
                             timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=120)  # noqa: S607
    return into


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--sim":
        port, token, world, ranks, pattern, readers, handshakes = sys.argv[2:9]
        asyncio.run(sim_main(int(port), token, int(world), [int(r) for r in ranks.split(",")], pattern,
                             {int(r) for r in readers.split(",")}, int(handshakes)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--runs", default="base:legacy,this:legacy,this:v2",
                        help="tree:pattern pairs; tree `base` is --baseline's (skipped without it), `this` this one")
    parser.add_argument("--baseline", default=None, help="a git revision whose store to measure too (before)")
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--readers", type=int, default=64, help="legacy pattern: ranks that read, above this N")
    args = parser.parse_args()
    print(f"{'tree':>6} {'pattern':>7} {'N':>5} {'sched CPU s':>11} {'wall s':>7} {'requests':>9} {'reply MB':>9} "
          f"{'client CPU s':>12} {'refused':>7}   (per generation, median of {args.generations}; {args.procs} "
          "client processes)", flush=True)
    results: dict[tuple[str, str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        trees = {"this": ROOT}
        if args.baseline:
            trees["base"] = export(args.baseline, Path(tmp))
        runs = [tuple(r.split(":")) for r in args.runs.split(",")]
        for size in (int(s) for s in args.sizes.split(",")):
            for name, pattern in runs:
                if name not in trees:
                    continue
                m = one_row(trees[name], size, pattern, args.procs, args.readers, args.generations, Path(tmp))
                note = " (no multi_get: wait+get per key)" if m["fallback"] else ""
                if m["scale"] > 1:
                    note += f" ({round(size / m['scale'])} of {size} ranks read: est. {m['cpu'] * m['scale']:.1f} " \
                            "sched CPU s for all)"
                results[(name, pattern, size)] = m["cpu"] * m["scale"]
                print(f"{name:>6} {pattern:>7} {size:>5} {m['cpu']:>11.3f} {m['wall']:>7.2f} {m['requests']:>9.0f} "
                      f"{m['mb']:>9.1f} {m['client']:>12.2f} {m['refused']:>7}{note}", flush=True)
    for size in (int(s) for s in args.sizes.split(",")):
        after = results.get(("this", "v2", size))
        for name in ("base", "this"):
            before = results.get((name, "legacy", size))
            if before and after:
                tree = args.baseline if name == "base" else "this tree"
                print(f"N={size}: scheduler CPU per generation, {tree} with gloo's default bootstrap / this tree with "
                      f"the two GLOO_* variables and multi_get: {before:.2f} / {after:.3f} = {before / after:.0f}x")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
