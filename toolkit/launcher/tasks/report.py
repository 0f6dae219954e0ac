"""`report`: the run's picture (a PNG) and summary (tables), or its data as JSON, from the scheduler's ledger.json
and metrics.jsonl (toolkit.contracts.rundoc), fetched from the scheduler's host in one bounded command. Works while the
job runs (the documents are rewritten as it goes) and after it ended, locally and over SSH."""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any

from toolkit.contracts import rundoc
from toolkit.contracts.jobrecord import JobRecord
from toolkit.errors import UserError
from toolkit.launcher import runreport as run_report
from toolkit.launcher.jobhosts.output import say, table_console
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, host_target, load_record, record_ssh
from toolkit.launcher.remote import Host, run_on_all
from toolkit.launcher.settings import JobRef

# Prints ledger.json, a record separator line, then the newest MAX_DOC_BYTES of metrics.jsonl (its first line may
# be cut: rundoc.read_metrics skips it); exit 3 when there is no ledger. Argument: the recovery directory.
FETCH_SCRIPT = r"""
r=$1 max=$2
[ -f "$r/ledger.json" ] || exit 3
head -c "$max" -- "$r/ledger.json"; printf '\n\036\n'
tail -c "$max" -- "$r/metrics.jsonl" 2>/dev/null
exit 0
"""
NO_LEDGER = 3


def report(ref: JobRef, out: str | None = None, as_json: bool = False) -> None:
    """The report of the job `ref` names: with `as_json`, report_data's structure on stdout (and a PNG only if
    `out` is given); else the PNG at `out` (default `<job>-report.png` in the current directory) and the summary
    tables on stdout. Raises UserError (one line) when the job has no ledger yet, the scheduler's host cannot be
    reached, the ledger is damaged, or the PNG cannot be written."""
    record = load_record(ref)
    ledger, metrics = fetch(record, ref)
    data = run_report.report_data(ledger, metrics)
    path = Path(out) if out else (None if as_json else Path.cwd() / f"{record.job}-report.png")
    if path is not None:
        try:
            run_report.draw(data, path)
        except OSError as e:
            raise UserError(f"cannot write the report to {path}: {e.strerror or e}; give another --out") from None
    if as_json:
        print(json.dumps(data, indent=1))
    else:
        console = table_console()
        for table in run_report.summary_tables(data):
            console.print(table)
    if path is not None:
        say(f"report of job {record.job} written to {path}")


def fetch(record: JobRecord, ref: JobRef) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(ledger document, metrics samples) from the scheduler's host. Raises UserError as `report` says."""
    sched = record.host(record.scheduler_host)
    recovery = posixpath.join(sched.job_dir, "recovery")  # MS_RECOVERY_PATH as plan.py renders it

    def run(host: Host) -> str:
        r = host.run(["sh", "-c", FETCH_SCRIPT, "sh", recovery, str(rundoc.MAX_DOC_BYTES)], timeout=STATUS_TIMEOUT)
        if r.exit_code == NO_LEDGER:
            raise UserError(f"job {record.job} has no ledger yet ({recovery}/{rundoc.LEDGER_FILE}): "
                            "the scheduler writes it once the job runs; 'fleet train' starts it")
        return r.check().stdout

    result = run_on_all([host_target(sched, record.local)], run, record_ssh(record, ref.request.core))[sched.name]
    if not result.ok or result.value is None:
        raise UserError(f"cannot fetch the report: {result.error}")
    ledger_text, _, metrics_text = result.value.partition("\n\x1e\n")
    ledger = rundoc.read_ledger(ledger_text)
    if ledger is None:
        raise UserError(f"{sched.name}: {recovery}/{rundoc.LEDGER_FILE} is not a ledger this toolkit can read "
                        f"(damaged, or of another version); the job's scheduler log says more: 'fleet logs --node "
                        "sched'")
    return ledger, rundoc.read_metrics(metrics_text)
