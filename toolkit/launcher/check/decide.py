"""The check's decisions, pure: facts from the hosts in, one Problem per finding out (the host, what is wrong, the
fix). Nothing here reaches a host or reads a clock; toolkit.launcher.jobhosts.preflight gathers and tables them.

Which value is right: the one most hosts share, a tie going to the scheduler host's value (a fleet that agrees
with itself and differs on one host names that host, even when it is the scheduler's). Slowness is measured
against the lower median, so that in a ring of pairs the slow pairs a slow host is in (two of them) cannot make
the reference slow themselves."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

# The environment variables that change how torch, gloo and NCCL behave: they must be alike on every host.
ENV_NAMES = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "LD_LIBRARY_PATH", "LD_PRELOAD", "CUDA_VISIBLE_DEVICES",
             "CUBLAS_WORKSPACE_CONFIG", "TP_SOCKET_IFNAME", "OPENBLAS_NUM_THREADS")
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "OMP_", "MKL_", "KMP_", "CUDA_")

DEFAULT_MIN_FREE_GB = 1.0  # GB free at each host's checkpoint directory
DEFAULT_MAX_SKEW = 2.0  # s a host's clock may be off this machine's
DEFAULT_SLOW_FACTOR = 3.0  # times the lower median beyond which a host or link is slow
MIN_EXTRA = 0.2  # s a slow measurement must also exceed the reference by (a busy machine's scheduling noise)


@dataclass(frozen=True)
class Problem:
    """One finding: `host` (or a link `a-b`), which check found it, what is wrong and what to do."""

    host: str
    check: str
    text: str
    fix: str
    slow: bool = False  # only slow (the job would run, at the pace of its slowest member): `train` warns

    def line(self) -> str:
        """The one line printed for it."""
        return f"{self.host}: {self.check}: {self.text}; {self.fix}"


def majority(values: Mapping[str, Hashable], prefer: str) -> Hashable:
    """The value most hosts have; among equally common ones the `prefer` host's (the scheduler's), else the first
    host's in order. `values` must not be empty."""
    counts = Counter(values.values())
    best = max(counts.values())
    tied = [v for v in values.values() if counts[v] == best]
    if prefer in values and values[prefer] in tied:
        return values[prefer]
    return tied[0]


def odd_ones(values: Mapping[str, Hashable], prefer: str) -> tuple[Hashable, dict[str, Hashable]]:
    """(the reference value, {host: its value} for every host that differs from it)."""
    if not values:
        return None, {}
    ref = majority(values, prefer)
    return ref, {h: v for h, v in values.items() if v != ref}


def _holders(values: Mapping[str, Hashable], ref: Hashable) -> str:
    hosts = [h for h, v in values.items() if v == ref]
    return ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more" if len(hosts) > 3 else "")


def version_problems(facts: Mapping[str, Mapping[str, Any]], sched: str) -> list[Problem]:
    """python, torch and toolkit: a host whose version differs from the others' is named with both versions."""
    out = []
    for what, fix in (("python", "point its python= (inventory) at the same Python version"),
                      ("torch", "install the same torch there (or point its python= at an environment that has it)"),
                      ("toolkit", "install the same toolkit there")):
        values = {h: f.get(what) for h, f in facts.items()}
        ref, odd = odd_ones(values, sched)
        for host, value in odd.items():
            out.append(Problem(host, what, f"{what} {value}, but {ref} on {_holders(values, ref)}", fix))
    return out


def project_problems(digests: Mapping[str, Mapping[str, Any] | None], local: Mapping[str, Any]) -> list[Problem]:
    """The deployed project copies against the project here: each copy that differs is named (one line for all
    when every copy differs: the project changed here since the deploy)."""
    fix = "run 'fleet deploy' to copy the project again"
    bad = {h: m for h, m in digests.items() if not m or m.get("digest") != local.get("digest")}
    if not bad:
        return []
    if len(bad) == len(digests) > 1 and len({(m or {}).get("digest") for m in bad.values()}) == 1:
        return [Problem("all hosts", "project", "the project here changed since it was deployed", fix)]
    return [Problem(h, "project", "its copy is missing" if not m or "error" in m else
                    f"its copy differs from the project here ({_size(m)} there, {_size(local)} here)", fix)
            for h, m in bad.items()]


