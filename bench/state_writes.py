#!/usr/bin/env python3
"""What persisting the scheduler's state costs, per phase of a job: bytes written and CPU time of the writes, the
incremental writer (toolkit.scheduler.state: a base plus a journal of the records that changed) next to the whole
document rewritten at every write (what the scheduler did before: `json.dumps(snapshot, indent=1)`, atomically
and durably).

Why: the state is written before the messages a membership change causes are sent; written whole it costs O(N)
per write (722 kB at 4096 ranks), and a formation or an incident makes many writes (issue 24). In-process, a real
Membership on a fake clock and real files with their fsyncs, so the byte counts do not depend on the machine's
load (the CPU times do; compare them side by side only).

    .venv/bin/python bench/state_writes.py [--sizes 1024,4096] [--batch 64] [--rounds 10]

Phases: formation (every rank registers, `--batch` registrations per loop pass, one write per pass), steady
(`--rounds` rounds of a commit from every rank, one write each, as COMMIT_PERSIST_INTERVAL batches them), incident
(one rank dies, its replacement registers, the job forms again: a write each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

from toolkit import atomicfile
from toolkit.atomicfile import Durability
from toolkit.contracts import protocol as P
from toolkit.scheduler import state as S
from toolkit.scheduler.membership import Membership


class Whole:
    """The scheduler's writer before the journal: the whole document, every time."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def save(self, m: Membership) -> int:
        data = json.dumps({"version": 1, **m.snapshot()}, indent=1)
        atomicfile.write(self.path, data, durability=Durability.DURABLE)
        return len(data)


class Incremental:
    """toolkit.scheduler.state.StateWriter, as Server._persist drives it; counts what it wrote."""

    def __init__(self, path: Path) -> None:
        self.writer = S.StateWriter(path)

    def save(self, m: Membership) -> int:
        w = self.writer
        base, journal = _inode(w.path), w.journal_bytes
        w.save(S.changes(m), m.snapshot)
        m.roster.unsaved.clear()
        if _inode(w.path) != base:  # rewritten: the base and a new journal
            return w.base_bytes + w.journal_bytes
        return w.journal_bytes - journal


def _inode(path: Path) -> int | None:
    """The file's inode (a rewrite renames a new file over it), None if there is none."""
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def run(world: int, make: Callable[[Path], Whole | Incremental], batch: int,
        rounds: int) -> dict[str, tuple[int, float, int]]:
    """Each phase's (bytes written, CPU seconds of the writes, writes)."""
    m = Membership("bench", world, 3.0, 600.0, "boot", "127.0.0.1:1", {P.worker_node_id(r): f"host{r // 8}"
                                                                         for r in range(world)}, 0.0)
    m.started(0.0)
    out: dict[str, tuple[int, float, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        writer = make(Path(tmp) / S.STATE_FILE)

        def phase(name: str, passes: list[Callable[[], None]]) -> None:
            written, cpu = 0, 0.0
            for event in passes:
                event()
                start = time.process_time()
                written += writer.save(m)
                cpu += time.process_time() - start
            out[name] = (written, cpu, len(passes))

        def register(peer: int, rank: int) -> None:
            m.register(peer, f"10.0.{rank // 256}.{rank % 256}:40000", {
                "op": P.REGISTER, "node_id": P.worker_node_id(rank), "rank": rank, "world_size": world,
                "incarnation": f"{peer:016x}", "pid": 10_000 + peer, "host": f"host{rank // 8}",
                "recovery": P.RECOVERY_IN_PLACE}, 1.0)

        def registrations(first: int) -> Callable[[], None]:
            return lambda: [register(r + 1, r) for r in range(first, min(first + batch, world))] and None

        def commits(step: int) -> Callable[[], None]:
            return lambda: [m.message(r + 1, {"op": P.COMMIT, "step": step}, 2.0) for r in range(world)] and None

        phase("formation", [registrations(first) for first in range(0, world, batch)])
        phase("steady", [commits(50 * (i + 1)) for i in range(rounds)])
        victim = world // 2 + 3
        phase("incident", [lambda: m.lost(victim + 1, "connection closed", 5.0) and None,
                           lambda: register(world + 1, victim)])
        assert m.formed and m.generation == 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096")
    parser.add_argument("--batch", type=int, default=64, help="registrations per loop pass during formation")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of commits in the steady state")
    args = parser.parse_args()
    print(f"{'N':>5} {'phase':<10} {'writes':>6} {'whole kB':>9} {'incr kB':>8} {'bytes x':>8} "
          f"{'whole ms':>9} {'incr ms':>8} {'cpu x':>6}")
    for world in (int(s) for s in args.sizes.split(",")):
        whole = run(world, Whole, args.batch, args.rounds)
        incr = run(world, Incremental, args.batch, args.rounds)
        for name, (wb, wc, n) in whole.items():
            ib, ic, _ = incr[name]
            print(f"{world:>5} {name:<10} {n:>6} {wb / 1e3:>9.1f} {ib / 1e3:>8.1f} {wb / max(ib, 1):>8.1f} "
                  f"{wc * 1e3:>9.1f} {ic * 1e3:>8.1f} {wc / max(ic, 1e-9):>6.1f}")


if __name__ == "__main__":
    main()
