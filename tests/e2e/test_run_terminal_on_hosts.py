"""`fleet run` in a terminal on 3 namespace hosts (6 ranks of the sample trainer, over SSH): the ranks chosen with
--ranks print their output in the terminal, `[rank3]: ...`, from remote hosts, and no other rank's; Ctrl-C stops
the job on every host with last words (each rank saves the step it stopped at), leaving no process. Then `fleet run
train.py` with no host or port flag runs the recorded job again (its hosts, 6 ranks, its port) from those words."""

from __future__ import annotations

import re
import subprocess

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

    # the recorded job is the default: no host, size or port typed (the project's config names its inventory, the
    # record wins), and it resumes from the last words
    r = subprocess.run([FLEET, "run", "--job", job.name, "--no-check", "--quiet", "train.py", "--epochs", "1",
                        "--batch-size", "16", "--ckpt-interval", "100000"], cwd=e2e.project, capture_output=True,
                       text=True, timeout=BOUND)
    assert r.returncode == 0 and f"job {job.name} succeeded" in r.stderr and "[rank" not in r.stdout, r.stderr
    assert f"scheduler on {job.host_of('worker_0')}:{job.port}" in r.stderr, r.stderr
    assert re.search(r"^rank 3: resumed from step [1-9]", job.log("worker_3"), re.M), job.log("worker_3")[-2000:]
    job.wait_no_leftovers()
