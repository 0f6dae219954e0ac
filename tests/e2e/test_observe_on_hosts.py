"""The operator's view on the namespace cluster, one job watched through its whole life by `status --watch` with a
captured console: an even stretch names no straggler, a rank slowed on purpose is named with its host and rank,
a killed worker shows restarting then running, a partitioned host's rows show unreachable while the others keep
updating, and the watch exits 0 at the job's end. One job for all of it: each phase costs a job's start-up
otherwise."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from typing import Any

from fault_harness import E2E, SCRIPT_ARGS, Job
from rich.console import Console

from toolkit.contracts import jobrecord, rundoc
from toolkit.launcher.jobhosts.reach import record_ssh
from toolkit.launcher.settings import CoreFlags
from toolkit.launcher.tasks.watch import watch_record
from toolkit.testing.slowdown import bursts

RUN_ARGS = SCRIPT_ARGS.replace("--epochs 2", "--epochs 10")  # long enough to slow, kill, cut off and recover
WATCH_EVERY = 0.5  # s between refreshes of the watch under test
COLUMNS = ("host", "node_id", "rank", "pid", "state", "restarts", "step", "steps_per_s", "loss", "heartbeat",
           "log_age", "note")  # the status table's, in order
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
EVEN_STEPS = 40  # steps of the straggler job before one rank is slowed: ~10 s of evaluations naming nobody


class Screen:
    """What a captured terminal showed: each refresh of the watch (split at its title) as rows per node id."""

    def __init__(self, job: str) -> None:
        self.buffer = _Buffer()
        self.console = Console(file=self.buffer, force_terminal=True, width=240, color_system="standard")
        self.title = f"job {job}:"

    def frames(self) -> list[dict[str, Any]]:
        """Each refresh: {"rows": {node_id: {column: cell}}, "text": the refresh's lines}."""
        text = ANSI.sub("", self.buffer.text())
        out = []
        for part in text.split(self.title)[1:]:
            rows = {}
            for line in part.splitlines():
                cells = [c.strip() for c in line.split("│")[1:-1]]
                if len(cells) == 12 and cells[1] not in ("node id", ""):
                    rows[cells[1]] = dict(zip(COLUMNS, cells, strict=True))
            out.append({"rows": rows, "text": part})
        return out


class _Buffer:
    """A file for rich that keeps everything written, readable while the watch writes from another thread."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True

    def text(self) -> str:
        with self.lock:
            return "".join(self.parts)


def _step(cell: str) -> int:
    return int(cell) if cell.isdigit() else -1


def _ledger(job: Job, host: str) -> dict[str, Any]:
    return rundoc.read_ledger((job.job_dir(host) / "recovery" / rundoc.LEDGER_FILE).read_text()) or {}


def test_one_job_watched_through_a_straggler_a_kill_and_a_partition(e2e: E2E) -> None:
    job = e2e.job("observed", "--script-args", RUN_ARGS, "--no-warm-spare")  # a cold relaunch: seconds restarting
    job.start()
    job.wait_step(2)
    record = jobrecord.load(e2e.project, "observed")
    screen = Screen("observed")
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            watch_record(record, record_ssh(record, CoreFlags()), WATCH_EVERY, console=screen.console)
            outcome["returned"] = True
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            outcome["error"] = e

    watcher = threading.Thread(target=run, daemon=True)
    watcher.start()
    host = e2e.hosts[1]
    victim = sorted(job.workers_on(host))[0]
    rank = int(victim.split("_")[1])

    def advanced() -> bool:
        steps = [s for s in (_step(f["rows"].get(victim, {}).get("step", "")) for f in screen.frames()) if s >= 0]
        return len(steps) >= 2 and steps[-1] > steps[0]

    job.wait_for("the watch's rows to show steps advancing", advanced, evidence=screen.buffer.text)

    # An even stretch: every rank judged, nobody named.
    job.wait_step(EVEN_STEPS)
    assert "straggler: " not in job.log("sched"), job.log("sched")
    live = json.loads(job.fleet("status", "--json").stdout)["live"]
    assert live["stragglers"] == [] and all(r["score"] for r in live["ranks"].values()), live

    # One rank slowed to about a third of its speed: named with host, rank and factor, in the log and in status.
    stop = threading.Event()
    slower = threading.Thread(target=bursts, args=(lambda: job.workers_on(host).get(victim), stop), daemon=True)
    slower.start()
    try:
        named = job.wait_for(f"{victim} named a straggler", lambda: re.search(
            rf"straggler: {victim} \(rank {rank}\) on {host} works (\S+)x", job.log("sched")), timeout=180)
        assert float(named.group(1)) >= 1.5
        others = [n for n in job.processes() if n not in ("sched", victim)]
        assert not any(re.search(rf"straggler: {n} ", job.log("sched")) for n in others)
        shown = json.loads(job.fleet("status", "--json").stdout)
        flagged = {p["node_id"]: p["straggler"] for p in shown["processes"] if p["straggler"] is not None}
        assert list(flagged) == [victim] and flagged[victim] >= 1.5, shown["live"]
        assert [(s["rank"], s["host"]) for s in shown["live"]["stragglers"]] == [(rank, host)]
        job.wait_for("the watch's note naming it", lambda: any(
            f["rows"].get(victim, {}).get("note", "").startswith("straggler") for f in screen.frames()),
            evidence=screen.buffer.text)
    finally:
        stop.set()
        slower.join(10)

    # The straggler killed: its row shows restarting (a cold relaunch), then running with one restart.
    pid = job.workers_on(host)[victim]
    os.kill(pid, signal.SIGKILL)
    job.wait_for(f"{victim} shown restarting", lambda: any(
        f["rows"].get(victim, {}).get("state") == "restarting" for f in screen.frames()), evidence=screen.buffer.text)
    job.wait_for(f"{victim} shown running again after 1 restart", lambda: any(
        r.get("state") == "running" and r.get("restarts") == "1" and r.get("pid") != str(pid)
        for r in (f["rows"].get(victim, {}) for f in screen.frames())), evidence=screen.buffer.text)
    assert job.declared_dead().get(victim), "the kill took effect: the scheduler declared the victim dead"

    # A host cut off: its rows unreachable while the others keep updating.
    cut = e2e.hosts[2]
    kept = [n for n, p in job.processes().items() if p["host"] == e2e.hosts[0]]
    with e2e.cluster.partitioned(cut):
        def unreachable_while_others_update() -> bool:
            frames = [f for f in screen.frames() if f["rows"] and all(
                r["state"] == "unreachable" for r in f["rows"].values() if r["host"] == cut)]
            seen = {tuple(f["rows"][n]["heartbeat"] + f["rows"][n]["log_age"] + f["rows"][n]["state"]
                          for n in kept) for f in frames}
            return len(frames) >= 2 and len(seen) >= 2 and all(
                f["rows"][n]["state"] != "unreachable" for f in frames for n in kept)

        job.wait_for(f"{cut}'s rows unreachable while {e2e.hosts[0]}'s keep updating",
                     unreachable_while_others_update, evidence=screen.buffer.text)
        assert f"{cut}: unreachable" in screen.frames()[-1]["text"]

    # The end: the watch returns (exit 0), its last refresh says so; the CLI's JSON stream agrees.
    code, output = job.join()
    assert code == 0, output
    watcher.join(120)
    assert not watcher.is_alive() and outcome.get("returned"), f"{outcome}\n{screen.buffer.text()[-3000:]}"
    last = screen.frames()[-1]
    assert "job observed succeeded" in last["text"]
    assert all(r["state"] in ("succeeded", "stopped") for r in last["rows"].values()), last["text"]  # all ended
    stream = job.fleet("status", "--watch", "--json", "--interval", "0.5")  # one object: the job ended, exit 0
    objects = [json.loads(line) for line in stream.stdout.splitlines()]
    assert objects[-1]["outcome"] == "succeeded" and objects[-1]["live"]["incidents"] >= 2
    episodes = _ledger(job, job.host_of("sched"))["stragglers"]
    assert [(e["rank"], e["node_id"], e["host"]) for e in episodes] == [(rank, victim, host)], episodes
    assert episodes[0]["factor"] >= 1.5
    job.wait_no_leftovers()
