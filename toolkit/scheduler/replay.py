"""Freshness of hello-first messages (toolkit.contracts.protocol): a proof that covers no server nonce is only as fresh
as its `sent` time, so the scheduler accepts one within HELLO_SKEW of its own clock, and each client nonce once while
it could still be accepted. Pure: nonces, times and a wall clock in, a verdict out; the server owns the clock.

Only hellos whose proof checked are recorded (nobody without the token can fill the table), and a nonce is forgotten
once its hello could no longer pass the window, so the table holds at most the job's own hellos of 2 x HELLO_SKEW.

What it does not cover: a scheduler that restarts forgets the nonces it saw; a hello recorded off the network in the
HELLO_SKEW before the restart could be replayed once after it (an eavesdropper on the job's network, who can also
read the unencrypted messages that follow any hello; docs/security.md).
"""

from __future__ import annotations

from typing import Any

from toolkit.contracts.protocol import HELLO_SKEW, hello_sent

CLOCK_SKEW = "this host's clock: "  # how the refusal of a hello-first message from too far off our clock begins


class Replays:
    """The client nonces of the hello-first messages accepted within the window, in order of acceptance."""

    def __init__(self, skew: float = HELLO_SKEW) -> None:
        self.skew = skew
        self.seen: dict[str, float] = {}  # nonce -> wall time after which it is forgotten, in order of acceptance

    def __len__(self) -> int:
        return len(self.seen)

    def judge(self, msg: dict[str, Any], now: float) -> str:
        """For a first message whose proof checked, at wall time `now`: "" if it answered a challenge (its proof
        covers the server's nonce) or is a fresh hello-first message (`verdict`), else why not; a clock too far
        from ours begins with CLOCK_SKEW (the server answers it with a proven refusal the client can trust)."""
        sent = hello_sent(msg)
        if sent is None:
            return ""
        why = self.verdict(str(msg["nonce"]), sent, now)
        return f"{CLOCK_SKEW}{why}" if why.startswith("its clock") else why

    def verdict(self, nonce: str, sent_ms: int, now: float) -> str:
        """"" if a hello whose proof checked, with client nonce `nonce` sent at `sent_ms` (the client's wall clock,
        ms), may be accepted at wall time `now` (s) — then it is recorded —, else one line saying why not: a clock
        too far from ours (with the difference and what to do) or a nonce seen before (a replay)."""
        self._forget(now)
        ahead = sent_ms / 1000.0 - now
        if abs(ahead) > self.skew:
            how = "ahead of" if ahead > 0 else "behind"
            return (f"its clock is {abs(ahead):.0f} s {how} the scheduler's (at most {self.skew:g} s allowed): "
                    "synchronise the hosts' clocks (NTP)")
        if nonce in self.seen:
            return "a hello seen before (replayed)"
        self.seen[nonce] = now + 2 * self.skew
        return ""

    def _forget(self, now: float) -> None:
        """Forget the nonces whose hellos could no longer pass the window (oldest first; a wall clock that stepped
        back only keeps them longer)."""
        while self.seen:
            nonce, until = next(iter(self.seen.items()))
            if until > now:
                return
            del self.seen[nonce]
