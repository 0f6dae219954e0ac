"""Another user who can write near the checkpoints must not control them (issue 25, item 1). The other user is uid
65534 (`setpriv`), acting on real directories; the job is the sample, run as a user runs it.

- A checkpoint directory another user can write, or that is theirs, or under a directory they can write, is
  refused when the manager is made: one line naming the directory and the fix.
- A checkpoint planted in the job's directory (it was open for a while, then closed again) is never resumed: it
  fails authentication, is named in one line and moved aside, and the job resumes from its own.
- A link planted at the name the writer will use for its temporary file is never followed.
- Another project of the same user, run alone with the same CKPT_DIR, is refused in one line instead of resuming
  the first's checkpoints (issue 39, round 3 item 10); the first still resumes its own.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from toolkit import atomicfile, privatedir
from toolkit.contracts import ckptkey
from toolkit.testing.stranger import AS_STRANGER
from toolkit.train.ckpt import partfile
from toolkit.train.ckpt.hostdir import HostDir
from toolkit.train.ckpt.manager import CheckpointManager, Placement
from toolkit.train.ckpt.partfile import PartName
from toolkit.train.faults import CheckpointError

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "train.py"
RUN_TIMEOUT = 240.0
KEY = b"security test key of 32 bytes!!!"
RESUMED = re.compile(r"^rank 0: resumed from step (\d+) ", re.M)


@pytest.fixture
def open_dir():
    """A directory under /tmp that the other user can reach (pytest's own tmp is 0700)."""
    if os.geteuid() != 0:
        pytest.fail("these tests play another user with setpriv and must run as root (as CI does)")
    d = Path(tempfile.mkdtemp(prefix="tk-ckpt-sec-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_other(*argv: str, data: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*AS_STRANGER, *argv], input=data, capture_output=True, timeout=60, cwd="/")


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_a_directory_another_user_can_write_or_owns_is_refused_naming_it(open_dir):
    shared = open_dir / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(shared, placement=Placement("a"), key=KEY)
    msg = one_line(e)
    assert f"checkpoint directory {shared} is writable by other users (mode 1777)" in msg
    assert f"chmod go-w {shared}" in msg and "--ckpt-dir" in msg

    theirs = shared / "theirs"  # made by the other user in the shared directory
    assert as_other("mkdir", "-m", "700", str(theirs)).returncode == 0
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(theirs, placement=Placement("a"), key=KEY)
    assert f"checkpoint directory {theirs} belongs to uid 65534, not to you" in one_line(e)

    group = open_dir / "group"
    group.mkdir()
    group.chmod(0o2775)  # group-writable, no sticky bit: a member could rename ours away
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(group / "mine", placement=Placement("a"), key=KEY)
    assert f"{group} above it is writable by other users (mode 2775, no sticky bit)" in one_line(e)



def test_a_directory_of_ours_in_a_sticky_directory_is_accepted_and_a_planted_host_directory_is_not(open_dir):
    sticky = open_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with CheckpointManager(sticky / "ckpt", placement=Placement("a"), key=KEY) as m:
        m.save(1, {"w": torch.ones(3)})
        assert oct((sticky / "ckpt").stat().st_mode & 0o777) == "0o700"
    assert as_other("mkdir", "-m", "777", str(sticky / "host_b")).returncode == 0
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(sticky, placement=Placement("b"), key=KEY)
    msg = one_line(e)
    assert str(sticky) in msg and "writable by other users" in msg


def sample(ckpt: Path, *args: str, script: Path = SAMPLE) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TOOLKIT_HOST",
                                                            "TOOLKIT_TOKEN_FILE", "MS_ROLE")}
    env.update(CKPT_DIR=str(ckpt), OMP_NUM_THREADS="1", DATA_PATH=str(SAMPLE.parent / "MNIST_Data"))
    return subprocess.run([sys.executable, str(script), "--epochs", "1", "--ckpt-interval", "10", "--log-every",
                           "100", *args], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)


def test_a_planted_newer_checkpoint_is_refused_naming_the_file_and_the_job_resumes_its_own(open_dir):
    ckpt = open_dir / "ckpt"
    first = sample(ckpt)
    assert first.returncode == 0, first.stderr
    host = ckpt / Placement(socket.gethostname()).dirname
    assert sorted(p.name for p in host.iterdir())[-1] == "step_000000000045.p0of1.ckpt"

    forged = forge(host, open_dir)

    ckpt.chmod(0o711)
    host.chmod(0o1777)  # the operator opened it for a while ("so the others can read the results")
    planted = host / PartName(9999, 0, 1).name
    done = as_other("sh", "-c", 'cat > "$1"', "sh", str(planted), data=forged)
    assert done.returncode == 0, done.stderr
    assert planted.stat().st_uid == 65534, "the other user's file was not planted"

    refused = sample(ckpt)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and str(host) in lines[0] and "writable by other users (mode 1777)" in lines[0], lines

    host.chmod(0o700)  # what the line said to do; the planted file is still there
    again = sample(ckpt)
    assert again.returncode == 0, again.stderr
    assert RESUMED.search(again.stdout).group(1) == "45", again.stdout
    said = [line for line in again.stderr.splitlines() if planted.name in line]
    assert len(said) == 1 and "fails authentication" in said[0] and "not used" in said[0], again.stderr
    assert not planted.exists() and (host / "refused" / planted.name).stat().st_uid == 65534


def test_another_project_with_the_same_ckpt_dir_is_refused_in_one_line_and_the_first_resumes(tmp_path):
    """The unlucky user: a second project (a copy of the sample elsewhere), run alone with the CKPT_DIR the first
    used. It used to resume the first's checkpoint (one key per user); now the keys are per project, and the
    directory's key-id refuses it before anything is read or moved."""
    ckpt = tmp_path / "ckpt"
    first = sample(ckpt)
    assert first.returncode == 0, first.stderr
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    other = tmp_path / "other-project"
    other.mkdir()
    shutil.copy(SAMPLE, other / "train.py")
    second = sample(ckpt, script=other / "train.py")
    assert second.returncode == 2, second.stdout + second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"checkpoint directory {ckpt} holds another job's checkpoints" in lines[0], lines
    assert not RESUMED.search(second.stdout) and "step" not in second.stdout, second.stdout
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    again = sample(ckpt)
    assert again.returncode == 0 and RESUMED.search(again.stdout).group(1) == "45", again.stdout + again.stderr


def forge(host: Path, scratch: Path) -> bytes:
    """What the attacker would plant: a checkpoint in the right format, of the job's own structure (known from its
    source), with their numbers, under their own key (the job's they do not have)."""
    key = ckptkey.default_key(os.environ, SAMPLE)  # the job's own key: the sample's project's
    with CheckpointManager(host.parent, placement=Placement(host.name[len("host_"):]), key=key) as m:
        state = m.load(45)
    state["step"] = 9999
    for name, t in state["model"].items():
        state["model"][name] = torch.full_like(t, 0.5)
    fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
    try:
        partfile.write_part(fd, PartName(9999, 0, 1), state, b"the attacker's own key, 32 bytes")
    finally:
        os.close(fd)
    return (scratch / PartName(9999, 0, 1).name).read_bytes()


@pytest.mark.parametrize("async_write", [False, True])
def test_the_writer_never_follows_a_link_planted_at_its_temporary_name(tmp_path, monkeypatch, async_write):
    """Links at the names the writer will try first: the old scheme's predictable one (pid and thread id) and the
    first random name (made predictable here): neither is followed, the checkpoint is written under another."""
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA the victim's key\n")
    with CheckpointManager(tmp_path / "ckpt", placement=Placement("a"), key=KEY, async_write=async_write) as m:
        final = PartName(1, 0, 1).name
        names = iter([f"{atomicfile.TMP_PREFIX}{final}.planted"])
        real = atomicfile.temp_name
        monkeypatch.setattr(atomicfile, "temp_name", lambda f: next(names, None) or real(f))
        writer = m._writer.thread.ident if m._writer is not None else threading.get_ident()
        for name in (f"{atomicfile.TMP_PREFIX}{final}.planted",
                     f"{atomicfile.TMP_PREFIX}{final}.{os.getpid()}.{writer}"):
            (m.directory / name).symlink_to(victim)
        m.save(1, {"w": torch.arange(10.0)})
        m.flush()
        assert torch.equal(m.load(1)["w"], torch.arange(10.0))
    assert victim.read_text() == "ssh-ed25519 AAAA the victim's key\n"
    links = [p for p in m.directory.iterdir() if p.is_symlink()]
    assert len(links) == 2 and all(p.resolve() == victim for p in links)


def test_a_link_swapped_after_the_check_is_not_followed_the_checked_directory_is_opened(open_dir, monkeypatch):
    """The checkpoint root is a link of ours in a directory another user can write; between the check of the host
    directory and its opening, they point the link at another directory (one of ours they could move there). What
    was checked is what is opened: the fd is the directory the link resolved to when it was checked."""
    mine, writable = open_dir / "mine", open_dir / "open"
    mine.mkdir(mode=0o700)
    writable.mkdir()
    writable.chmod(0o777)  # noqa: S103 - the fault: a directory every local user may write, no sticky bit
    other = writable / "other"
    (other / "host_a").mkdir(mode=0o700, parents=True)
    other.chmod(0o700)
    link = writable / "ckpt"
    link.symlink_to(mine)
    real_ensure = privatedir.ensure
    swapped = []

    def ensure_then_swap(path, *args):
        checked = real_ensure(path, *args)
        if Path(path).name == "host_a":  # the host directory was just checked: the attacker's moment
            done = as_other("ln", "-sfn", str(other), str(link))
            assert done.returncode == 0, done.stderr
            swapped.append(os.readlink(link))
        return checked

    monkeypatch.setattr(privatedir, "ensure", ensure_then_swap)
    host = HostDir(link, "host_a", KEY)
    try:
        assert swapped == [str(other)], "the attacker's swap did not happen"
        assert os.fstat(host.fd).st_ino == (mine / "host_a").stat().st_ino  # the checked one, not other/host_a
    finally:
        host.close()


def test_the_key_directory_is_opened_as_it_was_checked_a_link_swapped_after_the_check_is_not_followed(
        open_dir, monkeypatch):
    """Without a job token the checkpoint key is this user's secret under $XDG_CONFIG_HOME/toolkit. The config
    directory is a link of ours in a directory another user can write; right after the key directory was checked,
    they point the link at a directory of theirs holding a key file they know. The key made is ours, in the
    directory that was checked: their key is never read and nothing is written in their directory."""
    mine, writable = open_dir / "mine", open_dir / "open"
    mine.mkdir(mode=0o700)
    writable.mkdir()
    writable.chmod(0o777)  # noqa: S103 - the fault: a directory every local user may write, no sticky bit
    link = writable / "config"
    link.symlink_to(mine)
    theirs = writable / "theirs"
    assert as_other("mkdir", "-m", "755", str(theirs)).returncode == 0
    assert as_other("mkdir", "-m", "700", str(theirs / "toolkit")).returncode == 0
    known = b"k" * ckptkey.KEY_SIZE  # the key the attacker would have us use (and could then forge under)
    assert as_other("sh", "-c", 'umask 077; cat > "$1"', "sh", str(theirs / "toolkit" / "checkpoint.key"),
                    data=known).returncode == 0
    real_ensure = privatedir.ensure
    swapped = []

    def ensure_then_swap(path, *args):
        checked = real_ensure(path, *args)
        done = as_other("ln", "-sfn", str(theirs), str(link))  # the attacker's moment: the check is over
        assert done.returncode == 0, done.stderr
        swapped.append(os.readlink(link))
        return checked

    monkeypatch.setattr(privatedir, "ensure", ensure_then_swap)
    key = ckptkey.user_key({"XDG_CONFIG_HOME": str(link)})
    assert swapped == [str(theirs)], "the attacker's swap did not happen"
    assert key != known
    assert (mine / "toolkit" / "checkpoint.key").read_bytes() == key  # made in the directory that was checked
    assert sorted(p.name for p in (theirs / "toolkit").iterdir()) == ["checkpoint.key"]
    monkeypatch.setattr(privatedir, "ensure", real_ensure)
    with pytest.raises(ckptkey.KeyFileError) as e:  # and now, with the link theirs at the check: refused, one line
        ckptkey.user_key({"XDG_CONFIG_HOME": str(link)})
    assert f"checkpoint key directory {theirs / 'toolkit'} belongs to uid" in one_line(e)
