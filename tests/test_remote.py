"""toolkit.launcher.remote against real sshd on the namespace hosts (and LocalHost against this machine): strict host
keys, one-line errors per host, bounded waits on cut-off hosts, incremental sync, detaching, fan-out."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from toolkit.launcher.inventory import load_ansible_inventory
from toolkit.launcher.remote import (
    AuthenticationFailed,
    ChangedHostKey,
    ClusterError,
    CommandFailed,
    ConnectionLost,
    Host,
    HostStalled,
    HostUnreachable,
    LocalHost,
    PreflightFailed,
    SshSettings,
    Target,
    UnknownHostKey,
    check_all,
    open_host,
    run_on_all,
)
from toolkit.testing import waits
from toolkit.testing.cluster import Cluster, describe, exited

pytestmark = pytest.mark.timeout(60)

WAIT = 20.0
CLOSE_WAIT = 30.0  # s for a host to notice a closed connection, on a busy machine


def settings(cluster: Cluster, **kw: object) -> SshSettings:
    base: dict[str, object] = dict(known_hosts=str(cluster.known_hosts), connect_timeout=2, keepalive_interval=1,
                                   dead_after=3)
    base.update(kw)
    return SshSettings(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def targets(cluster: Cluster) -> list[Target]:
    """Targets as the launcher gets them: parsed from the cluster's generated Ansible inventory."""
    inventory = load_ansible_inventory(cluster.inventory)
    return [Target.of(h) for h in inventory.hosts]


def by_name(targets: list[Target], name: str) -> Target:
    return next(t for t in targets if t.name == name)


@pytest.fixture(params=["local", "ssh"])
def host_and_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Host, Path]]:
    """The same behaviours on LocalHost and on an SSH host, each with a fresh directory of its own."""
    if request.param == "local":
        (tmp_path / "host").mkdir()
        yield LocalHost(settings=SshSettings()), tmp_path / "host"
        return
    cluster: Cluster = request.getfixturevalue("cluster")
    targets_: list[Target] = request.getfixturevalue("targets")
    h = cluster.hosts[0]
    workdir = h.workdir / f"t-{uuid.uuid4().hex[:8]}"
    workdir.mkdir()
    with open_host(by_name(targets_, h.name), settings(cluster)) as host:
        yield host, workdir


# --- running commands ------------------------------------------------------------------------------------------


def test_runs_on_every_host_in_parallel_from_the_generated_inventory(cluster: Cluster, targets: list[Target]) -> None:
    barrier = threading.Barrier(len(targets), timeout=WAIT)  # passes only if every host's call runs at once

    def identify(host: Host) -> tuple[str, str]:
        out = host.run(["sh", "-c", 'hostname; echo "$HOME"; echo $(ls -A "$HOME")'], check=True).stdout.split("\n")
        barrier.wait()
        return out[0], out[2]

    results = check_all(run_on_all(targets, identify, settings(cluster)))
    assert {name: hostname for name, (hostname, _) in results.items()} == {n: n for n in cluster.names}
    # A private home per host: root's real one (.bashrc) is hidden; what toolkit itself keeps there (the pre-flight
    # check's manifest cache, ~/.cache, after a check ran on the shared cluster) is the host's own.
    shown = set(cluster.state.home_shares)
    assert all(set(home_listing.split()) - {".cache"} == shown for _, home_listing in results.values()), results


def test_fan_out_never_exceeds_parallel(cluster: Cluster, targets: list[Target]) -> None:
    lock = threading.Lock()
    inside = [0, 0]  # now, most seen

    def work(host: Host) -> None:
        with lock:
            inside[0] += 1
            inside[1] = max(inside)
        host.run(["sleep", "0.2"], check=True)
        with lock:
            inside[0] -= 1

    results = run_on_all(targets, work, settings(cluster, parallel=2))
    assert all(r.ok for r in results.values())
    assert inside[1] <= 2


