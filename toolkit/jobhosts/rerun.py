"""What a new run of a deployed job would start on, checked by `train` before it starts anything: the size of the
previous run (a run cannot change its worker count: the scheduler's persisted state and the checkpoints it would
resume from are those of the old size) and, for `train --fresh`, the checkpoints the previous runs' scripts wrote
into their project.

Why the project: a worker's working directory is the project (its copy on a remote host), so a plain script that
saves `checkpoints/last.pt` saves it there, where toolkit's own reset (CKPT_DIR, the scheduler's state) does not
reach, and its next run resumes from it. toolkit cannot know the name a script chose; it knows when the job ran:
launch.sh marks the job's first start (`state/since`, moved aside with the run), and every file with a checkpoint's
name (CHECKPOINT_NAMES, or under a directory whose name says ckpt or checkpoint) written in the working directory
between that mark and the end of the last run is moved aside with the run, to `project.previous-<stamp>/` in the
job directory. A file added after the last run ended, or before the first start, is the user's and stays.

Remote state is read in one bounded command per host and judged here (pure: `size_change`, `checkpoint_like`)."""

from __future__ import annotations

import datetime
import fnmatch
import json
import posixpath
from pathlib import Path
from typing import Any, Mapping

from toolkit.errors import UserError
from toolkit.jobhosts.reach import STATUS_TIMEOUT, fan_out, host_target, record_targets
from toolkit.jobrecord import HostRecord, JobRecord
from toolkit.remote import Host, SshSettings, run_on_all
from toolkit.scheduler.state import STATE_FILE

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
    if not isinstance(old, int) or isinstance(old, bool) or old == new:
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


# Names a checkpoint has (fnmatch, case-insensitive), and what a directory of checkpoints is called.
CHECKPOINT_NAMES = ("*.pt", "*.pth", "*.ckpt", "*.safetensors", "*.bin", "*.pkl", "*.pickle", "*.npz", "*.npy",
                    "*.h5", "*.hdf5", "*.msgpack", "*.distcp")
CHECKPOINT_DIRS = ("ckpt", "checkpoint")
MAX_FRESH_FILES = 10_000  # files to move aside: more is not a run's checkpoints, and too many to list

# Lists (NUL-terminated, relative to the working directory) the regular files modified after the job's first start
# (state/since) and, with a third argument, no later than that time: the end of its last run. Never follows a
# symlink nor leaves the file system. Arguments: working directory, the mark, the end (@<epoch> or "").
WRITTEN_SCRIPT = r"""
cwd=$1 since=$2 end=$3
[ -f "$since" ] && cd -- "$cwd" || exit 0
if [ -n "$end" ]; then
    find . -xdev \( -name .git -o -name __pycache__ -o -name .toolkit \) -prune -o -type f -newer "$since" \
        ! -newermt "$end" -print0 2>/dev/null
else
    find . -xdev \( -name .git -o -name __pycache__ -o -name .toolkit \) -prune -o -type f -newer "$since" \
        -print0 2>/dev/null
fi
exit 0
"""

# Moves the files named (relative to the working directory) into the destination, keeping their relative paths.
# Arguments: working directory, destination, files.
MOVE_SCRIPT = r"""
cwd=$1 dest=$2; shift 2
cd -- "$cwd" || exit 1
for f; do
    mkdir -p -- "$dest/$(dirname -- "$f")" && mv -- "$f" "$dest/$f" || exit 1
done
exit 0
"""


def checkpoint_like(path: str) -> bool:
    """Whether `path` (relative) has a checkpoint's name, or lies under a directory named like checkpoints (and is
    no Python source: code is never taken for a checkpoint)."""
    parts = path.lower().split("/")
    return (any(fnmatch.fnmatchcase(parts[-1], pattern) for pattern in CHECKPOINT_NAMES)
            or (not parts[-1].endswith(".py") and any(word in part for part in parts[:-1] for word in CHECKPOINT_DIRS)))


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
        out = host.run(["sh", "-c", WRITTEN_SCRIPT, "sh", cwd, posixpath.join(h.job_dir, "state", "since"),
                        _epoch(ends.get(host.name))], timeout=STATUS_TIMEOUT, check=True).stdout
        inside = [d for d in (h.ckpt_dir, h.job_dir) if d]
        return [f for f in out.split("\0") if f and checkpoint_like(f)
                and not any(_under(posixpath.normpath(posixpath.join(cwd, f)), d) for d in inside)]

    found = fan_out("looking for checkpoints the last runs wrote", record_targets(record), written, ssh)
    for name, files in found.items():
        if len(files) > MAX_FRESH_FILES:
            raise UserError(f"{name}: {len(files)} checkpoint-like files were written in the project since the job "
                            f"first started (more than {MAX_FRESH_FILES}): move them away yourself, then run "
                            "--fresh again; nothing was started or moved")
    return {name: files for name, files in found.items() if files}


def move_checkpoints(host: Host, h: HostRecord, cwd: str, files: list[str], stamp: str) -> str:
    """Move `files` (from project_checkpoints) into `<job dir>/project.previous-<stamp>/`, keeping their paths;
    returns the line that says so ("" for none). Raises what `Host.run(check=True)` raises."""
    if not files:
        return ""
    dest = posixpath.join(h.job_dir, f"project.previous-{stamp}")
    host.run(["sh", "-c", MOVE_SCRIPT, "sh", cwd, dest, *files], timeout=STATUS_TIMEOUT, check=True)
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
