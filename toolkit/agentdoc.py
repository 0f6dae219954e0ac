"""The agent's documents, defined once for the agent that writes them and for `fleet` that reads them (over SSH,
from the files, without starting a Python on the host):

- `state/agent.pid`: "<pid> <start time in clock ticks>" of the running agent (`pid_record`);
- `state/agent.json`: the agent's state, rewritten atomically on every change (`STATES`, `FINAL_STATES`); whether
  its writer still runs is decided by one rule (`judge`);
- `state/agent.sock`: its control socket, one JSON request per line (`ControlOp`) and one reply;
- `state/progress.sock`: the workers' progress datagrams (`progress`);
- `job-id`: which job of which project the job directory holds (`JOB_ID_FILE`, `read_identity`), written once by
  the first deploy (tasks.scripts.LAYOUT_SCRIPT) and compared by every later deploy, start and stop.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Mapping

AGENT_STATES = ("starting", "running", "finishing", "stopping", "succeeded", "failed", "stopped")
FINAL_STATES = ("succeeded", "failed", "stopped")  # an agent in one of these has exited for good
GONE = "gone"  # what `status` says of an agent whose process is gone before reaching a final state
ABSENT = "absent"  # never started here (no agent.json)


JOB_ID_FILE = "job-id"  # in the job directory: "<job id>\n<project it was deployed from>\n"
MAX_IDENTITY = 2048  # bytes of it read: it is two short lines
EXIT_OTHER_JOB = 4  # the agent's `start`/`stop --job-id`: the directory holds another project's job (left alone)


def read_identity(text: str) -> tuple[str, str]:
    """(job id, where it was deployed from) from job-id's text; ("", "") when the text has no id. The second line
    is only shown to people (with its control characters escaped by the caller)."""
    lines = text[:MAX_IDENTITY].split("\n")
    job_id = lines[0].strip()
    return (job_id, lines[1].strip() if len(lines) > 1 else "") if job_id else ("", "")


class ControlOp(str, enum.Enum):
    """Requests on the agent's control socket: `{"op": "status"}` -> the agent.json document; `{"op": "restart",
    "node_id": N}` -> `{"ok", "node_id", "was_pid", "pid"}` or `{"ok": false, "error"}`; `{"op": "stop"}` ->
    `{"ok": true}`, then the agent stops its children and exits."""

    STATUS = "status"
    RESTART = "restart"
    STOP = "stop"


def pid_record(text: str) -> tuple[int, int] | None:
    """(pid, start ticks) from agent.pid's text; None unless both are there. A pid alone is never trusted: pids
    are reused, and a pid file from before a reboot (or written by someone else) would name an unrelated process."""
    try:
        words = text.split()
        pid, ticks = int(words[0]), int(words[1])
    except (IndexError, ValueError):
        return None
    return (pid, ticks) if pid > 1 and ticks >= 0 else None


def stat_matches(record: tuple[int, int], stat_text: str) -> bool:
    """Whether /proc/<pid>/stat's text shows the recorded process alive: no zombie, the recorded start time. Pure:
    `fleet status` reads the file over SSH and decides here, without a Python on the host."""
    fields = stat_text.rsplit(")", 1)[-1].split()
    return len(fields) >= 20 and fields[0] not in ("Z", "X") and fields[19] == str(record[1])


def judge(doc: Mapping[str, Any] | None, running: tuple[int, int] | None) -> dict[str, Any]:
    """agent.json as `status` reports it: with `alive` (its writer is the running agent) and the state `gone` when the
    agent died before reaching a final state (`absent` without a document). Pure: `running` is the caller's finding
    (commands.running_agent on the host, stat_matches over SSH); returns a new dict."""
    if doc is None:
        return {"state": ABSENT, "alive": False, "processes": []}
    agent = doc.get("agent") if isinstance(doc.get("agent"), Mapping) else {}
    alive = running is not None and agent.get("pid") == running[0]
    out = dict(doc)
    if not alive and out.get("state") not in FINAL_STATES:
        out["state"] = GONE
    out["alive"] = alive
    return out


def recorded_groups(text: str) -> list[tuple[str, int, int]]:
    """(node_id, pgid, leader start ticks) of every process an agent.json names. An entry without its leader's start
    time is skipped: a group id alone may name someone else's processes by now."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return []
    out = []
    for p in doc.get("processes", []) if isinstance(doc, dict) else []:
        if not isinstance(p, dict):
            continue
        pgid = p.get("pgid") or p.get("last_pid")  # a session leader's pgid is its pid
        ticks = p.get("start_ticks") if p.get("pgid") else p.get("last_start_ticks")
        if (isinstance(pgid, int) and not isinstance(pgid, bool) and pgid > 1 and isinstance(ticks, int)
                and not isinstance(ticks, bool)):
            out.append((str(p.get("node_id")), pgid, ticks))
    return out


def progress(node_id: str, step: int | None = None, epoch: int | None = None,
             recovery: str | None = None) -> dict[str, Any]:
    """A progress datagram: how far a worker got, and how it recovers (protocol.RECOVERY_*)."""
    return {"node_id": node_id, "step": step, "epoch": epoch, "recovery": recovery}
