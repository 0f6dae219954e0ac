"""Where a worker is in its life, written down in one place: its phase, the generation the phase is about, and the
moves between phases that the runtime and the Trainer make.

    joining ──> formed ──> receiving ──> formed ──> ... ──> finished
                  │            │
                  v            v
               abandoned <─────┘        abandoned ──> abandoned: a newer generation before re-forming began
                  │                     abandoned ──> finished: done() without re-forming (a plain loop)
                  v                     every phase but the two ends ──> stopped
               re-forming ──> formed

- joining: registered with the scheduler (or starting alone / under torchrun), building the first process group.
- formed: holds the process group of `generation`; training, or between steps.
- abandoned: `generation` (the newest one announced) began while this process held an older group, or a collective
  broke: the group is to be left; the state the process holds is kept.
- re-forming: leaving the old group and building the group of a newer generation (Runtime.reform).
- receiving: the group is built and the ranks agree on the newest state any of them holds and take it (from a peer's
  memory, a checkpoint, or the initial state: toolkit.train.agreement); back to formed once it is taken.
- finished: the script ended cleanly (Runtime.done). stopped: released without success (Runtime.close: an error,
  SIGTERM, the job stopped).

Why a table: the recovery itself runs on exceptions (toolkit.train.faults), and without one place saying where the
worker is, that was implicit in several attributes; a move the table does not list is this code's bug, and raises
LifecycleError naming both phases.

Threads: only the training (main) thread moves the phase (Runtime and Trainer calls); the control thread
(toolkit.train.channel) and any other may read `now()`, which returns phase and generation together."""

from __future__ import annotations

import enum
import threading


class Phase(enum.Enum):
    """The worker's phases; the value is the word its log lines use."""

    JOINING = "joining"
    FORMED = "formed"
    ABANDONED = "abandoned"
    REFORMING = "re-forming"
    RECEIVING = "receiving"
    FINISHED = "finished"
    STOPPED = "stopped"


TERMINAL = frozenset({Phase.FINISHED, Phase.STOPPED})
HOLDING = frozenset({Phase.FORMED, Phase.RECEIVING, Phase.ABANDONED})  # a process group is held

MOVES: dict[Phase, frozenset[Phase]] = {  # from -> the phases it may move to (stopped: from every live phase)
    Phase.JOINING: frozenset({Phase.FORMED}),
    Phase.FORMED: frozenset({Phase.RECEIVING, Phase.ABANDONED, Phase.FINISHED}),
    Phase.RECEIVING: frozenset({Phase.FORMED, Phase.ABANDONED}),
    Phase.ABANDONED: frozenset({Phase.ABANDONED, Phase.REFORMING, Phase.FINISHED}),  # a newer generation meanwhile
    Phase.REFORMING: frozenset({Phase.FORMED}),
    Phase.FINISHED: frozenset(),
    Phase.STOPPED: frozenset(),
}


class LifecycleError(AssertionError):
    """A move the table (MOVES) does not list: a bug in toolkit, not the user's error."""


def legal(frm: Phase, to: Phase) -> bool:
    """Whether a worker in phase `frm` may move to `to`: MOVES, and stopped from every phase but the two ends."""
    return to in MOVES[frm] or (to is Phase.STOPPED and frm not in TERMINAL)


class Lifecycle:
    """The current phase and the generation it refers to (None before the first group); starts joining.

    Written by the training thread only (see the module's docstring); read from any thread through `now()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = Phase.JOINING
        self._generation: int | None = None

    def now(self) -> tuple[Phase, int | None]:
        """The phase and its generation, read together."""
        with self._lock:
            return self._phase, self._generation

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self.now()[0]

    def move(self, to: Phase, generation: int | None = None) -> None:
        """Enter `to`, about `generation` (None: the generation stays the one held). LifecycleError, naming both
        phases and the generation, for a move MOVES does not list."""
        with self._lock:
            if not legal(self._phase, to):
                raise LifecycleError(f"worker lifecycle: {self._phase.value} -> {to.value} is not a legal move "
                                     f"(generation {self._generation}, to {generation}): a bug in toolkit.train")
            self._phase = to
            if generation is not None:
                self._generation = generation

    def abandon(self, announced: int | None) -> None:
        """The group held is to be left: `announced` began (None: the generation stays the one held). Only a group
        held (formed, receiving, abandoned) is abandoned: while joining or re-forming the newest generation is
        waited for anyway, and after the end (finished, stopped) it is no longer this process's business."""
        if self.phase in HOLDING:  # read, then moved: one writer (the training thread)
            self.move(Phase.ABANDONED, announced)

    def __str__(self) -> str:
        phase, generation = self.now()
        return phase.value if generation is None else f"{phase.value} (generation {generation})"
