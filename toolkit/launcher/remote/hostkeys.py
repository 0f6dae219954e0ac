"""Strict SSH host keys: every connection checks its host's key against known_hosts; an unknown key is refused unless
accepting new keys was asked for (then it is recorded, under a lock), a changed key always is.

Fabric alone would accept any key (paramiko's AutoAddPolicy, no known_hosts read); SshHost applies `KnownHosts` to
its connection and to every ProxyJump hop before connecting. The policy raises `KeyNotInKnownHosts` (and paramiko raises
BadHostKeyException); SshHost turns them into UnknownHostKey and ChangedHostKey (toolkit.launcher.remote.results)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.launcher.remote.sshsettings import SshSettings


class KeyNotInKnownHosts(Exception):
    """Raised by the host-key policy for a host that has no key in known_hosts (and accept-new is off)."""

    def __init__(self, hostname: str, key: Any) -> None:
        super().__init__(hostname)
        self.hostname = hostname
        self.key = key

    def describe(self, settings: SshSettings) -> str:
        """The cause for UnknownHostKey: the key's type and fingerprint, and the ssh-keyscan line (`-p PORT` for a
        non-standard port) or the flag that would accept it."""
        host = self.hostname
        scan = host[1:].replace("]:", " -p ") if host.startswith("[") else host
        return (f"host key unknown: {host} is not in {settings.known_hosts} ({self.key.get_name()} "
                f"{self.key.fingerprint}); verify it and add it (`ssh-keyscan {scan} >> {settings.known_hosts}`), "
                "or pass --accept-new-host-keys to trust keys seen for the first time")


class KnownHosts:
    """settings.known_hosts, parsed once for a whole fan-out; each connection gets only its own host's entries
    (parsing the file per connection costs hosts x lines key decodings: minutes at a few hundred hosts).

    Checking: a changed key is always refused (paramiko raises BadHostKeyException before any policy is asked);
    an unknown one is refused unless accept_new_host_keys, in which case it is appended to the file (under a
    lock, so parallel connections and processes do not lose lines).

    Read once, under a shared lock; raises UserError if the file exists but cannot be read. A missing file means
    no host is known. Built by run_on_all once per fan-out (and by SshHost when none is passed)."""

    def __init__(self, settings: SshSettings) -> None:
        import paramiko

        self.path = settings.known_hosts_path
        self.accept_new = settings.accept_new_host_keys
        self.keys = paramiko.HostKeys()
        if self.path.exists():
            try:
                with open(self.path) as f:
                    fcntl.flock(f, fcntl.LOCK_SH)
                    self.keys.load(str(self.path))
            except OSError as e:
                raise UserError(f"{self.path}: cannot read known_hosts ({e.strerror}); check the path") from None

    def apply(self, client: Any, hostname: str, port: int) -> None:
        """Make `client` check the key of hostname:port against this file: only that host's entries are loaded
        into it (looked up as `host` on port 22, `[host]:port` otherwise, as OpenSSH writes them), and a policy
        for a host without an entry is installed. Call before the client connects."""
        import paramiko

        name = hostname if int(port) == 22 else f"[{hostname}]:{port}"
        entry = self.keys.lookup(name)
        if entry is not None:
            for keytype in entry.keys():
                client.get_host_keys().add(name, keytype, entry[keytype])
        known = self

        class Policy(paramiko.MissingHostKeyPolicy):
            def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
                if not known.accept_new:
                    raise KeyNotInKnownHosts(hostname, key)
                _append_known_host(known.path, hostname, key)
                client.get_host_keys().add(hostname, key.get_name(), key)

        client.set_missing_host_key_policy(Policy())


def _append_known_host(path: Path, hostname: str, key: Any) -> None:
    """Record a first-seen key (accept-new) in known_hosts, created 0600 in a 0700 directory if missing.

    The file is re-read under an exclusive lock, so parallel connections (and other toolkit processes) neither
    lose lines nor record a host twice: the same key already there is a no-op; a different key recorded since
    this fan-out read the file raises paramiko.BadHostKeyException, reported as a changed key."""
    import paramiko

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        known = paramiko.HostKeys()
        for lineno, line in enumerate(f.read().splitlines(), 1):
            with contextlib.suppress(paramiko.SSHException, ValueError):
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
                if entry is not None:
                    for name in entry.hostnames:
                        known.add(name, entry.key.get_name(), entry.key)
        existing = known.lookup(hostname)
        if existing is not None:
            if existing.get(key.get_name()) == key:
                return
            # another process recorded a different key for this host meanwhile: that is a changed key
            raise paramiko.BadHostKeyException(hostname, key, next(iter(existing.values())))
        f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
