"""The shell snippets toolkit runs on the hosts (POSIX sh, user values only as arguments), and the parsers of what
they print. Each does its work in one round trip and without starting a Python where it can.

Every script is run as `host.run(["sh", "-c", SCRIPT, "sh", ARG...])`, so user values (paths, names) arrive as
positional parameters and are never pasted into shell text. Scripts that print several parts separate them with a
line holding only the ASCII record separator (0x1E), where toolkit.launcher.jobhosts.poll and tasks.status split them.
The host needs GNU coreutils and findutils (stat -c, sha256sum, find -printf, date +%N)."""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Mapping

# Makes the job's layout and lists mode and checksum of the rendered files already there, in one round trip, so
# a second deploy of an unchanged job writes none of them. Arguments: job dir, job id, SHA-256 of the token file,
# where the job is deployed from (one line), then the rendered files. Each directory of the job is checked before
# it is used: not a symlink, ours, not writable by others. The job directory's `job-id` (agentdoc.JOB_ID_FILE) is
# made once (noclobber: two deploys at once agree on the first) and must name this job: another project's job of the
# same name is never touched (a job directory from before job ids: its token must be this job's).
LAYOUT_SCRIPT = r"""
d=$1 jid=$2 toksum=$3 about=$4; shift 4
me=$(id -u)
umask 077
check() {
    if [ -L "$1" ]; then printf '%s\n%s\n' "$1" "$(readlink -- "$1")"; exit 23; fi
    [ -d "$1" ] || return 0
    owner=$(stat -c %u -- "$1") mode=$(stat -c %a -- "$1")
    [ "$owner" = "$me" ] || { printf '%s\n%s %s\n' "$1" "$owner" "$me"; exit 20; }
    [ $((0$mode & 022)) -eq 0 ] || { printf '%s\n%s\n' "$1" "$mode"; exit 21; }
}
check "${d%/*}"
mkdir -p -- "${d%/*}" || exit 1
check "${d%/*}"
check "$d"
mkdir -p -- "$d" || exit 1
check "$d"
if [ ! -f "$d/job-id" ] && [ -f "$d/token" ]; then
    sum=$(sha256sum < "$d/token") || exit 1
    [ "${sum%% *}" = "$toksum" ] || { printf -- '-\n'; exit 22; }
fi
( set -C; printf '%s\n%s\n' "$jid" "$about" > "$d/job-id" ) 2>/dev/null
there=$(head -n 1 -- "$d/job-id") || exit 1
[ "$there" = "$jid" ] || { head -c 2048 -- "$d/job-id"; exit 22; }
mkdir -p -- "$d/env" "$d/logs" "$d/state" "$d/recovery" "$d/ckpt" && cd -- "$d" \
    && chmod 700 . env logs state recovery ckpt || exit 1
for f; do
    [ -f "$f" ] && printf '%s %s\n' "$(stat -c %a -- "$f")" "$(sha256sum -- "$f")"
done
exit 0
"""
LAYOUT_NOT_OURS, LAYOUT_OPEN_TO_OTHERS, LAYOUT_OTHER_JOB, LAYOUT_SYMLINK = 20, 21, 22, 23  # its exit codes


# Moves a run's checkpoints, scheduler state, agent.json and the mark of its first start (state/since) aside under
# one stamp (a shared checkpoint directory is moved once: the first host's mv wins, the others find nothing to move).
# A checkpoint directory whose key-id (toolkit.train.ckpt.hostdir) names another key than the job's ($4) holds another
# job's checkpoints: it stays where it is, and the line says so. Arguments: job dir, checkpoint dir, stamp, key id.
ARCHIVE_SCRIPT = r"""
d=$1 ckpt=$2 stamp=$3 id=$4
for p in "$ckpt" "$d/recovery"; do
    [ -e "$p" ] || continue
    if [ "$p" = "$ckpt" ] && [ -f "$p/key-id" ] && [ "$(head -c 128 -- "$p/key-id")" != "$id" ]; then
        echo "left $p where it is: its key-id says it holds another job's checkpoints"; continue
    fi
    mv -- "$p" "$p.previous-$stamp" && echo "moved $p to $p.previous-$stamp"
done
if [ -e "$d/state/agent.json" ]; then mv -- "$d/state/agent.json" "$d/state/agent.previous-$stamp.json"; fi
if [ -e "$d/state/since" ]; then mv -- "$d/state/since" "$d/state/since.previous-$stamp"; fi
exit 0
"""


# Starts a new run's logs, then runs the rest of its arguments (launch.sh): the last run's logs (logs/*.log) move to
# logs/runs/<n>/, n counting up from 1 (logs/runs/last holds the last n), and only the newest `keep` of those are
# kept. Run only where the host's agent is not running (a running agent writes into its open files). Arguments: job
# dir, keep, then the command.
LOG_ROTATE_SCRIPT = r"""
d=$1 keep=$2; shift 2
logs=$d/logs runs=$d/logs/runs
if [ -d "$logs" ] && [ -n "$(find "$logs" -maxdepth 1 -name '*.log' -size +0 -print -quit 2>/dev/null)" ]; then
    n=$(cat -- "$runs/last" 2>/dev/null) || n=0
    case $n in ''|*[!0-9]*) n=0 ;; esac
    n=$((n + 1))
    mkdir -p -m 700 -- "$runs/$n" || exit 1
    find "$logs" -maxdepth 1 -name '*.log' -exec mv -- {} "$runs/$n/" \; || exit 1
    echo "$n" > "$runs/last"
    for old in $(ls -- "$runs" | grep -E '^[0-9]+$' | sort -n | head -n "-$keep"); do rm -rf -- "$runs/$old"; done
fi
exec "$@"
"""


