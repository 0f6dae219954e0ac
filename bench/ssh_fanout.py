"""How SSH fan-out cost grows with the number of hosts: connect (TCP, key exchange, key auth, strict host-key
check) and run one trivial command on 1, 4 and 16 namespace hosts through toolkit.launcher.remote.run_on_all. The goal
is that 16 hosts cost about what 4 do (bounded parallelism), not 4x; a serial run is printed beside it.

Run as root: .venv/bin/python bench/ssh_fanout.py [--repeat N] [--hosts 1,4,16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from toolkit.launcher.remote import SshSettings, Target, check_all, open_host, run_on_all
from toolkit.testing.cluster import Cluster


def fan_out(targets: list[Target], settings: SshSettings) -> float:
    start = time.perf_counter()
    check_all(run_on_all(targets, lambda h: h.run(["true"], check=True), settings))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--hosts", default="1,4,16")
    parser.add_argument("--parallel", type=int, default=32)
    args = parser.parse_args()
    sizes = [int(n) for n in args.hosts.split(",")]

    built = time.perf_counter()
    cluster = Cluster.up(max(sizes))
    built = time.perf_counter() - built
    try:
        settings = SshSettings(known_hosts=str(cluster.known_hosts), parallel=args.parallel)
        targets = [Target(h.name, h.address, 22, "root", str(cluster.key)) for h in cluster.hosts]
        fan_out(targets, settings)  # warm-up: imports, first ARP resolution, page cache

        medians = {}
        print(f"cluster of {len(targets)} namespace hosts built in {built:.2f} s")
        print(f"connect + run `true`, parallel={args.parallel}, median of {args.repeat}:")
        print(f"{'hosts':>6} {'median s':>9} {'min s':>7} {'max s':>7}")
        for n in sizes:
            times = [fan_out(targets[:n], settings) for _ in range(args.repeat)]
            medians[n] = statistics.median(times)
            print(f"{n:>6} {medians[n]:>9.3f} {min(times):>7.3f} {max(times):>7.3f}")
        for a, b in zip(sizes[1:], sizes[:-1], strict=True):
            print(f"ratio {a}/{b} hosts: {medians[a] / medians[b]:.2f}  (serial would be {a / b:.0f})")

        serial = SshSettings(known_hosts=str(cluster.known_hosts), parallel=1)
        rounds = max(1, args.repeat // 2)
        cpu = time.process_time()
        times = [fan_out(targets[: sizes[-1]], serial) for _ in range(rounds)]
        cpu = (time.process_time() - cpu) / (rounds * sizes[-1])
        print(f"serial (parallel=1), {sizes[-1]} hosts: median {statistics.median(times):.3f} s "
              f"= {statistics.median(times) / medians[sizes[-1]]:.1f}x the parallel run")
        print(f"client CPU per host (connect + command, all threads of this process): {cpu * 1000:.1f} ms; "
              f"the hosts' sshds share this machine's {os.cpu_count()} CPUs with it")

        # Reference under the same load: Fabric's own ThreadingGroup (no host-key check, invoke's runner).
        import fabric

        group_times = {}
        for n in (sizes[1] if len(sizes) > 1 else sizes[0], sizes[-1]):
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                group = fabric.ThreadingGroup(*(h.address for h in cluster.hosts[:n]), user="root",
                                              connect_kwargs={"key_filename": [str(cluster.key)]})
                group.run("true", hide=True, in_stream=False)
                group.close()
                times.append(time.perf_counter() - start)
            group_times[n] = statistics.median(times)
            print(f"fabric.ThreadingGroup, {n} hosts: median {group_times[n]:.3f} s "
                  f"(toolkit: {medians[n]:.3f} s)")

        with open_host(targets[0], settings) as host:
            runs = []
            for _ in range(args.repeat * 3):
                start = time.perf_counter()
                host.run(["true"], check=True)
                runs.append(time.perf_counter() - start)
        print(f"one command on an open connection: median {statistics.median(runs) * 1000:.1f} ms")
    finally:
        problems = cluster.down()
        if problems:
            print("teardown: " + "; ".join(problems), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
