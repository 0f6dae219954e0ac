"""What a new run of a deployed job would start on, checked by `train` before it starts anything: the size of the
previous run (a run cannot change its worker count: the scheduler's persisted state and the checkpoints it would
resume from are those of the old size) and, for `train --fresh`, the checkpoints the previous runs' scripts wrote
into their project.

Why the project: a worker's working directory is the project (its copy on a remote host), so a plain script that
saves `checkpoints/last.pt` saves it there, where toolkit's own reset (CKPT_DIR, the scheduler's state) does not
reach, and its next run resumes from it. toolkit cannot know the name a script chose; it knows when the job ran:
launch.sh marks the job's first start (`state/since`, moved aside with the run), and every file taken for a
checkpoint (`checkpoint_like`: a checkpoint format's name, not under a data directory; any file under a directory,
or with a name, that says ckpt or checkpoint) written in the working directory between that mark and the end of
the last run is moved aside with the run, to `project.previous-<stamp>/` in the job directory. A file added after
the last run ended, or before the first start, is the user's and stays; so is what lies in an installed environment
(a virtualenv, site-packages, node_modules: WRITTEN_SCRIPT), and data in formats checkpoints share (data/tokens.npy,
vocab.bin). On each host the project's files are moved first, all or nothing, then the checkpoint directory and the
scheduler's state (toolkit.launcher.jobhosts.launch): a failure leaves that host as it was.

Remote state is read in one bounded command per host and judged here (pure: `size_change`, `checkpoint_like`)."""

from __future__ import annotations

import datetime
import fnmatch
import json
import posixpath
from pathlib import Path
from typing import Any, Mapping

from toolkit.contracts.jobrecord import HostRecord, JobRecord
from toolkit.contracts.protocol import is_int
from toolkit.contracts.rundoc import STATE_FILE
from toolkit.errors import UserError
from toolkit.launcher.jobhosts.reach import STATUS_TIMEOUT, fan_out, host_target, record_targets
from toolkit.launcher.remote import Host, SshSettings, run_on_all

MAX_STATE_BYTES = 16 * 1024 * 1024  # the state's base takes about 160 bytes a rank: far below this at 10,000
# Prints the base of the scheduler's persisted state (MS_RECOVERY_PATH as plan.py renders it), which holds the job's
# name and size (they never change in a run), nothing when there is none.
STATE_SCRIPT = r"""
head -c "$2" -- "$1" 2>/dev/null
exit 0
"""


def previous_state(record: JobRecord, ssh: SshSettings) -> dict[str, Any] | None:
    """The scheduler's persisted state on its host (job, world_size, status, ...), or None when there is none or it
    cannot be read or parsed (the scheduler itself then says what is wrong with it)."""
    sched = record.host(record.scheduler_host)
    path = posixpath.join(sched.job_dir, "recovery", STATE_FILE)
    result = run_on_all([host_target(sched, record.local)],
                        lambda host: host.run(["sh", "-c", STATE_SCRIPT, "sh", path, str(MAX_STATE_BYTES)],
                                              timeout=STATUS_TIMEOUT, check=True).stdout, ssh)[sched.name]
    if not result.ok or not result.value:
        return None
    try:
        doc = json.loads(result.value)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def size_change(record: JobRecord, state: dict[str, Any] | None, verb: str, running: bool = False,
                world_size: int | None = None) -> str | None:
    """Why job `record` cannot start on the previous run's `state` (its scheduler's): the message when that run had
    another number of workers than `world_size` (default the record's: `run` asks before it deploys the new size),
    else None. `verb` is the command to type again (`fleet train`, `fleet run`); `running`: that run still runs (it
    must be stopped first)."""
    if not state or state.get("job") != record.job:
        return None
    new = record.world_size if world_size is None else world_size
    old = state.get("world_size")
    if not is_int(old) or old == new:
        return None
    where = f"{record.scheduler_host}:{posixpath.join(record.host(record.scheduler_host).job_dir, 'recovery')}"
    first = "'fleet stop', then " if running else ""
    now = "is deployed now with" if world_size is None else "this run asks for"
    return (f"job {record.job} {'runs' if running else 'last ran'} with {old} worker(s) and {now} "
            f"{new}: a run cannot change its size (the scheduler's state in {where} and the "
            f"checkpoints it would resume from are those of {old}); {first}'{verb} --fresh' starts it over with {new} "
            f"(the old run is moved aside, not deleted), or deploy it again with {old} worker(s) to go on")


