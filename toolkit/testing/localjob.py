"""The sample trainer (examples/train.py) as a local job, planned and rendered as `fleet deploy` does it and run by
the real host agent (`python -m toolkit.agent run`) started directly: for the tests and benchmarks that watch the
agent's files and pids without the fleet command around it."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

from toolkit.contracts.agentdoc import AgentDoc, BadDocument
from toolkit.freeports import free_port_pair
from toolkit.launcher.inventory import local_inventory
from toolkit.launcher.plan import JobOptions, make_plan
from toolkit.launcher.render import render_host, write_files

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"  # in a source checkout (the editable install)
ENV_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CKPT_DIR",
            "DATA_PATH")
STOP_WAIT = 30.0  # s for the agent to stop its children after SIGTERM (its grace period and some)
KILL_WAIT = 10.0  # s for its session to go after SIGKILL
STEP_LINE = re.compile(r"^epoch: (\d+), step: (\d+), loss is", re.M)


def clean_env() -> dict[str, str]:
    """This process's environment without any job's variables: a test may itself run under torchrun or fleet."""
    return {k: v for k, v in os.environ.items()
            if k not in ENV_DROP and not k.startswith(("MS_", "TOOLKIT_", "TORCHELASTIC_"))}


class JobDirFiles:
    """What a test reads of a local job's directory `dir` (set or computed by the subclass): agent.json and its
    processes, the logs, and the evidence a failed assertion prints. `dir_known` False: the test does not know the
    job directory (evidence says so)."""

    dir: Path
    dir_known = True

    def agent_doc(self) -> AgentDoc | None:
        """The agent's state/agent.json as it is now (toolkit.contracts.agentdoc); None before the agent first writes
        it."""
        try:
            return AgentDoc.parse((self.dir / "state" / "agent.json").read_bytes())
        except (OSError, BadDocument):
            return None  # not written yet (every write is a rename, so never half)

    def doc(self) -> dict[str, Any]:
        """agent.json as it is now, as JSON has it; {} before the agent first writes it."""
        doc = self.agent_doc()
        return doc.to_dict() if doc else {}

    def procs(self) -> dict[str, dict[str, Any]]:
        """agent.json's processes by node id ({} before it is written)."""
        return {p["node_id"]: p for p in self.doc().get("processes", [])}

    def log(self, name: str) -> str:
        """The text of logs/`name` (e.g. worker_0.log); "" while it does not exist."""
        try:
            return (self.dir / "logs" / name).read_text(errors="replace")
        except OSError:
            return ""

    def evidence(self) -> str:
        """What a failed assertion prints: the agent's state and the last 15 lines of every log."""
        if not self.dir_known:
            return "(no --workdir: the job's files are not known to this test)"
        doc = self.doc()
        parts = [f"--- agent.json state: {doc.get('state')} {doc.get('reason') or ''}"]
        for path in sorted((self.dir / "logs").glob("*.log")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)


