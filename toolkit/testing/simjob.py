"""A simulated job of many ranks against the real scheduler, for the scale benchmark (bench/scheduler_scale.py) and
its quick test (tests/test_scale.py).

Why: the scheduler and the job's store must not fall off a cliff with a thousand ranks, and that can only be seen
with the real process serving thousands of authenticated connections. `SimJob` starts `python -m toolkit.scheduler`
in its own session, configured as a deployed job (MS_WORKER_NUM, TOOLKIT_EXPECTED naming host `sim<k>` for the
ranks 8k..8k+7, recovery on in a directory on disk, the token in a 0600 file), and simulated hosts
(toolkit.testing.simhosts: one agent and its workers per host, whole hosts per process, clamp(N/512, 2, 8)
processes, each host from its own loopback address) that speak the real protocol. It drives them through a
formation, a steady state, losses and their re-formation, and the end, and measures each phase from outside:

- times from the simulators' CLOCK_MONOTONIC stamps (system-wide): `formed` and `built` (every rank's bootstrap
  done) after `go`; after a kill, each survivor's `generation` notice, the new formation and every rank rebuilt;
- the scheduler's CPU (utime + stime), RSS and peak RSS, and the bytes it wrote to disk (/proc/<pid>/io
  write_bytes: the recovery directory is on disk, not tmpfs), per phase; the simulators' CPU next to it, and a phase
  in which one simulator used more than CLIENT_BOUND of a core, or the simulators and the scheduler together more
  than CLIENT_BOUND of the machine's cores, is flagged "client-bound" (its latencies measure the clients, not the
  scheduler);
- per loss, until the ledger (ledger.json) says every rank trained again: the scheduler's CPU seconds and bytes;
- refused connections at both ends (the simulators' counts; the scheduler log's refusals), ERROR and WARNING lines,
  and the most often one line (digits masked) was logged within one second.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import selectors
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit import procs
from toolkit.contracts import envvars, protocol, rundoc
from toolkit.freeports import free_port_pair
from toolkit.testing.simhosts import PATTERNS
from toolkit.testing.waits import wait_for

PER_HOST = 8
RANKS_PER_SIM = 512  # ranks one simulator process plays, at most (within MIN_SIMS..MAX_SIMS processes)
MIN_SIMS, MAX_SIMS = 2, 8
CLIENT_BOUND = 0.8  # share of a core above which a simulator is the bottleneck of a phase
STOP_GRACE = 10.0  # s for a process to end after SIGTERM before SIGKILL
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
LOG_LINE = re.compile(r"^(\S+) sched (\w+) (.*)$")
REFUSAL = re.compile(r"to make room|cannot accept|did not authenticate|rejected|dropped")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Usage:
    """A process's resource use so far: CPU seconds (user + system), resident and peak resident bytes, bytes it
    caused to be written to storage."""

    cpu: float
    rss: int
    hwm: int
    written: int
    queued: float  # s it was ready to run but waited for a CPU (/proc/<pid>/schedstat): the machine's load

    @classmethod
    def of(cls, pid: int) -> Usage:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
        kb = {k: int(v.split()[0]) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(.+)$", status, re.M)}
        try:
            written = int(re.search(r"^write_bytes: (\d+)", Path(f"/proc/{pid}/io").read_text(), re.M)[1])
        except (OSError, TypeError):
            written = 0
        try:
            queued = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            queued = 0.0
        return cls((int(fields[11]) + int(fields[12])) / TICKS, kb.get("VmRSS", 0), kb.get("VmHWM", 0), written,
                   queued)


@dataclass
class Phase:
    """One phase measured from outside: wall seconds, the scheduler's CPU seconds, bytes written and seconds it
    waited for a CPU (`queued`: on a loaded machine latencies include it), its RSS and peak RSS at the end, the
    busiest simulator's share of a core (`sims`) and all the simulators' together (`sims_total`, in cores)."""

    wall: float
    cpu: float
    written: int
    queued: float
    sims: float
    rss: int
    hwm: int
    sims_total: float = 0.0

    @property
    def cpu_share(self) -> float:
        return self.cpu / self.wall if self.wall > 0 else 0.0

    @property
    def client_bound(self) -> bool:
        cores = os.cpu_count() or 1
        return self.sims > CLIENT_BOUND or self.sims_total + self.cpu_share > CLIENT_BOUND * cores


@dataclass
class Built:
    """A generation as the ranks saw it: per rank (formed, generation notice, rebuilt) monotonic times."""

    gen: int
    ranks: dict[int, tuple[float | None, float | None, float]]

    def last(self, what: int) -> float:
        return max(t[what] for t in self.ranks.values() if t[what] is not None)


@dataclass
class Loss:
    """One loss and its re-formation: who was killed when, what every rank saw, what it cost the scheduler."""

    killed: list[int]
    at: float
    built: Built
    phase: Phase  # from the kill until the ledger says every rank trains again
    incident: dict[str, Any]

    @property
    def survivors(self) -> list[int]:
        return [r for r in self.built.ranks if r not in self.killed]

    @property
    def notices(self) -> list[float]:
        """Each survivor's delay from the kill to its `generation` notice (survivors without one are missing)."""
        return sorted(t[1] - self.at for r, t in self.built.ranks.items() if r not in self.killed and t[1] is not None)

    @property
    def reformed(self) -> float:
        return self.built.last(0) - self.at

    @property
    def rebuilt(self) -> float:
        return self.built.last(2) - self.at


