"""The worker side of the scheduler protocol: `init()` gives a training loop its process group and tells it when
the group must be re-formed.

Why a runtime at all: a worker that dies must cost seconds, not the job. The survivors have to learn at once that
the group they hold is broken (the scheduler pushes a new generation over a connection that the kernel closes
when a process dies), leave it without hanging on a dead or stopped peer, and build a fresh group over a
generation-scoped key prefix of the scheduler's store once the replacement has registered. The loop sees all of
that as one exception, `GenerationChanged`, and one call, `reform()`. The control connection and its thread are
toolkit.train.channel; what each of the scheduler's messages means is decided in toolkit.train.jobview.

    rt = toolkit.train.init()            # registers, heartbeats, returns once every rank is there
    while step < total:
        try:
            with rt.guard():             # a collective broken by a peer's death -> GenerationChanged
                loss = train_step(...)   # collectives on rt.group (the default group: dist.* works)
            rt.report(step, epoch)
        except toolkit.train.GenerationChanged:
            rt.reform()                  # new default process group; roll back to the common checkpoint
    rt.done()                            # or: with toolkit.train.init() as rt: ...

Three modes, chosen from the environment so one script runs everywhere:
- under toolkit (MS_ROLE=MS_WORKER): the scheduler protocol above;
- under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, no MS_ROLE): plain env:// init, no generations
  (torchrun restarts the world itself);
- alone (none of those): a world of one, so `python train.py` just runs.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from toolkit.contracts import envvars, protocol, stepfile
from toolkit.contracts import messages as wire
from toolkit.train import fence as fence_mod
from toolkit.train import progress, stacks
from toolkit.train import store as job_store
from toolkit.train.channel import Channel
from toolkit.train.faults import GenerationChanged, JobStopped, RuntimeConfigError, first_line, looks_collective
from toolkit.train.faults import RegistrationError as RegistrationError  # part of this module's interface
from toolkit.train.fence import Fence
from toolkit.train.lifecycle import Lifecycle, Phase
from toolkit.train.log import say
from toolkit.train.pace import StepPace

DEFAULT_TIMEOUT = 30.0  # s: bound of one collective and of building a process group
CONNECT_TIMEOUT = 10.0  # s: for each of a group's connections once every rank arrived (`_arrive`); gloo tries 5 times
PROGRESS_INTERVAL = 1.0  # s: at most one progress datagram to the agent per interval

MODE_TOOLKIT = "toolkit"
MODE_TORCHRUN = "torchrun"
MODE_SINGLE = "single"


@dataclass(frozen=True)
class WorkerEnv:
    """What the runtime reads from the environment, validated once."""

    mode: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_id: str = "worker_0"
    job: str = "job"
    sched_host: str = "127.0.0.1"
    sched_port: int = envvars.DEFAULT_SCHED_PORT
    store_host: str = "127.0.0.1"
    store_port: int = envvars.DEFAULT_SCHED_PORT + 1
    token: str = field(default="", repr=False)
    heartbeat_interval: float = envvars.DEFAULT_HEARTBEAT_INTERVAL
    node_timeout: float = envvars.DEFAULT_NODE_TIMEOUT
    topo_timeout: float = envvars.DEFAULT_TOPO_TIMEOUT
    agent_socket: str | None = None
    step_file: str | None = None  # TOOLKIT_STEP_FILE: the agent reads the latest step there after a death
    restart_only: bool = False  # TOOLKIT_RECOVERY=restart: recover by relaunching even a toolkit.train script
    pace: bool = True  # TOOLKIT_PACE: time the steps for the scheduler (toolkit.train.pace); "0" turns it off
    verify_every: int | str = "auto"  # TOOLKIT_VERIFY_EVERY: steps between replica checks (toolkit.train.replicas)

    @property
    def word_wait(self) -> float:
        """s to wait for the scheduler's word after a collective failed: a peer's death is announced at once (its
        connection closes, its agent reports the exit), a stopped or cut-off peer's after MS_NODE_TIMEOUT of
        silence; a heartbeat interval or two and a second more for the message to travel on a loaded host."""
        return self.node_timeout + 2 * self.heartbeat_interval + 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "WorkerEnv":
        """Read and validate `env`. The mode follows from it: MS_ROLE=MS_WORKER is toolkit (the token read from
        TOOLKIT_TOKEN_FILE); RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT without MS_ROLE is torchrun; neither
        is a world of one. RuntimeConfigError, naming the variable, for another MS_ROLE, no world size, a rank
        outside it, an unreadable token file, a value that is not a number, a heartbeat interval not shorter than
        MS_NODE_TIMEOUT, or a TOOLKIT_RECOVERY other than auto or restart."""
        role = env.get(envvars.MS_ROLE)
        if role is not None and role != envvars.ROLE_WORKER:
            raise RuntimeConfigError(f"{envvars.MS_ROLE}={role}: a training script runs where "
                                     f"{envvars.MS_ROLE}={envvars.ROLE_WORKER}")
        if role is None:
            if all(env.get(n) for n in (envvars.RANK, envvars.WORLD_SIZE, envvars.MASTER_ADDR, envvars.MASTER_PORT)):
                return cls(mode=MODE_TORCHRUN, rank=_int(env, envvars.RANK, 0),
                           world_size=_int(env, envvars.WORLD_SIZE, 1), local_rank=_int(env, envvars.LOCAL_RANK, 0),
                           node_id=f"rank_{env[envvars.RANK]}")
            return cls(mode=MODE_SINGLE, agent_socket=env.get(envvars.TOOLKIT_AGENT_SOCKET) or None,
                       step_file=env.get(envvars.TOOLKIT_STEP_FILE) or None)
        world = _int(env, envvars.MS_WORKER_NUM, 0) or _int(env, envvars.WORLD_SIZE, 0)
        if world < 1:
            raise RuntimeConfigError(f"{envvars.MS_WORKER_NUM} is not set: give the total number of workers")
        rank_var = envvars.RANK_ID if env.get(envvars.RANK_ID) else envvars.RANK
        rank = _int(env, rank_var, -1)
        if not 0 <= rank < world:
            raise RuntimeConfigError(f"{rank_var}={env.get(rank_var)!r}: need a rank from 0 to {world - 1}")
        token_file = env.get(envvars.TOOLKIT_TOKEN_FILE)
        token = ""
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as e:
                raise RuntimeConfigError(
                    f"{envvars.TOOLKIT_TOKEN_FILE}={token_file}: cannot read the job token ({e.strerror})") from None
        sched_host = env.get(envvars.MS_SCHED_HOST) or "127.0.0.1"
        sched_port = _int(env, envvars.MS_SCHED_PORT, envvars.DEFAULT_SCHED_PORT)
        interval = _float(env, envvars.TOOLKIT_HEARTBEAT_INTERVAL, envvars.DEFAULT_HEARTBEAT_INTERVAL)
        node_timeout = _float(env, envvars.MS_NODE_TIMEOUT, envvars.DEFAULT_NODE_TIMEOUT)
        if not 0 < interval < node_timeout:
            raise RuntimeConfigError(
                f"{envvars.TOOLKIT_HEARTBEAT_INTERVAL}={interval:g} must be positive and shorter than "
                f"{envvars.MS_NODE_TIMEOUT}={node_timeout:g}")
        return cls(
            mode=MODE_TOOLKIT,
            rank=rank,
            world_size=world,
            local_rank=_int(env, envvars.LOCAL_RANK, 0),
            node_id=env.get(envvars.MS_NODE_ID) or protocol.worker_node_id(rank),
            job=env.get(envvars.TOOLKIT_JOB) or "job",
            sched_host=sched_host,
            sched_port=sched_port,
            store_host=env.get(envvars.MASTER_ADDR) or sched_host,
            store_port=_int(env, envvars.MASTER_PORT, sched_port + 1),
            token=token,
            heartbeat_interval=interval,
            node_timeout=node_timeout,
            topo_timeout=_float(env, envvars.MS_TOPO_TIMEOUT, envvars.DEFAULT_TOPO_TIMEOUT),
            agent_socket=env.get(envvars.TOOLKIT_AGENT_SOCKET) or None,
            step_file=env.get(envvars.TOOLKIT_STEP_FILE) or None,
            restart_only=_recovery(env),
            pace=(env.get(envvars.TOOLKIT_PACE) or "1").strip() != "0", verify_every=_verify_every(env),
        )


def _recovery(env: Mapping[str, str]) -> bool:
    value = (env.get(envvars.TOOLKIT_RECOVERY) or "auto").strip().lower()
    if value not in ("auto", protocol.RECOVERY_RESTART):
        raise RuntimeConfigError(f"{envvars.TOOLKIT_RECOVERY}={value!r}: expected auto or {protocol.RECOVERY_RESTART}")
    return value == protocol.RECOVERY_RESTART


def _verify_every(env: Mapping[str, str]) -> int | str:
    value = (env.get(envvars.TOOLKIT_VERIFY_EVERY) or "auto").strip().lower()
    if value == "auto":
        return value
    if not value.isdigit():
        raise RuntimeConfigError(f"{envvars.TOOLKIT_VERIFY_EVERY}={value!r}: expected a number of steps (0: never) "
                                 "or auto")
    return int(value)


_int, _float = envvars.readers(RuntimeConfigError)  # the env contract's readers, raising this process's error


class Runtime:
    """A training process's view of the job: rank, world size, the current process group, and generations; and the
    job's logical ranks (`logical_world`, L) and the ones this process serves (`logical_ranks`), as the scheduler's
    `formed` said at the last re-formation (under torchrun or alone: L = world size, this rank serves its own)."""

    def __init__(self, cfg: WorkerEnv, backend: str, timeout: float) -> None:
        self.cfg = cfg
        self.backend = backend
        self.timeout = timeout
        self.rank = cfg.rank
        self.world_size = cfg.world_size
        self.local_rank = cfg.local_rank
        self.node_id = cfg.node_id
        self.mode = cfg.mode
        self.device = torch.device(f"cuda:{cfg.local_rank}") if backend == "nccl" else torch.device("cpu")
        self.generation: int | None = None  # the generation of the group this process holds
        self.life = Lifecycle()  # where this worker is in its life (toolkit.train.lifecycle); moved on this thread
        self.logical_world, self.assignment, self.logical_ranks = 1, ((0,),), (0,)
        serve(self, self.world_size, one_each(self.world_size))
        self._channel: Channel | None = None
        self._store: Any = None
        self._fence = Fence(timeout=timeout)
        self._progress_sock: socket.socket | None = None
        self._progress_lock = threading.Lock()  # progress comes from the training thread and the checkpoint writer
        self._progress_sent = 0.0
        self._steps = stepfile.Writer.open(cfg.step_file)  # every step, for the agent's restart budget
        self._epoch: int | None = None
        self._closed = False
        self.pace = StepPace()  # this rank's step times, loss and checkpoint stalls (training thread only)

    @property
    def group(self) -> dist.ProcessGroup:
        """The current process group; it is also the default group, so plain `dist.*` calls and DDP use it."""
        return dist.group.WORLD

    @property
    def fence(self) -> Fence:
        """The current group's fence: what abandons it when a new generation begins (`watch`, `call`)."""
        return self._fence

    # -- generations

    def check(self) -> None:
        """Raise GenerationChanged if the job moved to a new generation since this process's group was built."""
        ch = self._channel
        if ch is None:
            return
        view = ch.view  # swapped whole: one read is one consistent view
        if view.stop_reason is not None:
            raise JobStopped(view.stop_reason)
        if view.announced is not None and view.announced != self.generation:
            self.life.abandon(view.announced)
            raise GenerationChanged(self.generation, view.announced)

    @contextlib.contextmanager
    def guard(self, word: Callable[[Exception], GenerationChanged | None] | None = None) -> Iterator["Runtime"]:
        """Run one step: a collective that fails because a peer died (or a stopped peer made it time out)
        surfaces as GenerationChanged, not as gloo's RuntimeError; other errors pass through unchanged.
        `word` decides whether an error is the job moving on (default `changed_by`; the Trainer's own collectives
        pass one that SIGTERM can interrupt): the one guard of the worker's collectives."""
        self.check()
        try:
            yield self
        except (GenerationChanged, JobStopped):
            raise
        except Exception as e:
            changed = (word or self.changed_by)(e)
            if changed is None:
                raise
            raise changed from e
        self.check()

    def changed_by(self, error: BaseException) -> GenerationChanged | None:
        """Whether `error` (raised by a step) is a collective broken by the job moving to a new generation: if it
        looks like one, wait (bounded by the heartbeat rules) for the scheduler's word. Returns the
        GenerationChanged to raise instead, or None if the error is the step's own."""
        ch = self._channel
        if ch is None or not looks_collective(error):
            return None
        # WorkerEnv.word_wait, and the progress watchdog's bound (protocol.stall_bound of this rank's p99 step time,
        # about the job's): a collective that timed out on a stuck peer is this rank's failure only if the watchdog
        # did not name the peer meanwhile
        new = ch.wait_change(self.generation, self.cfg.word_wait + protocol.stall_bound(self.pace.p99()))
        if new is None:
            return None
        self.life.abandon(new)
        return GenerationChanged(self.generation, new)

    def reform(self) -> dist.ProcessGroup:
        """Leave the broken group, wait (bounded by MS_TOPO_TIMEOUT) until every rank of the newest generation has
        registered, and build its group over the generation's own store prefix. Returns the new group."""
        ch = self._channel
        if ch is None:
            if not dist.is_initialized():
                raise RuntimeError("reform() after close(): call toolkit.train.init() again")
            return self.group
        view = ch.view
        if view.announced == self.generation and dist.is_initialized() and view.stop_reason is None:
            return self.group
        if self._closed:
            raise RuntimeError("reform() after close(): call toolkit.train.init() again")
        if self.life.phase is not Phase.JOINING:  # the first group is built while joining
            self.life.abandon(view.announced)
            self.life.move(Phase.REFORMING)
        started = time.monotonic()
        deadline = started + self.cfg.topo_timeout + self.cfg.node_timeout
        while True:
            generation, prefix = ch.wait_formed(self.generation, deadline)
            view = ch.view  # one read: the logical ranks and the shape of the same `formed`
            logical = view.logical
            if logical is None or logical[0] != generation:  # a newer generation formed meanwhile: wait for it
                continue
            self._leave()
            shape = view.shape  # an elastic job's generation may number its ranks anew (issue 42)
            if shape is not None and shape != (self.rank, self.world_size):
                say(self.node_id, f"generation {generation}: rank {shape[0]} of {shape[1]} (was {self.rank} of "
                                  f"{self.world_size})")
                self.rank, self.world_size = shape
            serve(self, logical[1], logical[2])
            try:
                self._build(generation, prefix)
            except Exception as e:  # a peer died while the group was being built: wait for the next generation
                view = ch.view
                moved = view.announced != generation or view.stop_reason is not None
                if not moved and time.monotonic() < deadline:
                    moved = ch.wait_change(generation, self.cfg.node_timeout + self.cfg.heartbeat_interval) \
                        is not None
                if not moved:
                    raise
                say(self.node_id, f"building generation {generation} failed ({first_line(e)}); retrying")
                continue
            previous, self.generation = self.generation, generation
            ch.adopt(generation)
            was = self.life.phase
            self.life.move(Phase.FORMED, generation)
            self.pace.restart()  # a fault and its recovery are no step's time (the watchdog's p99 step time)
            say(self.node_id, f"generation {generation}: process group of {self.world_size} ready in "
                               f"{time.monotonic() - started:.2f} s" + ("" if previous is None else
                                                                       f" (was {previous})") +
                f"; {was.value} -> {Phase.FORMED.value}")
            return self.group

    def _build(self, generation: int, prefix: str) -> None:
        """A build waits for every rank, and a survivor of a fault may first spend up to one collective timeout
        leaving the old group (gloo cannot interrupt a collective, and the survivors can be left waiting on each
        other): a replacement that gave up sooner would die just as they arrive. So the wait for every rank to
        arrive gets room for that (`_arrive`; a new generation cuts it short through the store's connection).

        The connections that follow (gloo's) get at most CONNECT_TIMEOUT each: gloo connects its pairs in turn,
        and a pair waiting for a peer that stopped or died after it published its address is woken by nothing but
        its timeout (it has no socket yet for a fence to shut down). With the build's bound there, a survivor
        whose sender died in that instant waited minutes (CI 2026-11-26); now it gives up within CONNECT_TIMEOUT
        per pair and joins the next generation. Collectives get their own timeout afterwards."""
        build = timedelta(seconds=2 * self.timeout + self.cfg.node_timeout)
        self._fence.arm(generation)
        before = fence_mod.tcp_sockets()
        self._store = job_store.connect(self.cfg.store_host, self.cfg.store_port, self.cfg.token, self.node_id, build)
        self._fence.add_sockets(fence_mod.opened_since(before))  # a new generation during the build cuts it short
        if self._channel is not None:
            self._fence.overtaken(self._channel.view.announced or generation)
        store = dist.PrefixStore(prefix, self._store)
        if self.backend != "nccl":  # NCCL connects at the first collective, which the fence aborts
            _arrive(store, self.world_size, build)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=min(self.timeout, CONNECT_TIMEOUT)))
        self._fence.add_sockets(fence_mod.opened_since(before))
        if self.backend == "nccl":
            self._fence.add_group(dist.group.WORLD)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.timeout))

    def _leave(self) -> None:
        self._fence.disarm()
        leave_group()
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- progress and the end

    def report(self, step: int, epoch: int | None = None, *, loss: Any = None, busy: float | None = None) -> None:
        """Tell the host agent (and the scheduler, in heartbeats) how far training got; cheap to call every step.

        `step` ended now. `loss` (a float or a one-element tensor; None: not reported) is sampled at most once per
        pace.SAMPLE_INTERVAL, since reading a device tensor waits for the device. `busy` is the seconds of the
        step this rank spent on its own work before its last gradient bucket went to the allreduce (the Trainer
        measures it; see toolkit.train.pace). The figures reach the scheduler with the next heartbeat."""
        now = time.monotonic()
        if self._steps is not None:
            self._steps.set(step)
        if self.cfg.pace:
            self.pace.step(step, now, busy)
            if loss is not None and self.pace.wants_loss(now):
                self.pace.sample_loss(loss, now)
        if self._channel is not None:
            self._channel.step = step
        self._epoch = epoch
        if now - self._progress_sent >= PROGRESS_INTERVAL:
            self.publish_pace()
            self._progress(step, epoch, now)

    def fault_history(self) -> tuple[int, float, float | None] | None:
        """The job's faults so far, its age in seconds and its goodput so far (0 to 1; None: not known yet), as the
        scheduler's ledger last said (with the generation it formed), the age aged by the time since; None before
        the scheduler said it."""
        view = self._channel.view if self._channel is not None else None
        if view is None or view.history is None:
            return None
        faults, uptime, told = view.history
        return faults, uptime + (time.monotonic() - told), view.goodput

    def checkpoint_stalled(self, seconds: float, nbytes: int = 0) -> None:
        """The training thread was blocked `seconds` by a checkpoint save of `nbytes` (this rank's part): the
        goodput ledger's checkpoint time, the metrics endpoint's checkpoint bytes."""
        self.pace.checkpoint(seconds, nbytes)

    def publish_pace(self, **extra: Any) -> None:
        """Hand the current pace figures (and `extra` fields such as the checkpoint interval in use) to the
        heartbeat thread. Called on the training thread: the figures are computed here, never by the reader."""
        if self._channel is not None:
            self._channel.beat = {**self._channel.beat, **(self.pace.summary() if self.cfg.pace else {}), **extra}

    def committed(self, step: int) -> None:
        """A checkpoint of `step` is durable on this rank: the scheduler persists the newest step every rank has.
        Safe to call from a checkpoint writer thread."""
        if self._channel is not None:
            self._channel.send(wire.Commit(step))
        self._progress(step, self._epoch, time.monotonic())

    def recovered(self, step: int, source: str, from_rank: int | None, recomputed: int, seconds: float,
                  nbytes: int) -> None:
        """Tell the scheduler this rank trains again in its generation, from the state of `step` taken from
        `source` ("peer", "checkpoint", "initial"), and how many steps it had done that are now done again. The
        lifecycle's receiving ends: formed."""
        self.life.move(Phase.FORMED)
        if self._channel is not None:
            self._channel.send(wire.Recovered(self.generation, step, source, from_rank, recomputed, round(seconds, 4),
                                              nbytes))

    def _progress(self, step: int, epoch: int | None, now: float) -> None:
        path = self.cfg.agent_socket
        self._progress_sent = now
        if not path:
            return
        recovery = self._channel.recovery if self._channel is not None else None
        payload = json.dumps({"node_id": self.node_id, "step": step, "epoch": epoch, "recovery": recovery}).encode()
        with self._progress_lock:
            try:
                if self._progress_sock is None:
                    self._progress_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._progress_sock.setblocking(False)
                self._progress_sock.sendto(payload, path)
            except OSError:
                pass  # the agent may be restarting; progress is advisory

    def done(self) -> None:
        """Training ended cleanly on this rank: the scheduler counts it finished (not dead) and exits 0 once every
        rank is, and the host agent is told this rank said so (a non-zero exit after it is then the job's failure,
        not a crash to restart). The default process group is left in place, as torchrun leaves it: the script's
        usual ending, `dist.destroy_process_group()`, destroys it (and `dist.get_rank()` still answers until then);
        one the script leaves is destroyed at exit (atexit, before the interpreter's teardown, where gloo's threads
        would otherwise abort the process: `terminate called without an active exception`)."""
        if self._closed:
            return
        atexit.register(_destroy_left_group)
        self.life.move(Phase.FINISHED)
        said = False
        if self._channel is not None:
            said = self._channel.done()
        if said:
            notify_agent(self.cfg, {"node_id": self.node_id, "done": True})
        self.close(keep_group=True)

    def close(self, *, keep_group: bool = False) -> None:
        """Release everything without claiming success (the scheduler sees this rank's exit as a death): the channel,
        the progress socket and the process group, unless `keep_group` (`done`'s: its fence is disarmed, nothing is
        abandoned after the end)."""
        if self._closed:
            return
        self._closed = True
        if self.life.phase is not Phase.FINISHED:  # done() said finished, and ends here
            self.life.move(Phase.STOPPED)
        if self._channel is not None:
            self._channel.close()
        if keep_group:
            self._fence.disarm()
        else:
            self._leave()
        if self._progress_sock is not None:
            self._progress_sock.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.done()
        else:
            self.close()


