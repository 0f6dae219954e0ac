"""`fleet report`'s pure part (toolkit.launcher.runreport.report_data, the figure and the tables) on a hand-made ledger,
and the task locally (no SSH) on documents placed where the scheduler writes them. The run with real faults is in
tests/e2e/test_ledger_report.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console

from toolkit.contracts import rundoc
from toolkit.freeports import free_port_pair
from toolkit.launcher import runreport as R
from toolkit.scheduler.ledger import Ledger
from toolkit.scheduler.membership import CAUSE_CLOSED, CAUSE_SILENCE

T0 = 5_000.0
BIN = Path(sys.executable).parent
WORKER = Path(__file__).resolve().parent / "scripts" / "tasks_worker.py"
COMMAND_TIMEOUT = 120.0


def death(rank: int, cause: str, generation: int, host: str, silent_for: float = 0.0) -> dict[str, Any]:
    return {"node_id": f"worker_{rank}", "rank": rank, "host": host, "pid": 100 + rank, "cause": cause,
            "reason": "test", "silent_for": silent_for, "step": None, "recovery": "in-place", "begins": True,
            "generation": generation}


def pace(rank: int, step: int) -> dict[str, Any]:
    return {"rank": rank, "node_id": f"worker_{rank}", "host": "h", "pid": 100 + rank, "step": step,
            "step_time": 0.5, "ckpt_stall": 0.0}


def two_faults() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Two ranks, one sample a second, two steps a second. Rank 1 is killed at step 10 (t=15) and the job resumes
    from step 10 at t=20; rank 0 falls silent at step 20 (t=25), is declared dead at t=28, and the job resumes from
    a checkpoint at step 16 at t=32 (4 steps recomputed); the job finishes at step 30 (t=41)."""
    led = Ledger("demo", 2, T0)
    samples: list[tuple[float, int, dict[int, list[Any]]]] = []
    led.note("formed", {"generation": 0}, T0 + 8)
    step = 0
    for t in range(10, 16):  # steps 0..10
        step = (t - 10) * 2
        for r in (0, 1):
            led.note("pace", pace(r, step), T0 + t)
        samples.append((T0 + t, 0, {r: [step, 2.0 - step / 100 + r / 1000, 0.5, 0.2] for r in (0, 1)}))
    led.note("death", death(1, CAUSE_CLOSED, 1, "h2"), T0 + 15.5)
    led.note("exited", {"node_id": "worker_1", "rank": 1, "host": "h2", "pid": 101, "code": None,
                        "signal": "SIGKILL"}, T0 + 15.6)
    for t in range(16, 20):  # rank 0 waits at step 10, rank 1 is gone
        samples.append((T0 + t, 1, {0: [10, 1.9, 0.5, 0.2]}))
    led.note("formed", {"generation": 1}, T0 + 19)
    for r in (0, 1):
        led.note("recovered", {"rank": r, "generation": 1, "step": 10, "recomputed": 0}, T0 + 20)
    for t in range(20, 26):  # steps 10..20
        step = 10 + (t - 20) * 2
        for r in (0, 1):
            led.note("pace", pace(r, step), T0 + t)
        samples.append((T0 + t, 1, {r: [step, 2.0 - step / 100 + r / 1000, 0.5, 0.2] for r in (0, 1)}))
    led.note("death", death(0, CAUSE_SILENCE, 2, "h1", silent_for=3.0), T0 + 28)
    led.note("formed", {"generation": 2}, T0 + 31)
    for r in (0, 1):
        led.note("recovered", {"rank": r, "generation": 2, "step": 16, "recomputed": -1}, T0 + 32)
    for t in range(33, 41):  # steps 16..30
        step = 16 + (t - 33) * 2
        for r in (0, 1):
            led.note("pace", pace(r, step), T0 + t)
        samples.append((T0 + t, 2, {r: [step, 2.0 - step / 100 + r / 1000, 0.5, 0.2] for r in (0, 1)}))
    led.note("finished", {}, T0 + 41)
    metrics = "\n".join(rundoc.metric_line(t, g, ranks) for t, g, ranks in samples)
    return json.loads(json.dumps(led.to_json(T0 + 41))), rundoc.read_metrics(metrics)


