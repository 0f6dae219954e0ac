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
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a terminal's colour and cursor codes, not columns
NARROW = 80  # columns of the terminal `fleet status` is shown in (the compact layout is below 100)


def test_run_streams_the_chosen_ranks_and_ctrl_c_stops_every_host(e2e: E2E) -> None:
    job = e2e.job("terminal")
    argv = [FLEET, "run", *job.args(), "--no-check", "--ranks", "0,3", "train.py", "--epochs", "50",
            "--batch-size", "16", "--ckpt-interval", "100000", "--step-delay", "0.1"]
    with Terminal(argv, cwd=e2e.project) as term:
        term.wait_for_text("[rank3]: epoch: 0, step: 2,", BOUND)
        term.wait_for_text("[rank0]: epoch: 0, step: 2,", BOUND)
        with Terminal([FLEET, "status", "--job", job.name], cwd=e2e.project, columns=NARROW) as status:
            shown = status.wait(BOUND), ANSI.sub("", status.output).replace("\r", "")
        term.ctrl_c()
        code = term.wait(BOUND)
        out = term.output
    assert code == EXIT_STOPPED and "Traceback" not in out, f"exit {code}\n{out}"
    # `fleet status` of the running 6-rank job in an 80-column terminal: the compact table, every worker's row
    # with its host and state in full, no line of the table wider than the terminal, nothing cut to `loc…` (the
    # notes under it are prose, wrapped by the terminal)
    assert shown[0] == 0, shown[1]
    lines = shown[1].splitlines()
    rows = [i for i, line in enumerate(lines) if re.search(r"\bworker_\d\b", line)]
    assert len(rows) == 6 and all("running" in lines[i] for i in rows), shown[1]
    table = lines[:rows[-1] + 1]
    assert max(map(len, table)) <= NARROW and "…" not in "".join(table), shown[1]
    assert {h for h in e2e.hosts if any(line.startswith(f"{h} ") for line in table)} == set(e2e.hosts), shown[1]
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



def test_a_fault_every_host_shares_is_said_once_naming_the_hosts(e2e: E2E) -> None:
    """One fact, one line (issue 43 item 8): a checkpoint directory no host can make (under a file) is refused by
    each of the 3 hosts alike; the CLI says it once, naming the 3 hosts, with no host's name doubled, and
    starts nothing."""
    job = e2e.job("one-fact")
    r = subprocess.run([FLEET, "run", *job.args(), "--no-check", "--quiet", "--ckpt-dir", "/etc/hostname/ckpt",
                        "train.py", "--epochs", "1"], cwd=e2e.project, capture_output=True, text=True,
                       timeout=BOUND)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out
    fact = "checkpoint directory /etc/hostname/ckpt/one-fact cannot be made"
    said = [line for line in out.splitlines() if fact in line]
    assert len(said) == 1, out  # the fault took effect on every host, and it is one line
    assert all(re.search(rf"\b{h}\b", said[0]) for h in e2e.hosts), said[0]
    assert not any(re.search(rf"\b{h}: {h}:", out) for h in e2e.hosts), out
    job.wait_no_leftovers()
