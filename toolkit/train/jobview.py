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

from toolkit.contracts import protocol
from toolkit.contracts.logical import parse_formed

DONE_WAIT = 5.0  # s to hear the scheduler acknowledge `done` (by closing) before exiting anyway
MAX_WORLD = 1 << 20  # ranks a `formed` may say a generation has (a hostile bound)
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


def on_message(view: JobView, msg: dict[str, Any], now: float) -> tuple[JobView, list[Effect]]:
    """One message of the (authenticated) scheduler, read at monotonic time `now`: the new view and the effects to
    apply in order. TripFence comes whenever the announced generation is newer than the one held (or none is held
    yet): the fence, armed for the generation being built or held, makes the last call. `fenced` returns `view`
    itself and one ExitProcess. A malformed message (welcome, generation or formed without a generation >= 0,
    formed without a store prefix) raises ProtocolError and changes nothing: the channel drops the connection like
    any broken one and reconnects. A `formed` whose assignment of logical ranks is wrong (authenticated, so a bug or
    a version skew, not noise) changes nothing and ends the process (EXIT_FATAL) with one line. An op this worker
    does not know changes nothing."""
    op = msg["op"]
    if op == protocol.FENCED:
        return view, [fenced(msg.get("reason"))]
    generation = protocol.whole(msg, "generation")
    if op in (protocol.WELCOME, protocol.GENERATION, protocol.FORMED) and (generation is None or generation < 0):
        raise protocol.ProtocolError(f"{op} without a generation")
    if op == protocol.FORMED and not isinstance(msg.get("prefix"), str):
        raise protocol.ProtocolError("formed without a store prefix")
    if op == protocol.FORMED and "world_size" in msg and _shape(msg) is None:
        raise protocol.ProtocolError("formed with a rank that is not in its world size")
    if op == protocol.FORMED:
        shape = _shape(msg) if "world_size" in msg else None  # an elastic job's generation has its own size
        try:
            logical = _logical(msg, shape[1] if shape is not None else view.world_size)
        except ValueError as e:
            return view, [_bad_assignment(generation, e)]
        view = dataclasses.replace(view, logical=(generation, *logical))
    new = _changed(view, op, msg, generation, now)
    effects: list[Effect] = []
    if new.announced is not None and (new.held is None or new.announced > new.held):
        effects.append(TripFence(new.announced))
    if new.restart_only and new.held is not None and new.announced != new.held:
        code = protocol.EXIT_REJOIN
        effects.append(ExitProcess(code, f"the job moved to generation {new.announced}; this script cannot re-form in "
                                         f"place: exiting with code {code} for its agent to relaunch it"))
        return new, effects
    if op == protocol.GENERATION:
        effects.append(Say(f"the job moved to generation {generation}"))
    elif op == protocol.STOP:
        effects.append(Say(f"the scheduler stopped the job: {msg.get('reason')}"))
    return new, effects


def _logical(msg: dict[str, Any], world_size: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(L, the logical ranks of each rank) of a `formed` message: without the two fields (a scheduler that does not
    send them), one logical rank per rank, rank r serving r. ValueError naming what is wrong with them."""
    if "logical" not in msg and "logical_world" not in msg:
        return world_size, tuple((r,) for r in range(world_size))
    parts = parse_formed(msg.get("logical"), world_size, msg.get("logical_world"))
    return msg["logical_world"], parts


def _bad_assignment(generation: int | None, error: ValueError) -> ExitProcess:
    """A `formed` whose assignment of logical ranks is wrong (toolkit.contracts.logical.parse_formed): this worker
    cannot know which data and gradients are its own, so it stops (EXIT_FATAL: its agent gives up, the job fails
    with this line) rather than train on it."""
    code = protocol.EXIT_FATAL
    return ExitProcess(code, f"the scheduler's formed message of generation {generation} is wrong: "
                             f"{str(error)[:MAX_FENCED_REASON]}; stopping rather than training on it (exit {code}): "
                             "the scheduler and this worker may run different toolkit versions")


def _changed(view: JobView, op: str, msg: dict[str, Any], generation: int | None, now: float) -> JobView:
    """The view after a validated message. The ledger's history is taken only when its figures are sane: a
    negative or non-finite uptime (or a fault count that is no whole number >= 0) leaves the last one."""
    if op in (protocol.WELCOME, protocol.GENERATION):
        return dataclasses.replace(view, announced=generation)
    if op == protocol.FORMED and generation is not None:  # (on_message checked that it is)
        history = view.history
        faults, uptime = protocol.whole(msg, "faults"), protocol.seconds_field(msg, "uptime")
        if faults is not None and faults >= 0 and uptime is not None:
            history = (faults, uptime, now)
        goodput = msg.get("goodput")
        goodput = float(goodput) if type(goodput) in (int, float) and 0 <= goodput <= 1 else None
        return dataclasses.replace(view, formed=(generation, msg["prefix"]), announced=generation, history=history,
                                   goodput=goodput, shape=_shape(msg) if "world_size" in msg else view.shape)
    if op == protocol.STOP:
        return dataclasses.replace(view, stop_reason=str(msg.get("reason", "stopped by the scheduler"))[:MAX_REASON])
    return view


def _shape(msg: dict[str, Any]) -> tuple[int, int] | None:
    """A `formed` message's (rank, world size) of this process, None unless 0 <= rank < world size (bounded)."""
    rank, world = protocol.whole(msg, "rank"), protocol.whole(msg, "world_size")
    if rank is None or world is None or not 0 <= rank < world <= MAX_WORLD:
        return None
    return rank, world


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
