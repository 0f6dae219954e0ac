"""`fleet report`: a picture and a summary of one run, from the scheduler's ledger.json and metrics.jsonl
(toolkit.contracts.rundoc).

Pure core, thin shell: `report_data` turns the two documents into a plain structure (JSON-ready: lists, numbers,
strings) holding everything the picture shows, so tests check what is drawn without reading pixels; `draw` puts
it on a matplotlib figure (the Agg backend: no display needed) and `summary_tables` on rich tables. Fetching the
documents from the scheduler's host is toolkit.launcher.tasks.report's.

Times in the data are seconds since the job started (the ledger's `started_at`). What is shown:
- loss against step, one line per rank (the loss each rank last reported, sampled with its step); the steps every
  generation trained shaded (from where it resumed to where the next incident struck); each incident marked at
  the step the job had reached when it failed;
- steps/s against time, one line per rank (the steps between two samples over the time between them: recoveries
  show as the drop they are; a gap where a rank was gone or rolled back), and each rank's own work per step
  (dotted, where the straggler stands out); generations shaded by when they formed; incidents marked when they
  failed, with their recovery as a span; straggler episodes as spans naming the rank, host and factor;
- the goodput breakdown: where the wall time went (productive, startup, recovery, recomputed, checkpoint);
- for a job that shrank or grew (issue 42): the world size over time, each shrink and grow marked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.table import Table

from toolkit.contracts.protocol import is_int, is_number

BREAKDOWN = ("productive", "startup", "recovery", "recomputed", "checkpoint")  # the goodput parts, in drawing order
COLORS = {"productive": "#2ca02c", "startup": "#7f7f7f", "recovery": "#d62728", "recomputed": "#ff7f0e",
          "checkpoint": "#1f77b4"}
FIGSIZE = (11.0, 12.0)  # inches: three panels stacked
DPI = 100


def report_data(ledger: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What `fleet report` draws and prints, from a ledger document (Ledger.to_json, as rundoc.read_ledger returns
    it) and the metrics samples (rundoc.read_metrics). Lenient: a field missing or of the wrong type leaves its
    part empty rather than failing (the documents may come from a run still under way)."""
    t0 = _num(ledger.get("started_at")) or 0.0
    loss, rate, busy = _series(metrics, t0)
    end = _num(ledger.get("ended_at")) or _num(ledger.get("updated_at")) or t0
    incidents = [_incident(i, t0) for i in ledger.get("incidents") or [] if isinstance(i, Mapping)]
    last_step = ledger.get("last_step") if isinstance(ledger.get("last_step"), int) else None
    goodput = ledger.get("goodput") if isinstance(ledger.get("goodput"), Mapping) else {}
    return {
        "job": ledger.get("job"), "world_size": ledger.get("world_size"), "outcome": ledger.get("outcome"),
        "failure": ledger.get("failure"), "started_at": t0, "duration": round(end - t0, 3),
        "last_step": last_step, "incident_count": ledger.get("incident_count", len(incidents)),
        "loss": dict(sorted(loss.items(), key=lambda kv: _rank_key(kv[0]))),
        "rate": dict(sorted(rate.items(), key=lambda kv: _rank_key(kv[0]))),
        "busy": dict(sorted(busy.items(), key=lambda kv: _rank_key(kv[0]))),
        "generations": _generations(ledger, t0, end, incidents, last_step), "incidents": incidents,
        "stragglers": _stragglers(ledger, t0),
        "intervals": [dict(i) for i in ledger.get("intervals") or [] if isinstance(i, Mapping)],
        "goodput": {k: goodput.get(k) for k in ("wall", *BREAKDOWN, "goodput", "basis", "note")},
        **_world(ledger, t0),
    }


def _world(ledger: Mapping[str, Any], t0: float) -> dict[str, Any]:
    """The world size over time (the ledger's `world_periods`: workers and steps/s of each) and the shrinks and
    grows that changed it (`elastic`), times in seconds since `t0`; both empty for a job that never shrank."""
    events = [{"kind": str(e.get("kind")), "at": round(_num(e.get("at")) - t0, 3), "host": e.get("host"),
               "workers": e.get("workers"), "generation": e.get("generation"), "step": e.get("step")}
              for e in ledger.get("elastic") or [] if isinstance(e, Mapping) and _num(e.get("at")) is not None]
    periods = [{"start": round(_num(p.get("from")) - t0, 3), "end": round(_num(p.get("until")) - t0, 3),
                "workers": p.get("workers"), "steps_per_s": _num(p.get("steps_per_s"))}
               for p in ledger.get("world_periods") or [] if isinstance(p, Mapping)
               and _num(p.get("from")) is not None and _num(p.get("until")) is not None] if events else []
    return {"elastic": events, "world": periods}