@dataclass
class LogSummary:
    """What the scheduler logged: ERROR lines (and any line that is not a log record: a traceback), WARNING count,
    refusals (closed at accept, rejected, dropped), and the WARNING or ERROR line (digits masked) logged most often
    within one second (`burst` times)."""

    errors: list[str] = field(default_factory=list)
    warnings: int = 0
    refusals: list[str] = field(default_factory=list)
    burst: int = 0
    burst_line: str = ""

    @classmethod
    def of(cls, text: str) -> LogSummary:
        out = cls()
        per_second: dict[tuple[str, str], int] = {}
        for line in text.splitlines():
            m = LOG_LINE.match(line)
            if m is None:
                out.errors.append(line)
                continue
            stamp, level, msg = m.groups()
            if level == "ERROR":
                out.errors.append(line)
            elif level == "WARNING":
                out.warnings += 1
            if REFUSAL.search(msg):
                out.refusals.append(line)
            if level in ("WARNING", "ERROR"):
                key = (stamp[:19], re.sub(r"\d+", "#", msg))
                per_second[key] = per_second.get(key, 0) + 1
        if per_second:
            (_, out.burst_line), out.burst = max(per_second.items(), key=lambda kv: kv[1])
        return out


class SimProcess:
    """One simulator process, its end of the socketpair and the events it sent that nobody took yet."""

    def __init__(self, child: procs.Child, chan: socket.socket, hosts: list[int], log: Path) -> None:
        self.child, self.chan, self.hosts, self.log = child, chan, hosts, log
        self.buf = bytearray()
        self.inbox: list[dict[str, Any]] = []
        self.closed = False  # it closed its end (after its last event, or dead)
        self.pid = child.pid

    def send(self, cmd: str, **fields: Any) -> None:
        if self.closed:
            raise AssertionError(f"simulator {self.log.name} has ended: cannot send {cmd!r}")
        self.chan.sendall(json.dumps({"cmd": cmd, **fields}).encode() + b"\n")

    def feed(self) -> bool:
        """Read what the simulator sent (into `inbox`); False when it closed its end."""
        data = self.chan.recv(1 << 20)
        if not data:
            return False
        self.buf += data
        while b"\n" in self.buf:
            line, _, rest = bytes(self.buf).partition(b"\n")
            self.buf = bytearray(rest)
            self.inbox.append(json.loads(line))
        return True


