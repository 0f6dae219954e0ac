"""The sample trainer (examples/train.py) with each SIGTERM placed exactly where a test wants it handled.

The signal is the real one the agent sends (recover.sh, stop.sh); this script only chooses when the process sees
it. Its plan (JSON at $TEST_SIGTERM_PLAN: {"events": PATH, "ranks": {RANK: {LAUNCH: {"arm": STEP or "recovery",
"deliver": POINT}}}}, LAUNCH being TORCHELASTIC_RESTART_COUNT) says, per process incarnation, when to arm (at the
start of step STEP, or once a recovery finished) and where to deliver. Armed, the script holds SIGTERM back (its
handler only notes it) and says "armed" on the events socket, so the test knows it may send the signal; at POINT it
waits for the signal (bounded), then restores the Trainer's handler and raises the signal there:

- before_agree / after_agree: just before / after the step boundary's stop agreement of step STEP;
- next_step: just after the boundary of step STEP (the agreement done, the peers' "a peer stops" checkpoint saved),
  before anything of step STEP + 1: not at the start of step STEP + 1, which a loaded machine may reach only after
  the job re-formed without the ranks that left (the signal would then be seen a step later);
- in_wait: inside the wait for the scheduler's word after a collective failed (Runtime.changed_by);
- after_recovery: once the Trainer re-formed the group and took the state (its `_sync` returned).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import toolkit.train
from toolkit.train.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"
WAIT = 120.0  # s an armed process waits for its SIGTERM before it gives up (exit 99: the test failed)


class Placement:
    """This incarnation's entry of the plan, and the SIGTERM it holds back."""

    def __init__(self, plan: dict[str, Any], rank: int, launch: int) -> None:
        entry = plan["ranks"].get(str(rank), {}).get(str(launch)) or {}
        self.events, self.rank, self.launch = plan["events"], rank, launch
        self.arm_at, self.point = entry.get("arm"), entry.get("deliver")
        self.armed = False
        self.pending = threading.Event()
        self.handler: Any = None

    def at(self, point: str, step: int | None = None) -> None:
        """The script reached `point` (of step `step`): arm, or deliver, if the plan says so here."""
        if self.arm_at is None:
            return
        if not self.armed and ((point == "step" and step == self.arm_at)
                               or (point == "after_recovery" and self.arm_at == "recovery")):
            self.handler = signal.getsignal(signal.SIGTERM)  # the Trainer's
            signal.signal(signal.SIGTERM, lambda *_: self.pending.set())
            self.armed = True
            self.say("armed")
        if not self.armed or point != self.point or (point == "next_step" and step != self.arm_at):
            return
        if not self.pending.wait(WAIT):
            print(f"sigterm_worker rank {self.rank}: no SIGTERM within {WAIT} s at {point}", file=sys.stderr,
                  flush=True)
            os._exit(99)
        self.arm_at, self.armed = None, False
        self.say(f"delivered at {point}")
        signal.signal(signal.SIGTERM, self.handler)
        signal.raise_signal(signal.SIGTERM)  # handled here, before the next line (Terminated, where it raises)

    def say(self, what: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps({"rank": self.rank, "launch": self.launch, "event": what}).encode(), self.events)


def hooked(placement: Placement) -> type[Trainer]:
    class Hooked(Trainer):
        """The Trainer with the plan's points."""

        def __init__(self, rt: Any, *args: Any, **kwargs: Any) -> None:
            changed_by = rt.changed_by

            def waiting(error: BaseException) -> Any:
                placement.at("in_wait")
                return changed_by(error)

            rt.changed_by = waiting
            super().__init__(rt, *args, **kwargs)

        @contextlib.contextmanager
        def step(self) -> Iterator[int]:
            placement.at("step", self.step_count + 1)
            with super().step() as n:
                yield n
            placement.at("next_step", self.step_count)  # the boundary of step_count is behind: its agreement done

        def _agree_stop(self) -> bool | None:
            placement.at("before_agree")
            verdict = super()._agree_stop()
            placement.at("after_agree")
            return verdict

        def _sync(self) -> None:
            super()._sync()
            placement.at("after_recovery")

    return Hooked


def main() -> None:
    plan = json.loads(Path(os.environ["TEST_SIGTERM_PLAN"]).read_text())
    placement = Placement(plan, int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    toolkit.train.Trainer = hooked(placement)  # what examples/train.py constructs
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
