"""A test cluster built from Linux network namespaces: each "host" has its own address on a private bridge, its
own hostname, home, workdir and OpenSSH server (key-only), and the cluster comes with a client key, a real
known_hosts file, an ssh_config and an Ansible inventory, so tests exercise the same SSH paths a user's cluster
does without leaving this machine. On the hosts, the hosts' names resolve (an /etc/hosts of the cluster's, mounted
in their own mount namespaces), as on a cluster with DNS: a job given `--hosts=node1:4,node2:4` through ssh_config
aliases works.

Everything an instance creates is named from a short id unique on this machine and recorded in `cluster.json`
before it is created, so two clusters coexist and teardown (also `scripts/cluster.py down` of a stale one)
removes exactly what was made: processes are found through their namespace (`ip netns pids`), never by name.
Needs root, iproute2, util-linux and openssh-server (`scripts/install.sh --system`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

SSHD = "/usr/sbin/sshd"
ROOT_HOME = "/root"  # the sessions' user is root; each host mounts its own home over this
REGISTRY = Path("/run/toolkit-cluster")  # <id>.json per live cluster: where its state is, who owns it
STATE_FILE = "cluster.json"
SSH_PORT = 22
CONNECT_TIMEOUT = 5  # seconds, written into ssh_config
READY_POLL = 0.01  # s between looks for sshd's pidfile, which it writes once it listens
READY_TIMEOUT = 30.0
LINK_POLL = 0.05  # s between connection attempts while a host's link comes back
EXIT_TIMEOUT = 10.0  # bound on waiting for killed processes to go
IP_TIMEOUT = 30.0
MAX_HOSTS = 250  # one /24: .1 is the bridge
SUBNET_FIRST, SUBNET_COUNT = 200, 50  # clusters use 10.200.0.0 - 10.249.255.0 (/24 each)


class ClusterSetupError(RuntimeError):
    """The cluster could not be built or torn down; the message says which step and why."""


@dataclass(frozen=True)
class ClusterHost:
    """One namespace host. Its files live in `dir`; `home` is bind-mounted over /root for its sessions, so the
    machine's ~/.bashrc (pyenv init on every command) never runs there."""

    name: str
    index: int
    address: str
    netns: str
    veth: str  # the end in the root namespace, on the bridge; setting it down partitions the host
    dir: str

    @property
    def home(self) -> Path:
        """The host's private home, bind-mounted over /root in its namespaces."""
        return Path(self.dir) / "home"

    @property
    def workdir(self) -> Path:
        """The host's workdir for jobs (the inventory's `workdir`)."""
        return Path(self.dir) / "work"

    @property
    def host_key(self) -> Path:
        """The private host key its sshd serves (the public half next to it, `.pub`)."""
        return Path(self.dir) / "ssh_host_ed25519_key"

    @property
    def sshd_config(self) -> Path:
        """Its sshd's configuration file."""
        return Path(self.dir) / "sshd_config"

    @property
    def pid_file(self) -> Path:
        """Its sshd's pidfile, written once sshd listens; absent while the host is down."""
        return Path(self.dir) / "sshd.pid"

    @property
    def sshd_log(self) -> Path:
        """Its sshd's log (and the output of the host's init)."""
        return Path(self.dir) / "sshd.log"

    def public_key(self) -> str:
        """`ssh-ed25519 AAAA...` of the key its sshd serves now."""
        return " ".join(Path(str(self.host_key) + ".pub").read_text().split()[:2])


@dataclass(frozen=True)
class ClusterState:
    """What one cluster consists of; written to cluster.json before anything is created, so a teardown from
    another process (or after a crash) knows exactly what to remove."""

    id: str
    dir: str
    owns_dir: bool
    bridge: str
    bridge_address: str
    prefix_len: int
    hosts: tuple[ClusterHost, ...]
    python: str
    owner: tuple[int, int] | None  # (pid, start time) of the process whose exit makes the cluster stale
    home_shares: tuple[str, ...] = ()  # entries of root's real home that the private homes show (the python)

    def to_json(self) -> str:
        """The text of cluster.json."""
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> ClusterState:
        """Parse cluster.json (as `to_json` writes it); ValueError, KeyError or TypeError if it is not one."""
        data = json.loads(text)
        data["hosts"] = tuple(ClusterHost(**h) for h in data["hosts"])
        data["owner"] = tuple(data["owner"]) if data["owner"] else None
        data["home_shares"] = tuple(data.get("home_shares", ()))
        return ClusterState(**data)


