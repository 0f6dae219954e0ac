"""The scheduler's Prometheus endpoint (`--metrics-address`, off by default): a read-only HTTP listener in a thread of
its own that serves GET /metrics, rendered by prometheus_client from toolkit.scheduler.exposition's collector.

Threads: the scheduler's loop is one thread and its objects are never read from another. A scrape asks the loop for
a snapshot (`Exchange.ask`: a flag and a byte on the loop's wake-up socket), the loop copies its figures between two
passes (`Exchange.serve`, exposition.take) and hands them back; the listener's thread renders them. If the loop does
not answer within SNAPSHOT_WAIT the scrape gets the previous snapshot.

Hostile-facing (anyone who reaches the address): GET only, /metrics or /; at most MAX_CLIENTS connections at once
(more are closed unanswered); each request has REQUEST_TIMEOUT s to arrive and be answered; the rendered page is
reused for RENDER_EVERY s, so scrapes as fast as a client can send cost at most one snapshot and one rendering per
RENDER_EVERY. Nothing served names a file, a token or a command line (exposition's docstring).

The page is prepared ahead (issue 46: a scrape answers within 200 ms at 4096 ranks on a loaded machine). Rendering
4096 ranks is tens of ms of CPU, and the snapshot waits for the loop's current pass; on a machine loaded ten times
over its cores that was a 280 ms answer, nearly all of it waiting for a core, not work. Prometheus scrapes at a
steady interval, so after two scrapes the listener knows when the next one comes: the "prepare" thread renders the
page PREPARE_AHEAD s before it, and the scrape is answered with that page (never older than RENDER_EVERY: a scrape
that comes later than expected, or the first ones, renders as before). The work per scrape is the same (one
snapshot, one rendering); without scrapes nothing is prepared. A client scraping at odd intervals can cause at most
one prepared rendering beside each asked one, so at most two per RENDER_EVERY.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from toolkit.scheduler.config import ConfigError
from toolkit.scheduler.exposition import JobCollector, RankLines, Snapshot

MAX_CLIENTS = 4  # connections served at once; more are closed unanswered
REQUEST_TIMEOUT = 5.0  # s for a request to arrive and its answer to leave
RENDER_EVERY = 2.0  # s a rendered page is served again before a new snapshot is asked for
SNAPSHOT_WAIT = 2.0  # s a scrape waits for the loop's snapshot before it serves the previous one
PREPARE_AHEAD = 1.0  # s before the next expected scrape that its page is rendered (less than RENDER_EVERY)
CLOSE_WAIT = 5.0  # s close() waits for the prepare thread to end
IDLE_WAIT = 60.0  # s the prepare thread sleeps when no scrape is expected (a scrape or close() wakes it sooner)
PATHS = ("/metrics", "/")

log = logging.getLogger("toolkit.scheduler")


class Exchange:
    """Snapshots handed from the loop's thread to the listener's. `wake()` wakes the loop (its self-pipe)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._cond = threading.Condition()
        self._wanted = False
        self._seq = 0
        self._snapshot: Snapshot | None = None

    @property
    def wanted(self) -> bool:
        """A scrape waits for a snapshot (read by the loop on every pass: one attribute read)."""
        return self._wanted

    def serve(self, take: Callable[[], Snapshot]) -> None:
        """On the loop's thread: take a snapshot and hand it to the waiting scrapes."""
        snap = take()
        with self._cond:
            self._snapshot, self._wanted = snap, False
            self._seq += 1
            self._cond.notify_all()

    def ask(self, timeout: float) -> Snapshot | None:
        """On the listener's thread: a fresh snapshot, or after `timeout` s the previous one (None before any)."""
        with self._cond:
            seq = self._seq
            self._wanted = True
        self._wake()
        with self._cond:
            self._cond.wait_for(lambda: self._seq != seq, timeout)
            return self._snapshot


class _Server(ThreadingMixIn, HTTPServer):
    """A threading HTTP server that serves at most MAX_CLIENTS connections at once."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], family: int) -> None:
        self.address_family = family
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed unanswered
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class Endpoint:
    """The listener on `host`:`port` serving the snapshots of `exchange`; `start` binds (ConfigError naming the
    address if it cannot) and serves in a daemon thread, `close` stops it."""

    def __init__(self, host: str, port: int, exchange: Exchange) -> None:
        self.host, self.port, self.exchange = host, port, exchange
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(self._snapshot, ranks=False))
        self.rank_lines = RankLines()  # the per-rank families, their labels rendered once (exposition)
        self._lock = threading.Lock()
        self._page = b""
        self._rendered_at = -RENDER_EVERY
        self._pending: Snapshot | None = None
        self._scraped_at: float | None = None  # monotonic time of the last scrape
        self._due: float | None = None  # when the prepare thread renders the next page (None: not expected)
        self._closed = False
        self._wakeup = threading.Condition()
        self.server: _Server | None = None
        self.thread: threading.Thread | None = None
        self.preparer: threading.Thread | None = None

    def _snapshot(self) -> Snapshot | None:
        return self._pending

    def page(self) -> bytes:
        """The exposition text of a scrape: the page prepared for it, or one rendered now from a fresh snapshot when
        the newest is RENDER_EVERY s old. Expects the next scrape one interval later (when the interval is at least
        RENDER_EVERY: faster scrapers share pages anyway) and has the prepare thread render it ahead."""
        with self._lock:
            now = time.monotonic()
            interval = None if self._scraped_at is None else now - self._scraped_at
            self._scraped_at = now
            if now - self._rendered_at >= RENDER_EVERY:
                self._render()
            page = self._page
        with self._wakeup:
            self._due = now + interval - PREPARE_AHEAD if interval is not None and interval >= RENDER_EVERY else None
            self._wakeup.notify_all()
        return page

    def _render(self) -> None:
        """Under self._lock: a fresh snapshot, rendered into self._page."""
        self._pending = self.exchange.ask(SNAPSHOT_WAIT)
        self._page = self.rank_lines.render(self._pending) + generate_latest(self.registry)
        self._pending = None
        self._rendered_at = time.monotonic()

    def _prepare(self) -> None:
        """The prepare thread: render the page when the next scrape is PREPARE_AHEAD s away (see the module
        docstring); waits on the condition the scrapes and close() notify."""
        while True:
            with self._wakeup:
                while not self._closed and (self._due is None or self._due > time.monotonic()):
                    self._wakeup.wait(IDLE_WAIT if self._due is None else self._due - time.monotonic())
                if self._closed:
                    return
                self._due = None
            with self._lock:
                self._render()

    def start(self) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT
            server_version = "toolkit"
            sys_version = ""

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] not in PATHS:
                    self.send_error(404, "only /metrics is served")
                    return
                body = endpoint.page()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                pass  # a scrape every few seconds is not news; a hostile client must not fill the log

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            self.server = _Server((self.host, self.port), Handler, family)
        except OSError as e:
            raise ConfigError(f"cannot serve the metrics on {self.host}:{self.port} (--metrics-address): "
                              f"{e.strerror or e}; choose another port, or an address of this host") from None
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="metrics", daemon=True)
        self.thread.start()
        self.preparer = threading.Thread(target=self._prepare, name="metrics-prepare", daemon=True)
        self.preparer.start()
        log.info("metrics for Prometheus on http://%s:%d/metrics", self.host, self.port)

    def close(self) -> None:
        """Stop serving (bounded: serve_forever notices within its poll interval) and close the listener."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify_all()
        if self.preparer is not None:
            self.preparer.join(CLOSE_WAIT)
            self.preparer = None
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