def one_each(world_size: int) -> tuple[tuple[int, ...], ...]:
    """One logical rank per rank, rank r serving r: under torchrun, alone, and before the first `formed`."""
    return tuple((r,) for r in range(world_size))


def serve(rt: Runtime, logical_world: int, assignment: tuple[tuple[int, ...], ...]) -> None:
    """`rt` serves, from now on, its part of `assignment` (the ascending logical ranks each rank of the current group
    serves, index = rank; toolkit.contracts.logical) of the job's `logical_world` (L) logical ranks. A function, not
    a method: Runtime's interface stays small."""
    rt.logical_world, rt.assignment, rt.logical_ranks = logical_world, assignment, assignment[rt.rank]


class RuntimeReporter:
    """report() for a script on toolkit.train.init() that does not use the Trainer (which reports on its own)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def report(self, step: int, loss: Any, checkpoint: bool, total: int | None = None) -> None:
        """See `progress.report`: Runtime.report, and Runtime.committed for a checkpoint."""
        if total is not None:
            self.rt.pace.total = total
        self.rt.report(step, loss=loss)
        if checkpoint:
            self.rt.committed(step)

    def long_phase(self, what: str) -> contextlib.AbstractContextManager[None]:
        """See `progress.long_phase`: the heartbeats say `long` while in it."""
        return stacks.long_phase(self.rt._channel, what)


def report_corruption(rt: Runtime, step: int, since: int | None, ranks: Sequence[int], hosts: Sequence[str],
                      action: str) -> None:
    """Tell the scheduler that the replica check found `ranks` (on `hosts`) corrupt at `step`, the last good check
    at `since`, and did `action` (toolkit.train.replicas; messages.Corruption), for its ledger and its fencing of
    hosts; nothing outside toolkit. A function, not a method: Runtime's interface stays small."""
    if rt._channel is not None:
        rt._channel.send(wire.Corruption(rt.generation, step, since, tuple(ranks), tuple(hosts), action))


