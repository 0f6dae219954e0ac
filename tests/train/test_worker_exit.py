"""How a worker process ends (toolkit.train.wrapper.exit_now): once the script ran, the process ends at once with the
script's status, skipping the interpreter's teardown (where gloo's threads can abort a finished FSDP worker), after
the script's atexit handlers ran and the files it left open were flushed, as the teardown would have done.

A real script run as the agent runs a worker (`python -m toolkit.train SCRIPT`, stdout to a file, so buffered)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.testing.localjob import clean_env

SCRIPT = """
import atexit, sys
text = open("left-open.txt", "w")          # never closed, never flushed
text.write("text the script wrote\\n" * 100)
raw = open("left-open.bin", "wb")
raw.write(b"\\x00\\x01" * 1000)
atexit.register(lambda: open("atexit.txt", "w").write("ran"))
print("the last line on stdout", end="")   # no newline: still in stdout's buffer
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("status", [0, 3])
def test_the_script_status_its_open_files_and_its_atexit_handlers_survive_the_quick_exit(
        tmp_path: Path, status: int) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {k: v for k, v in clean_env().items() if k != "PYTHONUNBUFFERED"}
    with open(tmp_path / "out.log", "wb") as out:
        code = subprocess.run([sys.executable, "-m", "toolkit.train", "script.py", str(status)], cwd=tmp_path,
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode
    log = (tmp_path / "out.log").read_text()
    assert code == status, log
    assert (tmp_path / "left-open.txt").read_text() == "text the script wrote\n" * 100
    assert (tmp_path / "left-open.bin").read_bytes() == b"\x00\x01" * 1000
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert log == "the last line on stdout", log  # and nothing else: no warning, no traceback
