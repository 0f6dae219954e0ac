"""What a worker knows of its job, and how each word of the scheduler changes it. Pure: no torch, no socket, no
clock; the time comes in as a value.

The worker's control connection (toolkit.train.channel) reads the scheduler's messages on a background thread while
the training thread works. Each message goes through `on_message`, which returns the new `JobView` and the effects
to apply, in order: trip the group's fence (`TripFence`), write a line to the worker's log (`Say`), end the process
(`ExitProcess`). The channel swaps the view in under its lock, wakes the training thread, then applies the effects,
as the scheduler's server applies its membership's actions. The decisions of the thread's loop are here too: what a
refused reconnect means (`on_refused`) and when to send the next heartbeat (`next_wake`); and the two questions the
training thread's waits ask of a view (`formed_for`, `changed_from`).

Two orders matter and are kept by the effects' order:
- `fenced`: the process ends before any state changes (the view is returned unchanged), so the training thread never
  wakes into a generation this incarnation no longer belongs to and writes nothing into it.
- restart recovery (`restart_only`, a torchrun-style script): on a newer generation the view changes and the waiters
  wake first, then the fence trips, then the process exits EXIT_REJOIN for its agent to relaunch it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

from toolkit.contracts import messages as wire
from toolkit.contracts import protocol
from toolkit.contracts.logical import parse_formed

DONE_WAIT = 5.0  # s to hear the scheduler acknowledge `done` (by closing) before exiting anyway
MAX_REASON = 2000  # characters of a `stop` reason kept
MAX_FENCED_REASON = 1000  # characters of a `fenced` or refusal reason logged


@dataclass(frozen=True)
class JobView:
    """The scheduler's word as this worker last heard it, and the generation of the group it holds."""

    announced: int | None = None  # newest generation the scheduler told us about
    formed: tuple[int, str] | None = None  # (generation, store prefix) of the newest formed generation
    stop_reason: str | None = None  # the scheduler ended the job (or refused this worker back), and why
    held: int | None = None  # generation of the group this process holds (sent when rejoining)
    history: tuple[int, float, float] | None = None  # (faults, job uptime s, monotonic time told): the ledger's
    restart_only: bool = False  # restart recovery: a newer generation ends the process (EXIT_REJOIN)
    goodput: float | None = None  # the job's goodput so far (0 to 1) as the scheduler said at the last formation
    # (rank, world size) of this process in the newest formed generation, when the scheduler said (an elastic job
    # shrinks and grows: issue 42); None: the rank and world size it started with
    shape: tuple[int, int] | None = None
    world_size: int = 1  # ranks of a generation (the worker's MS_WORKER_NUM): what `formed`'s assignment must cover
    # (generation, L, the logical ranks each rank serves) of the newest `formed` (toolkit.contracts.logical)
    logical: tuple[int, int, tuple[tuple[int, ...], ...]] | None = None


@dataclass(frozen=True)
class ExitProcess:
    """End the process at once with `code`, after writing `why` to the worker's log (one effect: nothing comes
    between the line and the exit)."""

    code: int
    why: str


@dataclass(frozen=True)
class TripFence:
    """Generation `generation` was announced: abandon the group if it belongs to an older one (the fence decides,
    and the channel logs what it cut)."""

    generation: int


@dataclass(frozen=True)
class Say:
    """One line to the worker's log."""

    text: str


Effect = Union[ExitProcess, TripFence, Say]


@dataclass(frozen=True)
class Retry:
    """A refused reconnect that may succeed later (our predecessor's connection is not yet found dead)."""


@dataclass(frozen=True)
class Stop:
    """A refused reconnect that is final: the job is over for this worker, for `reason`."""

    reason: str


class Wake(NamedTuple):
    """The control loop's next step: send a heartbeat now or not, when the next one is due, and until when to wait
    for the scheduler's next message before looking again (a time, not a span: a heartbeat's send may block)."""

    beat: bool
    next_beat: float
    wait_until: float


def fenced(reason: Any) -> ExitProcess:
    """The scheduler declared this incarnation dead (`reason`: its word): exit EXIT_FENCED, relaunched like any
    death."""
    code = protocol.EXIT_FENCED
    return ExitProcess(code, f"fenced by the scheduler: {str(reason)[:MAX_FENCED_REASON]}; exiting with code {code}")


