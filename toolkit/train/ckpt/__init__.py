"""Checkpoints: the copies on disk for when no survivor holds the state.

- manager.py: CheckpointManager (one copy per host, async staging, the restart agreement: Placement, choose).
- shards.py: ShardCheckpoints (a sharded state: each rank its own shard, the manifest, the restart agreement).
- writer.py: the single-slot background writer both use.
- schedule.py: when the Trainer checkpoints and what it costs (fixed interval or "auto", agreed every step).
- interval.py: the "auto" interval from the job's own data (Young's formula).
- parts.py: a state cut into the parts a host's ranks write, and put together again (pure).
- hostdir.py: one host's checkpoint directory through one fd: list, write, read, refuse, tidy.
- partfile.py: one checkpoint file: its name, its MAC'd format, the key.
"""