def test_argv_is_quoted_and_exit_codes_and_stderr_come_back(host_and_dir: tuple[Host, Path]) -> None:
    host, workdir = host_and_dir
    tricky = ["a b", "$HOME", "it's", "; touch pwned", "`id`", "*"]
    result = host.run(["printf", "%s\\n", *tricky], cwd=str(workdir), check=True)
    assert result.stdout.splitlines() == tricky
    assert not (workdir / "pwned").exists()
    failed = host.run("echo oops >&2; exit 3")
    assert (failed.exit_code, failed.stderr, failed.connection_lost) == (3, "oops\n", False)
    with pytest.raises(CommandFailed) as e:
        failed.check()
    assert str(e.value).startswith(f"{host.name}: command exited with 3") and "oops" in str(e.value)


def test_env_and_cwd_are_applied_quoted(host_and_dir: tuple[Host, Path]) -> None:
    host, workdir = host_and_dir
    out = host.run(["sh", "-c", 'printf "%s|%s" "$GREETING" "$(pwd)"'], cwd=str(workdir),
                   env={"GREETING": "it's $HOME; ok"}, check=True).stdout
    assert out == f"it's $HOME; ok|{workdir}"
    with pytest.raises(ValueError):
        host.run(["true"], env={"BAD NAME": "x"})


def test_a_timed_out_command_is_stopped_on_the_host(host_and_dir: tuple[Host, Path]) -> None:
    host, workdir = host_and_dir
    pidfile = workdir / "sleeper.pid"
    result = host.run(["sh", "-c", 'echo $$ > "$1"; exec sleep 30', "sh", str(pidfile)], timeout=1)
    assert result.timed_out and result.exit_code is None and not result.ok and not result.connection_lost
    pid = int(pidfile.read_text())
    waits.wait_for(f"timed-out command (pid {pid}) to be gone", lambda: exited(pid), WAIT)


def test_a_command_killed_by_a_signal_is_not_a_lost_connection(host_and_dir: tuple[Host, Path]) -> None:
    host, _ = host_and_dir
    result = host.run(["sh", "-c", "kill -KILL $$"])
    assert result.exit_code is None and not result.connection_lost and result.signal
    assert host.run(["true"]).ok  # the connection is still usable


def test_detached_process_outlives_the_connection(host_and_dir: tuple[Host, Path]) -> None:
    host, workdir = host_and_dir
    pid = host.detach(["sh", "-c", "echo started; exec sleep 60"], "detached.log", cwd=str(workdir))
    try:
        host.close()
        assert not exited(pid)
        assert os.getsid(pid) == pid  # its own session: no hangup from the connection
        log = workdir / "detached.log"
        waits.wait_for("the detached process's log", lambda: log.read_text() == "started\n", WAIT)
    finally:
        os.kill(pid, 9)


def test_put_and_write_are_atomic_with_the_mode_asked(host_and_dir: tuple[Host, Path], tmp_path: Path) -> None:
    host, workdir = host_and_dir
    src = tmp_path / "script.sh"
    src.write_text("#!/bin/sh\necho hi\n")
    src.chmod(0o750)
    host.put(src, str(workdir / "copy.sh"))
    host.write(str(workdir / "token"), "secret", mode=0o600)
    assert host.run([str(workdir / "copy.sh")], check=True).stdout == "hi\n"
    modes = host.run(["stat", "-c", "%a %n", str(workdir / "copy.sh"), str(workdir / "token")], check=True).stdout
    assert modes.split() == ["750", str(workdir / "copy.sh"), "600", str(workdir / "token")]
    assert host.run(["cat", str(workdir / "token")], check=True).stdout == "secret"
    assert sorted(p.name for p in workdir.iterdir()) == ["copy.sh", "token"]  # no temp files left
    with pytest.raises(CommandFailed) as e:
        host.write(str(workdir / "missing-dir" / "f"), "x")
    assert str(e.value).startswith(f"{host.name}: ")


