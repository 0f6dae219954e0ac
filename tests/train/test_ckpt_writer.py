"""The single-slot background writer both kinds of checkpoint use (toolkit.train.ckpt.writer): one write in flight
and one job queued, never a queued job replaced; a slot not freed in time is one line; a staged copy waited for; a
background write's error raised on the training thread; and through both users, every step saved is written even
when the saves come faster than the disk."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from toolkit.train.ckpt.manager import CheckpointManager, Placement
from toolkit.train.ckpt.shards import Manifest, ShardCheckpoints, ShardName
from toolkit.train.ckpt.writer import SlotWriter
from toolkit.train.faults import CheckpointError

BOUND = 60.0  # s for anything the test waits on (a loaded machine)
KEY = b"k" * 32


@dataclass
class Job:
    step: int
    staged: threading.Event = field(default_factory=threading.Event)

    def stage(self) -> None:
        self.staged.set()


class Disk:
    """A write that blocks until released, recording the steps written."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.written: list[int] = []
        self.committed: list[int] = []
        self.fail: int | None = None

    def write(self, job: Job) -> bool:
        self.started.set()
        assert self.release.wait(BOUND)
        if job.step == self.fail:
            raise OSError("the disk went away")
        self.written.append(job.step)
        return True


def test_one_in_flight_one_queued_and_none_replaced(tmp_path: Path) -> None:
    disk = Disk()
    w: SlotWriter[Job] = SlotWriter(disk.write, disk.committed.append, what="checkpoint", directory=tmp_path,
                                    timeout=BOUND)
    assert w.slot() is False
    w.put(Job(1), staging=True)
    assert w.wait_staged(BOUND) >= 0.0 and disk.started.wait(BOUND)  # taken: staged, now being written
    assert w.slot() is True  # the slot is free, a write is in flight
    w.put(Job(2), staging=False)
    w.timeout = 0.2
    with pytest.raises(CheckpointError, match=r"previous checkpoint in .* still being written after 0 s"):
        w.slot()  # job 2 waits in the slot: a third is not queued over it
    w.timeout = BOUND
    disk.release.set()
    w.flush()
    assert disk.written == [1, 2] and disk.committed == [1, 2]
    disk.fail = 3
    w.put(Job(3), staging=False)
    with pytest.raises(CheckpointError, match=r"checkpoint of step 3 in .* failed: OSError"):
        w.flush()
    w.close()
    with pytest.raises(CheckpointError, match="are closed"):
        w.slot()


@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_saves_faster_than_the_disk_are_all_written(tmp_path: Path, kind: str) -> None:
    """Saves of steps 1..4 in a row, nothing waited for between them, keep_max 4: every step is on disk after."""
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 0}
    if kind == "replicated":
        m = CheckpointManager(tmp_path, keep_max=4, placement=Placement("a"), key=KEY, async_write=True)
        for step in range(1, 5):
            m.save(step, {**state, "step": step})
        m.close()
        assert m.steps_on_disk() == [1, 2, 3, 4]
        return
    s = ShardCheckpoints(tmp_path, 0, Manifest(1, (1,)), key=KEY, placement=Placement("a"), keep_max=4)
    for step in range(1, 5):
        s.save(step, {**state, "step": step})
    s.close()
    assert sorted(n.step for n in map(ShardName.parse, [p.name for p in (tmp_path / "host_a").iterdir()])
                  if n is not None) == [1, 2, 3, 4]
