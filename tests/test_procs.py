"""toolkit.procs with real processes and real signals."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import procs
from toolkit.procs import ExitStatus, LaunchSpec
from toolkit.testing.events import EVENT_WAIT, Events

WORKER = str(Path(__file__).parent / "scripts" / "agent_worker.py")


@pytest.fixture
def events(tmp_path: Path):
    ev = Events(tmp_path / "events.sock")
    yield ev
    ev.close()


def write_env(path: Path, **env: str) -> Path:
    path.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
    return path


def worker_spec(tmp_path: Path, events: Events, *flags: str, env_file: Path | None = None, **kw) -> LaunchSpec:
    env_file = env_file or write_env(tmp_path / "w.env", MS_NODE_ID="worker_0", RANK="0")
    argv = procs.env_argv(str(env_file), [sys.executable, WORKER, "--events", events.path, *flags])
    return LaunchSpec(argv=tuple(argv), env=dict(os.environ), cwd=str(tmp_path),
                      log_file=str(tmp_path / "w.log"), **kw)


def test_spawn_applies_env_file_log_and_own_session(tmp_path, events):
    env_file = write_env(tmp_path / "w.env", MS_NODE_ID="worker_7", RANK="7", EXTRA="a b 'c' $HOME")
    spec = worker_spec(tmp_path, events, "--exit", "3", "--print-lines", "2", env_file=env_file,
                       marker="--- start 1 ---")
    child = procs.spawn(spec)
    ev = events.next()
    assert ev["pid"] == child.pid  # bash exec'd into the program: the pid we hold is the program's
    assert ev["pgid"] == child.pid and ev["sid"] == child.pid
    assert ev["env"]["RANK"] == "7" and ev["env"]["EXTRA"] == "a b 'c' $HOME"
    assert child.wait(EVENT_WAIT) == ExitStatus(3, None)
    log = (tmp_path / "w.log").read_text().splitlines()
    assert log[0] == "--- start 1 ---"
    assert "worker_7 line 1" in log and log[-1] == "exiting with 3"


def test_env_file_edits_apply_at_next_spawn(tmp_path, events):
    env_file = write_env(tmp_path / "w.env", RANK="1")
    procs.spawn(worker_spec(tmp_path, events, env_file=env_file)).wait(EVENT_WAIT)
    assert events.next()["env"]["RANK"] == "1"
    write_env(env_file, RANK="1", EXTRA="edited")
    procs.spawn(worker_spec(tmp_path, events, env_file=env_file)).wait(EVENT_WAIT)
    assert events.next()["env"]["EXTRA"] == "edited"


def test_missing_env_file_does_not_run_the_program(tmp_path, events):
    child = procs.spawn(worker_spec(tmp_path, events, env_file=tmp_path / "nope.env"))
    assert child.wait(EVENT_WAIT) == ExitStatus(125, None)
    assert "nope.env" in (tmp_path / "w.log").read_text()


def test_resolve_env_matches_what_a_spawned_program_sees(tmp_path, events):
    env_file = write_env(tmp_path / "w.env", RANK="5", EXTRA="x y")
    env = procs.resolve_env(str(env_file), {"PATH": os.environ["PATH"], "KEEP": "1"}, str(tmp_path))
    assert env["RANK"] == "5" and env["EXTRA"] == "x y" and env["KEEP"] == "1"
    with pytest.raises(OSError, match="missing.env"):
        procs.resolve_env(str(tmp_path / "missing.env"), {"PATH": os.environ["PATH"]}, str(tmp_path))


def test_signal_death_is_reported_by_name(tmp_path, events):
    child = procs.spawn(worker_spec(tmp_path, events, "--block"))
    events.next()
    os.kill(child.pid, signal.SIGKILL)
    status = child.wait(EVENT_WAIT)
    assert status == ExitStatus(None, signal.SIGKILL)
    assert status.describe() == "killed by SIGKILL" and status.as_dict() == {"code": None, "signal": "SIGKILL"}


def test_pidfd_is_readable_only_after_exit(tmp_path, events):
    child = procs.spawn(worker_spec(tmp_path, events, "--block"))
    events.next()
    assert child.reap() is None and child.alive
    assert child.wait(0.05) is None
    child.signal_group(signal.SIGTERM)
    assert child.wait(EVENT_WAIT) == ExitStatus(None, signal.SIGTERM)
    assert not child.signal_group(signal.SIGTERM)  # reaped: never signals a reused pid


def test_reap_kills_what_is_left_of_the_group(tmp_path, events):
    child = procs.spawn(worker_spec(tmp_path, events, "--block", "--grandchild"))
    grandchild = events.next()["grandchild"]
    assert procs.is_running(grandchild)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(EVENT_WAIT)
    assert procs.wait_gone(grandchild, None, EVENT_WAIT)


def test_stop_all_sends_sigterm_first_then_sigkill_after_grace(tmp_path, events):
    words = tmp_path / "last-words"
    polite = procs.spawn(worker_spec(tmp_path, events, "--block", "--on-term", str(words)))
    stubborn = procs.spawn(worker_spec(tmp_path, events, "--block", "--ignore-term"))
    events.next(), events.next()
    killed = []
    out = procs.stop_all([polite, stubborn], grace=0.5, on_kill=killed.append)
    assert out[polite.pid] == ExitStatus(0, None)
    assert words.read_text().startswith(f"TERM {polite.pid}")
    assert out[stubborn.pid] == ExitStatus(None, signal.SIGKILL)
    assert killed == [stubborn]
    assert not procs.is_running(polite.pid) and not procs.is_running(stubborn.pid)


def test_children_die_with_their_parent(tmp_path, events):
    """PR_SET_PDEATHSIG: kill -9 of the process that spawned a child leaves no child running."""
    code = (
        "import os, sys, select\n"
        "from toolkit import procs\n"
        f"c = procs.spawn(procs.LaunchSpec(argv=('sleep', '300'), env=dict(os.environ), cwd={str(tmp_path)!r}))\n"
        "print(c.pid, c.start_ticks, flush=True)\n"
        "select.select([], [], [], 120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, ticks = map(int, parent.stdout.readline().split())
        assert procs.is_running(pid, ticks)
        parent.kill()
        parent.wait(EVENT_WAIT)
        assert procs.wait_gone(pid, ticks, EVENT_WAIT)
    finally:
        parent.kill()
        parent.wait(EVENT_WAIT)
        parent.stdout.close()


def test_cpus_are_pinned(tmp_path, events):
    cpu = min(os.sched_getaffinity(0))
    child = procs.spawn(worker_spec(tmp_path, events, cpus=frozenset({cpu})))
    assert events.next()["affinity"] == [cpu]
    child.wait(EVENT_WAIT)


def test_parent_signal_handlers_do_not_leak_into_children(tmp_path, events):
    """The parent's Python handlers and wakeup fd are reset before exec, so a signal sent to a fresh child
    acts on the child, not on the parent's event loop."""
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    old_fd = signal.set_wakeup_fd(w.fileno())
    old = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        child = procs.spawn(LaunchSpec(argv=("sleep", "300"), env=dict(os.environ), cwd=str(tmp_path)))
        child.signal_group(signal.SIGTERM)
        assert child.wait(EVENT_WAIT) == ExitStatus(None, signal.SIGTERM)
        with pytest.raises(BlockingIOError):
            r.recv(16)
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.set_wakeup_fd(old_fd)
        r.close()
        w.close()


def test_reclaim_group_kills_orphans_of_a_dead_leader_only(tmp_path, events):
    leader = procs.spawn(worker_spec(tmp_path, events, "--block", "--grandchild"))
    grandchild = events.next()["grandchild"]
    ticks = leader.start_ticks
    # the leader dies without our reaping kills (as when the agent itself is SIGKILLed): kill it alone
    os.kill(leader.pid, signal.SIGKILL)
    assert procs.wait_gone(leader.pid, ticks, EVENT_WAIT)
    assert procs.is_running(grandchild)
    assert procs.reclaim_group(leader.pgid, ticks + 1) == []  # the recorded leader was another process
    assert procs.reclaim_group(leader.pgid, ticks) == [grandchild]
    assert procs.wait_gone(grandchild, None, EVENT_WAIT)
    leader.reap()


def test_proc_info_and_start_ticks():
    me = procs.proc_info(os.getpid())
    assert me.pid == os.getpid() and me.ppid == os.getppid() and me.pgid == os.getpgid(0)
    assert procs.is_running(os.getpid(), me.start_ticks)
    assert not procs.is_running(os.getpid(), me.start_ticks + 1)
    assert procs.start_ticks(2**22 + 12345) is None