def refuse_size_change(record: JobRecord, ssh: SshSettings, verb: str, running: bool = False,
                       world_size: int | None = None) -> None:
    """UserError (nothing has been started) when the previous run had another size; see `size_change`."""
    why = size_change(record, previous_state(record, ssh), verb, running, world_size)
    if why:
        raise UserError(why)


# What --fresh takes for a checkpoint (fnmatch on the lowered name): the formats checkpoints are saved in, unless
# under a directory whose name says data; the formats data is kept in as often as checkpoints (a tokenised corpus
# in tokens.npy, a vocabulary in vocab.bin), only under a directory, or with a name, that says checkpoint; any file
# but Python source under a directory named like checkpoints.
CHECKPOINT_NAMES = ("*.pt", "*.pth", "*.ckpt", "*.safetensors", "*.distcp")
CHECKPOINT_WORDS = ("ckpt", "checkpoint")
DATA_WORD = "data"
MAX_FRESH_FILES = 10_000  # files to move aside: more is not a run's checkpoints, and too many to list

# Lists (NUL-terminated, "./" and relative to the working directory) the regular files modified after the job's
# first start (the mark, state/since) and, when an end is given (@<epoch>), no later than it: the end of its last
# run. Python (-I: nothing of the host's environment or working directory imported), so that no name is ever
# shell text. Never follows a symlink nor leaves the file system; never enters .git, caches, or an installed
# environment (a directory holding pyvenv.cfg or conda-meta, site-packages, node_modules, ...: what pip writes
# there during a run is not a checkpoint). Arguments: working directory, the mark, the end ("" for none).
WRITTEN_SCRIPT = r"""
import os, stat, sys
cwd, since, end = sys.argv[1:4]
try:
    mark = os.stat(since).st_mtime_ns
    os.chdir(cwd)
except OSError:
    sys.exit(0)
limit = int(float(end[1:]) * 1e9) if end else None
skip = {".git", "__pycache__", ".toolkit", "site-packages", "dist-packages", "node_modules", "__pypackages__",
        ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
dev = os.stat(".").st_dev
out = sys.stdout.buffer
for top, dirs, files in os.walk(".", followlinks=False):
    if os.path.lexists(os.path.join(top, "pyvenv.cfg")) or os.path.lexists(os.path.join(top, "conda-meta")):
        dirs[:] = []
        continue
    keep = []
    for d in dirs:
        try:
            if d not in skip and os.lstat(os.path.join(top, d)).st_dev == dev:
                keep.append(d)
        except OSError:
            pass
    dirs[:] = keep
    for name in files:
        path = os.path.join(top, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mtime_ns > mark and (limit is None or st.st_mtime_ns <= limit):
            out.write(os.fsencode(path) + b"\0")
"""

# Moves the files named (relative to the working directory) into the destination, keeping their relative paths:
# all or nothing (on a failure, what was moved goes back, and the line says which file failed and why, exit 1);
# a file already at a destination is never replaced. Python, the names as arguments: no name is ever shell text
# (a directory name ending in a newline stopped the shell version half way). Arguments: cwd, destination, files.
MOVE_SCRIPT = r"""
import os, shutil, sys
cwd, dest, files = sys.argv[1], sys.argv[2], sys.argv[3:]
done, name = [], cwd
try:
    os.chdir(cwd)
    for name in files:
        target = os.path.join(dest, name)
        if os.path.lexists(target):
            raise FileExistsError(f"{target!r} is there already")
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        shutil.move(name, target)
        done.append((name, target))
except (OSError, shutil.Error) as e:
    for name, target in reversed(done):
        try:
            shutil.move(target, name)
        except (OSError, shutil.Error):
            print(f"could not put {name!r} back from {target!r}", file=sys.stderr)
    print(f"cannot move {name!r} aside ({e}): nothing was moved", file=sys.stderr)
    sys.exit(1)
"""