def test_sync_dir_sends_only_what_changed(host_and_dir: tuple[Host, Path], tmp_path: Path) -> None:
    host, workdir = host_and_dir
    src = tmp_path / "project"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "__pycache__").mkdir()
    (src / "train.py").write_text("print('train')\n")
    (src / "run me.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run me.sh").chmod(0o755)
    (src / "pkg" / "deep" / "data.bin").write_bytes(os.urandom(100_000))
    (src / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"cache")
    dest = workdir / "project"

    first = host.sync_dir(src, str(dest))
    assert (first.files_sent, first.files_unchanged, first.dirs_created) == (3, 0, 2)
    assert host.run(["sh", "-c", '"./run me.sh"'], cwd=str(dest), check=True).stdout == "ran\n"
    remote_sum = host.run(["sha256sum", "pkg/deep/data.bin"], cwd=str(dest), check=True).stdout.split()[0]
    local_sum = subprocess.run(["sha256sum", str(src / "pkg/deep/data.bin")], capture_output=True,
                               text=True, check=True).stdout.split()[0]
    assert remote_sum == local_sum
    assert not (dest / "__pycache__").exists()

    second = host.sync_dir(src, str(dest))
    assert (second.files_sent, second.bytes_sent, second.files_unchanged, second.dirs_created) == (0, 0, 3, 0)

    (src / "train.py").write_text("print('train, longer')\n")  # new size
    st = (src / "pkg" / "deep" / "data.bin").stat()
    os.utime(src / "pkg" / "deep" / "data.bin", (st.st_atime, st.st_mtime - 100))  # same size, older mtime
    third = host.sync_dir(src, str(dest))
    assert (third.files_sent, third.files_unchanged) == (2, 1)
    assert host.run(["cat", "train.py"], cwd=str(dest), check=True).stdout == "print('train, longer')\n"

    host.write(str(dest / "stale.txt"), "left over")
    assert host.sync_dir(src, str(dest)).removed == 0 and (dest / "stale.txt").exists()
    assert host.sync_dir(src, str(dest), delete=True).removed == 1 and not (dest / "stale.txt").exists()


def test_preflight_names_what_the_host_lacks(host_and_dir: tuple[Host, Path]) -> None:
    host, workdir = host_and_dir
    host.preflight(sys.executable, str(workdir / "jobs"))
    assert (workdir / "jobs").is_dir()

    with pytest.raises(PreflightFailed, match=rf"^{host.name}: python /nonexistent/python3 not found"):
        host.preflight("/nonexistent/python3", str(workdir / "jobs"))
    with pytest.raises(PreflightFailed, match=rf"^{host.name}: /usr/bin/python3 cannot import toolkit"):
        host.preflight("/usr/bin/python3", str(workdir / "jobs"))
    (workdir / "a-file").write_text("")
    with pytest.raises(PreflightFailed, match=rf"^{host.name}: cannot create the workdir .*a-file/jobs"):
        host.preflight(sys.executable, str(workdir / "a-file" / "jobs"))

    if isinstance(host, LocalHost):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(PreflightFailed, match=rf"^{host.name}: port {port} is already in use"):
                host.preflight(sys.executable, str(workdir / "jobs"), ports=[port])
    else:
        with pytest.raises(PreflightFailed, match=rf"^{host.name}: port 22 is already in use"):  # its sshd
            host.preflight(sys.executable, str(workdir / "jobs"), ports=[0, 22])


# --- host keys -------------------------------------------------------------------------------------------------


