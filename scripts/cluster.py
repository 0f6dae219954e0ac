#!/usr/bin/env python3
"""Build or remove the network-namespace test cluster by hand (as root), to try toolkit against real SSH hosts
without the test suite.

  scripts/cluster.py up N [--dir D] [--slots S] [--python P]   build N hosts, print how to reach them
  scripts/cluster.py down [--dir D]                            remove the cluster recorded in D
  scripts/cluster.py down --stale                              remove clusters whose test run died
  scripts/cluster.py list                                      show the clusters recorded on this machine

A cluster made here has no owning process: it stays until `down`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolkit.testing.cluster import STATE_FILE, Cluster, ClusterSetupError

REPO = Path(__file__).resolve().parent.parent

DEFAULT_DIR = Path("/run/toolkit-test-cluster")  # root-only, like the namespaces it holds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build N hosts")
    up.add_argument("n", type=int, help="number of hosts (1-250)")
    up.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"where its files go (default {DEFAULT_DIR})")
    up.add_argument("--slots", type=int, default=1, help="slots per host in the inventory (default 1)")
    venv_python = REPO / ".venv" / "bin" / "python"
    up.add_argument("--python", default=str(venv_python) if venv_python.exists() else sys.executable,
                    help="python written into the inventory (default: the repo's .venv)")
    down = sub.add_parser("down", help="remove a cluster")
    which = down.add_mutually_exclusive_group()
    which.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"its directory (default {DEFAULT_DIR})")
    which.add_argument("--stale", action="store_true", help="every cluster whose owning test run is gone")
    sub.add_parser("list", help="clusters recorded on this machine")
    args = parser.parse_args(argv)

    try:
        if args.command == "up":
            return _up(args.n, args.dir, args.slots, args.python)
        if args.command == "down":
            return _down_stale() if args.stale else _down(args.dir)
        for cid, directory, stale in Cluster.recorded():
            print(f"{cid}\t{directory}\t{'stale' if stale else 'live'}")
        return 0
    except ClusterSetupError as e:
        print(f"scripts/cluster.py: {e}", file=sys.stderr)
        return 1


def _up(n: int, directory: Path, slots: int, python: str) -> int:
    c = Cluster.up(n, dir=directory, slots=slots, python=python, owned_by_this_process=False)
    s = c.state
    first = c.hosts[0]
    print(f"cluster {s.id}: {n} hosts {c.hosts[0].name}..{c.hosts[-1].name} on {first.address.rsplit('.', 1)[0]}.0/"
          f"{s.prefix_len} (bridge {s.bridge}); files in {c.dir}")
    print(f"  inventory    {c.inventory}")
    print(f"  ssh_config   {c.ssh_config}")
    print(f"  known_hosts  {c.known_hosts}")
    print(f"  client key   {c.key}")
    print("try:")
    print(f"  ssh -F {c.ssh_config} {first.name} hostname")
    print(f"  fleet train --inventory {c.inventory} --known-hosts {c.known_hosts}")
    print(f"  ansible -i {c.inventory} all -m ping")
    print(f"  ip netns exec {first.netns} ss -tlnp        # look inside a host without SSH")
    print("remove with:")
    print(f"  {sys.executable} {Path(__file__).resolve()} down --dir {c.dir}")
    return 0


def _down(directory: Path) -> int:
    if not (directory / STATE_FILE).exists():
        print(f"no cluster recorded in {directory}; nothing to remove")
        return 0
    problems = Cluster.load(directory).down()
    for p in problems:
        print(f"scripts/cluster.py: {p}", file=sys.stderr)
    if not problems:
        print(f"removed the cluster in {directory}")
    return 1 if problems else 0


def _down_stale() -> int:
    problems = Cluster.remove_stale()
    for p in problems:
        print(f"scripts/cluster.py: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
