"""Free ports on this machine's loopback: the default port of a job on this machine (deploy, when no --master-port
is given: two local jobs run side by side), and of the jobs tests and benchmarks start locally.

Chosen below the kernel's ephemeral range, at random. Every outgoing connection (ssh, gloo, a store client, the
other test process) takes its local port from the ephemeral range, so a port the OS hands out there (bind to 0) can
be taken between the choice and the job's bind: seen in CI with two test processes, as "port ... is already in use".
Below that range only a listener can take it, and the random choice keeps two test processes apart."""

from __future__ import annotations

import random
import socket
from pathlib import Path

ATTEMPTS = 200
LOWEST = 24000  # the tests' fixed job ports (9300-9900, 21000-24000) and the default 8118 lie below
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
EPHEMERAL_DEFAULT = 32768  # Linux's default lower bound of the ephemeral range


def free_port() -> int:
    """A port nothing listens on right now, outside the ephemeral range. Free now only."""
    return _find(1)


def free_port_pair() -> int:
    """A port P such that P and P + 1 are free now, outside the ephemeral range: a job's control server and its
    store. Free now only: a listener may take them before the job binds. RuntimeError if no such pair turns up in
    ATTEMPTS tries."""
    return _find(2)


def _find(count: int) -> int:
    """A port P such that P .. P + count - 1 can be bound on 127.0.0.1 now."""
    highest = _ephemeral_low() - count
    choose = random.SystemRandom()  # not the seedable module state: tests seed it, and both processes alike
    for _ in range(ATTEMPTS):
        port = choose.randrange(LOWEST, highest)
        if all(_bindable(p) for p in range(port, port + count)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1 in {LOWEST}-{highest + count - 1}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_DEFAULT
