"""The agent's control socket server (toolkit.agent.control) on a real unix socket in tmp_path, driven by a real
selector and timers on a fake clock, as the agent's loop drives it: hostile requests, the client limit, the deadline
of a silent client, and a deferred action that runs only once its reply was sent."""

from __future__ import annotations

import json
import select
import selectors
import socket
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from toolkit.agent import control
from toolkit.agent.control import CLIENT_TIMEOUT, MAX_CONTROL_CLIENTS, MAX_CONTROL_LINE, ControlServer
from toolkit.agent.timers import Timers
from toolkit.testing.clock import FakeClock

BOUND = 10.0  # s of real time a condition may take on a loaded machine


class Loop:
    """The agent's loop in miniature: a selector, fake-clock timers, and a server whose `handle` echoes the request
    (or does what the test put in `replies`)."""

    def __init__(self, path: Path) -> None:
        self.sel = selectors.DefaultSelector()
        self.clock = FakeClock()
        self.timers = Timers(self.clock)
        self.requests: list[Any] = []
        self.after: Callable[[], None] | None = None
        self.server = ControlServer(path, self.sel, self.timers, self.handle)

    def handle(self, req: Any) -> tuple[dict, Callable[[], None] | None]:
        self.requests.append(req)
        if not isinstance(req, dict):
            raise AttributeError("not an object")  # as Agent._control_request's req.get would
        return {"ok": True, "echo": req}, self.after

    def pump(self, until: Callable[[], bool]) -> None:
        """Dispatch selector events and due timers until `until()` holds (bounded)."""
        deadline = time.monotonic() + BOUND
        while not until():
            assert time.monotonic() < deadline, "the server did not get there"
            for key, mask in self.sel.select(0.05):
                if self.sel.get_map().get(key.fd) is key:
                    key.data(mask)
            self.timers.run_due()

    def spin(self, rounds: int = 5) -> None:
        """Dispatch whatever is there for a few rounds: for asserting that something does NOT happen."""
        for _ in range(rounds):
            for key, mask in self.sel.select(0.02):
                if self.sel.get_map().get(key.fd) is key:
                    key.data(mask)
            self.timers.run_due()


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Loop]:
    lp = Loop(tmp_path / "agent.sock")
    lp.server.open()
    yield lp
    lp.server.close()
    lp.sel.close()


def connect(loop: Loop) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(BOUND)
    c.connect(str(loop.server.path))
    return c


def readable(c: socket.socket) -> bool:
    """Whether the server sent something or closed (without consuming it)."""
    return bool(select.select([c], [], [], 0)[0])


def converse(loop: Loop, data: bytes, shut: bool = False) -> bytes:
    """Send `data` (then close our side if `shut`), run the loop until the server answered or closed, and return
    everything it sent before closing."""
    c = connect(loop)
    c.sendall(data)
    if shut:
        c.shutdown(socket.SHUT_WR)
    loop.pump(lambda: readable(c))
    out = b""
    while chunk := c.recv(65536):
        out += chunk
    c.close()
    return out


def test_the_socket_is_the_operators_own_and_gone_after_close(tmp_path: Path) -> None:
    lp = Loop(tmp_path / "agent.sock")
    (tmp_path / "agent.sock").write_text("stale")  # a previous agent's leftover
    lp.server.open()
    assert stat.S_IMODE((tmp_path / "agent.sock").stat().st_mode) == 0o600
    c = connect(lp)
    lp.pump(lambda: lp.server.clients() == 1)
    lp.server.close()
    assert not (tmp_path / "agent.sock").exists()
    assert lp.server.clients() == 0 and c.recv(1) == b""  # an open conversation is closed with it
    lp.sel.close()


def test_one_request_per_connection_answered_with_one_json_line(loop: Loop) -> None:
    assert json.loads(converse(loop, b'{"op": "status"}\n{"op": "stop"}\n')) == {"ok": True, "echo": {"op": "status"}}
    assert loop.requests == [{"op": "status"}]  # the second line of the connection is never read as a request
    assert json.loads(converse(loop, b'{"op": "x"}', shut=True))["echo"] == {"op": "x"}  # EOF ends a request too


def test_a_request_in_pieces_is_answered_once_it_is_whole(loop: Loop) -> None:
    c = connect(loop)
    c.sendall(b'{"op": ')
    loop.pump(lambda: loop.server.clients() == 1)
    loop.spin()
    assert loop.requests == [] and not readable(c)
    c.sendall(b'"status"}\n')
    loop.pump(lambda: readable(c))
    assert json.loads(c.recv(65536))["echo"] == {"op": "status"}
    c.close()


@pytest.mark.parametrize("data", [b"not json\n", b"\xff\xfe\n", b"[1, 2]\n", b"[" * 50000 + b"\n",
                                  b"x" * (MAX_CONTROL_LINE + 10)])
def test_hostile_lines_are_answered_not_a_json_object_line(loop: Loop, data: bytes) -> None:
    assert json.loads(converse(loop, data)) == control.NOT_JSON
    assert loop.server.clients() == 0


def test_an_empty_line_gets_no_answer(loop: Loop) -> None:
    assert converse(loop, b"  \n") == b""
    assert converse(loop, b"", shut=True) == b""
    assert loop.requests == [] and loop.server.clients() == 0


def test_past_the_client_limit_a_connection_is_closed_unanswered(loop: Loop) -> None:
    held = [connect(loop) for _ in range(MAX_CONTROL_CLIENTS)]
    loop.pump(lambda: loop.server.clients() == MAX_CONTROL_CLIENTS)
    extra = connect(loop)
    loop.pump(lambda: readable(extra))
    assert extra.recv(1) == b"" and loop.server.clients() == MAX_CONTROL_CLIENTS
    held[0].sendall(b'{"op": "status"}\n')  # the ones accepted are still served
    loop.pump(lambda: readable(held[0]))
    assert json.loads(held[0].recv(65536))["ok"] is True
    for c in held + [extra]:
        c.close()


def test_a_silent_client_is_closed_at_its_deadline(loop: Loop) -> None:
    c = connect(loop)
    loop.pump(lambda: loop.server.clients() == 1)
    loop.clock.advance(CLIENT_TIMEOUT - 0.1)
    loop.spin()
    assert loop.server.clients() == 1 and not readable(c)
    loop.clock.advance(0.1)
    loop.pump(lambda: loop.server.clients() == 0)
    assert c.recv(1) == b""
    c.close()


def test_a_deferred_action_runs_only_once_the_reply_was_sent(loop: Loop) -> None:
    c = connect(loop)
    seen: list[bytes] = []
    loop.after = lambda: seen.append(c.recv(65536, socket.MSG_PEEK) if readable(c) else b"")
    c.sendall(b'{"op": "stop"}\n')
    loop.pump(lambda: bool(seen))
    assert json.loads(seen[0]) == {"ok": True, "echo": {"op": "stop"}}  # the reply was there when the action ran
    c.close()