def on_message(view: JobView, msg: wire.Message, now: float) -> tuple[JobView, list[Effect]]:
    """One message of the (authenticated) scheduler, read at monotonic time `now` (wire.decode has checked it: a
    welcome, generation or formed without a generation >= 0, a formed without a store prefix or with a rank outside
    its world size never gets here): the new view and the effects to apply in order. TripFence comes whenever the
    announced generation is newer than the one held (or none is held yet): the fence, armed for the generation
    being built or held, makes the last call. `fenced` returns `view` itself and one ExitProcess. A welcome without
    a generation raises ProtocolError and changes nothing (a worker's welcome has one): the channel drops the
    connection like any broken one and reconnects. A `formed` whose assignment of logical ranks is wrong
    (authenticated, so a bug or a version skew, not noise) changes nothing and ends the process (EXIT_FATAL) with
    one line. A message this worker does not act on changes nothing."""
    if isinstance(msg, wire.Fenced):
        return view, [fenced(msg.reason)]
    if isinstance(msg, wire.Welcome) and msg.generation is None:
        raise protocol.ProtocolError("welcome without a generation")
    if isinstance(msg, wire.Formed):
        shape = msg.shape  # an elastic job's generation has its own size
        try:
            logical = _logical(msg, shape[1] if shape is not None else view.world_size)
        except ValueError as e:
            return view, [_bad_assignment(msg.generation, e)]
        view = dataclasses.replace(view, logical=(msg.generation, *logical))
    new = _changed(view, msg, now)
    effects: list[Effect] = []
    if new.announced is not None and (new.held is None or new.announced > new.held):
        effects.append(TripFence(new.announced))
    if new.restart_only and new.held is not None and new.announced != new.held:
        code = protocol.EXIT_REJOIN
        effects.append(ExitProcess(code, f"the job moved to generation {new.announced}; this script cannot re-form in "
                                         f"place: exiting with code {code} for its agent to relaunch it"))
        return new, effects
    if isinstance(msg, wire.Generation):
        effects.append(Say(f"the job moved to generation {msg.generation}"))
    elif isinstance(msg, wire.Stop):
        effects.append(Say(f"the scheduler stopped the job: {msg.reason}"))
    return new, effects


def _logical(msg: wire.Formed, world_size: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(L, the logical ranks of each rank) of a `formed` message: without the two fields (a scheduler that does not
    send them), one logical rank per rank, rank r serving r. ValueError naming what is wrong with them."""
    if msg.logical is None and msg.logical_world is None:
        return world_size, tuple((r,) for r in range(world_size))
    parts = parse_formed(msg.logical, world_size, msg.logical_world)
    return msg.logical_world, parts


def _bad_assignment(generation: int | None, error: ValueError) -> ExitProcess:
    """A `formed` whose assignment of logical ranks is wrong (toolkit.contracts.logical.parse_formed): this worker
    cannot know which data and gradients are its own, so it stops (EXIT_FATAL: its agent gives up, the job fails
    with this line) rather than train on it."""
    code = protocol.EXIT_FATAL
    return ExitProcess(code, f"the scheduler's formed message of generation {generation} is wrong: "
                             f"{str(error)[:MAX_FENCED_REASON]}; stopping rather than training on it (exit {code}): "
                             "the scheduler and this worker may run different toolkit versions")


def _changed(view: JobView, msg: wire.Message, now: float) -> JobView:
    """The view after a validated message. The ledger's history is taken only when its figures are sane (a fault
    count and an uptime both read): otherwise the last one stays."""
    if isinstance(msg, (wire.Welcome, wire.Generation)):
        return dataclasses.replace(view, announced=msg.generation)
    if isinstance(msg, wire.Formed):
        history = view.history
        if msg.faults is not None and msg.uptime is not None:
            history = (msg.faults, msg.uptime, now)
        return dataclasses.replace(view, formed=(msg.generation, msg.prefix), announced=msg.generation,
                                   history=history, goodput=msg.goodput, shape=msg.shape or view.shape)
    if isinstance(msg, wire.Stop):
        reason = "stopped by the scheduler" if msg.reason is None else msg.reason
        return dataclasses.replace(view, stop_reason=reason[:MAX_REASON])
    return view


def on_refused(first_at: float, now: float, retry: bool, reason: str, node_timeout: float) -> Retry | Stop | \
        ExitProcess:
    """The scheduler refused this worker's reconnect at `now` (refusals since `first_at`, in a row). Without
    `retry` the refusal is final: Stop. With it, our predecessor's connection may still be counted live: Retry, for
    up to two MS_NODE_TIMEOUTs; past that the scheduler has replaced this incarnation while it was disconnected,
    which is being fenced: ExitProcess(EXIT_FENCED)."""
    if not retry:
        return Stop(f"the scheduler refused this worker back: {reason}")
    if now - first_at > 2 * node_timeout:
        return fenced(f"replaced while disconnected: {reason}")
    return Retry()


def stopped(view: JobView, reason: str) -> JobView:
    """The view once the job ended for this worker for `reason` (a final refusal: on_refused's Stop)."""
    return dataclasses.replace(view, stop_reason=reason)


def next_wake(now: float, next_beat: float, finishing: bool, interval: float) -> Wake:
    """At `now`, with the next heartbeat due at `next_beat` every `interval` s: beat now if it is due, and wait for
    the scheduler until the one after. After `done` (`finishing`) nothing more is sent: wait up to DONE_WAIT for
    the scheduler to close."""
    if finishing:
        return Wake(False, next_beat, now + DONE_WAIT)
    if now >= next_beat:
        return Wake(True, now + interval, now + interval)
    return Wake(False, next_beat, next_beat)


def formed_for(view: JobView, current: int | None) -> tuple[int, str] | None:
    """The (generation, store prefix) to build a group for, once the newest announced generation has formed and it
    is not `current` (the one held); None while it has not."""
    f = view.formed
    return f if f is not None and f[0] == view.announced and f[0] != current else None


def changed_from(view: JobView, current: int | None) -> int | None:
    """The generation the job moved to if it is not `current`; None while it is (or nothing was announced)."""
    return view.announced if view.announced is not None and view.announced != current else None


def adopt(view: JobView, generation: int) -> tuple[JobView, bool]:
    """This process now holds a group of `generation`: the new view, and whether the job has already moved past
    it (a newer generation was announced meanwhile)."""
    return dataclasses.replace(view, held=generation), view.announced != generation