_Series = dict[str, dict[str, list[Any]]]  # rank -> {axis name: values}


def _series(metrics: Sequence[Mapping[str, Any]], t0: float) -> tuple[_Series, _Series, _Series]:
    """(loss, rate, busy) per rank from the metrics samples, times in seconds since `t0`: each new loss value with
    its step; steps/s between two samples in a row (None where the rank was gone or rolled back: a gap); each
    rank's own work per step. Samples or ranks of the wrong shape are left out."""
    loss: _Series = {}
    rate: _Series = {}
    busy: _Series = {}
    previous: dict[str, tuple[float, int]] = {}  # rank -> (t, step) in the sample before, where it was in it
    for sample in metrics:
        t = _num(sample.get("t"))
        ranks = sample.get("ranks")
        if t is None or not isinstance(ranks, Mapping):
            continue
        seen: dict[str, tuple[float, int]] = {}
        for rank, vals in ranks.items():
            if not isinstance(vals, list) or len(vals) < 4 or not _whole(vals[0]):
                continue
            rank, step, value, own = str(rank), vals[0], _num(vals[1]), _num(vals[3])
            seen[rank] = (t, step)
            series = loss.setdefault(rank, {"step": [], "loss": []})
            if value is not None and step >= 1 and (not series["loss"] or series["loss"][-1] != value):
                series["step"].append(step)  # a new loss sample (taken at about this step)
                series["loss"].append(value)
            _add_rate(rate.setdefault(rank, {"t": [], "steps_per_s": []}), previous.get(rank), t, step, t0)
            if own is not None:
                b = busy.setdefault(rank, {"t": [], "busy": []})
                b["t"].append(round(t - t0, 3))
                b["busy"].append(own)
        previous = seen
    return loss, rate, busy


def _add_rate(r: dict[str, list[Any]], before: tuple[float, int] | None, t: float, step: int, t0: float) -> None:
    """Append to one rank's steps/s line the rate since `before` (its (t, step) in the sample before); a gap (None)
    where it was not in that sample or went back in steps, unless the line has not begun."""
    if before is not None and step >= before[1] and t > before[0]:
        r["t"].append(round(t - t0, 3))
        r["steps_per_s"].append(round((step - before[1]) / (t - before[0]), 4))
    elif r["t"]:  # the rank was gone (dead, replaced) or rolled back: a gap in its line
        r["t"].append(round(t - t0, 3))
        r["steps_per_s"].append(None)


def _generations(ledger: Mapping[str, Any], t0: float, end: float, incidents: list[dict[str, Any]],
                 last_step: int | None) -> list[dict[str, Any]]:
    """Each generation of the ledger with when it formed and until when it ran (the next one's forming, or `end`),
    in seconds since `t0`, and the steps it trained (`_step_range`)."""
    gens = [g for g in ledger.get("generations") or [] if isinstance(g, Mapping) and _num(g.get("formed_at"))
            and isinstance(g.get("generation"), int)]
    generations = []
    for i, g in enumerate(gens):
        number = g["generation"]
        until = _num(gens[i + 1]["formed_at"]) if i + 1 < len(gens) else end
        generations.append({"generation": number, "start": round(_num(g["formed_at"]) - t0, 3),
                            "end": round(max(until, _num(g["formed_at"])) - t0, 3),
                            **_step_range(number, i == 0, incidents, last_step)})
    return generations


def _stragglers(ledger: Mapping[str, Any], t0: float) -> list[dict[str, Any]]:
    """The ledger's straggler episodes, their times in seconds since `t0` (end None: still going)."""
    return [{"rank": s.get("rank"), "node_id": s.get("node_id"), "host": s.get("host"),
             "factor": s.get("factor"), "start": round(_num(s.get("since")) - t0, 3),
             "end": None if _num(s.get("until")) is None else round(_num(s["until"]) - t0, 3)}
            for s in ledger.get("stragglers") or [] if isinstance(s, Mapping) and _num(s.get("since"))]


