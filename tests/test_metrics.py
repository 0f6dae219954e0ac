"""The scheduler's Prometheus endpoint (--metrics-address), scraped over HTTP from a real local job while a rank is
stopped (SIGSTOP: no steps) and then killed (kill -9: an incident, a recovery, a restart): what it serves moves as
the ledger does, it names no token or path, and the alert rules (deploy/prometheus) and the Grafana dashboard
(deploy/grafana) name only metrics it serves, the rules firing on the recorded scrapes where the fault says they must.
One job (module fixture) serves every test here."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from promlite import Recording, evaluate, metric_names, parse, seconds
from rich.console import Console

from toolkit.contracts import rundoc
from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.freeports import free_port
from toolkit.launcher.jobhosts.tables import live_lines, progress_line
from toolkit.launcher.plan import JobOptions, PlanError
from toolkit.launcher.tasks.watch import View, render
from toolkit.scheduler import metrics
from toolkit.scheduler.actions import Note, NoteKind
from toolkit.scheduler.config import ConfigError
from toolkit.scheduler.exposition import (
    CAUSE_KINDS,
    MTTR_BUCKETS,
    JobCollector,
    RankLines,
    RankRow,
    Snapshot,
    cause_kind,
    take,
)
from toolkit.scheduler.journal import Journal
from toolkit.scheduler.metrics import Endpoint, Exchange
from toolkit.scheduler.roster import Roster
from toolkit.testing import waits
from toolkit.testing.localjob import LocalJob

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "toolkit-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "toolkit-dashboard.json"
WORLD = 2
ARGS = ["--epochs", "100", "--batch-size", "16", "--step-delay", "0.1"]
STOPPED_FOR = 4.0  # s worker_1 is stopped: no step for ~40 step times (node_timeout below is longer)
SCRAPE_EVERY = 0.5  # s between the recorder's scrapes
LOSS_LINE = re.compile(r"^epoch: \d+, step: (\d+), loss is ([-+0-9.e]+)$", re.M)
TIMEOUT = 240.0  # s for each wait on a loaded 2-core machine
until = partial(waits.until, bound=TIMEOUT)

pytestmark = pytest.mark.timeout(900)


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - a loopback URL the test built
        return reply.read().decode()


class Recorder:
    """Scrapes the endpoint every SCRAPE_EVERY s in a thread; `marks` names moments of the fault."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rec = Recording()
        self.texts: list[str] = []
        self.marks: dict[str, float] = {}
        self.live: dict[str, Any] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                text = get(self.url)
            except OSError:
                self.stop.wait(SCRAPE_EVERY)
                continue
            self.rec.add(time.monotonic(), text)
            self.texts.append(text)
            self.stop.wait(SCRAPE_EVERY)

    def latest(self, name: str, **labels: str) -> float | None:
        for _, samples in reversed(self.rec.scrapes):
            for (n, ls), v in samples.items():
                if n == name and all(dict(ls).get(k) == x for k, x in labels.items()):
                    return v
            return None
        return None


