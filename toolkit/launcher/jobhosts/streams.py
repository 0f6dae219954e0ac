"""Following the processes' logs as they are written, from every host at once: `logs -f` (lines `host:role:rank |
text`) and the output `run` and `train --join` stream while they wait (lines `[rank1]: text`, as torchrun's --tee
prefixes them).

Each host streams `tail -F` of its chosen logs over one connection (Host.stream), so a rank never writes to us: it
writes its log file, and however fast it prints, reading it cannot stall its training. What we read goes through
a `Printer`; the one `run` uses holds at most STREAM_BUFFER_LINES not yet written (a terminal slower than the
ranks' output, a paused pager): beyond that, lines are dropped, counted per process, and said at the end (every
line stays in the log file: `fleet logs` has them). Each line is written whole, under a lock: lines of different
processes never interleave mid-line."""

from __future__ import annotations

import collections
import contextlib
import functools
import shlex
import sys
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

from toolkit.contracts.jobrecord import JobRecord
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.output import dash, say
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, host_target
from toolkit.launcher.jobhosts.scripts import TailParser, missing_logs
from toolkit.launcher.remote import ClusterError, Host, HostResult, SshSettings, Target, run_on_all
from toolkit.printable import clean_lines

STREAM_BUFFER_LINES = 10_000  # lines read but not yet written that `run` holds before it drops (and counts) more
STREAM_DRAIN = 1.0  # s the streams go on after the job ended, for the last lines its processes wrote
# s between tail's looks at the logs. Not inotify: it wakes tail at every write of a rank, on the rank's own CPU
# (the kernel places a woken task beside its waker), which cost a rank printing 38,000 lines/s 9-11% of its steps
# (bench/stream_cost.py); looking 20 times a second cost it 2-3%, and a line shows at most this late.
FOLLOW_POLL = 0.05


class Printer:
    """Whole lines to stdout from several threads at once, each its process's prefix, `sep`, then the text. The
    text's control characters are shown as escapes (`\\x1b`, `\\r`; tabs kept): a log line can neither pass for
    another line nor drive the terminal (printable.clean).

    With `bound`, `lines` never blocks on stdout: it queues (at most `bound` lines held; more are dropped and counted
    per prefix in `dropped`) for a writer thread, started by `start` and drained by `close`. Without, it writes
    at once. A batch of lines takes the lock once and wakes the writer once."""

    def __init__(self, sep: str, bound: int | None = None) -> None:
        self.sep = sep
        self.bound = bound
        self.lock = threading.Lock()
        self.queue: collections.deque[str] = collections.deque()  # batches of whole lines, not yet written
        self.held = 0  # lines in the queue
        self.ready = threading.Condition(self.lock)
        self.closed = False
        self.dropped: collections.Counter[str] = collections.Counter()
        self.writer: threading.Thread | None = None

    def lines(self, prefix: str, texts: list[str]) -> None:
        """Print (or queue) lines of the process `prefix` names, in order."""
        shown = clean_lines(texts, tabs=True)
        head = prefix + self.sep
        with self.lock:
            if self.bound is not None:
                room = max(0, self.bound - self.held)
                if len(shown) > room:
                    self.dropped[prefix] += len(shown) - room
                    shown = shown[:room]
                self.held += len(shown)
            if not shown:
                return
            text = head + ("\n" + head).join(shown) + "\n"
            if self.bound is None:
                sys.stdout.write(text)
                sys.stdout.flush()
            else:
                self.queue.append(text)
                self.ready.notify()

    def start(self) -> None:
        """Start the writer thread of a bounded printer."""
        self.writer = threading.Thread(target=self._write, name="printer", daemon=True)
        self.writer.start()

    def _write(self) -> None:
        while True:
            with self.lock:
                while not self.queue and not self.closed:
                    self.ready.wait()
                if not self.queue:
                    return
                lines = list(self.queue)
                self.queue.clear()
                self.held = 0
            with contextlib.suppress(BrokenPipeError, ValueError):
                sys.stdout.write("".join(lines))
                sys.stdout.flush()

    def close(self, bound: float = STATUS_TIMEOUT) -> None:
        """Write what is queued (waiting at most `bound` s) and stop the writer; say what was dropped."""
        with self.lock:
            self.closed = True
            self.ready.notify()
        if self.writer is not None:
            self.writer.join(bound)
        for prefix, count in sorted(self.dropped.items()):
            say(f"{prefix}: {count} line(s) not shown (they came faster than the terminal took them); "
                "'fleet logs' has every line")


def follow_host(host: Host, paths: Mapping[str, str], lines: str, out: Printer, stop_event: threading.Event) -> None:
    """Stream this host's logs (`paths`: their prefixes) to `out` until `stop_event`, beginning with `lines` (tail's
    -n: "20" the last 20, "+1" from the start); a tail that ends on its own is this host's failure (UserError, or
    the error of the command's result)."""
    parser = TailParser(paths, out.lines)
    # --pid: if this end vanishes without killing it, tail still ends once the SSH session's process does.
    # ---disable-inotify: GNU tail's own spelling (uutils' tail takes it too); see FOLLOW_POLL.
    command = (f"exec tail -v -F ---disable-inotify -s {FOLLOW_POLL} -n {shlex.quote(lines)} --pid=\"$PPID\" -- "
               + " ".join(shlex.quote(p) for p in paths))
    result = host.stream(command, parser, stop_event)
    for note in missing_logs(result.stderr, paths):
        say(note)
    if not result.stopped:
        result.check()
        raise UserError(f"{host.name}: tail ended on its own ({result.describe()})")


