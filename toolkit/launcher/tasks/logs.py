"""`logs`: the processes' logs, each line prefixed host:role:rank, once or followed from every host at once.

Logs are read with `tail` on the hosts (one command per host for all its chosen logs), never copied whole; lines
go to stdout as `host:role:rank | line` (control characters shown as escapes), notes (a log not written yet, a host
that stopped answering) to stderr."""

from __future__ import annotations

import threading
from typing import Any, Mapping

from toolkit.contracts.jobrecord import JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.output import interrupt_sets, say
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, host_target, load_record, record_ssh
from toolkit.launcher.jobhosts.scripts import TailParser, missing_logs
from toolkit.launcher.jobhosts.streams import Printer, log_files, raise_failed
from toolkit.launcher.jobhosts.streams import follow as follow_logs
from toolkit.launcher.remote import (
    Host,
    SshSettings,
    Target,
    check_all,
    run_on_all,
)
from toolkit.launcher.settings import JobRef

LOG_LINES = 20  # default of `logs -n`


def logs(ref: JobRef, node: str | None = None, rank: int | None = None, host_name: str | None = None,
         follow: bool = False, lines: int = LOG_LINES) -> None:
    """The last `lines` lines of the chosen processes' logs (msrun's names: scheduler.log, worker_<rank>.log),
    each prefixed host:role:rank; with `follow`, keep printing new lines from every host until Ctrl-C.

    `node`, `rank` and `host_name` choose (at most one of them; none: every process). Without `follow`, one
    `tail -n` per host bounded by STATUS_TIMEOUT; the lines are printed host by host once every host answered.
    With `follow`, every host streams at once (one connection per host, whatever --parallel says) until
    Ctrl-C, which kills each host's tail; a host whose stream ends is reported and the others go on. Raises
    UserError for a negative `lines` or more than one choice, and ClusterError naming the hosts that could not
    be read (after printing what the others gave)."""
    if lines < 0:
        raise UserError(f"-n {lines}: give 0 or more lines")
    record = load_record(ref)
    chosen = _choose(record, node, rank, host_name)
    ssh = record_ssh(record, ref.request.core)
    files = log_files(record, chosen)
    targets = [host_target(record.host(n), record.local) for n in files]
    if follow:
        stop_event = threading.Event()
        with interrupt_sets(stop_event):
            raise_failed(follow_logs(targets, files, str(lines), ssh, Printer(" | "), stop_event))
    else:
        _print_tails(targets, files, lines, ssh)


def _print_tails(targets: list[Target], files: Mapping[str, dict[str, str]], lines: int, ssh: SshSettings) -> None:
    """The last `lines` lines of each host's logs (`files`), printed host by host once every host answered, with a
    note for each log not written yet. ClusterError naming the hosts that could not be read, after the rest."""
    out = Printer(" | ")
    results = run_on_all(targets, lambda host: _read_tails(host, files[host.name], lines), ssh)
    for r in results.values():
        if r.ok and r.value is not None:
            got, missing = r.value
            for prefix, lines in got:
                out.lines(prefix, lines)
            for note in missing:
                say(note)
    check_all(results)


def _read_tails(host: Host, paths: dict[str, str], lines: int) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """This host's (prefix, line) pairs of the last `lines` of each of `paths`, and notes for its missing logs, by
    one `tail -n` bounded by STATUS_TIMEOUT. tail exits 1 when a log is missing: still an answer, unless tail did
    not finish or gave neither lines nor that complaint (then the result's error is raised)."""
    result = host.run(["tail", "-v", "-n", str(lines), "--", *paths], timeout=STATUS_TIMEOUT)
    if not result.ok and (result.exit_code is None or not (result.stdout or "cannot open" in result.stderr)):
        result.check()
    got: list[tuple[str, list[str]]] = []
    parser = TailParser(paths, lambda prefix, lines: got.append((prefix, lines)))
    if result.stdout:
        parser(result.stdout.removesuffix("\n").split("\n"))  # newlines only: a carriage return is shown, not obeyed
    return got, missing_logs(result.stderr, paths)


def _choose(record: JobRecord, node: str | None, rank: int | None, host_name: str | None) -> list[Mapping[str, Any]]:
    """The record's processes the options name. Raises UserError for more than one option, or for a node, rank
    or host the job does not have."""
    given = [x for x in (node, rank, host_name) if x is not None]
    if len(given) > 1:
        raise UserError("give one of --node, --rank or --host (or none for every process)")
    if node is not None:
        return [record.process(node)]
    if rank is not None:
        return [record.process_of_rank(rank)]
    if host_name is not None:
        record.host(host_name)
        return [p for p in record.processes if p["host"] == host_name]
    return list(record.processes)