def goodput_text(goodput: Mapping[str, Any]) -> str:
    """The goodput as a share ("87.5%"; "at most 87.5%" where it is an upper bound: a script that reports no steps,
    see toolkit.scheduler.ledger), or "cannot be computed" when there is no wall time yet."""
    gp = _num(goodput.get("goodput"))
    if gp is None:
        return "cannot be computed (no wall time yet)"
    return f"at most {gp:.1%}" if goodput.get("basis") == "formations" else f"{gp:.1%}"


def _step_range(generation: int, first_listed: bool, incidents: list[dict[str, Any]],
                last_step: int | None) -> dict[str, Any]:
    """The steps `generation` trained: from where the incident that began it resumed (step 0 for the first
    generation listed; None where no incident says) to the step the next incident struck at (or the job's newest
    step heard). From the ledger, not from the metrics samples: a sample taken while a generation gathers still
    shows the previous one's steps."""
    began = next((i for i in incidents if i["generation"] == generation), None)
    if began is None:
        first = 0 if first_listed else None
    else:
        first = began["resumed_from"] if began["resumed_from"] is not None else began["step"]
    following = [i["step"] for i in incidents if isinstance(i["generation"], int) and i["generation"] > generation
                 and i["step"] is not None]
    last = following[0] if following else last_step
    return {"first_step": first, "last_step": last}


def _incident(i: Mapping[str, Any], t0: float) -> dict[str, Any]:
    """One incident for the report: where it is marked (the step the job had reached when it failed: the step the
    ranks resumed from plus the steps recomputed where the ledger knows them, else the newest step heard), when
    (s since the start), and what it cost."""
    procs = [p for p in i.get("processes") or [] if isinstance(p, Mapping)]
    resumed, recomputed = i.get("resumed_from"), i.get("recomputed")
    step = resumed + max(0, recomputed or 0) if isinstance(resumed, int) else i.get("step")
    failed, detected = _num(i.get("failed_at")), _num(i.get("detected_at"))
    recovered = _num(i.get("recovered_at"))
    return {
        "number": i.get("number"), "cause": i.get("cause"), "generation": i.get("generation"), "step": step,
        "processes": [p.get("node_id") for p in procs], "hosts": sorted({str(p.get("host")) for p in procs}),
        "ranks": [p.get("rank") for p in procs],
        "relaunched": [p.get("node_id") for p in i.get("relaunched") or [] if isinstance(p, Mapping)],
        "failed": None if failed is None else round(failed - t0, 3),
        "detected_after": None if failed is None or detected is None else round(detected - failed, 3),
        "recovered": None if recovered is None else round(recovered - t0, 3),
        "time_to_recover": i.get("time_to_recover"), "resumed_from": resumed, "recomputed": recomputed,
    }


def draw(data: Mapping[str, Any], out: Path) -> Any:
    """Draw `data` (report_data's) into a PNG at `out` and return the matplotlib Figure (closed: its artists stay
    readable). Raises OSError if the file cannot be written."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file is the point
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    if data.get("world"):
        ax_loss, ax_rate, ax_good, ax_world = fig.subplots(4, 1, height_ratios=[3, 3, 1, 1])
        _draw_world(ax_world, data)
    else:
        ax_loss, ax_rate, ax_good = fig.subplots(3, 1, height_ratios=[3, 3, 1])
    fig.suptitle(_title(data))
    _shade_generations(ax_loss, ax_rate, data["generations"])
    for rank, s in data["loss"].items():
        ax_loss.plot(s["step"], s["loss"], lw=1, label=f"rank {rank}", gid=f"loss-rank-{rank}")
    _mark_incidents(ax_loss, ax_rate, data["incidents"])
    _label_loss(ax_loss, bool(data["loss"]))
    _draw_rates(ax_rate, data)
    _draw_goodput(ax_good, data["goodput"])
    fig.savefig(out)
    return fig


def _draw_world(ax: Any, data: Mapping[str, Any]) -> None:
    """The world size over time as steps, each period labelled with its steps/s, each shrink and grow marked."""
    for p in data["world"]:
        ax.hlines(p["workers"], p["start"], p["end"], lw=2, color="black", gid=f"world-{p['start']}")
        if p["steps_per_s"] is not None:
            ax.annotate(f"{p['workers']} workers, {p['steps_per_s']:.2f} steps/s", (p["start"], p["workers"]),
                        textcoords="offset points", xytext=(2, 3), fontsize=8)
    for e in data["elastic"]:
        ax.axvline(e["at"], color="red" if e["kind"] == "shrink" else "green", ls="--", gid=f"{e['kind']}-{e['at']}")
    top = max((p["workers"] for p in data["world"] if isinstance(p["workers"], int)), default=1)
    ax.set_ylim(0, top * 1.3)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("workers")


def _title(data: Mapping[str, Any]) -> str:
    """The figure's title: the job, its size, generations, incidents, goodput and outcome ("running": none yet)."""
    title = f"job {data.get('job')}: {data.get('world_size')} ranks, {len(data['generations'])} generation(s), " \
            f"{len(data['incidents'])} incident(s)"
    title += f", goodput {goodput_text(data['goodput'])}"
    return title + (f" ({data['outcome']})" if data.get("outcome") else " (running)")


