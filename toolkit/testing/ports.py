"""Free ports on this machine's loopback for the jobs tests and benchmarks start locally: toolkit.freeports', which
`deploy` uses for a local job given no --master-port."""

from toolkit.freeports import free_port, free_port_pair

__all__ = ["free_port", "free_port_pair"]
