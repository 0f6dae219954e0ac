"""Free ports on this machine's loopback, for jobs that tests and benchmarks start locally."""

from __future__ import annotations

import socket

ATTEMPTS = 200


def free_port_pair() -> int:
    """A port P such that P and P + 1 are free now: a job's control server and its store. Free now only: another
    process may take them before the job binds. RuntimeError if no such pair turns up in ATTEMPTS tries."""
    for _ in range(ATTEMPTS):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")