def await_word(rt: Runtime, bound: float) -> str | None:
    """Wait up to `bound` s for the scheduler to act on this process after its rank was fenced (toolkit.train.replicas):
    a `fenced` ends it on the channel's thread (its host's ranks go to a spare); a `stop` returns the reason the job
    stopped. None when no word came in time, or outside toolkit. New generations meanwhile are waited through."""
    ch = rt._channel
    if ch is None:
        return None
    deadline = time.monotonic() + bound
    current = rt.generation
    while (left := deadline - time.monotonic()) > 0:
        try:
            current = ch.wait_change(current, left)
        except JobStopped as e:
            return str(e)
        if current is None:
            return None
    return None


def _arrive(store: Any, world: int, timeout: timedelta) -> None:
    """Return once every one of the `world` ranks building this group has called this on `store` (the generation's
    prefix), waiting up to `timeout` (the store raises past it). Two operations per rank: one `add`, and one wait
    on a key the last to arrive sets."""
    if int(store.add(protocol.ARRIVED, 1)) >= world:
        store.set(protocol.ALL_ARRIVED, "1")
    store.wait([protocol.ALL_ARRIVED], timeout)


def _destroy_left_group() -> None:
    """At exit after a clean end (Runtime.done): the default group the script did not destroy itself."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def leave_group() -> None:
    """Destroy the default process group, or, if building it failed, undo what the failed build left behind."""
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        # A failed init_process_group leaves torch's group counter advanced, and that counter names the group's
        # keys in the store: a fresh peer counts from 0, so this process must too.
        dist.distributed_c10d._world.group_count = 0


def notify_agent(cfg: WorkerEnv, message: dict[str, Any]) -> None:
    """One progress datagram to the host agent (TOOLKIT_AGENT_SOCKET), best effort: the agent may be restarting."""
    if not cfg.agent_socket:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(json.dumps(message).encode(), cfg.agent_socket)
    except OSError:
        pass


def init(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT,
         env: Mapping[str, str] | None = None) -> Runtime:
    """Join the job described by the environment and return its Runtime, with the default process group built.

    `backend`: "gloo" or "nccl" (default: nccl when CUDA is available, else gloo). `timeout`: seconds one
    collective may block before it fails (a stopped peer is otherwise waited on forever); building a group may
    take twice that plus MS_NODE_TIMEOUT. Under toolkit this blocks until every worker has registered (at most
    MS_TOPO_TIMEOUT).
    """
    env = os.environ if env is None else env
    cfg = WorkerEnv.from_env(env)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and cfg.mode != MODE_SINGLE else "gloo"
    if timeout <= 0:
        raise RuntimeConfigError(f"timeout={timeout}: give a positive number of seconds")
    if dist.is_initialized():
        raise RuntimeConfigError("a default process group already exists: call toolkit.train.init() instead of "
                                 "dist.init_process_group(), not both")
    rt = Runtime(cfg, backend, timeout)
    if backend == "nccl":
        torch.cuda.set_device(rt.device)
    if cfg.mode == MODE_SINGLE:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout))
        rt.generation = 0
        rt.life.move(Phase.FORMED, 0)
        return rt
    if cfg.mode == MODE_TORCHRUN:
        rt._fence.arm(0)  # what the Trainer abandons when torchrun's SIGTERM comes and a peer is gone
        before = fence_mod.tcp_sockets()
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout), **_torchrun_round(env, timeout))
        rt._fence.add_sockets(fence_mod.opened_since(before))
        if backend == "nccl":
            rt._fence.add_group(dist.group.WORLD)
        rt.rank, rt.world_size = dist.get_rank(), dist.get_world_size()
        serve(rt, rt.world_size, one_each(rt.world_size))
        rt.generation = 0
        rt.life.move(Phase.FORMED, 0)
        return rt
    channel = Channel(cfg, exit_on_new_generation=cfg.restart_only, fence=rt._fence)
    deadline = time.monotonic() + cfg.topo_timeout
    channel.join(deadline)
    channel.start()
    rt._channel = channel
    try:
        rt.reform()
    except BaseException:
        rt.close()
        raise
    progress.install(RuntimeReporter(rt))  # toolkit.train.report() reaches this runtime
    return rt


def _torchrun_round(env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """Under torchrun on one node: this restart round's own keys in the agent's store.

    Why: torchrun's agent keeps one store for every round and env:// reads the peers' addresses under the same
    keys each round, so a restarted worker can read a dead incarnation's address and fail to connect, round after
    round, until max_restarts is spent (the stale-key hang in REFERENCE.md). On one node every worker of a round
    has the same TORCHELASTIC_RESTART_COUNT, so it names the round. Across nodes the counts can differ (a node
    that joins later starts at 0): there env:// is left as it is."""
    restart = env.get(envvars.TORCHELASTIC_RESTART_COUNT)
    if (restart is None or env.get(envvars.TORCHELASTIC_USE_AGENT_STORE, "").lower() != "true"
            or env.get(envvars.LOCAL_WORLD_SIZE) != env.get(envvars.WORLD_SIZE)):
        return {}
    store = dist.TCPStore(env[envvars.MASTER_ADDR], int(env[envvars.MASTER_PORT]), None, is_master=False,
                          timeout=timedelta(seconds=timeout), use_libuv=True)
    return {"store": dist.PrefixStore(f"toolkit/restart_{restart}/", store), "rank": int(env[envvars.RANK]),
            "world_size": int(env[envvars.WORLD_SIZE])}
