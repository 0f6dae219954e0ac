"""The first cause of an exit (toolkit.agent.causes): the script's own word (its error file, torch's `@record`
format) before a signal from outside, before the fencing that killed it; and an error file is hostile input."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from toolkit.agent import causes
from toolkit.contracts import protocol as P
from toolkit.procs import ExitStatus

EXIT1, SEGV, KILL = ExitStatus(1, None), ExitStatus(None, signal.SIGSEGV), ExitStatus(None, signal.SIGKILL)


def test_the_scripts_own_word_comes_first_then_the_signal_then_fencing() -> None:
    boom = "RuntimeError: boom at step 5"
    assert causes.first_cause(EXIT1, boom, None) == f"{boom} (exit code 1)"
    assert causes.first_cause(KILL, boom, "heartbeat silence") == f"{boom} (killed by SIGKILL)"  # raised, then fenced
    assert causes.first_cause(SEGV, None, None) is None  # the signal says it: "killed by SIGSEGV"
    assert causes.first_cause(ExitStatus(3, None), None, None) is None  # "exit code 3"
    assert causes.first_cause(KILL, None, "heartbeat silence") == \
        "heartbeat silence: fenced by the scheduler (killed by SIGKILL)"
    assert causes.first_cause(EXIT1, None, "heartbeat silence") is None  # it exited on its own before the kill
    for ok in (ExitStatus(0, None), ExitStatus(P.EXIT_FENCED, None), ExitStatus(P.EXIT_REJOIN, None)):
        assert causes.first_cause(ok, boom, "x") is None  # no failure: no cause
    assert causes.describe(KILL, None) == "killed by SIGKILL" and causes.describe(EXIT1, "x (exit code 1)") == \
        "x (exit code 1)"


def test_the_operators_stop_or_restart_is_the_cause_of_the_exit_it_brought_about() -> None:
    term = ExitStatus(None, signal.SIGTERM)
    assert causes.operator_cause(ExitStatus(143, None), "stopped by fleet stop") == \
        "stopped by fleet stop (exit code 143)"
    assert causes.operator_cause(term, causes.RESTARTED_BY_OPERATOR) == \
        "restarted by fleet restart --node (killed by SIGTERM)"
    assert causes.operator_cause(ExitStatus(0, None), "stopped by fleet stop") is None  # a clean exit needs none
    assert causes.operator_cause(term, None) is None


def test_torchs_error_file_is_read_and_a_hostile_one_is_not(tmp_path: Path, monkeypatch) -> None:
    path = causes.error_file(tmp_path, "worker_3", 2)
    assert path == tmp_path / "worker_3.2.json" and causes.read_error_file(path) is None  # none written
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("bad shape (4, 2)\nsecond line")
    except ValueError as e:
        ErrorHandler().record_exception(e)  # what @record writes
    assert causes.read_error_file(path) == "ValueError: bad shape (4, 2)"
    path.write_text(json.dumps({"message": "the old format: a plain string", "timestamp": 1}))
    assert causes.read_error_file(path) == "the old format: a plain string"
    path.write_text(json.dumps({"message": {"message": "x" * 5000 + "\x1b[31m"}}))
    assert len(causes.read_error_file(path) or "") == P.MAX_CAUSE
    for junk in ("not json", "[1, 2]", '{"message": 3}', '{"message": {"message": ""}}', "[" * 100000):
        path.write_text(junk)
        assert causes.read_error_file(path) is None, junk
    target = tmp_path / "secret.json"
    target.write_text(json.dumps({"message": "someone else's file"}))
    path.unlink()
    path.symlink_to(target)  # a link is not followed
    assert causes.read_error_file(path) is None
    path.unlink()
    os.mkfifo(path)  # nor is a fifo read (it would block)
    assert causes.read_error_file(path) is None