def ledger(job: LocalJob) -> dict[str, Any]:
    try:
        return json.loads((job.dir / "recovery" / "ledger.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Recorder, LocalJob, dict[str, Any]]]:
    """The job, scraped from its start to after its recovery from a kill -9; yields (recorder, job, ledger)."""
    port = free_port()
    job = LocalJob(tmp_path_factory.mktemp("metrics"), WORLD, ARGS, job="watched", node_timeout=15,
                   cluster_time_out=120, grace=5, max_restarts=1, metrics_address=f"127.0.0.1:{port}")
    rec = Recorder(f"http://127.0.0.1:{port}/metrics")
    job.start()
    rec.thread.start()
    try:
        until("step 20 in a scrape", lambda: (rec.latest("toolkit_job_last_step") or 0) >= 20, job)
        rec.marks["steady"] = time.monotonic()
        pid = job.procs()["worker_1"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(STOPPED_FOR)  # the fault itself: a rank stopped this long
        finally:
            os.kill(pid, signal.SIGCONT)
        rec.marks["stopped"] = time.monotonic()
        step = rec.latest("toolkit_job_last_step") or 0
        until("steps again after SIGCONT", lambda: (rec.latest("toolkit_job_last_step") or 0) >= step + 10, job)
        rec.marks["before kill"] = time.monotonic()
        os.kill(job.procs()["worker_1"]["pid"], signal.SIGKILL)
        done = until("the incident's recovery in the ledger", lambda: (lambda d: d if d.get("incidents") and
                     d["incidents"][0]["time_to_recover"] is not None else None)(ledger(job)), job)
        until("the recovery in a scrape", lambda: rec.latest("toolkit_job_time_to_recover_seconds_count") == 1, job)
        rec.marks["recovered"] = time.monotonic()
        until("every rank's pace again", lambda: all(rec.latest("toolkit_rank_steps_per_second", rank=str(r))
                                                     for r in range(WORLD)), job)
        rec.live = until("live.json with the progress", lambda: (lambda d: d if d and (d.get("progress") or {}).get(
            "total") and d["progress"].get("steps_per_s") else None)(rundoc.read_live(
                (job.dir / "recovery" / rundoc.LIVE_FILE).read_text())), job)
        yield rec, job, done
    finally:
        rec.stop.set()
        rec.thread.join(10)
        job.cleanup()


def test_the_scrape_moves_as_the_ledger_does(recorded: tuple[Recorder, LocalJob, dict[str, Any]]) -> None:
    rec, job, doc = recorded
    before = [s for t, s in rec.rec.scrapes if t < rec.marks["before kill"]][-1]
    after = rec.rec.scrapes[-1][1]

    def value(samples: dict, name: str, **labels: str) -> float | None:
        return next((v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()), None)

    assert doc["incident_count"] == 1, doc
    inc = doc["incidents"][0]
    assert cause_kind(inc["cause"]) == "signal", inc  # killed by SIGKILL, as the agent saw it
    assert value(before, "toolkit_job_incidents_total", cause="signal") == 0
    assert value(after, "toolkit_job_incidents_total", cause="signal") == 1
    assert sum(v for (n, _), v in after.items() if n == "toolkit_job_incidents_total") == doc["incident_count"]
    assert value(before, "toolkit_job_time_to_recover_seconds_count") == 0
    assert value(after, "toolkit_job_time_to_recover_seconds_count") == 1
    assert value(after, "toolkit_job_time_to_recover_seconds_sum") == pytest.approx(inc["time_to_recover"], abs=1e-6)
    bound = next(b for b in MTTR_BUCKETS if inc["time_to_recover"] <= b)
    assert value(after, "toolkit_job_time_to_recover_seconds_bucket", le=repr(bound)) == 1
    assert value(before, "toolkit_process_restarts_total", rank="1") is None
    assert value(after, "toolkit_process_restarts_total", rank="1", node_id="worker_1", host="localhost") == 1
    assert value(after, "toolkit_process_restarts_total", rank="0") is None
    assert value(after, "toolkit_job_world_size") == WORLD and value(after, "toolkit_job_max_restarts") == 1
    for rank in range(WORLD):
        assert value(after, "toolkit_rank_steps_per_second", rank=str(rank)) > 0
        assert value(after, "toolkit_rank_loss", rank=str(rank)) is not None
        assert value(after, "toolkit_rank_straggler", rank=str(rank)) is None  # a series only for a straggler
    assert value(after, "toolkit_job_goodput_ratio") == pytest.approx(doc["goodput"]["goodput"], abs=0.2)
    page = rec.texts[-1]
    for secret in (job.token, str(job.dir), "train.py", "--step-delay"):
        assert secret not in page, secret


def test_the_alert_rules_parse_name_served_metrics_and_fire_on_the_recording(
        recorded: tuple[Recorder, LocalJob, dict[str, Any]]) -> None:
    rec = recorded[0]
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert set(rules) == {"ToolkitNoStep", "ToolkitStraggler", "ToolkitLowGoodput", "ToolkitHostLost",
                          "ToolkitRestartBudgetNearlyUsed"}
    served = rec.rec.names()
    for name, rule in rules.items():
        seconds(rule["for"])
        assert rule["labels"]["severity"] in ("page", "warning") and rule["annotations"]["summary"], name
        assert metric_names(parse(rule["expr"])) <= served, (name, metric_names(parse(rule["expr"])) - served)

    def fires(name: str, since: float, until_: float) -> bool:
        expr = parse(rules[name]["expr"])
        return any(evaluate(expr, rec.rec, t) for t in rec.rec.times() if since <= t <= until_)

    start, marks = rec.rec.times()[0], rec.marks
    assert not fires("ToolkitNoStep", start + 1, marks["steady"]), "no step alert while every rank stepped"
    assert fires("ToolkitNoStep", marks["steady"], marks["stopped"] + 1), "no step alert while a rank was stopped"
    assert not fires("ToolkitRestartBudgetNearlyUsed", start, marks["before kill"])
    assert fires("ToolkitRestartBudgetNearlyUsed", marks["before kill"], marks["recovered"])  # 1 of --max-restarts 1
    assert fires("ToolkitLowGoodput", start, marks["recovered"])  # start-up and the fault, over a minute's job
    assert not fires("ToolkitStraggler", start, marks["recovered"])
    assert not fires("ToolkitHostLost", marks["steady"], marks["recovered"])  # before, its agent was connecting
    doctored = Recording()  # the same scrapes with rank 1 a straggler and the host down: those two fire
    for t, samples in rec.rec.scrapes:
        doctored.scrapes.append((t, {k: 0.0 if k[0] == "toolkit_host_up" else v for k, v in samples.items()}))
        doctored.scrapes[-1][1][("toolkit_rank_straggler", frozenset({"rank": "1", "job": "watched"}.items()))] = 1.0
    assert evaluate(parse(rules["ToolkitStraggler"]["expr"]), doctored, marks["recovered"])
    assert evaluate(parse(rules["ToolkitHostLost"]["expr"]), doctored, marks["recovered"])


def test_every_dashboard_query_names_a_served_metric(recorded: tuple[Recorder, LocalJob, dict[str, Any]]) -> None:
    served = recorded[0].rec.names()
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for wanted in ("steps/s per rank", "loss per rank", "goodput over time", "mttr"):
        assert wanted in titles, wanted
    assert "toolkit_job_incidents_total" in dash["annotations"]["list"][0]["expr"]
    for expr in exprs:
        names = metric_names(parse(expr))
        assert names and names <= served, (expr, names - served)


def test_the_listener_serves_get_metrics_only_and_turns_away_extra_clients() -> None:
    served = threading.Event()

    def wake() -> None:  # stands for the loop: answers at once with no job (no series)
        threading.Thread(target=exchange.serve, args=(lambda: None,), daemon=True).start()
        served.set()

    exchange = Exchange(wake)
    endpoint = Endpoint("127.0.0.1", 0, exchange)
    endpoint.start()
    base = f"http://127.0.0.1:{endpoint.port}"
    try:
        assert get(base + "/metrics") == "" and served.is_set()
        with pytest.raises(urllib.error.HTTPError) as e:
            get(base + "/etc/passwd")
        assert e.value.code == 404
        req = urllib.request.Request(base + "/metrics", data=b"x", method="POST")  # noqa: S310 - loopback
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)  # noqa: S310 - a loopback URL the test built
        assert e.value.code == 501
        with pytest.raises(ConfigError, match=rf"^cannot serve the metrics on 127.0.0.1:{endpoint.port} "
                                              r"\(--metrics-address\): .*choose another port"):
            Endpoint("127.0.0.1", endpoint.port, exchange).start()  # the port is taken (by the first)
    finally:
        endpoint.close()


def test_a_steady_scraper_gets_the_page_prepared_before_its_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    """After two scrapes an interval apart, the next page is rendered ahead (a snapshot asked with no scrape
    waiting), and the third scrape is answered with it: no snapshot asked while it waits. Intervals shrunk."""
    monkeypatch.setattr(metrics, "RENDER_EVERY", 1.5)
    monkeypatch.setattr(metrics, "PREPARE_AHEAD", 0.2)
    asked: list[float] = []

    def wake() -> None:  # stands for the loop: answers at once with no job
        asked.append(time.monotonic())
        threading.Thread(target=exchange.serve, args=(lambda: None,), daemon=True).start()

    exchange = Exchange(wake)
    endpoint = Endpoint("127.0.0.1", 0, exchange)
    endpoint.start()
    url = f"http://127.0.0.1:{endpoint.port}/metrics"
    try:
        get(url)
        time.sleep(2.0)  # the scraper's interval, longer than RENDER_EVERY
        get(url)
        assert len(asked) == 2  # the first scrapes render as they come
        waits.wait_for("the page prepared ahead", lambda: len(asked) == 3, TIMEOUT)
        scraped = time.monotonic()
        get(url)
        assert len(asked) == 3 and asked[-1] < scraped  # the scrape took the prepared page
        time.sleep(4.5)  # a late scrape: the page prepared for it is older than RENDER_EVERY, it renders anew
        waits.wait_for("the second page prepared", lambda: len(asked) == 4, TIMEOUT)
        late = time.monotonic()
        get(url)
        assert len(asked) == 5 and asked[-1] >= late
    finally:
        endpoint.close()
    assert endpoint.preparer is None


def test_a_bad_metrics_address_is_one_line_naming_the_flag() -> None:
    for bad in ("host:99999", "nine", "::1:9464"):
        with pytest.raises(PlanError, match=r"^--metrics-address .*\[HOST:\]PORT"):
            JobOptions(job="j", metrics_address=bad)
    assert JobOptions(job="j", metrics_address="[::1]:9464").metrics_address == "[::1]:9464"


def test_status_and_watch_show_step_of_total_a_bar_and_the_eta(
        recorded: tuple[Recorder, LocalJob, dict[str, Any]]) -> None:
    live = recorded[0].live
    progress = live["progress"]
    assert progress["total"] % 100 == 0 and 0 < progress["step"] < progress["total"], progress  # 100 epochs
    lines = live_lines(live)  # what fleet status prints under the table
    shown = next(line for line in lines if line.startswith("progress: "))
    assert f"step {progress['step']}/{progress['total']} [" in shown and "ETA " in shown, shown
    assert len(shown) <= 100, shown
    record = JobRecord("watched", True, "localhost", 8118, (HostRecord("localhost", "localhost", None, None, None,
                                                                       "/w/job", "python3", ("sched",)),),
                       ({"host": "localhost", "role": "sched", "node_id": "sched", "rank": None,
                         "local_rank": None, "log": "logs/scheduler.log"},), {})
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(render(record, View([], live, None, 0.0), 2.0))  # one refresh of --watch
    assert shown in console.export_text(), console.export_text()
    assert progress_line({"step": 50, "total": 100, "steps_per_s": 5.0}) == (
        "progress: step 50/100 [##########----------] 50.0%, ETA 10s at 5.00 steps/s")
    assert "total not known" in progress_line({"step": 5, "total": None, "steps_per_s": 1.0})
    assert progress_line({"step": None}) is None


def test_tensorboard_holds_the_loss_of_every_step_rank_0_reported(
        recorded: tuple[Recorder, LocalJob, dict[str, Any]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = recorded[1]
    printed = {int(s): float(v) for s, v in LOSS_LINE.findall(job.log("worker_0.log"))}
    assert len(printed) > 40, "the job printed too few steps"
    tb = job.dir / "tb"

    def losses() -> dict[int, float]:
        acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
        acc.Reload()
        return {e.step: e.value for e in acc.Scalars("loss")} if "loss" in acc.Tags()["scalars"] else {}

    seen = until("the event files to hold every printed step", lambda: (lambda d: d if set(printed) <= set(d)
                                                                        else None)(losses()), job)
    for step, value in printed.items():
        assert seen[step] == pytest.approx(value, abs=1e-5), step
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert "steps_per_s" in acc.Tags()["scalars"]
    goodput = acc.Scalars("goodput")  # at each formation: the first, and the one after the kill
    assert len(goodput) >= 2 and 0 < goodput[-1].value <= 1, goodput
    texts = [v.tensor_proto.string_val[0].decode() for v in acc.Tensors("incidents/text_summary")]
    assert texts and "generation" in texts[0], texts  # the recovery, as text


def test_the_series_are_bounded_at_4096_ranks_and_causes_are_kinds_not_text() -> None:
    world, per_host = 4096, 8
    journal = Journal(None, "big", world, 0.75)
    roster = Roster({f"worker_{r}": f"h{r // per_host}" for r in range(world)})
    for r in range(world):
        journal.note(Note(NoteKind.PACE, {"rank": r, "node_id": f"worker_{r}", "host": f"h{r // per_host}", "pid": r,
                                          "step": 10, "step_time": 0.1, "busy": 0.05, "loss": 1.0, "total": 100}))
    for rec_ in roster.hosts.values():
        rec_.heard_at = 0.0  # watched: every host has its toolkit_host_up series
    snap = take(journal, roster, 0, 3, time.monotonic(), time.time())
    registry = CollectorRegistry()
    registry.register(JobCollector(lambda: snap))
    samples = [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]
    assert len(samples) == 4 * world + world // per_host + 40 == 16_936  # the figure exposition's docstring gives
    assert {cause_kind(c) for c in ("killed by SIGKILL", "exit code 3", "RuntimeError: /secret/path boom",
                                    "heartbeat silence", "connection closed", "did not reconnect",
                                    "host lost (h1: its agent went too)", "host h1 lost, replaced by spare s1",
                                    "host replaced")} == set(CAUSE_KINDS)


def test_the_rank_lines_kept_between_scrapes_render_the_page_generate_latest_would() -> None:
    """The endpoint's page (RankLines for the ranks, generate_latest for the rest) is byte for byte the library's
    rendering of the whole collector, scrape after scrape: values changing, a rank moved to another host, ranks gone
    and new, label values a hostile inventory could hold, figures missing."""
    hostile = ['h"1', "h\\2", "h\n3", "h 4", "hé5", "h}6"]

    def snapshot(scrape: int) -> Snapshot:
        ranks = tuple(RankRow(r, f"worker_{r}", hostile[r % 6] if not (scrape and r == 7) else "spare",
                              None if r % 5 == 0 else 100 * scrape + r, None if r % 4 == 0 else 0.1 + r / 1e4 + scrape,
                              None if r % 3 == 0 else 1e-7 * r, None if r % 2 else 2.5 - r / 1e3, r % 9 == scrape)
                      for r in range(scrape, 40 + 2 * scrape))
        return Snapshot(job='j"ob', world_size=64, members=40, generation=scrape, ranks=ranks,
                        hosts=(("a", True),), goodput={"goodput": 0.5}, causes=dict.fromkeys(CAUSE_KINDS, 0),
                        incidents=0, recover_times=(), restarts=((3, "worker_3", 1),), checkpoint_stall=0.0,
                        checkpoint_bytes=0, last_step=None, total=None, since_last_step=None, max_restarts=None)

    lines = RankLines()
    assert lines.render(None) == b""
    for scrape in range(4):
        snap = snapshot(scrape)
        whole, rest = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
        whole.register(JobCollector(lambda snap=snap: snap))
        rest.register(JobCollector(lambda snap=snap: snap, ranks=False))
        page = lines.render(snap) + generate_latest(rest)
        assert page == generate_latest(whole), scrape
        assert len(lines.prefixes) == len(snap.ranks)  # the ranks gone are forgotten
    assert 'host="spare"' in page.decode() and 'host="h\\"1"' in page.decode()


def test_run_and_join_print_the_progress_with_its_eta_every_so_often(capsys: pytest.CaptureFixture[str]) -> None:
    from toolkit.launcher.jobhosts.follow import JOIN_PROGRESS_EVERY, _Watch
    from toolkit.launcher.jobhosts.view import HostStatus

    def polled(step: int) -> list[HostStatus]:
        live = {"progress": {"step": step, "total": 1000, "steps_per_s": 10.0}}
        return [HostStatus("a", True, None, "running", True, 1, None, live=live)]

    watch = _Watch()
    watch.progress(polled(100), 0.0)
    watch.progress(polled(150), JOIN_PROGRESS_EVERY / 2)  # too soon: nothing
    watch.progress(polled(400), JOIN_PROGRESS_EVERY)
    lines = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines()]  # less the time stamp
    assert lines == ["progress: step 100/1000 [##------------------] 10.0%, ETA 2m at 10.00 steps/s",
                     "progress: step 400/1000 [########------------] 40.0%, ETA 1m at 10.00 steps/s"]


def test_a_plain_script_gives_its_total_with_report_and_a_wrong_one_is_one_clear_error() -> None:
    from toolkit.train import progress
    from toolkit.train.pace import StepPace

    class Reporter:  # stands for the wrapper's ScriptReporter: what report() hands on
        def __init__(self) -> None:
            self.pace = StepPace()

        def report(self, step: int, loss: Any, checkpoint: bool, total: int | None = None) -> None:
            if total is not None:
                self.pace.total = total

    saved = list(progress._installed)
    reporter = Reporter()
    progress.install(reporter)
    try:
        progress.report(3, total=1000)
        progress.report(4)
        assert reporter.pace.summary()["total"] == 1000  # rides every heartbeat from now on
        for bad in (-1, 2.5, True):
            with pytest.raises(ValueError, match=r"^toolkit.train.report\(total=.*\): give the total steps"):
                progress.report(5, total=bad)
    finally:
        progress._installed[:] = saved
