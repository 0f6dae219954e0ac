"""The key checkpoints are authenticated under, and the public id that tells whose a checkpoint directory is.

Which key: under toolkit, the job's, derived from its token (``TOOLKIT_TOKEN_FILE``, 0600 in the job directory,
never sent anywhere): HMAC-SHA256(token, "toolkit checkpoint key v1"), the same on every host of the job and never
written down. Alone or under torchrun (no token), the project's: HMAC-SHA256 of this user's secret (random, made
once in ``$XDG_CONFIG_HOME/toolkit/checkpoint.key``, default ``~/.config``; 0600, in a 0700 directory opened as
it was checked, the file made and read through that descriptor without following links, its owner and mode checked
on what was opened) over the real path of the script that runs (``sys.argv[0]``; the working directory when there
is none). Why per project and not per user: two projects of one
user pointed at the same CKPT_DIR must not resume each other's checkpoints (the red team's round 3 saw the second
resume the first's, silently). Why the script: it is what names the job when no launcher does (torchrun's run id is
random with --standalone, the working directory changes with where it is typed); moving or renaming the script
starts a new job, whose directory then refuses the old one's checkpoints in one line.

The id: HMAC-SHA256(key, "toolkit checkpoint key id v1"), hex; one-way, so writing it down (the checkpoint
directory's ``key-id``, toolkit.train.ckpt.hostdir) reveals nothing of the key. Torch-free: `fleet train --fresh`
computes the job's id to move only its own checkpoint directory aside.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import sys
from pathlib import Path
from typing import Mapping

from toolkit import privatedir
from toolkit.contracts.envvars import TOOLKIT_TOKEN_FILE

KEY_INFO = b"toolkit checkpoint key v1"
PROJECT_INFO = b"toolkit project checkpoint key v1\0"
ID_INFO = b"toolkit checkpoint key id v1"
ID_CHARS = 32  # hex digits of a key id
KEY_FILE = Path("toolkit") / "checkpoint.key"
KEY_SIZE = 32


class KeyFileError(RuntimeError):
    """The checkpoint key cannot be made or read safely; one line naming the file and what to do."""


def job_key(token: str) -> bytes:
    """The checkpoint key of a job: derived from its token (never the token itself, which proves identity to the
    scheduler: a key that leaked from a checkpoint tool must not open the job's ports)."""
    return hmac.new(token.encode(), KEY_INFO, hashlib.sha256).digest()


def key_id(key: bytes) -> str:
    """The public id of `key` (module docstring)."""
    return hmac.new(key, ID_INFO, hashlib.sha256).hexdigest()[:ID_CHARS]


def project_key(env: Mapping[str, str], script: str | os.PathLike[str]) -> bytes:
    """The key of the project whose script is `script`, for runs without a job token (module docstring)."""
    project = os.path.realpath(script).encode(errors="surrogateescape")
    return hmac.new(user_key(env), PROJECT_INFO + project, hashlib.sha256).digest()


def main_script() -> str:
    """What names this run's project: the script that runs (sys.argv[0]) if it is a file, else the working
    directory (an interactive session, `python -c`)."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 if argv0 and os.path.isfile(argv0) else os.getcwd()


def default_key(env: Mapping[str, str], script: str | os.PathLike[str] | None = None) -> bytes:
    """The job's key if `env` names a token file (a worker under toolkit), else the project's key of `script`
    (default: main_script())."""
    token_file = env.get(TOOLKIT_TOKEN_FILE)
    if token_file:
        try:
            return job_key(Path(token_file).read_text().strip())
        except OSError as e:
            raise KeyFileError(f"{TOOLKIT_TOKEN_FILE}={token_file}: cannot read the job token ({e.strerror})") from None
    return project_key(env, script if script is not None else main_script())


def user_key(env: Mapping[str, str]) -> bytes:
    """This user's secret, made once (module docstring); never a checkpoint key itself (project_key is).

    The directory is opened as it was checked (privatedir.open_private: one component at a time, O_NOFOLLOW, each
    held to the rule by fstat of what was opened), and the key file is made or read relative to that descriptor,
    also without following links: another user who swaps a link into the path after the check (in a directory
    above that they may write) gets nothing followed, and the key is never read from or written to their file."""
    base = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    path = base / KEY_FILE
    try:
        dir_fd = privatedir.open_private(path.parent, "checkpoint key directory",
                                         "remove it (a new key is made; checkpoints of the old key are then not "
                                         "resumed)")
    except privatedir.NotPrivate as e:
        raise KeyFileError(str(e)) from None
    except OSError as e:
        raise KeyFileError(f"checkpoint key directory {path.parent} cannot be made: {e.strerror}") from None
    try:
        try:
            fd = os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
        except FileExistsError:
            return _read_key(path, dir_fd)
        except OSError as e:
            raise KeyFileError(f"checkpoint key {path} cannot be made: {e.strerror}") from None
        try:
            os.write(fd, os.urandom(KEY_SIZE))
            os.fsync(fd)
        finally:
            os.close(fd)
        return _read_key(path, dir_fd)
    finally:
        os.close(dir_fd)


def _read_key(path: Path, dir_fd: int) -> bytes:
    """The key file `path`'s bytes, opened by its name in the checked directory `dir_fd` without following a link,
    and held to being a private regular file of ours by fstat of what was opened."""
    fix = "remove it (a new key is made; checkpoints made with the old one are then not resumed)"
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise KeyFileError(f"checkpoint key {path} cannot be read ({e.strerror}): {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise KeyFileError(f"checkpoint key {path} is not a private file of yours (uid {st.st_uid}, mode "
                               f"{stat.S_IMODE(st.st_mode):o}): {fix}")
        data = os.read(fd, KEY_SIZE + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_SIZE:
        raise KeyFileError(f"checkpoint key {path} is {len(data)} bytes, not {KEY_SIZE}: {fix}")
    return data
