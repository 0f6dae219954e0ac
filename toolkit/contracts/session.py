"""A blocking, authenticated connection to the scheduler (its control port or the job's store), for the worker
runtime, the store client and the agent's last words: connect, send a hello that proves the job token at once (hello
first, without waiting for the server's challenge), and accept the answer only if it proves the token too
(toolkit.contracts.protocol has the scheme and why).

The agent's everyday link is non-blocking and does the same steps in its event loop (toolkit.agent)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol


class ClosedEarly(ConnectionError):
    """The scheduler closed the connection before the handshake was over (a store or control port under a flood
    closes connections still waiting to authenticate, or refuses one beyond its source's rate): trying again at once
    may work (the hello is read at accept then)."""


AT_ONCE = 8  # evictions in a row a client answers by connecting again at once, before its usual pause between tries


def evicted(e: BaseException) -> bool:
    """Whether a failed handshake looks like the scheduler closing it to make room (ClosedEarly, or a reset or broken
    pipe while the hello was sent): the client connects again at once, its hello read at accept this time, rather
    than after a pause (callers bound it: AT_ONCE in a row)."""
    return isinstance(e, (ClosedEarly, ConnectionResetError, BrokenPipeError))


class Unproven(Exception):
    """The peer answered without proving it holds the job token: a wrong token on this side, or not this job's
    scheduler (something else took its address)."""


@dataclass
class Session:
    """An open connection whose peer proved the token: `reply` is its answer to the hello (welcome, reject,
    fenced), `queued` what came with it."""

    sock: socket.socket
    lines: protocol.LineBuffer
    reply: wire.Message
    queued: list[dict[str, Any]] = field(default_factory=list)  # as read (protocol.LineBuffer), for wire.decode


def open_session(address: tuple[str, int], token: str, hello: wire.Message, timeout: float,
                 connect_timeout: float, limit: int = protocol.MAX_LINE) -> Session:
    """Connect to `address` (host, port) and say `hello` (register, agent_hello, store_hello, replace), bounded by
    `timeout` for the whole exchange. OSError for the network, ProtocolError for a peer that does not speak the
    protocol (or a malformed answer, toolkit.contracts.messages), Unproven for one that cannot prove the token.

    `connect_timeout` bounds the TCP connect alone; `limit` is the longest line accepted from the server
    (P.MAX_STORE_LINE for the store). The reply is returned only once it proved the token, whatever it says: a
    proven `reject` or `fenced` is the caller's to act on, an unproven one raises Unproven quoting its reason. The
    socket is closed on any error; on success it is blocking, with the handshake's last timeout still set (callers
    set their own)."""
    deadline = time.monotonic() + timeout
    sock = socket.create_connection(address, timeout=connect_timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lines = protocol.LineBuffer(limit)
        pending: list[dict[str, Any]] = []

        def next_message() -> dict[str, Any]:
            """The next message from the server, each read bounded by what is left of the exchange's deadline (at
            least 10 ms; socket.timeout, an OSError, when it passes); ConnectionError if the server closes first."""
            while not pending:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = sock.recv(65536)
                if not data:
                    raise ClosedEarly("the scheduler closed the connection during the handshake")
                pending.extend(lines.feed(data))
            return pending.pop(0)

        line, client_nonce = protocol.first_hello(hello.OP, token, time.time(), **hello.encode())
        sock.sendall(line)  # hello first: usually read at the scheduler's accept, before any flood can evict it
        server_nonce = protocol.challenge_nonce(next_message())
        reply = next_message()
        if not protocol.check_server(token, server_nonce, client_nonce, reply):
            said = (f"it said: {str(reply.get('reason'))[:300]}" if reply.get("op") == protocol.REJECT
                    else f"{str(reply.get('op'))[:40]} without a proof")
            raise Unproven(f"the answer did not prove the job token ({said}); a wrong token on this host, or not "
                           "this job's scheduler")
        return Session(sock, lines, wire.decode(reply), pending)
    except BaseException:
        sock.close()
        raise
