"""The step file a worker shares with its agent (toolkit.contracts.stepfile): the agent makes it hold no step, the
worker's writes are read back exactly (after the writer is gone), and neither side follows a link planted in its
place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from toolkit.contracts import stepfile


def test_a_step_survives_the_writers_sigkill_and_links_are_never_followed(tmp_path: Path) -> None:
    path = tmp_path / "worker_0.step"
    stepfile.reset(path)
    assert stepfile.read(path) is None and oct(path.stat().st_mode & 0o777) == "0o600"
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time; from toolkit.contracts import stepfile; "
                               "w = stepfile.Writer.open(sys.argv[1]); [w.set(s) for s in range(1, 1235)]; "
                               "print('set', flush=True); time.sleep(60)", str(path)],
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None and writer.stdout.readline() == "set\n"
    os.kill(writer.pid, signal.SIGKILL)  # no chance to flush anything
    writer.wait(30)
    assert stepfile.read(path) == 1234

    victim = tmp_path / "precious"
    victim.write_text("keep me")
    path.unlink()
    path.symlink_to(victim)  # planted in the step file's place
    assert stepfile.Writer.open(str(path)) is None and stepfile.read(path) is None
    stepfile.reset(path)  # replaces the link, never writes through it
    assert not path.is_symlink() and victim.read_text() == "keep me" and stepfile.read(path) is None
    assert stepfile.Writer.open(None) is None and stepfile.Writer.open(str(tmp_path / "absent")) is None