class LocalJob(JobDirFiles):
    """A local job of `workers` workers running `script` (default: the sample trainer) from `project` with `args`,
    its files rendered under `root`/`job` at construction; `start` runs its agent. `options` are JobOptions fields
    (node_timeout, grace, warm_spare, ckpt_dir, ...); the rest are fleet's defaults. `token`: the job's token (the
    same job again: its checkpoints are authenticated with a key from it); default a new one, as deploy makes for a
    new job. Call `cleanup` when done."""

    def __init__(self, root: Path, workers: int, args: list[str], job: str = "local", project: Path = EXAMPLES,
                 script: str = "train.py", token: str | None = None, **options: Any) -> None:
        self.workers = workers
        job_options = JobOptions(job=job, script=script, script_args=" ".join(args), master_port=free_port_pair(),
                                 workdir=str(root), python=sys.executable, **options)
        plan = make_plan(local_inventory(workers), job_options, str(project))
        (host,) = plan.hosts
        self.dir = Path(host.job_dir)
        self.token = token or secrets.token_hex(16)
        write_files(render_host(plan, host, self.token), self.dir)
        self.agent: subprocess.Popen | None = None

    def number_hosts(self, per_host: int) -> None:
        """Number the workers as hosts of `per_host` ranks each (LOCAL_RANK, LOCAL_WORLD_SIZE as fleet sets them on
        several hosts), in the env files the agent starts each incarnation from: for what depends on the ranks per
        host (the shard mirror's ring on the next host) on this one machine. Before `start`."""
        for rank in range(self.workers):
            path = self.dir / "env" / f"worker_{rank}.env"
            text = re.sub(r"^export LOCAL_RANK=.*$", f"export LOCAL_RANK={rank % per_host}", path.read_text(),
                          flags=re.M)
            path.write_text(re.sub(r"^export LOCAL_WORLD_SIZE=.*$", f"export LOCAL_WORLD_SIZE={per_host}", text,
                                   flags=re.M))

    def start(self, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start the job's agent in a session of its own (output to agent.out in the job dir) and return it; `env`
        defaults to `clean_env()`."""
        with open(self.dir / "agent.out", "wb") as out:
            self.agent = subprocess.Popen([sys.executable, "-m", "toolkit.agent", "run", "--job-dir", str(self.dir)],
                                          env=clean_env() if env is None else dict(env), stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=out, start_new_session=True)
        return self.agent

    def ended(self) -> str | None:
        """Why nothing more will come of the job (its agent exited, with what), or None while it runs."""
        if self.agent is None or self.agent.poll() is None:
            return None
        return f"the job ended (its agent exited with {self.agent.returncode})"

    def last_step(self, rank: int) -> int:
        """The newest step rank `rank` printed (the sample trainer's `epoch: E, step: S, loss is` lines); 0 if none."""
        steps = STEP_LINE.findall(self.log(f"worker_{rank}.log"))
        return int(steps[-1][1]) if steps else 0

    def finish(self, timeout: float) -> int:
        """Wait up to `timeout` s for the agent (started by `start`) to end the job; its exit code (0 succeeded,
        1 failed, 2 bad input, 3 stopped). AssertionError with the evidence if it does not end in time."""
        assert self.agent is not None
        try:
            return self.agent.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not end the job within {timeout} s\n{self.evidence()}") from None

    def cleanup(self) -> None:
        """SIGTERM the agent we started (it stops its children), bounded; then SIGKILL its own session."""
        if self.agent is None or self.agent.poll() is not None:
            return
        self.agent.send_signal(signal.SIGTERM)
        try:
            self.agent.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            os.killpg(self.agent.pid, signal.SIGKILL)
            self.agent.wait(KILL_WAIT)


TORCHRUN = str(Path(sys.executable).parent / "torchrun")
FINAL_LINE = re.compile(r"^final parameters: (\S+) sha256 ([0-9a-f]{64})$", re.M)


class TorchrunRun:
    """The sample trainer under the real torchrun (`world` processes on this machine, `args` to the script), with
    its checkpoints and logs under `root`: the reference a fault-tolerant run must end bitwise equal to. It starts
    at construction, so that a test may run its own job meanwhile; `logs` waits for its end."""

    def __init__(self, root: Path, world: int, args: list[str]) -> None:
        self.root, self.world = root, world
        argv = [TORCHRUN, "--nproc-per-node", str(world), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{free_port_pair()}", "--log-dir", str(root / "logs"), "--redirects", "3",
                str(EXAMPLES / "train.py"), *args]
        self.proc = subprocess.Popen(argv, cwd=root, env={**clean_env(), "CKPT_DIR": str(root / "ckpt"),
                                                          "OMP_NUM_THREADS": "1"},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.ranks: dict[int, str] | None = None

    def logs(self, timeout: float) -> dict[int, str]:
        """Rank -> its output, once torchrun ended with 0 (within `timeout` s of this call, else it is killed);
        AssertionError with torchrun's output otherwise."""
        if self.ranks is None:
            try:
                out, _ = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                out, _ = self.proc.communicate()
                raise AssertionError(f"the reference run did not finish in {timeout} s:\n{out[-3000:]}") from None
            assert self.proc.returncode == 0, out[-3000:]
            ranks = {int(p.parent.name): p.read_text() for p in (self.root / "logs").glob("*/attempt_0/*/stdout.log")}
            assert sorted(ranks) == list(range(self.world)), out[-3000:]
            self.ranks = ranks
        return self.ranks

    def final(self, timeout: float) -> tuple[Path, str]:
        """The final parameters rank 0 saved: their file and sha256."""
        (m,) = FINAL_LINE.finditer(self.logs(timeout)[0])
        return Path(m.group(1)), m.group(2)

    def stop(self) -> None:
        """Kill its session if it still runs (a test that failed before waiting for it)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


FLEET = str(Path(sys.executable).parent / "fleet")


class FleetRun(JobDirFiles):
    """A local job as a user runs it: `fleet deploy train --join` in the background, from `cwd`, on a copy of
    a project; the agent's files are read straight from the job directory (a status per look would steal CPU)."""

    def __init__(self, cwd: Path, job: str, flags: list[str]) -> None:
        self.cwd, self.job = cwd, job
        self.flags = ["--job", job, "--master-port", str(free_port_pair()), *flags]
        self.workdir = Path(flags[flags.index("--workdir") + 1]) if "--workdir" in flags else None
        self.runner: subprocess.Popen[str] | None = None
        self.output: str | None = None

    @property
    def dir(self) -> Path:
        """The job directory, `<--workdir>/<job>`: what doc, procs, log and evidence read. AssertionError unless the
        flags give --workdir."""
        assert self.workdir is not None, "give --workdir"
        return self.workdir / self.job

    @property
    def dir_known(self) -> bool:
        """Whether the flags give --workdir (else the job's files are not known to the test)."""
        return self.workdir is not None

    def start(self, *tasks: str) -> None:
        """Run `fleet TASKS --join` (default: deploy train) in the background, in a session of its own."""
        self.output = None
        self.runner = subprocess.Popen([FLEET, *(tasks or ("deploy", "train")), "--join", *self.flags], cwd=self.cwd,
                                       env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True)

    def join(self, timeout: float) -> tuple[int, str]:
        """(exit code, output) of the fleet command, waiting up to `timeout` s; past it the command is killed and
        AssertionError carries its output and the evidence. A second call returns the same result."""
        assert self.runner is not None
        if self.output is None:
            try:
                self.output, _ = self.runner.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.runner.pid, signal.SIGKILL)
                self.output, _ = self.runner.communicate()
                raise AssertionError(f"the job did not end within {timeout} s\n{self.output}\n{self.evidence()}") \
                    from None
        return self.runner.returncode, self.output

    def ended(self) -> str | None:
        """Why nothing more will come of the job (the fleet command exited: its output), or None while it runs."""
        if self.runner is None or self.runner.poll() is None:
            return None
        return f"the job ended:\n{self.join(1)[1]}"

    def stop(self) -> None:
        """Whatever happened: nothing of the job left running (`fleet stop`, bounded). The agents run detached from
        the `fleet` runner, so they are stopped even when the runner has ended (or was killed by `join`)."""
        if self.runner is None:
            return
        subprocess.run([FLEET, "stop", "--job", self.job], cwd=self.cwd, env=clean_env(), capture_output=True,
                       timeout=STOP_WAIT + 30)
        if self.runner.poll() is None:
            os.killpg(self.runner.pid, signal.SIGKILL)
            self.runner.wait(KILL_WAIT)