def test_unknown_host_key_is_refused(cluster: Cluster, targets: list[Target], tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    results = run_on_all(targets, lambda h: None, settings(cluster, known_hosts=str(empty)))
    for t in targets:
        assert isinstance(results[t.name].exception, UnknownHostKey)
        error = results[t.name].error
        assert error.startswith(f"{t.name}: host key unknown: {t.hostname} is not in {empty}")
        assert "--accept-new-host-keys" in error and "\n" not in error
    assert empty.read_text() == ""
    assert_no_unauthenticated_connections(cluster)


def assert_no_unauthenticated_connections(cluster: Cluster) -> None:
    """A refused host leaves no half-open connection behind (its sshd would hold it until LoginGraceTime)."""
    def left() -> dict[str, Any]:
        return {n: infos for n in cluster.names if (infos := cluster.unauthenticated(n))}

    waits.wait_for("no unauthenticated connection left open", lambda: not left(), CLOSE_WAIT,
                   evidence=lambda: f"still open: {left()}")


def test_accept_new_saves_keys_once_and_they_are_then_checked(
        cluster: Cluster, targets: list[Target], tmp_path: Path) -> None:
    known = tmp_path / "ssh" / "known_hosts"  # directory and file do not exist yet, as on a fresh machine
    check_all(run_on_all(targets, lambda h: None, settings(cluster, known_hosts=str(known), accept_new_host_keys=True)))
    lines = known.read_text().splitlines()
    assert sorted(lines) == sorted(f"{h.address} {h.public_key()}" for h in cluster.hosts)
    check_all(run_on_all(targets, lambda h: None, settings(cluster, known_hosts=str(known))))
    check_all(run_on_all(targets, lambda h: None, settings(cluster, known_hosts=str(known), accept_new_host_keys=True)))
    assert known.read_text().splitlines() == lines  # nothing added twice


def test_hashed_known_hosts_entries_are_understood(cluster: Cluster, targets: list[Target], tmp_path: Path) -> None:
    known = cluster.write_known_hosts(tmp_path / "known_hosts")
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True, timeout=30)
    assert all(line.startswith("|1|") for line in known.read_text().splitlines())
    check_all(run_on_all(targets, lambda h: None, settings(cluster, known_hosts=str(known))))


def test_changed_host_key_is_refused_even_with_accept_new(
        cluster: Cluster, targets: list[Target], tmp_path: Path) -> None:
    victim = cluster.hosts[-1]
    known = cluster.write_known_hosts(tmp_path / "known_hosts")
    before = known.read_text()
    with cluster.host_key_changed(victim.name) as new_key:
        results = run_on_all(targets, lambda h: None, settings(cluster, known_hosts=str(known),
                                                               accept_new_host_keys=True))
        assert [n for n, r in results.items() if not r.ok] == [victim.name]
        failure = results[victim.name]
        assert isinstance(failure.exception, ChangedHostKey)
        assert failure.error.startswith(f"{victim.name}: host key for {victim.address} has CHANGED")
        assert "ssh-keygen -R" in failure.error and "\n" not in failure.error
        assert new_key not in before
    assert known.read_text() == before


def test_wrong_key_is_an_authentication_failure(cluster: Cluster, targets: list[Target], tmp_path: Path) -> None:
    wrong = tmp_path / "id_wrong"
    wrong.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    wrong.chmod(0o600)
    t = targets[0]
    with pytest.raises(AuthenticationFailed) as e:
        open_host(Target(t.name, t.hostname, t.port, t.user, str(wrong)), settings(cluster))
    assert str(e.value).startswith(f"{t.name}: authentication failed for user root at {t.hostname}:22 with {wrong}")
    with pytest.raises(AuthenticationFailed, match=rf"^{t.name}: SSH key file {tmp_path}/nope not found"):
        open_host(Target(t.name, t.hostname, t.port, t.user, str(tmp_path / "nope")), settings(cluster))
    assert_no_unauthenticated_connections(cluster)


# --- ssh_config ------------------------------------------------------------------------------------------------


