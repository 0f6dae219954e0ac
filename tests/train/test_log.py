"""Every line of a worker's log lands whole while two threads write there (toolkit.train.log).

CI saw a rank's last words glued to the control thread's line ("...2 connection(s) shut down)rank 0: stopped by
SIGTERM at step 19, checkpoint saved"): with PYTHONUNBUFFERED=1 `print` writes a line's text and its newline in two
writes, and another thread's line landed between them. Here a real script runs as a worker does (`python -m
toolkit.train SCRIPT`), stdout and stderr one file opened for appending as the agent starts workers: its main
thread prints (the script's own lines) and writes the Trainer's lines, while a second thread writes the runtime's
timestamped lines, as the control thread does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from toolkit.testing.localjob import clean_env

LINES = 3000  # per thread: with plain unbuffered prints, hundreds of lines tear on a 2-core machine

SCRIPT = f"""
import threading
from toolkit.train import log

def control():
    for i in range({LINES}):
        log.say("worker_0", f"control line {{i}}: the job moved to a generation")

thread = threading.Thread(target=control)
thread.start()
for i in range({LINES}):
    if i % 2:
        log.line(f"rank 0: trainer line {{i}}, checkpoint saved")
    else:
        print(f"epoch: 0, step: {{i}}, loss is 0.5")
thread.join()
"""
WHOLE = re.compile(r"^(?:\S+ worker_0 toolkit: control line (\d+): the job moved to a generation"
                   r"|rank 0: trainer line (\d+), checkpoint saved|epoch: 0, step: (\d+), loss is 0\.5)$")


def test_lines_of_two_threads_land_whole_in_one_unbuffered_log(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    logfile = tmp_path / "worker_0.log"
    fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        done = subprocess.run([sys.executable, "-m", "toolkit.train", str(script)], stdout=fd, stderr=fd,
                              env={**clean_env(), "PYTHONUNBUFFERED": "1"}, timeout=120)
    finally:
        os.close(fd)
    text = logfile.read_text()
    assert done.returncode == 0, text[-2000:]
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    torn = [line for line in lines if not WHOLE.match(line)]
    assert not torn, f"{len(torn)} torn lines, e.g. {torn[:3]}"
    control = [int(m.group(1)) for m in map(WHOLE.match, lines) if m.group(1) is not None]
    main = [int(m.group(2) or m.group(3)) for m in map(WHOLE.match, lines) if m.group(1) is None]
    assert control == list(range(LINES)) and main == list(range(LINES))
