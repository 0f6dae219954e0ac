"""The scheduler's record of a run for its operator: it feeds the membership's Notes to the goodput ledger
(toolkit.scheduler.ledger) and the straggler tracking (toolkit.scheduler.stragglers), and writes the documents of
toolkit.contracts.rundoc (live.json, ledger.json, metrics.jsonl) into the recovery directory.

The server calls `note` for each Note and `tick` on every pass of its loop (`next_deadline` says when the next
write or evaluation is due, so its select() never polls). Writes are bounded in frequency (named intervals below)
and in size (the ledger's lists and the metrics file are capped), also in the job's size: live.json holds a row per
rank and is rewritten at most LIVE_RANKS_PER_S rows a second, metrics.jsonl gets at most that many rank samples a
second and keeps at most MAX_METRIC_VALUES, and a heartbeat that changes nothing marks nothing to write. A write
that fails is logged once a minute and retried: the record must never stop the job. Without a recovery directory
nothing is written (the tracking and the messages still work).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from toolkit import atomicfile
from toolkit.contracts import protocol, rundoc
from toolkit.scheduler.actions import Log, Note, NoteKind
from toolkit.scheduler.ledger import Ledger
from toolkit.scheduler.state import JobStatus
from toolkit.scheduler.stragglers import EVAL_INTERVAL, Cleared, Named, Stragglers

LIVE_INTERVAL = 1.0  # s between rewrites of live.json (what `fleet status` reads), up to LIVE_RANKS_PER_S ranks
LIVE_RANKS_PER_S = 1024  # ranks' rows in live.json written per second at most: a bigger job's is rewritten less often
LEDGER_INTERVAL = 5.0  # s: the ledger is written at most this often, except at once when an incident changes
METRICS_INTERVAL = 1.0  # s between metrics samples at first (up to LIVE_RANKS_PER_S ranks, then longer with the
#                         job's size, as live.json's); doubled each time the file is thinned
MAX_METRICS = 10_000  # samples kept in metrics.jsonl: past this, every other one goes
MAX_METRIC_VALUES = 640_000  # ranks x samples kept: a job of more than 64 ranks keeps fewer samples (the file's size
MIN_METRICS = 100  # and the cost of thinning it stay bounded), but never fewer than this
WRITE_ERROR_EVERY = 60.0  # s between log lines about a record that cannot be written

log = logging.getLogger("toolkit.scheduler")


class Journal:
    """See the module docstring. `directory` is the recovery directory (None: nothing is written); `clock` the
    server's monotonic clock, `wall` the time of day (persisted times are wall-clock)."""

    def __init__(self, directory: Path | None, job: str, world_size: int, threshold: float,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.dir = directory
        self.job = job
        self.world_size = world_size
        self.clock, self.wall = clock, wall
        self.stragglers = Stragglers(threshold)
        self.ledger = Ledger(job, world_size, wall())
        self.status = JobStatus.RUNNING
        self.generation = 0
        self.formed = False
        self.elastic: dict[str, Any] | None = None  # a shrunk world (workers, L, who serves what); None: the plain one
        now = clock()
        self.live_at = self.eval_at = self.metrics_at = now
        self.ledger_at = now + LEDGER_INTERVAL
        self.metrics_interval = METRICS_INTERVAL * max(1.0, world_size / LIVE_RANKS_PER_S)
        self.metrics_lines = 0
        self.live_interval = LIVE_INTERVAL * max(1.0, world_size / LIVE_RANKS_PER_S)
        self.max_metrics = min(MAX_METRICS, max(MIN_METRICS, MAX_METRIC_VALUES // max(1, world_size)))
        self.error_said = -math.inf
        self.deaths: dict[int, tuple[str, int]] = {}  # rank -> (node id, deaths of its processes): restarts
        self.step_heard_at: float | None = None  # monotonic: when the job's newest step was first heard
        self._goodput: tuple[Any, float | None] = (None, None)  # (generation and faults, goodput) told at formation

    def restore(self) -> list[Log]:
        """Read back the ledger of this run (after a scheduler restart, or `train` after `stop`); a damaged or
        foreign one is moved aside and a new ledger starts. Returns what to log."""
        if self.dir is None:
            return []
        path = self.dir / rundoc.LEDGER_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            return []
        except OSError as e:
            return [Log(logging.WARNING, f"cannot read the ledger {path} ({e.strerror}); a new one starts")]
        try:
            ledger = Ledger.from_json(json.loads(text))
            if (ledger.job != self.job or ledger.world_size != self.world_size
                    or ledger.outcome in (JobStatus.FINISHED, JobStatus.FAILED)):
                raise ValueError(f"it is job {ledger.job!r}'s with {ledger.world_size} workers, {ledger.outcome}")
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            aside = path.with_name(f"{path.name}.{int(self.wall())}.unused")
            try:
                path.rename(aside)
            except OSError:
                pass
            return [Log(logging.WARNING, f"the ledger {path} is not this run's ({e}); moved to {aside.name}, a new "
                                         "one starts")]
        ledger.resume(self.wall())
        self.ledger = ledger
        self.metrics_lines = self._count_metrics()
        return [Log(logging.INFO, f"ledger of job {self.job} read back: {ledger.faults.count} incident(s) so far")]

    # -- facts

    def note(self, note: Note) -> list[Log]:
        """A membership Note: into the ledger and the straggler tracking. Returns what to log."""
        now, wall = self.clock(), self.wall()
        out: list[Log] = []
        f = note.fields
        if note.kind == NoteKind.PACE:
            self.stragglers.observe(f, now)
            last = self.ledger.accounting.last_step
            if isinstance(f.get("step"), int) and (last is None or f["step"] > last):
                self.step_heard_at = now
        elif note.kind == NoteKind.DEATH:
            self.deaths[f["rank"]] = (f["node_id"], self.deaths.get(f["rank"], ("", 0))[1] + 1)
            for c in self.stragglers.forget(f["rank"]):
                self.ledger.straggler_cleared(c.rank, wall)
            self.generation = f["generation"]
            self.formed = self.formed and not f["begins"]
        elif note.kind == NoteKind.FORMED:
            self.generation, self.formed = f["generation"], True
            workers = f.get("workers", self.world_size)  # an elastic job's world of this generation (issue 42)
            self.elastic = None if workers == self.world_size and "logical" not in f else {
                "workers": workers, "world_size": self.world_size, "logical_world": f.get("logical_world"),
                "logical": dict(f.get("logical") or {})}
        elif note.kind in (NoteKind.FINISHED, NoteKind.FAILED):
            self.status = JobStatus(note.kind.value)
        self.ledger.note(note.kind, f, wall)
        if note.kind == NoteKind.DEATH:
            inc = self.ledger.faults.incidents[-1] if self.ledger.faults.incidents else None
            if inc is not None and any(p["node_id"] == f["node_id"] and p["pid"] == f["pid"] for p in inc.processes):
                out.append(Log(logging.INFO, f"ledger: incident {inc.number}: {inc.cause} "
                                             f"({', '.join(p['node_id'] for p in inc.processes)})"))
            else:
                out.append(Log(logging.INFO, f"ledger: {f['node_id']} {f['cause']} after the job was started "
                                             "again: a fault only if some other member came back"))
        return out

    def history(self) -> dict[str, Any]:
        """What `formed` tells the workers: the faults so far and the job's age (for their checkpoint interval), and
        the goodput so far (rank 0's TensorBoard scalars). The goodput is computed once per formation (every rank's
        `formed` asks: O(incidents) once, not per rank)."""
        key = (self.generation, self.ledger.faults.count)
        if self._goodput[0] != key:
            self._goodput = (key, self.ledger.goodput(self.wall()).get("goodput"))
        return {"faults": self.ledger.faults.count, "uptime": round(self.ledger.uptime(self.wall()), 3),
                **({"goodput": self._goodput[1]} if self._goodput[1] is not None else {})}

    def restarts(self) -> list[tuple[int, str, int]]:
        """(rank, node id, deaths of its processes) of every rank that died since this scheduler started: each death
        was followed by a restart or a replacement (the metrics endpoint's restarts per process)."""
        return [(r, node_id, n) for r, (node_id, n) in sorted(self.deaths.items())]

    def checkpoint_bytes(self) -> int:
        """Bytes of the newest checkpoint, summed over the ranks' latest reports (0 before any)."""
        return sum(f.figures.get("ckpt_bytes", 0) for f in self.stragglers.ranks.values())

    def stopped(self, why: str) -> None:
        """The scheduler is stopped by a signal: the ledger says so (a later start resumes it)."""
        self.ledger.stopped(why, self.wall())

    # -- time

    def next_deadline(self) -> float:
        """When `tick` has something to do next (monotonic)."""
        due = [self.eval_at]
        if self.dir is not None:
            due += [self.live_at, self.metrics_at]
            if self.ledger.dirty:
                due.append(self.clock() if self.ledger.urgent else self.ledger_at)
        return min(due)

    def tick(self) -> list[Log]:
        """Evaluate stragglers and write what is due; returns what to log."""
        now, wall = self.clock(), self.wall()
        out: list[Log] = []
        if now >= self.eval_at:
            self.eval_at = now + EVAL_INTERVAL
            for event in self.stragglers.evaluate(now):
                out.append(self._straggler(event, wall))
        if self.dir is None:
            return out
        if self.ledger.dirty and (self.ledger.urgent or now >= self.ledger_at):
            self._write_ledger(now)
        if now >= self.metrics_at:
            self.metrics_at = now + self.metrics_interval
            self._sample(wall)
        if now >= self.live_at:
            self.live_at = now + self.live_interval
            self._write(rundoc.LIVE_FILE, json.dumps(self.live(now, wall)))
        return out

    def close(self) -> None:
        """The scheduler exits: the ledger and live.json as they end."""
        if self.dir is not None:
            now = self.clock()
            self._write_ledger(now)
            self._write(rundoc.LIVE_FILE, json.dumps(self.live(now, self.wall())))

    # -- documents

    def live(self, now: float, wall: float) -> dict[str, Any]:
        """live.json's document (toolkit.contracts.rundoc)."""
        ranks = {}
        stalled_for = self.stalled_for(now)
        for r, fig in sorted(self.stragglers.ranks.items()):
            score = self.stragglers.scores.get(r)
            step_time = fig.figures.get("step_time")
            ranks[str(r)] = {
                "node_id": fig.node_id, "host": fig.host, "pid": fig.pid, "step": fig.step,
                "steps_per_s": 0.0 if stalled_for is not None else round(1.0 / step_time, 3) if step_time else None,
                # while the job is stalled: how long since this rank's step moved
                "no_step_for": None if stalled_for is None or fig.stepped_at is None else round(now - fig.stepped_at,
                                                                                                  1),
                "step_time": step_time, "busy": fig.figures.get("busy"), "loss": fig.figures.get("loss"),
                "heartbeat_age": round(now - fig.seen_at, 3), "score": round(score, 3) if score else None,
                "straggler": r in self.stragglers.flagged, "ckpt_every": fig.figures.get("ckpt_every"),
                "ckpt_skipped": fig.figures.get("ckpt_skipped"),
            }
        last = self.ledger.faults.incidents[-1] if self.ledger.faults.incidents else None
        return {
            "version": rundoc.LIVE_VERSION, "job": self.job, "updated_at": wall, "status": self.status,
            "generation": self.generation, "formed": self.formed, "world_size": self.world_size, "ranks": ranks,
            "stragglers": [{"rank": n.rank, "node_id": n.node_id, "host": n.host, "factor": round(n.factor, 2)}
                           for n in self.stragglers.flagged.values()],
            "skipping_checkpoints": list(self.ledger.accounting.skipping.values()),  # runs that last now
            "last_incident": None if last is None else {
                "number": last.number, "cause": last.cause, "at": last.detected_at, "step": last.step,
                "processes": [p["node_id"] for p in last.processes], "hosts": sorted({p["host"] for p in
                                                                                     last.processes}),
                "relaunched": [p["node_id"] for p in last.relaunched],
                "time_to_recover": last.time_to_recover, "recomputed": last.recomputed,
                "formed_in": None if last.formed_at is None else round(last.formed_at - last.failed_at, 3)},
            "incidents": self.ledger.faults.count,
            "elastic": self.elastic,
            "reports_steps": self.ledger.accounting.last_step is not None,
            "stalled_for": None if stalled_for is None else round(stalled_for, 1),
            "goodput": self.ledger.goodput(wall, stalled_for or 0.0),
            "progress": self.progress(ranks.values()),
        }

    def stalled_for(self, now: float) -> float | None:
        """Seconds since the job's newest step moved, once that is the progress watchdog's bound or more
        (protocol.stall_bound of the largest p99 step time a rank reports) while the job runs formed; else None.
        A stall is shown as one (`no step for 42 s`, 0 steps/s, not productive in the goodput so far) whether or
        not the watchdog can name a rank for it (a script that reports its steps but blocks outside a collective
        on every rank, or whose stuck rank is in a phase it said is long)."""
        figs = [f for f in self.stragglers.ranks.values() if f.stepped_at is not None]
        if not figs or not self.formed or self.status != JobStatus.RUNNING:
            return None
        p99s = [f.figures["step_p99"] for f in figs if f.figures.get("step_p99")]
        idle = now - max(f.stepped_at for f in figs if f.stepped_at is not None)
        return idle if idle >= protocol.stall_bound(max(p99s) if p99s else None) else None

    def progress(self, rows: Any) -> dict[str, Any]:
        """How far the job got: the newest step, the steps the run will take (the largest `total` a rank reported;
        None when the script does not say), and the median of the ranks' recent steps/s (what an ETA stands on)."""
        totals = [f.figures["total"] for f in self.stragglers.ranks.values() if "total" in f.figures]
        rates = sorted(r["steps_per_s"] for r in rows if r["steps_per_s"])
        return {"step": self.ledger.accounting.last_step, "total": max(totals, default=None),
                "steps_per_s": rates[len(rates) // 2] if rates else None}

    def _straggler(self, event: Named | Cleared, wall: float) -> Log:
        if isinstance(event, Named):
            self.ledger.straggler(event.rank, event.node_id, event.host, event.factor, event.busy, event.median,
                                  wall)
            return Log(logging.WARNING, f"straggler: {event.node_id} (rank {event.rank}) on {event.host} works "
                                        f"{event.factor:.2f}x as long per step as the median of the others "
                                        f"({event.busy:.4f} s vs {event.median:.4f} s)")
        self.ledger.straggler_cleared(event.rank, wall)
        return Log(logging.INFO, f"straggler no more: {event.node_id} (rank {event.rank}) on {event.host}")

    def _write_ledger(self, now: float) -> None:
        if self._write(rundoc.LEDGER_FILE, json.dumps(self.ledger.to_json(self.wall()))):
            self.ledger.dirty = self.ledger.urgent = False
        self.ledger_at = now + LEDGER_INTERVAL

    def _sample(self, wall: float) -> None:
        """Append one metrics line; thin the file when it passes MAX_METRICS."""
        ranks = {r: [f.step, f.figures.get("loss"), f.figures.get("step_time"), f.figures.get("busy")]
                 for r, f in self.stragglers.ranks.items() if f.step is not None}
        if not ranks or self.dir is None:
            return
        path = self.dir / rundoc.METRICS_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with open(fd, "a") as fh:  # 0600, as every file of the recovery directory (not 0666 less the umask)
                fh.write(rundoc.metric_line(wall, self.generation, ranks) + "\n")
            self.metrics_lines += 1
            if self.metrics_lines > self.max_metrics:
                kept = path.read_text().splitlines()[::2]
                atomicfile.write(path, "\n".join(kept) + "\n")
                self.metrics_lines = len(kept)
                self.metrics_interval *= 2
        except OSError as e:
            self._say_error(path, e)

    def _count_metrics(self) -> int:
        if self.dir is None:
            return 0
        try:
            with open(self.dir / rundoc.METRICS_FILE, "rb") as fh:
                return sum(1 for _ in fh)
        except OSError:
            return 0

    def _write(self, name: str, text: str) -> bool:
        """Replace `name` in the recovery directory with `text` (atomically); False if it could not be."""
        if self.dir is None:
            return False
        path = self.dir / name
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomicfile.write(path, text)
            return True
        except OSError as e:
            self._say_error(path, e)
            return False

    def _say_error(self, path: Path, e: OSError) -> None:
        now = self.clock()
        if now - self.error_said >= WRITE_ERROR_EVERY:
            self.error_said = now
            log.warning("cannot write %s (%s); the run's record lags, the job goes on", path, e.strerror or e)
