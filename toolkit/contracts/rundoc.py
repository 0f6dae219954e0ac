"""The documents the scheduler keeps about a run, in its recovery directory (MS_RECOVERY_PATH, by default
`<job dir>/recovery`), defined once for the scheduler that writes them (toolkit.scheduler.journal) and for `fleet
status` and `fleet report` that read them (over SSH, as text):

- `live.json`, rewritten every second: the job's generation and status, each rank's step, pace (steps/s, own-work
  time, straggler score), loss and heartbeat age, the named stragglers, the last incident and the goodput so far.
  What `fleet status` (and `--watch`) shows beside the agents' own files.
- `ledger.json`: the goodput ledger (toolkit.scheduler.ledger: incidents, generations, straggler episodes,
  checkpoint intervals, goodput). Kept across scheduler restarts; moved aside with the rest of a run by
  `train --fresh` / `--again`.
- `metrics.jsonl`: one sample per line (`t` wall-clock s, `generation`, and per rank `[step, loss, step_time,
  busy]`), for `fleet report`'s plots; thinned (every other line dropped, the interval doubled) when it grows past
  its bound, so a week-long run keeps a bounded file.

Readers are lenient the way the hostile-input rule asks: a damaged or foreign document is None (or the lines that
parse), never a traceback.
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any

STATE_FILE = "scheduler.json"  # the scheduler's own state (toolkit.scheduler.state)
LIVE_FILE = "live.json"
LEDGER_FILE = "ledger.json"
METRICS_FILE = "metrics.jsonl"
LIVE_VERSION = 1
LEDGER_VERSION = 1
MAX_DOC_BYTES = 32 << 20  # a document larger than this is not read (fleet reads it over SSH)


class JobStatus(str, enum.Enum):
    """The job's state in the document (`status`); a member prints, formats and serializes as its value."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # the ledger's outcome when its operator stopped the scheduler

    __str__ = str.__str__
    __format__ = str.__format__


def read_live(text: str) -> dict[str, Any] | None:
    """live.json's document, or None if it is missing, damaged or of another version."""
    doc = _json(text)
    return doc if doc is not None and doc.get("version") == LIVE_VERSION else None


def read_ledger(text: str) -> dict[str, Any] | None:
    """ledger.json's document (toolkit.scheduler.ledger.Ledger.to_json), or None."""
    doc = _json(text)
    if doc is None or doc.get("version") != LEDGER_VERSION or not isinstance(doc.get("incidents"), list):
        return None
    return doc


def read_metrics(text: str) -> list[dict[str, Any]]:
    """metrics.jsonl's samples, in order; lines that do not parse (a line cut by a crash) are skipped."""
    out = []
    for line in text.splitlines():
        doc = _json(line)
        if doc is not None and isinstance(doc.get("t"), (int, float)) and isinstance(doc.get("ranks"), dict):
            out.append(doc)
    return out


def metric_line(t: float, generation: int, ranks: dict[int, list[Any]]) -> str:
    """One metrics.jsonl line: `ranks` maps a rank to [step, loss, step_time, busy] (None where unknown)."""
    return json.dumps({"t": round(t, 3), "generation": generation,
                       "ranks": {str(r): [_finite(v) for v in vals] for r, vals in sorted(ranks.items())}},
                      separators=(",", ":"))


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _json(text: str) -> dict[str, Any] | None:
    if not text or len(text) > MAX_DOC_BYTES:
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None
