"""Another local user, for the tests that play one: uid 65534 through `setpriv`, running only what that user can
reach.

The clone the tests run from may sit in a directory only its owner can enter (`mktemp -d`, root's 0700 home), and its
virtual environment's interpreter may be a link into such a directory (~/.pyenv). So what the stranger runs is
copied into a world-readable directory under /tmp, and its interpreter is the first candidate the stranger can
actually start (tried as that user, not judged from modes): the one running the tests, the base interpreter the
environment points to, the system's python3. Scripts run this way use the standard library only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

UID = 65534  # nobody
AS_STRANGER = ("setpriv", "--reuid", str(UID), "--regid", str(UID), "--clear-groups", "--")
PROBE_TIMEOUT = 30.0  # s for an interpreter to start and exit as the stranger on a loaded machine
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")


def _candidates() -> list[str]:
    """Interpreters to try, in order, without duplicates."""
    found = [sys.executable, getattr(sys, "_base_executable", ""), os.path.realpath(sys.executable),
             *SYSTEM_PYTHONS, shutil.which("python3") or ""]
    return list(dict.fromkeys(p for p in found if p))


def stranger_python() -> str:
    """An interpreter uid 65534 can start. RuntimeError naming every candidate tried if none can."""
    tried = []
    for path in _candidates():
        try:
            done = subprocess.run([*AS_STRANGER, path, "-I", "-c", "pass"], capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{path} ({e})")
            continue
        if done.returncode == 0:
            return path
        tried.append(f"{path} ({done.stderr.strip().splitlines()[-1:] or done.returncode})")
    raise RuntimeError(f"no python3 that uid {UID} can run: tried {'; '.join(tried)}; install python3 where every "
                       "user can reach it")


@contextmanager
def readable_copies(files: Sequence[Path]) -> Iterator[dict[str, Path]]:
    """Copies of `files` in a fresh directory under /tmp that every user can read (mode 0755, files 0644), by name;
    removed on exit. The originals may sit where only their owner can go."""
    if os.geteuid() != 0:
        raise RuntimeError("tests that play another user switch to uid 65534 with setpriv and must run as root "
                           "(as CI does)")
    d = Path(tempfile.mkdtemp(prefix="tk-stranger-", dir="/tmp"))
    try:
        d.chmod(0o755)
        out = {}
        for f in files:
            copy = d / f.name
            shutil.copyfile(f, copy)
            copy.chmod(0o644)
            out[f.name] = copy
        yield out
    finally:
        shutil.rmtree(d, ignore_errors=True)
