"""What toolkit's tests, benchmarks and scripts share to run real jobs on this machine: the network-namespace test
cluster (cluster.py), local jobs run by the real agent or by `fleet` (localjob.py), free ports (ports.py), bounded
waits on a condition (waits.py) and the datagrams test workers send (events.py).

Not needed to run jobs; importable wherever toolkit is installed, so that `bench/` and `scripts/` use the same
pieces as the tests without editing sys.path.
"""
