"""`logs`: the processes' logs, each line prefixed host:role:rank, once or followed from every host at once.

Logs are read with `tail` on the hosts (one command per host for all its chosen logs), never copied whole; lines
go to stdout as `host:role:rank | line` (control characters shown as escapes), notes (a log not written yet, a host
that stopped answering) to stderr."""

from __future__ import annotations

import functools
import shlex
import sys
import threading
from dataclasses import replace
from typing import Any, Mapping

from toolkit.errors import UserError
from toolkit.jobhosts.output import dash, interrupt_sets, say
from toolkit.jobhosts.reach import STATUS_TIMEOUT, host_target, load_record, record_ssh
from toolkit.jobhosts.scripts import TailParser, missing_logs
from toolkit.jobrecord import JobRecord
from toolkit.printable import clean
from toolkit.remote import (
    ClusterError,
    Host,
    HostResult,
    SshSettings,
    Target,
    check_all,
    run_on_all,
)
from toolkit.settings import JobRef

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
    files = _log_files(record, chosen)
    targets = [host_target(record.host(n), record.local) for n in files]
    if follow:
        _follow(targets, files, lines, ssh)
    else:
        _print_tails(targets, files, lines, ssh)


def _log_files(record: JobRecord, chosen: list[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """{host: {log path on that host: the prefix of its lines}} of the chosen processes, hosts in the order of their
    first process."""
    files: dict[str, dict[str, str]] = {}
    for p in chosen:
        files.setdefault(p["host"], {})[f"{record.host(p['host']).job_dir}/{p['log']}"] = _prefix(p)
    return files


def _print_tails(targets: list[Target], files: Mapping[str, dict[str, str]], lines: int, ssh: SshSettings) -> None:
    """The last `lines` lines of each host's logs (`files`), printed host by host once every host answered, with a
    note for each log not written yet. ClusterError naming the hosts that could not be read, after the rest."""
    out = _Printer()
    results = run_on_all(targets, lambda host: _read_tails(host, files[host.name], lines), ssh)
    for r in results.values():
        if r.ok and r.value is not None:
            got, missing = r.value
            for prefix, line in got:
                out.line(prefix, line)
            for note in missing:
                say(note)
    check_all(results)


def _read_tails(host: Host, paths: dict[str, str], lines: int) -> tuple[list[tuple[str, str]], list[str]]:
    """This host's (prefix, line) pairs of the last `lines` of each of `paths`, and notes for its missing logs, by
    one `tail -n` bounded by STATUS_TIMEOUT. tail exits 1 when a log is missing: still an answer, unless tail did
    not finish or gave neither lines nor that complaint (then the result's error is raised)."""
    result = host.run(["tail", "-v", "-n", str(lines), "--", *paths], timeout=STATUS_TIMEOUT)
    if not result.ok and (result.exit_code is None or not (result.stdout or "cannot open" in result.stderr)):
        result.check()
    got: list[tuple[str, str]] = []
    parser = TailParser(paths, lambda prefix, line: got.append((prefix, line)))
    for line in result.stdout.removesuffix("\n").split("\n") if result.stdout else []:
        parser(line)  # split at newlines only: a carriage return or form feed is shown, not obeyed
    return got, missing_logs(result.stderr, paths)


def _follow(targets: list[Target], files: Mapping[str, dict[str, str]], lines: int, ssh: SshSettings) -> None:
    """Stream every host's logs at once (one connection per host, whatever --parallel says) until Ctrl-C, which
    kills each host's tail; a host whose stream ends is reported at once and the others go on. ClusterError naming
    the hosts whose stream failed, after Ctrl-C."""
    out = _Printer()
    stop_event = threading.Event()
    with interrupt_sets(stop_event):
        results = run_on_all(targets, lambda host: _follow_host(host, files[host.name], lines, out, stop_event),
                             replace(ssh, parallel=max(1, len(targets))),
                             progress=functools.partial(_say_ended, stop_event))
    failed = {n: r for n, r in results.items() if not r.ok}
    if failed:
        raise ClusterError(results)


def _follow_host(host: Host, paths: dict[str, str], lines: int, out: _Printer, stop_event: threading.Event) -> None:
    """Stream this host's logs (`paths`: their prefixes) to `out` until `stop_event`; a tail that ends on its own
    is this host's failure (UserError, or the error of the command's result)."""
    parser = TailParser(paths, out.line)
    # --pid: if this end vanishes without killing it, tail still ends once the SSH session's process does.
    command = f'exec tail -v -F -n {lines} --pid="$PPID" -- ' + " ".join(shlex.quote(p) for p in paths)
    result = host.stream(command, parser, stop_event)
    for note in missing_logs(result.stderr, paths):
        say(note)
    if not result.stopped:
        result.check()
        raise UserError(f"{host.name}: tail ended on its own ({result.describe()})")


def _say_ended(stop_event: threading.Event, r: HostResult[None]) -> None:
    """Say at once when one host's stream failed (not at Ctrl-C), while the others keep streaming."""
    if not r.ok and not stop_event.is_set():
        say(f"{r.error}; no more lines from {r.host}")


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


def _prefix(p: Mapping[str, Any]) -> str:
    """`host:role:rank` of a recorded process ("-" for the scheduler's rank), as status's ProcStatus.prefix."""
    return f"{p['host']}:{'sched' if p['rank'] is None else 'worker'}:{dash(p['rank'])}"


class _Printer:
    """Whole lines to stdout from several threads at once, each with its prefix."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def line(self, prefix: str, text: str) -> None:
        """Write `prefix | text` and flush, under the lock, so lines of different hosts never interleave. The text's
        control characters are shown as escapes (`\x1b`, `\r`; tabs kept): a log line can neither pass for another
        line nor drive the terminal (printable.clean)."""
        with self.lock:
            sys.stdout.write(f"{prefix} | {clean(text, None, tabs=True)}\n")
            sys.stdout.flush()