def _shade_generations(ax_loss: Any, ax_rate: Any, generations: Sequence[Mapping[str, Any]]) -> None:
    """Shade each generation, in alternating colours: over the steps it trained on the loss panel (where known),
    over the time it ran on the rate panel."""
    for n, g in enumerate(generations):
        shade = "#eeeeee" if n % 2 else "#dde7f3"
        if g["first_step"] is not None and g["last_step"] is not None:
            ax_loss.axvspan(g["first_step"], g["last_step"], color=shade, zorder=0,
                            label=f"generation {g['generation']}", gid=f"generation-{g['generation']}")
        ax_rate.axvspan(g["start"], g["end"], color=shade, zorder=0, gid=f"generation-{g['generation']}")


def _mark_incidents(ax_loss: Any, ax_rate: Any, incidents: Sequence[Mapping[str, Any]]) -> None:
    """Mark each incident, labelled with its number and cause: at its step on the loss panel, at when it failed on
    the rate panel, with its recovery as a span."""
    for inc in incidents:
        label = f"#{inc['number']} {inc['cause']}"
        if inc["step"] is not None:
            ax_loss.axvline(inc["step"], color="red", ls="--", lw=1, gid=f"incident-{inc['number']}")
            ax_loss.annotate(label, (inc["step"], 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                             ha="right", fontsize=8, color="red")
        if inc["failed"] is not None:
            ax_rate.axvline(inc["failed"], color="red", ls="--", lw=1, gid=f"incident-{inc['number']}")
            if inc["recovered"] is not None:
                ax_rate.axvspan(inc["failed"], inc["recovered"], color="red", alpha=0.15,
                                gid=f"recovery-{inc['number']}")
            ax_rate.annotate(label, (inc["failed"], 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                             ha="right", fontsize=8, color="red")


def _label_loss(ax_loss: Any, any_loss: bool) -> None:
    """The loss panel's axis labels and legend, or, when no rank reported a loss, a note saying how to get one."""
    if not any_loss:
        ax_loss.text(0.5, 0.5, "no loss reported: toolkit.train.report(step, loss=...) in the script draws it here",
                     transform=ax_loss.transAxes, ha="center", va="center", color="gray", gid="no-loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    if ax_loss.get_legend_handles_labels()[0]:  # no loss reported and no generation: no legend (matplotlib warns)
        ax_loss.legend(fontsize=7, ncol=4, loc="best")


def _draw_rates(ax_rate: Any, data: Mapping[str, Any]) -> None:
    """The rate panel's lines: steps/s per rank, each rank's own work per step (dotted, on a second axis), the
    straggler episodes as spans naming the rank, host and factor; then its labels and legend."""
    for rank, s in data["rate"].items():
        ax_rate.plot(s["t"], [math.nan if v is None else v for v in s["steps_per_s"]], lw=1, label=f"rank {rank}",
                     gid=f"rate-rank-{rank}")
    if data["busy"]:
        ax_busy = ax_rate.twinx()
        for n, (rank, s) in enumerate(data["busy"].items()):
            ax_busy.plot(s["t"], s["busy"], lw=0.8, ls=":", color=f"C{n % 10}", gid=f"busy-rank-{rank}")
        ax_busy.set_ylabel("own work per step, s (dotted): a straggler's stands out")
        ax_busy.set_ylim(bottom=0)
    for s in data["stragglers"]:
        end = s["end"] if s["end"] is not None else data["duration"]
        ax_rate.axvspan(s["start"], end, color="orange", alpha=0.25, gid=f"straggler-{s['rank']}")
        ax_rate.annotate(f"straggler rank {s['rank']} on {s['host']} ({s['factor']}x)", (s["start"], 0.02),
                         xycoords=("data", "axes fraction"), fontsize=8, color="darkorange")
    ax_rate.set_xlabel("seconds since the job started")
    ax_rate.set_ylabel("steps/s")
    if data["rate"]:
        ax_rate.legend(fontsize=7, ncol=4, loc="best")


def _draw_goodput(ax_good: Any, goodput: Mapping[str, Any]) -> None:
    """The goodput panel: one bar of the wall time split into BREAKDOWN's parts, each labelled with its seconds
    and share."""
    left = 0.0
    wall = goodput.get("wall") or 0.0
    for part in BREAKDOWN:
        seconds = goodput.get(part) or 0.0
        ax_good.barh([0], [seconds], left=left, color=COLORS[part], gid=f"goodput-{part}",
                     label=f"{part} {seconds:.1f} s" + (f" ({seconds / wall:.1%})" if wall else ""))
        left += seconds
    ax_good.set_yticks([])
    ax_good.set_xlabel("wall time, s")
    ax_good.legend(fontsize=7, ncol=len(BREAKDOWN), loc="upper center", bbox_to_anchor=(0.5, -0.6))


def summary_tables(data: Mapping[str, Any]) -> list[Table]:
    """The same summary as rich tables: the run and its goodput breakdown, the incidents, the stragglers."""
    gp = data["goodput"]
    wall = gp.get("wall") or 0.0
    run = Table(title=f"job {data.get('job')}: {data.get('outcome') or 'running'}, "
                      f"{_fmt(data.get('duration'))} s, last step {_fmt(data.get('last_step'))}, "
                      f"{len(data['generations'])} generation(s), {data.get('incident_count')} incident(s)")
    run.add_column("time")
    run.add_column("seconds", justify="right")
    run.add_column("share", justify="right")
    for part in ("wall", *BREAKDOWN):
        seconds = gp.get(part)
        share = f"{seconds / wall:.1%}" if wall and isinstance(seconds, (int, float)) else "-"
        run.add_row(part, _fmt(seconds), share)
    run.add_row("goodput", "", goodput_text(gp))
    if gp.get("note"):
        run.caption = f"goodput: {gp['note']}"
    tables = [run]
    if data["incidents"]:
        inc = Table(title="incidents")
        for column in ("#", "cause", "processes", "relaunched with them", "hosts", "generation", "step",
                       "detected after s", "time to recover s", "resumed from", "recomputed"):
            inc.add_column(column, justify="right" if column not in ("cause", "processes", "relaunched with them",
                                                                     "hosts") else "left")
        for i in data["incidents"]:
            inc.add_row(_fmt(i["number"]), str(i["cause"]), ", ".join(map(str, i["processes"])),
                        ", ".join(map(str, i.get("relaunched") or [])) or "-",
                        ", ".join(i["hosts"]), _fmt(i["generation"]), _fmt(i["step"]), _fmt(i["detected_after"]),
                        _fmt(i["time_to_recover"]), _fmt(i["resumed_from"]), _fmt(i["recomputed"]))
        tables.append(inc)
    if data.get("elastic"):
        el = Table(title="shrinks and grows (the world size over time)")
        for column in ("from s", "until s", "workers", "steps/s", "began with"):
            el.add_column(column)
        for i, p in enumerate(data["world"]):
            e = data["elastic"][i - 1] if 0 < i <= len(data["elastic"]) else None
            began = "the start" if e is None else f"{e['kind']} ({e['host']}, generation {_fmt(e['generation'])})"
            el.add_row(_fmt(p["start"]), _fmt(p["end"]), _fmt(p["workers"]), _fmt(p["steps_per_s"]), began)
        tables.append(el)
    if data["stragglers"]:
        st = Table(title="stragglers")
        for column in ("rank", "node id", "host", "factor", "from s", "until s"):
            st.add_column(column)
        for s in data["stragglers"]:
            st.add_row(_fmt(s["rank"]), str(s["node_id"]), str(s["host"]), _fmt(s["factor"]), _fmt(s["start"]),
                       _fmt(s["end"]) if s["end"] is not None else "still")
        tables.append(st)
    return tables


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _whole(v: Any) -> bool:
    return is_int(v) and v >= 0


def _num(v: Any) -> float | None:
    return float(v) if is_number(v) else None


def _rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isascii() and rank.isdigit() else (1 << 30, rank)
