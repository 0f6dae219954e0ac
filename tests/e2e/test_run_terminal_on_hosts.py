"""`fleet run` in a terminal on 3 namespace hosts (6 ranks of the sample trainer, over SSH): the ranks chosen with
--ranks print their output in the terminal, `[rank3]: ...`, from remote hosts, and no other rank's; Ctrl-C stops
the job on every host with last words (each rank saves the step it stopped at), leaving no process."""

from __future__ import annotations

import re

from fault_harness import E2E, FLEET

from toolkit.testing.terminal import Terminal

BOUND = 240.0  # s to start 6 torch workers on 3 hosts of a loaded 2-core machine, or to stop them
EXIT_STOPPED = 130


def test_run_streams_the_chosen_ranks_and_ctrl_c_stops_every_host(e2e: E2E) -> None:
    job = e2e.job("terminal")
    argv = [FLEET, "run", *job.args(), "--no-check", "--ranks", "0,3", "train.py", "--epochs", "50",
            "--batch-size", "16", "--ckpt-interval", "100000", "--step-delay", "0.1"]
    with Terminal(argv, cwd=e2e.project) as term:
        term.wait_for_text("[rank3]: epoch: 0, step: 2,", BOUND)
        term.wait_for_text("[rank0]: epoch: 0, step: 2,", BOUND)
        term.ctrl_c()
        code = term.wait(BOUND)
        out = term.output
    assert code == EXIT_STOPPED and "Traceback" not in out, f"exit {code}\n{out}"
    shown = set(re.findall(r"^\[rank(\d+)\]: ", out.replace("\r", ""), re.M))
    assert shown == {"0", "3"}, shown
    assert job.host_of("worker_3") != job.host_of("worker_0")  # rank 3's lines came from another host
    assert "job terminal stopped (Ctrl-C)" in out, out
    job.wait_no_leftovers()
    for rank in (0, 3):
        assert re.search(r"stopped by SIGTERM at step \d+, checkpoint saved", job.log(f"worker_{rank}")), \
            job.log(f"worker_{rank}")[-2000:]