# Stops the job through the host's stop.sh (SIGTERM, grace, SIGKILL, verified); says so when nothing was deployed
# in that directory, which is success too (nothing of the job can run there). Arguments: job dir, host name, job id
# (another project's job in that directory is left running: the agent's exit 4, with one line), then stop.sh's own
# flags (`--timeout 0`: no grace).
STOP_SCRIPT = r"""
d=$1 host=$2 id=$3 by=$4; shift 4
if [ -x "$d/stop.sh" ]; then
    if [ -n "$id" ]; then exec "$d/stop.sh" --job-id "$id" --by "$by" "$@"; fi
    exec "$d/stop.sh" --by "$by" "$@"
fi
echo "$host: nothing deployed in $d: nothing to stop"
"""


# What `status` runs: the agent's own judgement (`python -m toolkit.agent status`, or "absent" when nothing was
# deployed), the scheduler's live.json when a third argument names it (the scheduler host), then the host's clock
# and the mtime of each log, so log ages are measured by the host's clock.
STATUS_SCRIPT = r"""
py=$1 d=$2 live=$3
if [ -f "$d/host.json" ]; then
    "$py" -m toolkit.agent status --job-dir "$d" || exit
else
    echo '{"state": "absent", "alive": false, "processes": []}'
fi
printf '\036\n'
[ -n "$live" ] && head -c 4194304 -- "$live" 2>/dev/null; printf '\036\n'
date +%s.%N
find "$d/logs" -maxdepth 1 -name '*.log' -printf '%T@ %f\n' 2>/dev/null
exit 0
"""

# What --join and `status --watch` poll: the agent's own files, read without starting a Python on every host every
# interval, and the scheduler's live.json when a second argument names it. Liveness is decided here as `agent
# status` decides it: the pid file's process exists, is no zombie and started at the recorded clock tick, and
# agent.json was written by it.
POLL_SCRIPT = r"""
d=$1 live=$2
cat -- "$d/state/agent.pid" 2>/dev/null; printf '\036\n'
{ read -r pid _ < "$d/state/agent.pid"; } 2>/dev/null && cat "/proc/$pid/stat" 2>/dev/null; printf '\036\n'
cat -- "$d/state/agent.json" 2>/dev/null; printf '\036\n'
[ -n "$live" ] && head -c 4194304 -- "$live" 2>/dev/null; printf '\036\n'
date +%s.%N
find "$d/logs" -maxdepth 1 -name '*.log' -printf '%T@ %f\n' 2>/dev/null
exit 0
"""


def clock_and_logs(text: str) -> dict[str, Any]:
    """The tail of STATUS_SCRIPT's and POLL_SCRIPT's output: {"now": the host's clock (None if unreadable),
    "mtimes": {log file name: mtime}}, both in the host's seconds since the epoch. Lines that do not parse are
    skipped."""
    lines = text.splitlines()
    try:
        now = float(lines[0])
    except (IndexError, ValueError):
        now = None
    mtimes = {}
    for line in lines[1:]:
        stamp, _, name = line.partition(" ")
        with contextlib.suppress(ValueError):
            mtimes[name] = float(stamp)
    return {"now": now, "mtimes": mtimes}


_TAIL_HEADER = re.compile(r"^==> (.*) <==$")
_TAIL_MISSING = re.compile(r"cannot open '(.*)' for reading")


def missing_logs(stderr: str, paths: Mapping[str, str]) -> list[str]:
    """One note per log that `tail` could not open (the process has not written it yet), from tail's stderr;
    `paths` maps each log path to its process's prefix. Other complaints are not notes."""
    notes = []
    for line in stderr.splitlines():
        m = _TAIL_MISSING.search(line)
        if m and m.group(1) in paths:
            notes.append(f"{paths[m.group(1)]}: no log yet ({m.group(1)})")
    return notes


class TailParser:
    """`tail -v` output (a `==> path <==` header before each file's lines, a blank line before every header but
    the first) -> the lines of each log, under its process's prefix.

    Feed it every line of output in order, a batch at a time (it is the on_lines of a stream); `prefixes` maps each
    path given to tail to its process's prefix; `emit(prefix, lines)` gets each run of one log's lines of a batch.
    A blank line is held back until the next line shows it was not a separator. Lines before any header belong to
    the first path."""

    def __init__(self, prefixes: Mapping[str, str], emit: Callable[[str, list[str]], None]) -> None:
        self.prefixes = prefixes
        self.emit = emit
        self.current = next(iter(prefixes.values()), "?")
        self.blank = False  # a blank line held back: it may be the separator before the next header

    def __call__(self, lines: list[str]) -> None:
        """Take a batch of lines: a header switches the current prefix, anything else is emitted under it."""
        run: list[str] = []
        for line in lines:
            m = _TAIL_HEADER.match(line) if line.startswith("==> ") else None
            if m and m.group(1) in self.prefixes:
                if run:
                    self.emit(self.current, run)
                    run = []
                self.current, self.blank = self.prefixes[m.group(1)], False
                continue
            if self.blank:
                run.append("")
                self.blank = False
            if line == "":
                self.blank = True
            else:
                run.append(line)
        if run:
            self.emit(self.current, run)


# Runs the check's probe (toolkit.launcher.check.probe, given as source) with the host's interpreter in the environment
# one of its workers gets: the login environment plus the process's env file, from the job directory. Arguments:
# job dir, env file (relative to it), python, then the probe's source and its arguments. Exit 127: no python.
PROBE_SCRIPT = r"""
d=$1 envf=$2 py=$3; shift 3
cd -- "$d" || exit 1
if [ -f "$envf" ]; then set -a; . "./$envf" || exit 1; set +a; fi
exec "$py" -c "$@"
"""