class SimJob:
    """The real scheduler and simulated hosts for a job of `world` ranks (see the module docstring), under
    `workdir`. `patterns` are the store bootstraps every rank runs after each formation, in order
    (toolkit.testing.simhosts.PATTERNS); `monitor` NCCL's once-a-second store check (default: with an nccl pattern);
    `per_host_ips` gives each simulated host its own loopback address (else all come from 127.0.0.1); `delay` is how
    long an agent takes to relaunch a killed worker; `nofile` a soft RLIMIT_NOFILE for the scheduler (it raises its
    own); `tree` a source tree whose scheduler to run (default: this one); `profile` a file for the scheduler's
    cProfile statistics. Use as a context manager: `close` stops every process it started."""

    def __init__(self, world: int, workdir: Path, patterns: tuple[str, ...] = ("gloo",), monitor: bool | None = None,
                 sims: int | None = None, per_host_ips: bool = True, delay: float = 0.0, nofile: int | None = None,
                 node_timeout: float = envvars.DEFAULT_NODE_TIMEOUT, topo_timeout: float = 600.0,
                 tree: Path | None = None, profile: Path | None = None, metrics_port: int | None = None) -> None:
        unknown = [p for p in patterns if p not in PATTERNS]
        if unknown or world < 2:
            raise ValueError(f"patterns {unknown} (known: {', '.join(PATTERNS)}), world {world} (at least 2)")
        self.world, self.dir, self.patterns = world, workdir, patterns
        self.monitor = any(p.startswith("nccl") for p in patterns) if monitor is None else monitor
        hosts = (world + PER_HOST - 1) // PER_HOST
        self.nsims = min(hosts, sims or max(MIN_SIMS, min(MAX_SIMS, world // RANKS_PER_SIM)))
        self.per_host_ips, self.delay, self.nofile = per_host_ips, delay, nofile
        self.node_timeout, self.topo_timeout = node_timeout, topo_timeout
        self.tree = tree or ROOT
        self.profile = profile
        self.metrics_port = metrics_port  # the scheduler's Prometheus endpoint on 127.0.0.1 (None: not served)
        self.hosts = hosts
        self.port = 0
        self.sched: procs.Child | None = None
        self.sims: list[SimProcess] = []
        self.sel = selectors.DefaultSelector()
        self.generation = 0
        self.losses = 0
        self.go_at = 0.0
        self.began: tuple[Usage, list[float], float] | None = None
        self.sched_log = workdir / "scheduler.log"
        self.recovery = workdir / "recovery"

    def __enter__(self) -> SimJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- start and end

    def start(self, bound: float = 60.0) -> None:
        """Start the scheduler (until it logs that it listens) and the simulators (until each says ready)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        token = self.dir / "token"
        token.write_text(secrets.token_hex(16))
        token.chmod(0o600)
        expected = self.dir / "expected.json"
        expected.write_text(json.dumps({protocol.worker_node_id(r): f"sim{r // PER_HOST}" for r in range(self.world)}))
        self.port = free_port_pair()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "TOOLKIT_", "MASTER_"))}
        env.update({envvars.MS_ROLE: envvars.ROLE_SCHED, envvars.MS_SCHED_HOST: "127.0.0.1",
                    envvars.MS_SCHED_PORT: str(self.port), envvars.MASTER_ADDR: "127.0.0.1",
                    envvars.MASTER_PORT: str(self.port + 1), envvars.MS_WORKER_NUM: str(self.world),
                    envvars.MS_TOPO_TIMEOUT: str(self.topo_timeout), envvars.MS_NODE_TIMEOUT: str(self.node_timeout),
                    envvars.MS_ENABLE_RECOVERY: "1", envvars.MS_RECOVERY_PATH: str(self.recovery),
                    envvars.TOOLKIT_JOB: "sim",
                    envvars.TOOLKIT_TOKEN_FILE: str(token), envvars.TOOLKIT_EXPECTED: str(expected),
                    "PYTHONPATH": str(self.tree), "PYTHONDONTWRITEBYTECODE": "1"})
        if self.metrics_port is not None:
            env[envvars.TOOLKIT_METRICS_ADDRESS] = f"127.0.0.1:{self.metrics_port}"
        argv = [sys.executable, "-m", "toolkit.scheduler"]
        if self.profile is not None:  # cProfile writes its file when the scheduler returns (after done or SIGTERM)
            argv[1:1] = ["-m", "cProfile", "-o", str(self.profile)]
        if self.nofile is not None:
            argv = [sys.executable, "-m", "toolkit.testing.simjob", "--nofile", str(self.nofile), "--", *argv]
        self.sched = procs.spawn(procs.LaunchSpec(tuple(argv), env, str(self.tree), str(self.sched_log)))
        wait_for("the scheduler to listen", lambda: "control server on" in self._log_text(), bound,
                 evidence=self.evidence, ended=self._sched_ended)
        chunks = [list(range(self.hosts))[i::self.nsims] for i in range(self.nsims)]
        for i, hosts in enumerate(chunks):
            self.sims.append(self._spawn_sim(i, hosts, token))
        self._collect("ready", bound)
        self.began = (self._usage(), self._sims_cpu(), time.monotonic())

    def so_far(self) -> Phase:
        """The scheduler's cost since the simulators were ready (what a failed phase leaves to report)."""
        assert self.began is not None, "start() first"
        return self._phase(*self.began)

    def _spawn_sim(self, index: int, hosts: list[int], token: Path) -> SimProcess:
        ours, theirs = socket.socketpair()
        config = {"host": "127.0.0.1", "port": self.port, "store_port": self.port + 1, "world": self.world,
                  "node_timeout": self.node_timeout, "hosts": hosts, "per_host": PER_HOST,
                  "per_host_ips": self.per_host_ips, "patterns": list(self.patterns), "monitor": self.monitor}
        argv = (sys.executable, "-m", "toolkit.testing.simhosts", "--channel", str(theirs.fileno()),
                "--config", json.dumps(config), "--token-file", str(token))
        log = self.dir / f"sim{index}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        try:
            child = procs.spawn(procs.LaunchSpec(argv, env, str(ROOT), str(log), pass_fds=(theirs.fileno(),)))
        finally:
            theirs.close()
        sim = SimProcess(child, ours, hosts, log)
        self.sel.register(ours, selectors.EVENT_READ, sim)
        return sim

    def finish(self, bound: float = 120.0) -> int:
        """Every worker says `done`; wait until every agent was told `finished` and the scheduler exited; its exit
        code (AssertionError with the evidence if it did not exit within `bound`)."""
        for sim in self.sims:
            sim.send("done")
        self._collect("finished", bound)
        assert self.sched is not None
        status = self.sched.wait(bound)
        if status is None:
            raise AssertionError(f"the scheduler did not exit within {bound:g} s after done\n{self.evidence()}")
        return status.code if status.code is not None else 128 + (status.signal or 0)

    def close(self) -> None:
        """Stop what is still running (SIGTERM to each session, then SIGKILL), close the channels."""
        children = [s.child for s in self.sims] + ([self.sched] if self.sched is not None else [])
        procs.stop_all(children, STOP_GRACE)
        for sim in self.sims:
            sim.chan.close()
        self.sel.close()

    # -- phases

    def form(self, bound: float = 300.0) -> tuple[Built, Phase]:
        """`go`: every host connects, every worker registers and bootstraps generation 0. Returns what the ranks
        saw and the phase's cost; times in Built are absolute (subtract `self.go_at`)."""
        before, sims, self.go_at = self._usage(), self._sims_cpu(), time.monotonic()
        for sim in self.sims:
            sim.send("go")
            sim.send("wait", gen=0)
        built = self._built(0, bound)
        return built, self._phase(before, sims, self.go_at)

    def steady(self, seconds: float) -> Phase:
        """Measure `seconds` of steady training (heartbeats, commits, the NCCL monitor's checks): a measurement
        window, not a wait for a condition."""
        before, sims, t = self._usage(), self._sims_cpu(), time.monotonic()
        time.sleep(seconds)
        return self._phase(before, sims, t)

    def lose(self, rank: int, host: bool = False, bound: float = 300.0) -> Loss:
        """SIGKILL rank `rank` (with `host`: its whole host, agent included); its agent relaunches it after
        `delay`. Returns once every rank rebuilt the next generation and the ledger says every rank trains again
        in it (`Loss.phase` spans that)."""
        before, sims = self._usage(), self._sims_cpu()
        owner = next(s for s in self.sims if rank // PER_HOST in s.hosts)
        owner.send("kill", rank=rank, host=host, delay=self.delay)
        killed = self._collect("killed", bound, [owner])[0]
        self.generation += 1
        self.losses += 1
        for sim in self.sims:
            sim.send("wait", gen=self.generation)
        built = self._built(self.generation, bound)
        incident = wait_for("the ledger to record every rank trained again", self._recovered_incident, bound,
                            evidence=self.evidence, ended=self._sched_ended)
        return Loss(killed["ranks"], killed["t"], built, self._phase(before, sims, killed["t"]), incident)

    # -- what is known

    def stats(self, bound: float = 30.0) -> dict[str, Any]:
        """The simulators' counters summed (refused, retried, errors...) and their first error texts."""
        for sim in self.sims:
            sim.send("stats")
        return _merge(self._collect("stats", bound))

    def ledger(self) -> dict[str, Any] | None:
        try:
            return rundoc.read_ledger((self.recovery / rundoc.LEDGER_FILE).read_text())
        except OSError:
            return None

    def log(self) -> LogSummary:
        return LogSummary.of(self._log_text())

    def evidence(self) -> str:
        parts = [f"--- scheduler log (last 30 lines of {self.sched_log})", *self._log_text().splitlines()[-30:]]
        for sim in self.sims:
            tail = sim.log.read_text(errors="replace").splitlines()[-15:] if sim.log.exists() else []
            parts += [f"--- {sim.log.name}", *tail]
        return "\n".join(parts)

    # -- internals

    def _recovered_incident(self) -> dict[str, Any] | None:
        doc = self.ledger()
        incidents = doc.get("incidents", []) if doc else []
        if doc and doc.get("incident_count", 0) >= self.losses and incidents \
                and incidents[-1].get("recovered_at") is not None:
            return incidents[-1]
        return None

    def _built(self, gen: int, bound: float) -> Built:
        ranks: dict[int, tuple[float | None, float | None, float]] = {}
        for event in self._collect("built", bound):
            ranks.update({int(r): tuple(t) for r, t in event["ranks"].items()})  # type: ignore[misc]
        return Built(gen, ranks)

    def _collect(self, event: str, bound: float, sims: list[SimProcess] | None = None) -> list[dict[str, Any]]:
        """The next `event` of each simulator (of `sims`), waiting on their channels at most `bound` s."""
        sims = self.sims if sims is None else sims
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + bound
        while True:
            for i, sim in enumerate(sims):
                if i not in got:
                    found = next((m for m in sim.inbox if m.get("event") == event), None)
                    if found is not None:
                        sim.inbox.remove(found)
                        got[i] = found
            if len(got) == len(sims):
                return [got[i] for i in range(len(sims))]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"waiting for {event!r} from simulators {sorted(set(range(len(sims))) - set(got))}"
                                     f": not within {bound:g} s\n{self._stats_text()}\n{self.evidence()}")
            gone = [s for i, s in enumerate(sims) if s.closed and i not in got]
            if gone:
                raise AssertionError(f"simulator {gone[0].log.name} ended while waiting for {event!r}\n"
                                     f"{self.evidence()}")
            for key, _ in self.sel.select(left):
                if not key.data.feed():
                    key.data.closed = True
                    self.sel.unregister(key.fileobj)

    def _stats_text(self) -> str:
        """The simulators' counters for evidence, without waiting long for a simulator that may be stuck."""
        try:
            return f"simulators: {json.dumps(self.stats(5.0))[:3000]}"
        except AssertionError:
            return "simulators: no stats"

    def _usage(self) -> Usage:
        assert self.sched is not None
        return Usage.of(self.sched.pid)

    def _sims_cpu(self) -> list[float]:
        return [Usage.of(s.pid).cpu for s in self.sims]

    def _phase(self, before: Usage, sims: list[float], since: float) -> Phase:
        after, wall = self._usage(), time.monotonic() - since
        used = [b - a for a, b in zip(sims, self._sims_cpu(), strict=True)]
        per_s = 1 / wall if wall > 0 else 0.0
        return Phase(wall, after.cpu - before.cpu, after.written - before.written, after.queued - before.queued,
                     max(used, default=0.0) * per_s, after.rss, after.hwm, sum(used) * per_s)

    def _log_text(self) -> str:
        try:
            return self.sched_log.read_text(errors="replace")
        except OSError:
            return ""

    def _sched_ended(self) -> str | None:
        if self.sched is not None and self.sched.reap() is not None:
            return f"the scheduler exited ({self.sched.status.describe() if self.sched.status else '?'})"
        return None


def _merge(events: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    samples: list[str] = []
    total = {"sent": 0, "received": 0, "requests": 0}
    for e in events:
        for k, v in e["counts"].items():
            counts[k] = counts.get(k, 0) + v
        samples += e["samples"]
        for k in total:
            total[k] += e[k]
    return {"counts": counts, "samples": samples[:20], **total}


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0-1) of `values` (nearest rank), 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def main(argv: list[str]) -> int:
    """`python -m toolkit.testing.simjob --nofile SOFT -- PROGRAM...`: run PROGRAM with that soft descriptor limit
    (to show the scheduler raising its own)."""
    if len(argv) < 4 or argv[0] != "--nofile" or argv[2] != "--":
        print("usage: python -m toolkit.testing.simjob --nofile SOFT -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(argv[1]), hard))
    os.execv(argv[3], argv[3:])  # noqa: S606 - the harness's own program, as an argument list
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