def checkpoint_like(path: str) -> bool:
    """Whether `path` (relative) is taken for a checkpoint (see CHECKPOINT_NAMES): never Python source; any file
    under a directory named like checkpoints, or whose name says checkpoint; a checkpoint format's file unless under
    a directory named like data."""
    parts = path.lower().split("/")
    name, dirs = parts[-1], parts[:-1]
    if name.endswith(".py"):
        return False
    if any(word in part for part in dirs for word in CHECKPOINT_WORDS) or any(w in name for w in CHECKPOINT_WORDS):
        return True
    return (any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_NAMES)
            and not any(DATA_WORD in part for part in dirs))


def written_files(host: Host, python: str, cwd: str, since: str, end: str) -> list[str]:
    """The checkpoint-like files (`./`-relative) in `cwd` on `host` modified after the mark `since` and no later than
    `end` (@<epoch>, "" for none): WRITTEN_SCRIPT run with `python`, filtered by checkpoint_like."""
    out = host.run([python, "-I", "-c", WRITTEN_SCRIPT, cwd, since, end], timeout=STATUS_TIMEOUT, check=True).stdout
    return [f for f in out.split("\0") if f and checkpoint_like(f)]


def workdir_of(h: HostRecord, local: bool, project: Path) -> str:
    """The workers' working directory on host `h`: the project itself for a local job, its copy otherwise."""
    return str(project) if local else posixpath.join(h.job_dir, "project")


def project_checkpoints(record: JobRecord, ssh: SshSettings, project: Path,
                        ends: Mapping[str, str | None]) -> dict[str, list[str]]:
    """Per host, the checkpoint-like files (relative to the workers' working directory, `./` first) that the job's
    runs wrote there since its first start (`ends`: each host's end of its last run, an ISO time from its
    agent.json; None: no bound), less what --fresh moves aside anyway (CKPT_DIR, the job directory). UserError if a
    host cannot be asked, or holds more than MAX_FRESH_FILES of them."""
    def written(host: Host) -> list[str]:
        """The host's checkpoint-like files written by the job's runs."""
        h = record.host(host.name)
        cwd = workdir_of(h, record.local, project)
        found = written_files(host, h.python, cwd, posixpath.join(h.job_dir, "state", "since"),
                              _epoch(ends.get(host.name)))
        inside = [d for d in (h.ckpt_dir, h.job_dir) if d]
        return [f for f in found if not any(_under(posixpath.normpath(posixpath.join(cwd, f)), d) for d in inside)]

    found = fan_out("looking for checkpoints the last runs wrote", record_targets(record), written, ssh)
    for name, files in found.items():
        if len(files) > MAX_FRESH_FILES:
            raise UserError(f"{name}: {len(files)} checkpoint-like files were written in the project since the job "
                            f"first started (more than {MAX_FRESH_FILES}): move them away yourself, then run "
                            "--fresh again; nothing was started or moved")
    return {name: files for name, files in found.items() if files}


def move_checkpoints(host: Host, h: HostRecord, cwd: str, files: list[str], stamp: str) -> str:
    """Move `files` (from project_checkpoints) into `<job dir>/project.previous-<stamp>/`, keeping their paths, all
    or nothing (MOVE_SCRIPT); returns the line that says so ("" for none). Raises what `Host.run(check=True)`
    raises (nothing was moved then)."""
    if not files:
        return ""
    dest = posixpath.join(h.job_dir, f"project.previous-{stamp}")
    host.run([h.python, "-I", "-c", MOVE_SCRIPT, cwd, dest, *files], timeout=STATUS_TIMEOUT, check=True)
    shown = ", ".join(f.removeprefix("./") for f in files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5
                                                                  else "")
    return f"moved {len(files)} checkpoint file(s) the last runs wrote in the project to {dest}: {shown}"


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _epoch(iso: str | None) -> str:
    """`@<seconds>` for GNU find's -newermt, from an agent.json time; "" (no bound) when there is none."""
    if not iso:
        return ""
    try:
        moment = datetime.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return ""
    return f"@{moment.timestamp():.3f}"