def _size(m: Mapping[str, Any]) -> str:
    return f"{m.get('files')} file(s), {m.get('bytes')} bytes"


def data_problems(data: Mapping[str, Mapping[str, Mapping[str, Any]]], sched: str) -> list[Problem]:
    """Per data path ({path: {host: manifest}}): a host whose copy is missing or whose digest differs from the
    others' is named."""
    out = []
    for path, by_host in data.items():
        values = {h: m.get("digest") or f"error {m.get('error')}" for h, m in by_host.items()}
        ref, odd = odd_ones(values, sched)
        for host in odd:
            m = by_host[host]
            if "error" in m:
                text = f"{path} is {m['error']} there" if m["error"] == "missing" else f"{path}: {m['error']}"
            else:
                refm = next(v for h, v in by_host.items() if values[h] == ref)
                text = f"{path} differs from {_holders(values, ref)}'s ({_size(m)} there, {_size(refm)} on those)"
            out.append(Problem(host, "data", text, f"copy the same {path} there"))
    return out


def env_problems(envs: Mapping[str, Mapping[str, str]], sched: str) -> list[Problem]:
    """The watched environment variables (ENV_NAMES, ENV_PREFIXES) as the workers would get them: one line per
    host naming every variable whose value differs from the other hosts'."""
    names = sorted({n for e in envs.values() for n in e})
    per_host: dict[str, list[str]] = {}
    for name in names:
        values = {h: e.get(name) for h, e in envs.items()}
        ref, odd = odd_ones(values, sched)
        for host, value in odd.items():
            per_host.setdefault(host, []).append(f"{name}={_shown(value)} (others: {_shown(ref)})")
    return [Problem(h, "environment", ", ".join(diffs), "set them alike on every host (the login environment, or "
                    "the job's env files) or unset them") for h, diffs in per_host.items()]


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def port_problems(host: str, ports: Mapping[str, Mapping[str, Any]]) -> list[Problem]:
    """The scheduler's ports on its host: one held by anything but this job's own running scheduler is named,
    with the holder when it could be seen."""
    out = []
    for port, p in ports.items():
        if p.get("free") or p.get("ours"):
            continue
        holder = f" by pid {p['pid']} ({p.get('command') or '?'})" if p.get("pid") else ""
        out.append(Problem(host, "port", f"port {port} is taken{holder}",
                           "stop what listens there, or deploy with another --master-port"))
    return out


def disk_problems(free: Mapping[str, Mapping[str, Any]], min_bytes: int) -> list[Problem]:
    """A host with less than `min_bytes` available where its checkpoints go (or whose space is unknown)."""
    out = []
    for host, d in free.items():
        avail = d.get("free")
        if avail is None:
            out.append(Problem(host, "disk", f"cannot tell the free space at {d.get('path')}",
                               "check that the checkpoint directory's file system is mounted"))
        elif avail < min_bytes:
            out.append(Problem(host, "disk", f"{avail / 1e9:.2f} GB free at {d.get('path')}, below "
                               f"{min_bytes / 1e9:.2f} GB", "free space there, choose another --ckpt-dir, or lower "
                               "--min-free-gb"))
    return out


def clock_skew(remote: float, sent: float, received: float) -> float:
    """How far a host's clock is off this machine's, at least: `remote` was read on the host some time between
    `sent` and `received` (this machine's clock), so only the distance outside that window is sure."""
    return max(0.0, remote - received, sent - remote)


def clock_problems(skews: Mapping[str, float], max_skew: float) -> list[Problem]:
    """A host whose clock is off by more than `max_skew` seconds."""
    return [Problem(h, "clock", f"off by at least {s:.1f} s from this machine's",
                    "synchronise it (chrony or systemd-timesyncd)") for h, s in skews.items() if s > max_skew]