def test_ssh_config_is_honoured_through_an_alias(cluster: Cluster, tmp_path: Path) -> None:
    h = cluster.hosts[0]
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host alias-ok\n  HostName {h.address}\n  Port 22\n  User root\n  IdentityFile {cluster.key}\n"
        f"Host alias-port\n  HostName {h.address}\n  Port 2222\n  User root\n  IdentityFile {cluster.key}\n"
        f"Host alias-nokey\n  HostName {h.address}\n  User root\n"
        f"Host alias-user\n  HostName {h.address}\n  User nobody\n  IdentityFile {cluster.key}\n"
    )
    s = settings(cluster, ssh_config=str(config))
    with open_host(Target("alias-ok"), s) as host:
        assert host.run(["sh", "-c", "hostname; id -un"], check=True).stdout.split() == [h.name, "root"]
    with pytest.raises(HostUnreachable, match=rf"^alias-port: unreachable: connection refused at {h.address}:2222"):
        open_host(Target("alias-port"), s)
    with pytest.raises(AuthenticationFailed, match="^alias-nokey: authentication failed for user root"):
        open_host(Target("alias-nokey"), s)
    with pytest.raises(AuthenticationFailed, match="^alias-user: authentication failed for user nobody"):
        open_host(Target("alias-user"), s)
    # the cluster's own ssh_config: the inventory name is all a target needs
    with open_host(Target(h.name), SshSettings(known_hosts=str(cluster.known_hosts),
                                               ssh_config=str(cluster.ssh_config))) as host:
        assert host.run(["hostname"], check=True).stdout.strip() == h.name


def test_proxyjump_goes_through_the_jump_host_and_checks_its_key_too(cluster: Cluster, tmp_path: Path) -> None:
    jump, behind = cluster.hosts[0], cluster.hosts[1]
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host jump\n  HostName {jump.address}\n  User root\n  IdentityFile {cluster.key}\n"
        f"Host behind\n  HostName {behind.address}\n  User root\n  IdentityFile {cluster.key}\n  ProxyJump jump\n"
    )
    with open_host(Target("behind"), settings(cluster, ssh_config=str(config))) as host:
        assert host.run(["hostname"], check=True).stdout.strip() == behind.name
        peer = host.run(["sh", "-c", 'echo "$SSH_CLIENT"'], check=True).stdout.split()[0]
        assert peer == jump.address  # the connection really came from the jump host
    only_behind = cluster.write_known_hosts(tmp_path / "known_hosts", [behind.name])
    with pytest.raises(UnknownHostKey, match=f"{jump.address} is not in {only_behind}"):
        open_host(Target("behind"), settings(cluster, ssh_config=str(config), known_hosts=str(only_behind)))


def test_progress_reports_each_host_once(cluster: Cluster, targets: list[Target]) -> None:
    from toolkit.launcher.remote import rich_progress

    seen: list[str] = []
    lock = threading.Lock()
    with rich_progress("hosts", len(targets)) as bar:
        def progress(result: object) -> None:
            bar(result)  # type: ignore[arg-type]
            with lock:
                seen.append(result.host)  # type: ignore[attr-defined]

        check_all(run_on_all(targets, lambda h: None, settings(cluster), progress=progress))
    assert sorted(seen) == sorted(t.name for t in targets)


# --- unreachable and lost hosts --------------------------------------------------------------------------------


def test_unreachable_host_fails_alone_within_the_connect_timeout(cluster: Cluster, targets: list[Target]) -> None:
    victim = cluster.hosts[-1]
    with cluster.partitioned(victim.name):
        results = run_on_all(targets, lambda h: h.run(["hostname"], check=True).stdout.strip(),
                             settings(cluster, connect_timeout=1))
    assert {n: r.value for n, r in results.items() if r.ok} == {n: n for n in cluster.names if n != victim.name}
    failure = results[victim.name]
    assert isinstance(failure.exception, HostUnreachable)
    assert failure.error.startswith(f"{victim.name}: unreachable: ")
    assert victim.address in failure.error and "\n" not in failure.error
    with pytest.raises(ClusterError) as e:
        check_all(results)
    assert str(e.value).splitlines()[0] == f"1 of {len(targets)} hosts failed; root cause: {failure.error}"


