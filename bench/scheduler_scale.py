#!/usr/bin/env python3
"""How the scheduler scales: registration and formation of 64, 256 and 512 simulated workers against one real
`python -m toolkit.scheduler`, and the time to a new generation after one worker dies.

Why: formation and re-formation sit on the critical path of every launch and every recovery; they must stay far
below the seconds that starting Python and torch costs, even with hundreds of workers. Not a test: it prints
numbers.

    .venv/bin/python bench/scheduler_scale.py [--sizes 64,256,512] [--procs 8] [--repeats 3] [--recovery both]

Simulated workers speak only the control protocol (register, heartbeat every second, done) — they build no
process group, so the store is not exercised. They are spread over --procs processes (asyncio, one connection
per simulated worker): plain sockets do not show the TCPStore-clients-in-one-process stall (REFERENCE.md), and
separate OS processes for 512 workers would measure Python start-up on 2 cores, not the scheduler.

Measured, per size (median of --repeats runs):
- formed: from the moment every simulator starts registering until the last simulated worker holds `formed`;
- detect: from closing one worker's connection (a process death: the kernel closes its socket) until the last
  survivor has received the new generation;
- re-formed: from that death until the last worker (survivors and the replacement, which registers at once)
  holds `formed` for the new generation;
- finish: from `done` on every connection until the scheduler process has exited 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolkit import envvars as E
from toolkit import protocol as P
from toolkit.testing.ports import free_port_pair

ROOT = Path(__file__).resolve().parents[1]

HEARTBEAT = 1.0


# ---------------------------------------------------------------- the simulator process


class SimWorker:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.incarnation = secrets.token_hex(8)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.formed: dict[int, float] = {}
        self.generations: dict[int, float] = {}
        self.events: dict[int, asyncio.Event] = {}
        self.task: asyncio.Task | None = None

    def event(self, gen: int) -> asyncio.Event:
        return self.events.setdefault(gen, asyncio.Event())


async def sim_register(w: SimWorker, port: int, token: str, world: int) -> None:
    w.reader, w.writer = await asyncio.open_connection("127.0.0.1", port)
    nonce = P.challenge_nonce(P.decode((await w.reader.readline()).strip()))
    hello, _ = P.hello(P.REGISTER, token, nonce, node_id=P.worker_node_id(w.rank), rank=w.rank, world_size=world,
                       incarnation=w.incarnation, pid=os.getpid(), host="sim", generation=None, rejoin=False)
    w.writer.write(hello)
    await w.writer.drain()
    w.task = asyncio.create_task(sim_read(w))


async def sim_read(w: SimWorker) -> None:
    assert w.reader is not None
    while True:
        line = await w.reader.readline()
        if not line:
            return
        msg = P.decode(line.strip())
        now = time.monotonic()
        if msg["op"] == P.FORMED:
            w.formed.setdefault(msg["generation"], now)
            w.event(msg["generation"]).set()
        elif msg["op"] == P.GENERATION:
            w.generations.setdefault(msg["generation"], now)
            w.event(-msg["generation"]).set()
        elif msg["op"] == P.REJECT:
            raise SystemExit(f"rank {w.rank} rejected: {msg.get('reason')}")


async def sim_heartbeats(workers: dict[int, SimWorker]) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT)
        for w in list(workers.values()):
            if w.writer is not None and not w.writer.is_closing():
                w.writer.write(P.encode(P.HEARTBEAT, step=0))


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


async def sim_main(port: int, token: str, world: int, ranks: list[int]) -> None:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    workers = {r: SimWorker(r) for r in ranks}
    say(event="ready")
    beats: asyncio.Task | None = None
    while True:
        line = (await stdin.readline()).decode().split()
        if not line:
            return
        cmd, args = line[0], line[1:]
        if cmd == "go":
            await asyncio.gather(*(sim_register(w, port, token, world) for w in workers.values()))
            beats = asyncio.create_task(sim_heartbeats(workers))
            await asyncio.gather(*(w.event(0).wait() for w in workers.values()))
            say(event="formed", gen=0, t=max(w.formed[0] for w in workers.values()))
        elif cmd == "kill":  # close one connection: what the scheduler sees when a worker process dies
            rank = int(args[0])
            w = workers[rank]
            t = time.monotonic()
            assert w.writer is not None
            w.writer.transport.abort()
            say(event="killed", t=t)
        elif cmd == "replace":
            rank = int(args[0])
            workers[rank] = SimWorker(rank)
            await sim_register(workers[rank], port, token, world)
        elif cmd == "wait":  # every worker of this simulator: generation pushed (survivors) and formed
            gen, dead = int(args[0]), int(args[1])
            await asyncio.gather(*(w.event(gen).wait() for w in workers.values()))
            pushed = [w.generations[gen] for r, w in workers.items() if r != dead and gen in w.generations]
            say(event="formed", gen=gen, t=max(w.formed[gen] for w in workers.values()),
                pushed=max(pushed) if pushed else None)
        elif cmd == "done":
            t = time.monotonic()
            for w in workers.values():
                assert w.writer is not None
                w.writer.write(P.encode(P.DONE))
            await asyncio.gather(*(w.writer.drain() for w in workers.values() if w.writer is not None))
            say(event="done", t=t)
            if beats is not None:
                beats.cancel()
            await asyncio.gather(*(w.task for w in workers.values() if w.task is not None),
                                 return_exceptions=True)
            return


# ---------------------------------------------------------------- the driver


class Sim:
    def __init__(self, port: int, token: str, world: int, ranks: list[int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--sim", str(port), token, str(world), ",".join(map(str, ranks))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.ranks = ranks

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"simulator exited with {self.proc.wait()}")
        return json.loads(line)


def one_run(world: int, procs: int, recovery: bool, workdir: Path) -> dict[str, float]:
    port = free_port_pair()
    token = secrets.token_hex(16)
    token_file = workdir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    env = {**os.environ, E.MS_ROLE: E.ROLE_SCHED, E.MS_SCHED_HOST: "127.0.0.1", E.MS_SCHED_PORT: str(port),
           E.MASTER_ADDR: "127.0.0.1", E.MASTER_PORT: str(port + 1), E.MS_WORKER_NUM: str(world),
           E.MS_TOPO_TIMEOUT: "120", E.MS_NODE_TIMEOUT: "6", E.MS_ENABLE_RECOVERY: "1" if recovery else "0",
           E.MS_RECOVERY_PATH: str(workdir / f"recovery-{port}"), E.TOOLKIT_JOB: "bench",
           E.TOOLKIT_TOKEN_FILE: str(token_file), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    log = open(workdir / f"scheduler-{world}-{port}.log", "w")
    sched = subprocess.Popen([sys.executable, "-m", "toolkit.scheduler"], env=env, stdout=log,
                             stderr=subprocess.STDOUT, cwd=ROOT)
    sims: list[Sim] = []
    try:
        _wait_listening(port, sched)
        chunks = [list(range(world))[i::procs] for i in range(procs)]
        sims = [Sim(port, token, world, ranks) for ranks in chunks if ranks]
        for s in sims:
            assert s.read()["event"] == "ready"
        go = time.monotonic()
        for s in sims:
            s.send("go")
        formed = max(s.read()["t"] for s in sims) - go

        victim = world // 2
        owner = next(s for s in sims if victim in s.ranks)
        owner.send(f"kill {victim}")
        killed = owner.read()["t"]
        owner.send(f"replace {victim}")
        for s in sims:
            s.send(f"wait 1 {victim}")
        results = [s.read() for s in sims]
        detect = max(r["pushed"] for r in results if r["pushed"] is not None) - killed
        reformed = max(r["t"] for r in results) - killed

        for s in sims:
            s.send("done")
        started = min(s.read()["t"] for s in sims)
        code = sched.wait(60)
        finish = time.monotonic() - started
        if code != 0:
            raise RuntimeError(f"scheduler exited {code}; see {log.name}")
        return {"formed": formed, "detect": detect, "reformed": reformed, "finish": finish}
    finally:
        for s in sims:
            if s.proc.poll() is None:
                s.proc.kill()
            s.proc.wait(10)
        if sched.poll() is None:
            sched.kill()
            sched.wait(10)
        log.close()


def _wait_listening(port: int, sched: subprocess.Popen) -> None:
    """The scheduler listens only once its store is up; connect attempts are refused until then (bounded)."""
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sched.poll() is not None:
            raise RuntimeError(f"scheduler exited {sched.returncode} before serving")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)  # named poll: the scheduler offers no readiness signal to a foreign process
    raise RuntimeError("scheduler did not start serving within 60 s")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--sim":
        port, token, world, ranks = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
        asyncio.run(sim_main(int(port), token, int(world), [int(r) for r in ranks.split(",")]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,512")
    parser.add_argument("--procs", type=int, default=8, help="simulator processes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recovery", choices=["on", "off", "both"], default="both")
    args = parser.parse_args()
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.recovery]
    print(f"{'workers':>7} {'recovery':>8} {'formed ms':>10} {'detect ms':>10} {'re-formed ms':>13} "
          f"{'finish ms':>10}   (median of {args.repeats}; {args.procs} simulator processes)")
    with tempfile.TemporaryDirectory(prefix="sched-bench-") as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            for recovery in modes:
                runs = [one_run(size, min(args.procs, size), recovery, Path(tmp)) for _ in range(args.repeats)]
                med = {k: statistics.median(r[k] for r in runs) * 1000 for k in runs[0]}
                print(f"{size:>7} {'on' if recovery else 'off':>8} {med['formed']:>10.1f} {med['detect']:>10.1f} "
                      f"{med['reformed']:>13.1f} {med['finish']:>10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
