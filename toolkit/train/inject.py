"""A fault injector for silent corruption, for operators checking their setup end to end and for the tests: flip
chosen bits of a chosen rank's parameters or optimizer state after a chosen step, as a bad memory cell or a wrong
computation would, and watch the replica check (toolkit.train.replicas) name and heal it.

Off unless TOOLKIT_INJECT_CORRUPTION is set, and read only under toolkit (MS_ROLE=MS_WORKER), where a worker's
environment comes from its agent and its env file (env/<node id>.env in the job directory, mode 0600, the job
owner's): the agent does not pass the variable on from its own environment (toolkit.agent.supervisor), so only
someone who can already change the job's files can set it. Its value: one or more flips separated by `;`, each
`key=value` pairs separated by `,`:

    rank=1,step=7,in=params,bit=3;rank=1,step=20,in=optimizer

- rank: the rank whose state is changed (required); step: after which step (required, >= 1);
- in: `params` (default) or `optimizer` (its state tensors, e.g. SGD's momentum buffers: after the first step), or
  `recovered`: the parameters right after this process's first recovery at or after `step` (the group re-formed
  after a fault and the state agreed on, before a step trains on it): a state taken from a peer that changed past
  the transfer's own digest, which the check right after a recovery must catch;
- tensor: the index of the tensor among them, in the state's order (default 0); element: the element in it,
  flattened (default 0; a sharded model's: in this rank's own shard of it); bit: the bit of that element to flip
  (default 0, the lowest: a change no loss curve shows).

Each flip happens once per process (a step redone after a roll-back does not flip again): a transient fault. Two
flips of the same rank at two steps are a host that corrupts twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from toolkit.contracts import envvars
from toolkit.train.faults import InjectionError

IN_PARAMS, IN_OPTIMIZER, IN_RECOVERED = "params", "optimizer", "recovered"
KEYS = ("rank", "step", "in", "tensor", "element", "bit")


@dataclass(frozen=True)
class Flip:
    """One injected fault: flip `bit` of element `element` of tensor `tensor` of rank `rank`'s `where` after step
    `step`."""

    rank: int
    step: int
    where: str = IN_PARAMS
    tensor: int = 0
    element: int = 0
    bit: int = 0


def parse(text: str) -> tuple[Flip, ...]:
    """The flips TOOLKIT_INJECT_CORRUPTION asks for (see the module docstring); InjectionError naming the bad entry."""
    flips = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        fields: dict[str, str] = {}
        for pair in entry.split(","):
            key, sep, value = pair.strip().partition("=")
            if not sep or key not in KEYS or key in fields:
                raise InjectionError(f"{envvars.TOOLKIT_INJECT_CORRUPTION}: {entry!r}: expected key=value pairs of "
                                     f"{', '.join(KEYS)}, each once (e.g. rank=1,step=7,in=params,bit=3)")
            fields[key] = value.strip()
        if "rank" not in fields or "step" not in fields:
            raise InjectionError(f"{envvars.TOOLKIT_INJECT_CORRUPTION}: {entry!r}: give rank= and step=")
        where = fields.pop("in", IN_PARAMS)
        if where not in (IN_PARAMS, IN_OPTIMIZER, IN_RECOVERED):
            raise InjectionError(f"{envvars.TOOLKIT_INJECT_CORRUPTION}: {entry!r}: in={where}: give in=params, "
                                 "in=optimizer or in=recovered")
        try:
            numbers = {k: int(v, 10) for k, v in fields.items()}
        except ValueError:
            raise InjectionError(f"{envvars.TOOLKIT_INJECT_CORRUPTION}: {entry!r}: rank, step, tensor, element and "
                                 "bit are whole numbers") from None
        if numbers["step"] < 1 or min(numbers.values()) < 0:
            raise InjectionError(f"{envvars.TOOLKIT_INJECT_CORRUPTION}: {entry!r}: step >= 1, the others >= 0")
        flips.append(Flip(where=where, **numbers))
    return tuple(flips)


class Injector:
    """The flips of this rank, each applied once (`after_step`)."""

    def __init__(self, flips: tuple[Flip, ...], rank: int) -> None:
        self.pending = [f for f in flips if f.rank == rank]

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int, toolkit_mode: bool) -> Injector | None:
        """The injector TOOLKIT_INJECT_CORRUPTION asks for, under toolkit only; None when there is nothing to do."""
        text = env.get(envvars.TOOLKIT_INJECT_CORRUPTION, "").strip()
        if not text or not toolkit_mode:
            return None
        injector = cls(parse(text), rank)
        return injector if injector.pending else None

    def after_step(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """Apply the flips due after `step`; one line for the log per flip."""
        due = [f for f in self.pending if f.step == step and f.where != IN_RECOVERED]
        self.pending = [f for f in self.pending if f not in due]
        return [flip_bit(f, module, optimizer) for f in due]

    def after_recovery(self, generation: int | None, step: int, module: torch.nn.Module,
                       optimizer: torch.optim.Optimizer) -> list[str]:
        """Apply the `recovered` flips due once the group re-formed after a fault (`generation` > 0) at `step`."""
        if not generation:
            return []
        due = [f for f in self.pending if f.where == IN_RECOVERED and f.step <= step]
        self.pending = [f for f in self.pending if f not in due]
        return [flip_bit(f, module, optimizer, when=f"after the recovery at step {step}") for f in due]


def flip_bit(f: Flip, module: torch.nn.Module, optimizer: torch.optim.Optimizer, when: str = "") -> str:
    """Flip one bit as `f` says, in place, without autograd; the line saying what was changed (`when`: after which
    step, by default `f`'s)."""
    when = when or f"after step {f.step}"
    what = IN_OPTIMIZER if f.where == IN_OPTIMIZER else IN_PARAMS
    if f.where != IN_OPTIMIZER:
        named = [(name, p) for name, p in module.named_parameters()]
    else:
        named = [(f"state[{i}][{key}]", v) for i, s in sorted(optimizer.state_dict()["state"].items())
                 for key, v in sorted(s.items()) if isinstance(v, torch.Tensor) and v.numel()]
    if not named:
        return f"injected corruption {when}: no {what} tensor yet, nothing flipped"
    from torch.distributed.tensor import DTensor

    name, t = named[f.tensor % len(named)]
    shard = isinstance(t, DTensor)  # a sharded model's (FSDP2): this rank's own shard of it (a view), no collective
    if shard:
        t = t.detach().to_local()
    flat = t.detach().view(-1)
    index = f.element % flat.numel()
    bits = flat[index:index + 1].view(torch.uint8)
    byte, bit = divmod(f.bit % (8 * t.element_size()), 8)
    with torch.no_grad():
        bits[byte] ^= 1 << bit
    return (f"injected corruption {when}: flipped bit {byte * 8 + bit} of {what} {name}[{index}]"
            + (" (this rank's shard)" if shard else ""))