def test_connect_timeout_comes_from_ssh_config_when_not_set(cluster: Cluster, tmp_path: Path) -> None:
    victim = cluster.hosts[-1]
    config = tmp_path / "ssh_config"
    config.write_text(f"Host far\n  HostName {victim.address}\n  ConnectTimeout 1\n  IdentityFile {cluster.key}\n")
    with cluster.partitioned(victim.name):
        with pytest.raises(HostUnreachable) as e:
            open_host(Target("far", user="root"), SshSettings(known_hosts=str(cluster.known_hosts),
                                                              ssh_config=str(config)))
    message = str(e.value)
    assert message.startswith("far: unreachable: ")
    assert "within 1s (connect timeout)" in message or "no route to host" in message


def test_open_connection_to_a_cut_off_host_reports_connection_lost(cluster: Cluster, targets: list[Target]) -> None:
    victim = cluster.hosts[-1]
    with open_host(by_name(targets, victim.name), settings(cluster)) as host:
        assert host.run(["true"]).ok
        with cluster.partitioned(victim.name):
            with pytest.raises(ConnectionLost, match=rf"^{victim.name}: connection lost while writing"):
                host.write(str(victim.workdir / "never"), "x")  # sftp is bounded too
            result = host.run(["true"])
        assert result.connection_lost and result.exit_code is None and not result.ok
        with pytest.raises(ConnectionLost, match=rf"^{victim.name}: connection lost"):
            result.check()


def sshd_session(host: Host) -> int:
    """The pid of the sshd process serving `host`'s connection (`sshd: root@notty`): the parent of the command's
    parent (sshd -> the login shell, replaced by `timeout` -> sh)."""
    pid = int(host.run(["sh", "-c", 'read -r _ _ _ ppid _ < /proc/$PPID/stat; echo "$ppid"'], timeout=10,
                       check=True).stdout)
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sshd"), pid
    return pid