def test_report_data_places_incidents_and_generations() -> None:
    ledger, metrics = two_faults()
    data = R.report_data(ledger, metrics)
    assert (data["job"], data["outcome"], data["duration"], data["last_step"]) == ("demo", "finished", 41.0, 30)
    one, two = data["incidents"]
    assert (one["cause"], one["hosts"], one["step"], one["failed"], one["recovered"]) == \
        ("killed by SIGKILL", ["h2"], 10, 15.5, 20.0)
    assert (two["cause"], two["hosts"], two["processes"], two["failed"], two["detected_after"]) == \
        ("heartbeat silence", ["h1"], ["worker_0"], 25.0, 3.0)
    assert (two["resumed_from"], two["recomputed"], two["step"]) == (16, 4, 20)  # struck at 20, resumed at 16
    assert [(g["generation"], g["start"], g["end"], g["first_step"], g["last_step"]) for g in data["generations"]] \
        == [(0, 8.0, 19.0, 0, 10), (1, 19.0, 31.0, 10, 20), (2, 31.0, 41.0, 16, 30)]
    assert data["goodput"] == {k: ledger["goodput"][k] for k in ("wall", *R.BREAKDOWN, "goodput", "basis", "note")}


def test_report_data_series() -> None:
    data = R.report_data(*two_faults())
    loss0 = data["loss"]["0"]
    assert loss0["step"][:3] == [2, 4, 6] and loss0["loss"][0] == 1.98
    points = list(zip(loss0["step"], loss0["loss"], strict=True))
    assert all(a != b for a, b in zip(points, points[1:], strict=False))  # a sample repeated while waiting: no point
    assert points.count((18, 1.82)) == 2  # a recomputed step shows again
    rate0, rate1 = data["rate"]["0"], data["rate"]["1"]
    at = dict(zip(rate0["t"], rate0["steps_per_s"], strict=True))
    assert at[12.0] == 2.0 and at[17.0] == 0.0  # two steps a second, nothing while the job recovers
    at1 = dict(zip(rate1["t"], rate1["steps_per_s"], strict=True))
    assert at1[20.0] is None and at1[21.0] == 2.0  # rank 1 was gone: a gap, then its pace again
    assert at[33.0] is None  # rolled back to step 16: a gap
    assert set(data["busy"]["0"]["busy"]) == {0.2}


def test_report_data_is_lenient_with_damaged_documents() -> None:
    data = R.report_data({"version": 1, "incidents": [{"number": "x"}, 3], "generations": [None, {}]},
                         [{"t": 1.0, "ranks": {"0": "no", "1": [True, None, None, None]}}, {"t": "x"}])
    assert data["generations"] == [] and len(data["incidents"]) == 1 and data["loss"] == {}
    assert R.summary_tables(data)  # draws nothing it does not have, fails on nothing