def follow(targets: list[Target], files: Mapping[str, Mapping[str, str]], lines: str, ssh: SshSettings,
           out: Printer, stop_event: threading.Event) -> dict[str, HostResult[None]]:
    """Stream every host's logs at once (one connection per host, whatever --parallel says) until `stop_event`,
    which kills each host's tail; a host whose stream ends is said at once and the others go on. Returns each
    host's result."""
    return run_on_all(targets, lambda host: follow_host(host, files[host.name], lines, out, stop_event),
                      replace(ssh, parallel=max(1, len(targets))), progress=functools.partial(_say_ended, stop_event))


def _say_ended(stop_event: threading.Event, r: HostResult[None]) -> None:
    """Say at once when one host's stream failed (not when it was stopped), while the others keep streaming."""
    if not r.ok and not stop_event.is_set():
        say(f"{r.error}; no more lines from {r.host}")


def prefix_of(p: Mapping[str, Any]) -> str:
    """`host:role:rank` of a recorded process ("-" for the scheduler's rank), as status's ProcStatus.prefix."""
    return f"{p['host']}:{'sched' if p['rank'] is None else 'worker'}:{dash(p['rank'])}"


def log_files(record: JobRecord, chosen: list[Mapping[str, Any]],
              prefix: Callable[[Mapping[str, Any]], str] = prefix_of) -> dict[str, dict[str, str]]:
    """{host: {log path on that host: the prefix of its lines}} of the chosen processes, hosts in the order of their
    first process."""
    files: dict[str, dict[str, str]] = {}
    for p in chosen:
        files.setdefault(p["host"], {})[f"{record.host(p['host']).job_dir}/{p['log']}"] = prefix(p)
    return files


@dataclass(frozen=True)
class RankFilter:
    """Whose output `run` and `train --join` stream: every worker, the ranks of `ranks` (--ranks 0,3), the local
    ranks of `local_ranks` on every host (--local-ranks-filter, torchrun's), or none (`quiet`)."""

    ranks: frozenset[int] | None = None
    local_ranks: frozenset[int] | None = None
    quiet: bool = False

    @classmethod
    def parse(cls, ranks: str = "", local_ranks: str = "", quiet: bool = False) -> RankFilter:
        """From the flags as typed; UserError naming the flag for a bad list, or for more than one of them."""
        given = [flag for flag, v in (("--ranks", ranks), ("--local-ranks-filter", local_ranks), ("--quiet", quiet))
                 if v]
        if len(given) > 1:
            raise UserError(f"{' and '.join(given)} both given: choose whose output is shown one way")
        return cls(_rank_list("--ranks", ranks), _rank_list("--local-ranks-filter", local_ranks), quiet)

    def chosen(self, record: JobRecord) -> list[Mapping[str, Any]]:
        """The record's workers whose output is streamed. UserError for a rank the job does not have."""
        if self.quiet:
            return []
        workers = [p for p in record.processes if p["rank"] is not None]
        if self.ranks is not None:
            for rank in sorted(self.ranks):
                record.process_of_rank(rank)
            return [p for p in workers if p["rank"] in self.ranks]
        if self.local_ranks is not None:
            return [p for p in workers if p["local_rank"] in self.local_ranks]
        return workers


def _rank_list(flag: str, text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        ranks = frozenset(int(word, 10) for word in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r}: give ranks as whole numbers separated by commas (0,3)") from None
    if any(r < 0 for r in ranks):
        raise UserError(f"{flag} {text!r}: ranks start at 0")
    return ranks


@contextlib.contextmanager
def streamed(record: JobRecord, ssh: SshSettings, choice: RankFilter | None) -> Iterator[None]:
    """While the block runs, stream the chosen workers' output from the start of their logs (the current run's,
    see LOG_ROTATE_SCRIPT) to stdout, `[rank1]: text`, through a bounded Printer. Leaving the block waits
    STREAM_DRAIN for the last lines, stops every host's tail, writes what is queued and says what was dropped;
    a host whose stream failed was said at once. Nothing is streamed for `choice` None or choosing no worker."""
    chosen = choice.chosen(record) if choice is not None else []
    if not chosen:
        yield
        return
    files = log_files(record, chosen, lambda p: f"[rank{p['rank']}]")
    targets = [host_target(record.host(n), record.local) for n in files]
    out = Printer(": ", bound=STREAM_BUFFER_LINES)
    stop_event = threading.Event()
    out.start()
    thread = threading.Thread(target=follow, args=(targets, files, "+1", ssh, out, stop_event), name="streams",
                              daemon=True)
    thread.start()
    try:
        yield
        stop_event.wait(STREAM_DRAIN)  # (nothing sets it here: a bounded wait for the last lines)
    finally:
        stop_event.set()
        thread.join(STATUS_TIMEOUT)
        out.close()


def raise_failed(results: Mapping[str, HostResult[None]]) -> None:
    """ClusterError naming the hosts whose stream failed, if any."""
    if any(not r.ok for r in results.values()):
        raise ClusterError(results)