def test_a_stalled_ssh_session_is_reported_within_the_bound(cluster: Cluster, targets: list[Target]) -> None:
    """The sshd process serving our connection is SIGSTOPped: the host still answers TCP (keepalives are ACKed by
    its kernel) but nothing else. A command, the liveness probe and an sftp write each end within their bound,
    saying the host stopped answering."""
    victim = cluster.hosts[-1]
    host = open_host(by_name(targets, victim.name), settings(cluster, dead_after=3))
    session = None
    try:
        session = sshd_session(host)
        os.kill(session, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(HostStalled, match=rf"^{victim.name}: stopped answering: command exec true got no answer"):
            host.run(["true"], timeout=5)
        took = time.monotonic() - started
        assert took < 60, f"run(timeout=5) took {took:.0f} s on a stalled session"  # it hung forever before
        assert not host.alive()
    finally:
        if session is not None:
            with contextlib.suppress(ProcessLookupError):  # its sshd may have ended it with the connection
                os.kill(session, signal.SIGCONT)
        host.close()
    stalled = open_host(by_name(targets, victim.name), settings(cluster, dead_after=3))
    try:
        session = sshd_session(stalled)
        os.kill(session, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(HostStalled, match="stopped answering"):
            stalled.write(str(victim.workdir / "stalled"), "x")
        assert time.monotonic() - started < 60
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(session, signal.SIGCONT)
        stalled.close()


def test_command_in_flight_on_a_crashed_host_is_connection_lost(cluster: Cluster, targets: list[Target]) -> None:
    victim = cluster.hosts[-1]
    outcome: dict[str, object] = {}
    with open_host(by_name(targets, victim.name), settings(cluster)) as host:
        runner = threading.Thread(target=lambda: outcome.update(result=host.run(["sleep", "30"])))
        runner.start()

        def sleeping() -> bool:
            return any(info is not None and info.command == "sleep 30"
                       for info in map(describe, cluster.workload_pids(victim.name)))

        waits.wait_for("the remote sleep to start", sleeping, WAIT)
        with cluster.crashed(victim.name):
            runner.join(WAIT)
            assert not runner.is_alive()
    result = outcome["result"]
    assert result.connection_lost and result.exit_code is None  # type: ignore[attr-defined]
    assert cluster.workload_pids(victim.name) == []


# --- fan-out errors --------------------------------------------------------------------------------------------


def test_cluster_error_lists_every_failed_host_earliest_first(
        cluster: Cluster, targets: list[Target], tmp_path: Path) -> None:
    cut, rekeyed = cluster.hosts[-1], cluster.hosts[-2]
    with cluster.host_key_changed(rekeyed.name), cluster.partitioned(cut.name):
        results = run_on_all(targets, lambda h: None, settings(cluster, connect_timeout=1))
    with pytest.raises(ClusterError) as e:
        check_all(results)
    lines = str(e.value).splitlines()
    assert e.value.root_cause.host == rekeyed.name  # refused at once; the cut-off host only after its timeout
    assert lines[0].startswith(f"2 of {len(targets)} hosts failed; root cause: {rekeyed.name}: host key for")
    assert len(lines) == 2 and lines[1].startswith(f"  {cut.name}: unreachable")  # the root cause said once


def test_one_failure_shared_by_hosts_is_one_line() -> None:
    """One fact, one line: hosts that failed the same way are named together, a host's name is never doubled."""
    from toolkit.launcher.remote import HostResult
    from toolkit.launcher.remote.results import failure_lines

    failures = [HostResult(h, False, error=f"{h}: /ckpt is writable by other users (mode 1777)", finished=t)
                for t, h in enumerate(("a", "b", "c"))]
    failures.append(HostResult("d", False, error="d: unreachable: timed out", finished=9))
    assert failure_lines(failures, 5) == [
        "4 of 5 hosts failed; root cause: a: /ckpt is writable by other users (mode 1777) (also on b, c)",
        "  d: unreachable: timed out"]


def test_fail_fast_skips_hosts_not_yet_started(cluster: Cluster, targets: list[Target], tmp_path: Path) -> None:
    bad = Target(targets[0].name, targets[0].hostname, targets[0].port, targets[0].user, str(tmp_path / "no-key"))
    results = run_on_all([bad, *targets[1:]], lambda h: None, settings(cluster, parallel=1), fail_fast=True)
    assert not results[bad.name].ok and not results[bad.name].skipped
    assert all(r.skipped and r.error == f"{r.host}: not attempted: {bad.name} failed first"
               for r in list(results.values())[1:])
    with pytest.raises(ClusterError) as e:
        check_all(results)
    assert e.value.root_cause.host == bad.name


def test_bad_settings_are_one_line_user_errors(tmp_path: Path) -> None:
    from toolkit.errors import UserError

    with pytest.raises(UserError, match="--parallel 0"):
        SshSettings(parallel=0)
    with pytest.raises(UserError, match="dead_after"):
        SshSettings(dead_after=0)
    with pytest.raises(UserError, match="ssh_config not found"):
        run_on_all([Target("x")], lambda h: None, SshSettings(ssh_config=str(tmp_path / "none")))
    with pytest.raises(UserError, match="listed twice"):
        run_on_all([Target("x"), Target("x")], lambda h: None, SshSettings())


def test_a_host_named_by_its_error_is_not_named_twice() -> None:
    from toolkit.errors import UserError
    from toolkit.launcher.remote import SshSettings, Target, run_on_all

    def refuse(host: Any) -> None:
        raise UserError(f"{host.name}: checkpoint directory /x is writable by other users")

    results = run_on_all([Target("localhost", local=True)], refuse, SshSettings())
    assert results["localhost"].error == "localhost: checkpoint directory /x is writable by other users"
