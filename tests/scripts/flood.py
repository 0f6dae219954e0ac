"""Another local user's flood, for the tests (standard library only, run under an unprivileged uid): idle TCP
connections that never say a word or hold a partial hello, or connections opened and closed at once.

usage: flood.py idle HOST PORT[,PORT...] PER_PORT RATE [SOURCE]
                                                         keep PER_PORT idle connections open to each port; one the
                                                         server closes is opened again, at most RATE new ones a second
                                                         in all (from address SOURCE if given); prints "opened N" once
                                                         the first N are open, then "replaced N" each second
       flood.py partial HOST PORT[,PORT...] PER_PORT RATE [SOURCE]
                                                         the same, each connection sending the start of a hello
                                                         (PARTIAL, no newline, no token needed) once it is up
       flood.py churn HOST PORT[,PORT...] COUNT          open and close COUNT connections to each port, then exit

Runs until killed (idle) and prints one line per second of what it did.
"""

from __future__ import annotations

import errno
import selectors
import socket
import sys
import time

PARTIAL = b'{"op": "register"'  # the start of a hello, as the red team's flood held (round 3)


def connect(host: str, port: int, source: str | None = None) -> socket.socket | None:
    s = socket.socket()
    if source:
        s.bind((source, 0))
    s.setblocking(False)
    code = s.connect_ex((host, port))
    if code not in (0, errno.EINPROGRESS):
        s.close()
        return None
    return s


def idle(host: str, ports: list[int], per_port: int, rate: float, source: str | None = None,
         say: bytes = b"") -> None:
    sel = selectors.DefaultSelector()
    want = {port: per_port for port in ports}  # connections to open
    replaced = opened = 0
    first = per_port * len(ports)
    budget, last = rate, time.monotonic()
    said = last
    while True:
        now = time.monotonic()
        budget, last = min(rate, budget + (now - last) * rate), now
        for port in ports:
            while want[port] and budget >= 1:
                s = connect(host, port, source)
                budget -= 1
                if s is None:
                    break
                want[port] -= 1
                opened += 1
                sel.register(s, selectors.EVENT_READ | (selectors.EVENT_WRITE if say else 0), port)
                if opened == first:
                    print(f"opened {first}", flush=True)
        for key, mask in sel.select(0.05):
            s = key.fileobj
            if mask & selectors.EVENT_WRITE:  # connected: say the start of a hello, once
                try:
                    s.send(say)
                except OSError:
                    pass
                sel.modify(s, selectors.EVENT_READ, key.data)
                continue
            try:
                data = s.recv(4096)  # the server's challenge: read and ignore
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                want[key.data] += 1
                replaced += 1
        if now - said >= 1.0:
            print(f"replaced {replaced}", flush=True)
            said = now


def churn(host: str, ports: list[int], count: int) -> None:
    for port in ports:
        for _ in range(count):
            with socket.create_connection((host, port), timeout=10):
                pass
    print(f"opened and closed {count} connection(s) to each of {len(ports)} port(s)", flush=True)


def main() -> None:
    mode, host, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3].split(",")]
    if mode in ("idle", "partial"):
        idle(host, ports, int(sys.argv[4]), float(sys.argv[5]), sys.argv[6] if len(sys.argv) > 6 else None,
             PARTIAL if mode == "partial" else b"")
    else:
        churn(host, ports, int(sys.argv[4]))


if __name__ == "__main__":
    main()