def test_the_figure_is_drawn_from_the_data(tmp_path: Path) -> None:
    data = R.report_data(*two_faults())
    fig = R.draw(data, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    ax_loss, ax_rate, ax_good = fig.axes[:3]
    spans = [p for p in ax_loss.patches if (p.get_gid() or "").startswith("generation-")]
    assert [(p.get_x(), p.get_x() + p.get_width()) for p in spans] == [(0, 10), (10, 20), (16, 30)]
    marks = {ln.get_gid(): ln.get_xdata()[0] for ln in ax_loss.lines if (ln.get_gid() or "").startswith("incident")}
    assert marks == {"incident-1": 10, "incident-2": 20}
    rates = {ln.get_gid() for ln in ax_rate.lines}
    assert {"rate-rank-0", "rate-rank-1", "incident-1", "incident-2"} <= rates
    widths = {p.get_gid(): p.get_width() for p in ax_good.patches}
    assert widths == {f"goodput-{k}": data["goodput"][k] for k in R.BREAKDOWN}


def test_a_run_without_loss_or_generations_draws_without_a_warning(tmp_path: Path) -> None:
    """A plain script that reports no loss: the loss panel has nothing to label, and matplotlib's "No artists with
    labels found to put in legend" must not reach the user's terminal."""
    ledger, metrics = two_faults()
    data = R.report_data({**ledger, "generations": []}, [{**m, "ranks": {}} for m in metrics])
    assert data["loss"] == {} and data["generations"] == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = R.draw(data, tmp_path / "r.png")
    assert fig.axes[0].get_legend() is None and (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_the_tables_say_the_same(tmp_path: Path) -> None:
    console = Console(width=200, record=True, file=open(tmp_path / "out.txt", "w"))  # noqa: SIM115 - test sink
    for table in R.summary_tables(R.report_data(*two_faults())):
        console.print(table)
    text = console.export_text()
    assert "killed by SIGKILL" in text and "heartbeat silence" in text and "3 generation(s)" in text
    assert "goodput" in text and "worker_0" in text


def test_a_script_that_reports_no_steps_says_what_its_goodput_stands_on(tmp_path: Path) -> None:
    """An unmodified torchrun-style script (no step, no loss): the goodput is the upper bound from its group's
    formations and says so in the tables and the title; the empty loss panel says how to fill it."""
    led = Ledger("plain", 2, T0)
    led.note("formed", {"generation": 0, "recovery": ["restart"]}, T0 + 10)
    led.note("death", {**death(1, CAUSE_CLOSED, 1, "h2"), "recovery": "restart"}, T0 + 30)
    led.note("formed", {"generation": 1, "recovery": ["restart"]}, T0 + 36)
    led.note("finished", {}, T0 + 60)
    data = R.report_data(json.loads(json.dumps(led.to_json(T0 + 60))), [])
    assert data["goodput"]["basis"] == "formations" and data["goodput"]["goodput"] == 0.7333  # (60-10-6)/60
    assert data["goodput"]["productive"] == 44.0 and data["loss"] == {}
    console = Console(width=300, record=True, file=open(tmp_path / "out.txt", "w"))  # noqa: SIM115 - test sink
    for table in R.summary_tables(data):
        console.print(table)
    text = console.export_text()
    assert "at most 73.3%" in text and "upper bound" in text and "toolkit.train.report" in text, text
    assert "0.0%" not in text.split("goodput", 1)[1].splitlines()[0]
    fig = R.draw(data, tmp_path / "plain.png")
    assert "goodput at most 73.3%" in fig._suptitle.get_text()
    assert [t.get_gid() for t in fig.axes[0].texts] == ["no-loss"]


def fleet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "fleet"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT)


def test_fleet_report_locally(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(WORKER, project / "train.py")
    (project / "fabric.yaml").write_text(f"toolkit:\n  workdir: {tmp_path / 'work'}\n  warm_spare: false\n")
    flags = ["--job", "rep", "--worker-num", "2", "--master-port", str(free_port_pair())]
    assert fleet("deploy", *flags, cwd=project).returncode == 0
    r = fleet("report", *flags, cwd=project)  # deployed, never run
    assert r.returncode == 2 and "no ledger yet" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr

    recovery = tmp_path / "work" / "rep" / "recovery"
    ledger, metrics = two_faults()
    (recovery / rundoc.LEDGER_FILE).write_text(json.dumps(ledger))
    (recovery / rundoc.METRICS_FILE).write_text("cut line\n" + "\n".join(json.dumps(m) for m in metrics) + "\n")
    r = fleet("report", *flags, cwd=project)
    assert r.returncode == 0, r.stderr
    assert "killed by SIGKILL" in r.stdout and (project / "rep-report.png").read_bytes()[:4] == b"\x89PNG"
    r = fleet("report", "--json", *flags, cwd=project)
    assert r.returncode == 0 and json.loads(r.stdout) == R.report_data(ledger, metrics), r.stderr

    r = fleet("report", "--out", str(tmp_path / "nowhere" / "r.png"), *flags, cwd=project)
    assert r.returncode == 2 and "cannot write the report" in r.stderr and "--out" in r.stderr, r.stderr
    (recovery / rundoc.LEDGER_FILE).write_text("{damaged")
    r = fleet("report", *flags, cwd=project)
    assert r.returncode == 2 and "not a ledger" in r.stderr and "Traceback" not in r.stderr, r.stderr
