"""Which local network interface reaches the scheduler: the one gloo must bind its sockets to.

Why: gloo picks its address by resolving the machine's hostname, and where that name does not resolve to an
address of this host (no DNS entry, a container, a network namespace) it falls back to 127.0.0.1 and every peer on
another host then fails to connect. The route the kernel picks toward the scheduler names an interface that the
peers can reach; the agent hands it to its workers as GLOO_SOCKET_IFNAME unless the user set one.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
IF_INET6 = Path("/proc/net/if_inet6")


def interface_toward(host: str, port: int) -> str | None:
    """The name of the interface whose address the kernel would use to reach host:port; None if unknown."""
    address = _source_address(host, port)
    if address is None:
        return None
    for _, name in socket.if_nameindex():
        if address in _addresses(name):
            return name
    return None


def _source_address(host: str, port: int) -> str | None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)  # UDP: picks the route, sends nothing
                return str(ipaddress.ip_address(s.getsockname()[0].split("%")[0]))
        except OSError:
            continue
    return None


def _addresses(name: str) -> set[str]:
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            found.add(socket.inet_ntoa(reply[20:24]))
        except OSError:
            pass
    try:
        lines = IF_INET6.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and fields[5] == name:
            found.add(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found