def pair_rounds(hosts: Sequence[str]) -> list[list[tuple[str, str]]]:
    """The ring of pairs (each host with the next, the last with the first), in rounds where no host is in two
    pairs: two rounds for an even count, three for an odd one; one pair for two hosts, none for one."""
    n = len(hosts)
    if n < 2:
        return []
    if n == 2:
        return [[(hosts[0], hosts[1])]]
    ring = [(hosts[i], hosts[(i + 1) % n]) for i in range(n)]
    rounds = [ring[0:n - n % 2:2], ring[1:n - n % 2:2]]
    if n % 2:
        rounds[1] = ring[1:n - 1:2]
        rounds.append([ring[-1]])
    return [r for r in rounds if r]


def reference(values: Sequence[float]) -> float:
    """What a measurement is compared with: the median of three or more; of two, the faster (the median of two
    would be half the slow one)."""
    return statistics.median(values) if len(values) > 2 else min(values)


def _slow(t: float, ref: float, factor: float) -> bool:
    return t >= factor * ref and t - ref >= MIN_EXTRA


def health_problems(matmul: Mapping[str, float], pairs: Mapping[tuple[str, str], Mapping[str, Any]],
                    factor: float) -> list[Problem]:
    """A slow or broken host or link, with how much slower than the median (`reference`) it is.

    `matmul`: seconds of each host's matmul loop; `pairs`: {(a, b): {"seconds"} or {"error"}} for the ring's
    pairs. A host is slow when its matmul is, or when every pair it is in is slow or broken (its best pair's time
    against the median of every host's best); a slow or broken pair whose hosts are both fine is a link.
    One line per host or link."""
    found: dict[str, list[str]] = {}
    broken: set[str] = set()
    if len(matmul) > 1:
        ref = reference(list(matmul.values()))
        for h, t in matmul.items():
            if _slow(t, ref, factor):
                found.setdefault(h, []).append(f"matmul {t:.2f} s, {t / ref:.1f}x the median {ref:.2f} s")
    mine: dict[str, list[tuple[str, float, str | None]]] = {}
    for (a, b), r in pairs.items():
        t = r.get("seconds", math.inf)
        for h, peer in ((a, b), (b, a)):
            mine.setdefault(h, []).append((peer, t, r.get("error")))
    best = {h: min(t for _, t, _ in ps) for h, ps in mine.items()}
    finite = [t for t in best.values() if math.isfinite(t)]
    ref = reference(finite) if finite else math.inf
    for h, ps in mine.items():
        if len(ps) < 2 or len(pairs) < 3:
            continue  # a host in one pair only: which end is at fault cannot be told
        peers = " and ".join(p for p, _, _ in ps)
        if not math.isfinite(best[h]):
            found.setdefault(h, []).append(f"all-reduce with {peers} failed ({ps[0][2]})")
            broken.add(h)
        elif _slow(best[h], ref, factor):
            found.setdefault(h, []).append(f"all-reduce with {peers} {best[h] / ref:.1f}x the median "
                                           f"({best[h]:.2f} s vs {ref:.2f} s)")
    out = [Problem(h, "health", "; ".join(texts), "a slow or failing host: look at its load, CPU quota and NIC, "
                   "or leave it out of the inventory", slow=h not in broken) for h, texts in found.items()]
    for (a, b), r in pairs.items():
        if a in found or b in found:
            continue
        t = r.get("seconds", math.inf)
        if "error" in r:
            out.append(Problem(f"{a}-{b}", "link", f"all-reduce between them failed ({r['error']})",
                               "check the network between the two hosts (firewall, MTU, routes)"))
        elif math.isfinite(ref) and len(pairs) > 1 and _slow(t, ref, factor):
            out.append(Problem(f"{a}-{b}", "link", f"all-reduce {t / ref:.1f}x the median ({t:.2f} s vs "
                               f"{ref:.2f} s)", "check the network between the two hosts", slow=True))
    return out