class Cluster:
    """A live cluster. Build with `Cluster.up(n)`, or attach to a recorded one with `Cluster.load(dir)`;
    `down()` removes it. The fault helpers act on one host by its inventory name."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}  # sshds this process started (so it reaps them)
        self._flags: str | None = None

    # --- paths and names ---------------------------------------------------------------------------------------

    @property
    def dir(self) -> Path:
        """The cluster's directory: cluster.json, keys, known_hosts, ssh_config, inventory, hosts/."""
        return Path(self.state.dir)

    @property
    def hosts(self) -> tuple[ClusterHost, ...]:
        """The hosts, node1 first."""
        return self.state.hosts

    @property
    def names(self) -> list[str]:
        """The hosts' inventory names, node1 first."""
        return [h.name for h in self.hosts]

    def host(self, name: str) -> ClusterHost:
        """The host called `name`; KeyError listing the cluster's hosts if there is none."""
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"cluster {self.state.id} has no host {name!r}; hosts: {', '.join(self.names)}")

    @property
    def key(self) -> Path:
        """The client's private key (its public half is every host's authorized key)."""
        return self.dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """known_hosts with every host's key as built (not updated by `replace_host_key`)."""
        return self.dir / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        """ssh_config for `ssh -F`: every host by name and address, key-only, strict host keys."""
        return self.dir / "ssh_config"

    @property
    def etc_hosts(self) -> Path:
        """The hosts' /etc/hosts (mounted over theirs): every host's name and address, and localhost."""
        return self.dir / "etc_hosts"

    @property
    def inventory(self) -> Path:
        """The Ansible inventory (INI) of the cluster: every host a worker, with `slots` each."""
        return self.dir / "inventory.ini"

    @property
    def python(self) -> str:
        """The interpreter the inventory names (`python` and ansible_python_interpreter)."""
        return self.state.python

    def known_hosts_lines(self, names: Sequence[str] | None = None) -> list[str]:
        """known_hosts lines for the hosts' current keys (all hosts, or those named)."""
        chosen = self.hosts if names is None else [self.host(n) for n in names]
        return [f"{h.address},{h.name} {h.public_key()}" for h in chosen]

    def write_known_hosts(self, path: str | Path, names: Sequence[str] | None = None) -> Path:
        """Write `known_hosts_lines(names)` to `path` (replacing it) and return the path."""
        path = Path(path)
        path.write_text("".join(line + "\n" for line in self.known_hosts_lines(names)))
        return path

    def netns_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """argv that runs `argv` inside the host's network namespace (no SSH; the machine's own home)."""
        return ["ip", "netns", "exec", self.host(name).netns, *argv]

    # --- building ----------------------------------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        n: int,
        dir: str | Path | None = None,
        slots: int = 1,
        python: str | None = None,
        owned_by_this_process: bool = True,
    ) -> Cluster:
        """Build n hosts whose inventory says `python` (default: this interpreter). With
        `owned_by_this_process`, the cluster counts as stale once this process is gone (and an atexit hook tears
        it down on a normal exit); a cluster made by hand has no owner."""
        if not 1 <= n <= MAX_HOSTS:
            raise ClusterSetupError(f"a cluster has 1 to {MAX_HOSTS} hosts, not {n}")
        if os.geteuid() != 0:
            raise ClusterSetupError("building namespace hosts needs root (ip netns, mount, sshd)")
        for tool in (SSHD, shutil.which("ip"), shutil.which("unshare")):
            if not tool or not os.access(tool, os.X_OK):
                raise ClusterSetupError(
                    "the test cluster needs openssh-server, iproute2 and util-linux; run scripts/install.sh --system"
                )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        owner = (os.getpid(), _start_time(os.getpid())) if owned_by_this_process else None
        cluster = cls._allocate(n, dir, owner, os.path.abspath(python or sys.executable))
        try:
            cluster._build(slots)
        except BaseException:
            cluster.down()
            raise
        if owned_by_this_process:
            import atexit

            atexit.register(cluster.down)
        return cluster

    @classmethod
    def _allocate(cls, n: int, dir: str | Path | None, owner: tuple[int, int] | None, python: str) -> Cluster:
        """Pick an unused id and subnet and record them, under a machine-wide lock so that two clusters being
        built at once cannot pick the same."""
        REGISTRY.mkdir(mode=0o755, exist_ok=True)
        with open(REGISTRY / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken_ids = {p.stem for p in REGISTRY.glob("*.json")}
            existing_links = set(os.listdir("/sys/class/net"))
            existing_ns = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
            base = _base36(os.getpid())
            for suffix in [""] + list("abcdefghijklmnopqrstuvwxyz"):
                cid = base + suffix
                if (
                    cid not in taken_ids
                    and f"tkb{cid}" not in existing_links
                    and not any(ns.startswith(f"tk{cid}-") for ns in existing_ns)
                ):
                    break
            else:
                raise ClusterSetupError(f"no free cluster id for pid {os.getpid()}; "
                                        "run scripts/cluster.py down --stale")
            subnet = _free_subnet(REGISTRY, os.getpid())
            if dir is None:
                path, owns_dir = Path(tempfile.mkdtemp(prefix=f"toolkit-cluster-{cid}-")), True
            else:
                path, owns_dir = Path(dir).absolute(), False
                path.mkdir(parents=True, exist_ok=True)
                if (path / STATE_FILE).exists():
                    raise ClusterSetupError(f"{path} already holds a cluster; run scripts/cluster.py down --dir {path}")
            addresses = list(subnet.hosts())
            hosts = tuple(
                ClusterHost(
                    name=f"node{i}",
                    index=i,
                    address=str(addresses[i]),
                    netns=f"tk{cid}-node{i}",
                    veth=f"tk{cid}v{i}",
                    dir=str(path / "hosts" / f"node{i}"),
                )
                for i in range(1, n + 1)
            )
            state = ClusterState(
                id=cid,
                dir=str(path),
                owns_dir=owns_dir,
                bridge=f"tkb{cid}",
                bridge_address=str(addresses[0]),
                prefix_len=subnet.prefixlen,
                hosts=hosts,
                python=python,
                owner=owner,
                home_shares=_home_shares(python),
            )
            _write_atomic(path / STATE_FILE, state.to_json())
            _write_atomic(REGISTRY / f"{cid}.json", json.dumps({"dir": str(path), "subnet": str(subnet)}))
        return cls(state)

    def _build(self, slots: int) -> None:
        s = self.state
        client_key, client_pub = _new_ed25519()
        self.key.write_bytes(client_key)
        self.key.chmod(0o600)
        Path(str(self.key) + ".pub").write_text(client_pub + " toolkit-cluster\n")
        (self.dir / "authorized_keys").write_text(client_pub + "\n")
        for h in self.hosts:
            h.home.mkdir(parents=True, exist_ok=True)
            h.workdir.mkdir(parents=True, exist_ok=True)
            _write_host_key(h)
            h.sshd_config.write_text(self._sshd_config(h))

        lines = [f"link add {s.bridge} type bridge", f"addr add {s.bridge_address}/{s.prefix_len} dev {s.bridge}",
                 f"link set {s.bridge} up"]
        for h in self.hosts:
            lines += [f"netns add {h.netns}", f"link add {h.veth} type veth peer name eth0 netns {h.netns}",
                      f"link set {h.veth} master {s.bridge} up"]
        _ip_batch(lines)
        for h in self.hosts:
            _ip_batch(["link set lo up", f"addr add {h.address}/{s.prefix_len} dev eth0", "link set eth0 up"],
                      netns=h.netns)

        self.write_known_hosts(self.known_hosts)
        self.etc_hosts.write_text("".join(f"{a}\t{n}\n" for a, n in [("127.0.0.1", "localhost"), ("::1", "localhost")]
                                          + [(h.address, h.name) for h in self.hosts]))
        self.ssh_config.write_text(self._ssh_config_text())
        self.inventory.write_text(self._inventory_text(slots))
        self._start_sshds(self.names)

    def _sshd_config(self, h: ClusterHost) -> str:
        return "\n".join([
            f"ListenAddress {h.address}:{SSH_PORT}",
            f"HostKey {h.host_key}",
            f"PidFile {h.pid_file}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "StrictModes no",  # the key file sits under /tmp (mode 1777)
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "MaxStartups 1000",
            "MaxSessions 1000",
            "Subsystem sftp internal-sftp",
            "",
        ])

    def _ssh_config_text(self) -> str:
        common = [
            "    User root",
            f"    Port {SSH_PORT}",
            f"    IdentityFile {self.key}",
            "    IdentitiesOnly yes",
            f"    UserKnownHostsFile {self.known_hosts}",
            "    StrictHostKeyChecking yes",
            f"    ConnectTimeout {CONNECT_TIMEOUT}",
            "    BatchMode yes",
        ]
        out = [f"# toolkit test cluster {self.state.id}: use with ssh -F {self.ssh_config} node1", ""]
        for h in self.hosts:
            out += [f"Host {h.name}", f"    HostName {h.address}", *common, ""]
        out += ["# the same for the bare addresses (the inventory's ansible_host)",
                "Host " + " ".join(h.address for h in self.hosts), *common, ""]
        return "\n".join(out)

    def _inventory_text(self, slots: int) -> str:
        s = self.state
        out = [f"# toolkit test cluster {s.id}: {len(self.hosts)} hosts on {s.bridge} "
               f"({s.bridge_address}/{s.prefix_len}); remove with scripts/cluster.py down --dir {self.dir}",
               "[workers]"]
        for h in self.hosts:
            out.append(
                f"{h.name} ansible_host={h.address} ansible_port={SSH_PORT} ansible_user=root "
                f"ansible_ssh_private_key_file={self.key} slots={slots} workdir={h.workdir} python={self.python}"
            )
        out += [
            "",
            "[all:vars]",
            f"ansible_ssh_common_args='-F {self.ssh_config}'",
            f"ansible_python_interpreter={self.python}",
            "",
        ]
        return "\n".join(out)

    # --- sshd lifecycle ----------------------------------------------------------------------------------------

    def _start_sshds(self, names: Sequence[str]) -> None:
        """Start the hosts' sshds together, then wait until each has written its pidfile (it does so only once
        it listens)."""
        started = {}
        for name in names:
            h = self.host(name)
            h.pid_file.unlink(missing_ok=True)
            argv = ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                    "/bin/sh", "-c", _HOST_INIT, "sh", h.name, str(h.home), ROOT_HOME, SSHD, str(h.sshd_config),
                    str(h.sshd_log), self._sshd_flags(), str(self.etc_hosts), *self.state.home_shares]
            with open(h.sshd_log, "ab") as log:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        start_new_session=True, close_fds=True)
            self._sshd[name] = proc
            started[name] = proc
        deadline = time.monotonic() + READY_TIMEOUT
        pending = dict(started)
        while pending:
            for name, proc in list(pending.items()):
                h = self.host(name)
                if proc.poll() is not None:
                    raise ClusterSetupError(f"sshd of {name} exited with {proc.returncode}: {_tail(h.sshd_log)}")
                if h.pid_file.exists() and h.pid_file.read_text().strip():
                    del pending[name]
            if pending:
                if time.monotonic() > deadline:
                    raise ClusterSetupError(
                        f"sshd of {', '.join(pending)} did not listen within {READY_TIMEOUT:.0f}s; "
                        f"see {self.host(next(iter(pending))).sshd_log}"
                    )
                time.sleep(READY_POLL)

    def _sshd_flags(self) -> str:
        """`-r` (no re-exec per connection) where this sshd accepts it: it halves the server's CPU per
        connection, which on one shared machine all hosts' sshds otherwise compete for. Also checks the
        generated config, so a bad one fails here with sshd's own words."""
        if self._flags is None:
            config = str(self.hosts[0].sshd_config)
            for flags in ("-r", ""):
                out = subprocess.run([SSHD, "-t", *flags.split(), "-f", config], capture_output=True, text=True,
                                     timeout=IP_TIMEOUT)
                if out.returncode == 0:
                    self._flags = flags
                    break
            else:
                raise ClusterSetupError(f"sshd rejects {config}: {out.stderr.strip()}")
        return self._flags

    def sshd_pid(self, name: str) -> int | None:
        """The pid of the host's listening sshd, or None if it is not running."""
        h = self.host(name)
        try:
            pid = int(h.pid_file.read_text().split()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return None
        return pid if _in_netns(pid, h.netns) else None

    def inside_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """argv that runs `argv` where the host's own processes run: its network, hostname and mount namespaces
        (a mount made from outside does not reach the host's private mount namespace)."""
        pid = self.sshd_pid(name)
        if pid is None:
            raise ClusterSetupError(f"{name} is down: its sshd is not running")
        return ["nsenter", "--target", str(pid), "--net", "--uts", "--mount", "--", *argv]

    def start_sshd(self, name: str) -> None:
        """Start the host's sshd again (after `kill_host` or `stop_sshd`), as a rebooted host would."""
        if self.sshd_pid(name) is not None:
            raise ClusterSetupError(f"sshd of {name} is already running")
        self._start_sshds([name])

    def stop_sshd(self, name: str) -> None:
        """Stop only the listening sshd; sessions already open go on, as on a real host."""
        pid = self.sshd_pid(name)
        if pid is not None:
            _kill_and_wait([pid], self.host(name).netns, EXIT_TIMEOUT)
        self._reap(name)
        self.host(name).pid_file.unlink(missing_ok=True)

    def _reap(self, name: str) -> None:
        proc = self._sshd.pop(name, None)
        if proc is not None:
            try:
                proc.wait(timeout=EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass

    # --- faults --------------------------------------------------------------------------------------------------

    def netns_pids(self, name: str) -> list[int]:
        """Every live process in the host's network namespace (sshd, sessions, whatever the tests started)."""
        return _netns_pids(self.host(name).netns)

    def workload_pids(self, name: str) -> list[int]:
        """Processes of the host other than sshd's own (the listener and its per-connection processes, also
        those orphaned when a listener was restarted): what a test started there. Used to check that nothing is
        left running."""
        return [pid for pid in self.netns_pids(name) if not _is_sshd(pid)]

    def unauthenticated(self, name: str) -> list[ProcessInfo]:
        """sshd's processes for connections that never logged in (`sshd: [accepted]`, `[net]`): a client that
        gave up on a host without closing its connection leaves them behind until LoginGraceTime."""
        found = [describe(pid) for pid in self.netns_pids(name) if _is_sshd(pid)]
        return [info for info in found if info is not None and info.live
                and info.command in ("sshd: [accepted]", "sshd: [net]")]

    def workload(self, names: Sequence[str] | None = None) -> dict[str, list[ProcessInfo]]:
        """The live workload of each named host (all by default), described; hosts with none are left out."""
        out = {}
        for name in names if names is not None else self.names:
            found = [info for info in map(describe, self.workload_pids(name)) if info is not None and info.live]
            if found:
                out[name] = found
        return out

    def kill_host(self, name: str) -> list[int]:
        """Crash the host: SIGKILL every process in its namespace (sshd, sessions, setsid'd and double-forked
        children alike). Returns the pids killed. `start_sshd` boots it again."""
        h = self.host(name)
        pids = _netns_pids(h.netns)
        _kill_and_wait(pids, h.netns, EXIT_TIMEOUT)
        self._reap(name)
        h.pid_file.unlink(missing_ok=True)
        return pids

    def link_down(self, name: str) -> None:
        """Partition the host: its cable is pulled (the bridge-side veth goes down); processes keep running."""
        _ip_batch([f"link set {self.host(name).veth} down"])

    def link_up(self, name: str, wait: bool = True) -> None:
        """Plug the host back in; with wait, return once its sshd accepts TCP connections again (so the next
        test does not race the link coming up)."""
        h = self.host(name)
        _ip_batch([f"link set {h.veth} up"])
        if wait and self.sshd_pid(name) is not None:
            deadline = time.monotonic() + READY_TIMEOUT
            while True:
                try:
                    with socket.create_connection((h.address, SSH_PORT), timeout=1):
                        return
                except OSError:
                    if time.monotonic() > deadline:
                        raise ClusterSetupError(f"{name} is not reachable {READY_TIMEOUT:.0f}s after link up") from None
                    time.sleep(LINK_POLL)

    def replace_host_key(self, name: str) -> str:
        """Give the host a new host key (as a reinstalled machine, or an impostor, would have) and restart its
        sshd; known_hosts is left alone. Returns the new public key."""
        h = self.host(name)
        self.stop_sshd(name)
        _write_host_key(h)
        self._start_sshds([name])
        return h.public_key()

    @contextlib.contextmanager
    def partitioned(self, name: str) -> Iterator[ClusterHost]:
        """The host cut off the network inside the block (`link_down`), plugged back in after it (`link_up`: once its
        sshd, if running, accepts connections again)."""
        self.link_down(name)
        try:
            yield self.host(name)
        finally:
            self.link_up(name)

    @contextlib.contextmanager
    def crashed(self, name: str) -> Iterator[ClusterHost]:
        """The host crashed inside the block (`kill_host`), booted again after it (its sshd started unless the
        block did that already); processes killed stay dead."""
        self.kill_host(name)
        try:
            yield self.host(name)
        finally:
            if self.sshd_pid(name) is None:
                self.start_sshd(name)

    @contextlib.contextmanager
    def host_key_changed(self, name: str) -> Iterator[str]:
        """Serve a new host key inside the block, the original one after it."""
        h = self.host(name)
        saved = h.host_key.read_bytes(), Path(str(h.host_key) + ".pub").read_bytes()
        new = self.replace_host_key(name)
        try:
            yield new
        finally:
            self.stop_sshd(name)
            _write_host_key(h, saved)
            self._start_sshds([name])

    # --- teardown ------------------------------------------------------------------------------------------------

    def down(self) -> list[str]:
        """Remove everything this cluster made: every process in its namespaces, the namespaces (and with them
        the veths), the bridge, its registry entry, and its directory if it made it. Safe to call twice and on
        a half-built cluster. Returns what could not be removed (empty when clean)."""
        s = self.state
        problems: list[str] = []
        existing_ns = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
        mine = [h for h in self.hosts if h.netns in existing_ns]
        for h in mine:
            try:
                _kill_and_wait(_netns_pids(h.netns), h.netns, EXIT_TIMEOUT)
            except ClusterSetupError as e:
                problems.append(str(e))
        for name in list(self._sshd):
            self._reap(name)
        # A veth is deleted at once with its peer; a namespace's devices go asynchronously: veths first.
        lines = [f"link del {h.veth}" for h in self.hosts if os.path.exists(f"/sys/class/net/{h.veth}")]
        lines += [f"netns del {h.netns}" for h in mine]
        if os.path.exists(f"/sys/class/net/{s.bridge}"):
            lines.append(f"link del {s.bridge}")
        if lines and _ip_batch_tolerant(lines):
            # Another teardown of the same cluster (a sweep of stale ones by a concurrent test run) may have removed
            # some of them first: only what is still there is a problem.
            left = [h.netns for h in self.hosts if os.path.exists(f"/run/netns/{h.netns}")]
            left += [d for d in [*(h.veth for h in self.hosts), s.bridge] if os.path.exists(f"/sys/class/net/{d}")]
            problems += [f"ip: could not remove {name}" for name in left]
        if not problems:
            (REGISTRY / f"{s.id}.json").unlink(missing_ok=True)
            if s.owns_dir:
                shutil.rmtree(s.dir, ignore_errors=True)
            else:
                (self.dir / STATE_FILE).unlink(missing_ok=True)
        return problems

    @classmethod
    def load(cls, dir: str | Path) -> Cluster:
        """Attach to the cluster recorded in `dir` (by another process, e.g. `scripts/cluster.py up`), to use or
        tear it down; ClusterSetupError if `dir` holds none."""
        path = Path(dir) / STATE_FILE
        try:
            return cls(ClusterState.from_json(path.read_text()))
        except FileNotFoundError:
            raise ClusterSetupError(f"{dir}: no cluster recorded here ({STATE_FILE} missing)") from None

    @classmethod
    def remove_stale(cls) -> list[str]:
        """Tear down every recorded cluster whose owning process is gone (a test run that was killed); clusters
        made by hand have no owner and are left alone. Returns what could not be removed."""
        problems = []
        for cid, directory, stale in cls.recorded():
            if not stale:
                continue
            if directory == "?":
                problems.append(f"cluster {cid}: its state is gone; remove {REGISTRY}/{cid}.json and its "
                                f"tk{cid}-* namespaces by hand")
                continue
            problems += cls.load(directory).down()
        return problems

    @staticmethod
    def recorded() -> list[tuple[str, str, bool]]:
        """(id, dir, stale) of every cluster recorded on this machine; stale: its owner process is gone."""
        out = []
        for entry in sorted(REGISTRY.glob("*.json")):
            try:
                info = json.loads(entry.read_text())
                state = ClusterState.from_json((Path(info["dir"]) / STATE_FILE).read_text())
            except (OSError, ValueError, KeyError):
                out.append((entry.stem, "?", True))
                continue
            stale = state.owner is not None and _start_time(state.owner[0]) != state.owner[1]
            out.append((state.id, state.dir, stale))
        return out


# --- helpers ---------------------------------------------------------------------------------------------------

# Run inside a host's new UTS and mount namespaces: name it, give it the cluster's /etc/hosts, put its private home
# over root's (showing only the shared entries, e.g. ~/.pyenv where the venv's python lives) and become its sshd.
_HOST_INIT = """
name=$1 home=$2 real=$3 sshd=$4 conf=$5 log=$6 flags=$7 hosts=$8; shift 8
hostname "$name" || exit 1
mount --bind "$hosts" /etc/hosts || exit 1
for share in "$@"; do
    mkdir -p "$home/$share" && mount --bind "$real/$share" "$home/$share" || exit 1
done
mount --rbind "$home" "$real" && exec "$sshd" -D $flags -f "$conf" -E "$log"
"""


def _home_shares(python: str) -> tuple[str, ...]:
    """The top-level entries of root's home that `python` needs (a venv's interpreter under ~/.pyenv, say): a
    private home hides the rest, ~/.bashrc included."""
    paths = {os.path.realpath(python)}
    venv_cfg = Path(python).parent.parent / "pyvenv.cfg"
    if venv_cfg.is_file():
        for line in venv_cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("home", "executable"):
                paths.add(os.path.realpath(value.strip()))
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        paths |= {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    shares = set()
    for path in paths:
        rel = os.path.relpath(path, ROOT_HOME)
        if not rel.startswith(".."):
            shares.add(rel.split(os.sep)[0])
    return tuple(sorted(shares))


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, r = divmod(number, 36)
        out = digits[r] + out
        if not number:
            return out


def _free_subnet(registry: Path, seed: int) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that neither this machine's interfaces nor another recorded cluster uses."""
    used: list[ipaddress.IPv4Network] = []
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=IP_TIMEOUT)
    for line in out.stdout.splitlines():
        words = line.split()
        if "inet" in words:
            used.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    out = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, timeout=IP_TIMEOUT)
    for line in out.stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first and first != "default":
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(first, strict=False))
    for entry in registry.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            used.append(ipaddress.ip_network(json.loads(entry.read_text())["subnet"]))
    total = SUBNET_COUNT * 256
    for step in range(total):
        k = (seed + step) % total
        net = ipaddress.ip_network(f"10.{SUBNET_FIRST + k // 256}.{k % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise ClusterSetupError("no free 10.x.y.0/24 for a test cluster; run scripts/cluster.py down --stale")


def _new_ed25519() -> tuple[bytes, str]:
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public.decode()


def _write_host_key(h: ClusterHost, saved: tuple[bytes, bytes] | None = None) -> None:
    if saved is None:
        private, public = _new_ed25519()
        saved = private, (public + f" root@{h.name}\n").encode()
    h.host_key.unlink(missing_ok=True)
    fd = os.open(h.host_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(saved[0])
    Path(str(h.host_key) + ".pub").write_bytes(saved[1])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _ip_batch(lines: Sequence[str], netns: str | None = None) -> None:
    argv = ["ip"] + (["-n", netns] if netns else []) + ["-batch", "-"]
    out = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=IP_TIMEOUT)
    if out.returncode != 0:
        where = f" in {netns}" if netns else ""
        raise ClusterSetupError(f"ip{where} failed: {out.stderr.strip() or out.stdout.strip()}")


def _ip_batch_tolerant(lines: Sequence[str]) -> list[str]:
    """Run each line even if one fails (teardown removes what it can); return the failures."""
    out = subprocess.run(["ip", "-force", "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, timeout=IP_TIMEOUT)
    return [f"ip: {line}" for line in out.stderr.splitlines() if line.strip()] if out.returncode else []


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=IP_TIMEOUT)
    return [int(w) for w in out.stdout.split()] if out.returncode == 0 else []


def _netns_inode(netns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{netns}").st_ino
    except FileNotFoundError:
        return None


def _in_netns(pid: int, netns: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == _netns_inode(netns)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def _kill_and_wait(pids: Sequence[int], netns: str, timeout: float) -> None:
    """SIGKILL each pid that is still in the namespace, through a pidfd so a reused pid is never hit, and wait
    (on the pidfds, bounded) until they have exited; a zombie counts as gone."""
    fds = []
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            if not _in_netns(pid, netns):  # checked after the pidfd pins the process
                os.close(fd)
                continue
            fds.append(fd)
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        remaining = len(fds)
        deadline = time.monotonic() + timeout
        while remaining:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterSetupError(f"{remaining} processes in {netns} still alive {timeout:.0f}s after SIGKILL")
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                remaining -= 1
    finally:
        for fd in fds:
            os.close(fd)


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _is_sshd(pid: int) -> bool:
    """A process of sshd's own: the listener, a per-connection process (`sshd: [accepted]`, `sshd: [net]`,
    `sshd: root@notty`), whoever its parent now is. A session's command is never one: sshd execs a shell. A process
    on its way out has no exe link any more (the kernel drops it with its memory, before the process turns zombie):
    then its name says it (CI 2026-11-27: a connection's sshd, exiting, 0.1 s old, was taken for a job's leftover)."""
    try:
        return os.readlink(f"/proc/{pid}/exe") == SSHD
    except FileNotFoundError:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip() == Path(SSHD).name
        except OSError:
            return False
    except OSError:
        return False


@dataclass(frozen=True)
class ProcessInfo:
    """What a leftover-process assertion prints about one process."""

    pid: int
    ppid: int
    state: str
    age: float  # s since it started
    command: str

    @property
    def live(self) -> bool:
        """True unless the process is a zombie (Z) or dead (X)."""
        return self.state not in ("Z", "X")

    def __str__(self) -> str:
        return f"pid {self.pid} (parent {self.ppid}, state {self.state}, age {self.age:.1f} s): {self.command}"


def describe(pid: int) -> ProcessInfo | None:
    """pid, parent, state, age and command line of a process, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    command = " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)
    if not command:
        command = "[" + stat[stat.index("(") + 1:stat.rindex(")")] + "]"
    age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return ProcessInfo(pid, int(fields[1]), fields[0], age, command)


def exited(pid: int) -> bool:
    """Gone, or a zombie awaiting its reaper (this machine's reaper may be slow): what "no longer runs" means."""
    info = describe(pid)
    return info is None or not info.live


def format_workload(found: dict[str, list[ProcessInfo]]) -> str:
    """One line per leftover process, under its host: what an assertion about leftovers prints."""
    return "\n".join(f"  {host}: {info}" for host, infos in found.items() for info in infos)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
