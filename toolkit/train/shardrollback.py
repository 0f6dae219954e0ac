"""Pure FSDP (one replica group) recovered in place from the shard mirror (toolkit.train.shardmirror): the
Trainer's wiring of it, kept apart from the HSDP agreement (toolkit.train.shardstate) that calls it.

With one replica group a lost rank's shard exists nowhere else in accelerator memory; the mirror keeps a copy of
each rank's shard in another host's RAM, refreshed every K steps. What this part adds to the Trainer:

- at the start (`mirror_for`): the mirror, or the one line that says why there is none and what a fault then costs;
- after each step when due (`MirrorRollback.refresh`): the refresh, with a copy of what every rank holds alike
  (the optimizer's hyperparameters, the extra state such as an LR scheduler), which is not in the shard's tensors;
- after each (re-)formation (`regroup`): the mirror's own group;
- in the agreement, when a rank of the one replica group was lost (`recover`): every survivor ends the exchange in
  flight (`settle`), the ranks gather the steps they hold and take the newest every survivor holds whole
  (`rollback_step`); the replacement builds its optimizer state's tensors (one step at learning rate 0 on zero
  gradients: an optimizer that never stepped has none, and `hand_over` fills tensors in place) and receives its
  shard from the rank keeping its copy; the survivors give it the replicated state of that step; then every rank
  puts that step back and refreshes the copies at it (the replacement holds none yet). The Trainer goes on from
  it: the steps since (at most K, plus a refresh still in flight at the fault) are redone, bitwise, as a step's
  batch and randomness are functions of the step (toolkit.train.stepdata), and reported as recomputed.

Order: every collective of the recovery on the job's group comes before any survivor changes its state, so a fault
during the recovery leaves the survivors at the step they reported (the next agreement starts again from it); the
refresh that ends it runs in the background on the mirror's group (a fault voids it, the older copies stay).

Not covered: a fault before the first refresh (step K; the optimizer has no state to copy before the first step),
or a lost rank whose copy's keeper was lost too (two hosts next to each other in the ring): TrainerError naming the
fallback, a whole-job restart.

The memory check needs the shard's size before the optimizer has state: it counts the parameters' shards three
times (the parameters and an Adam-like optimizer's two moments) plus the buffers.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
import torch.distributed as dist

from toolkit.train import log, transfer
from toolkit.train.agreement import FROM_PEER, Agreed, Source
from toolkit.train.faults import TrainerError
from toolkit.train.runtime import Runtime
from toolkit.train.shardmirror import ShardMirror, holder_of, rollback_step

SETTLE_WAIT = 10.0  # s a survivor waits for the exchange in flight at a fault before voiding it (a refresh of a
# small shard takes milliseconds; a longer one voided only means going back to the refresh before)
ADAM_LIKE = 3  # the parameters' shards and an Adam-like optimizer's two moments: the shard's size at the start
FALLBACK = "a lost rank costs a whole-job restart from the newest sharded checkpoint"


def mirror_for(rt: Runtime, module: torch.nn.Module, per_host: int, every: int | str) -> ShardMirror | None:
    """The mirror of a pure-FSDP model's shards, None when `every` is 0 (off) or the world is one rank; says at
    start (rank 0, one line) that it is off and what a fault costs then. TrainerError for a bad `every`."""
    if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        raise TrainerError(f"shard_mirror={every!r}: give the steps between refreshes of the copies of the shards in "
                           "memory (at least 1), \"auto\" (K for at most 3% of the step time) or 0 (none)")
    if every == 0 or rt.world_size == 1:
        if rt.rank == 0 and rt.world_size > 1:
            log.line(f"rank 0: pure FSDP without a copy of each shard in memory (shard_mirror=0): {FALLBACK}")
        return None
    nbytes = ADAM_LIKE * sum(getattr(p, "_local_tensor", p).nbytes for p in module.parameters()) + sum(
        b.nbytes for b in module.buffers())
    mirror = ShardMirror(rt.rank, rt.world_size, per_host, nbytes, every=every)
    if rt.rank == 0:
        if mirror.enabled:
            every = "K (chosen for at most 3% of the step time)" if mirror.auto else str(mirror.every)
            log.line(f"rank 0: pure FSDP: each rank r keeps a copy of rank (r + {per_host}) mod {rt.world_size}'s "
                     f"shard in host memory, refreshed every {every} steps: a lost rank's shard comes from it")
        else:
            log.line(f"rank 0: pure FSDP without a copy of each shard in memory ({mirror.why_not}): {FALLBACK}")
    return mirror if mirror.enabled else None


def flat(shard: Any) -> list[torch.Tensor]:
    """A ShardState's tensors in the order every incarnation gives them: the parameters' local shards, the buffers,
    then the optimizer's per-parameter state (by index, then key). References to the live storage."""
    t = shard.tensors()
    out = list(t["model"].values()) + list(t["buffers"].values())
    state = t["optimizer"]["state"]
    for i in sorted(state, key=int):
        out += [v for _, v in sorted(state[i].items()) if isinstance(v, torch.Tensor)]
    return out


class MirrorRollback:
    """The Trainer's end of the mirror (module docstring). `shard`: this rank's ShardState; `commit`: its StepCommit
    (the replacement's zero-learning-rate step must not wait for the other ranks)."""

    def __init__(self, rt: Runtime, mirror: ShardMirror, shard: Any, commit: Any) -> None:
        self.rt = rt
        self.mirror = mirror
        self.shard = shard
        self.commit = commit
        self._replicated: dict[int, Any] = {}  # step -> what every rank holds alike at that step

    def refresh(self, step: int, step_time: float | None = None) -> None:
        """Collective (in the background): refresh the copies at `step`. Also after each (re-)formation, at the
        step agreed (a replacement holds no copy yet), but not before the first step: the optimizer's state has no
        tensors yet, and the exchange's sizes are agreed once per group."""
        if step < 1:
            return
        self._replicated[step] = copy.deepcopy(self.shard.replicated())
        self.mirror.refresh(step, flat(self.shard), step_time)
        keep = set(self.mirror.held()) | {step}
        for s in [s for s in self._replicated if s not in keep]:
            del self._replicated[s]

    def regroup(self) -> None:
        """Collective, after each (re-)formation: the mirror's own group."""
        self.mirror.regroup()

    @staticmethod
    def applies(table: Sequence[tuple[int, int, int]]) -> bool:
        """Whether the agreement's `table` (each rank's held step, pristine, ready) is a lost rank's: some rank
        holds a step, another none."""
        held = [h for h, _, _ in table]
        return max(held) >= 0 and min(held) < 0

    def recover(self, table: Sequence[tuple[int, int, int]]) -> tuple[Agreed, bool]:
        """Collective (every rank, in the agreement): go back to the newest step of the mirror every survivor holds
        (module docstring). Returns this rank's Agreed and whether it received its shard. TrainerError, naming the
        fallback, when no such step exists (a lost rank's copy was lost too, or nothing was refreshed yet)."""
        rt = self.rt
        lost = [r for r, (h, _, _) in enumerate(table) if h < 0]
        survivors = tuple(r for r in range(rt.world_size) if r not in lost)
        held = self._gather_held(self.mirror.settle(SETTLE_WAIT))
        step = rollback_step(held, lost, rt.world_size, self.mirror.per_host)
        if step is None:
            raise TrainerError(f"ranks {lost} were lost and the copies of their shards in memory do not cover them "
                               f"(held steps {held}: nothing refreshed yet, or the rank keeping a copy was lost "
                               f"too); {FALLBACK}")
        receiving = rt.rank in lost
        if receiving:
            self._build_optimizer_state()
        self.mirror.hand_over(step, lost, flat(self.shard) if receiving else None, group=rt.group)
        replicated, _ = transfer.share(self._replicated.get(step) if not receiving else self.shard.replicated(),
                                       survivors, rank=rt.rank, world=rt.world_size, device=rt.device,
                                       fence=rt.fence)
        rt.fence.wait(dist.all_reduce(torch.zeros(1, device=rt.device), async_op=True),
                      "the wait for every rank to hold its shard")
        self.regroup()
        # no collective below: a fault before here left every survivor at the step it reported
        if receiving:
            self.shard.load_replicated(replicated)
        else:
            self.mirror.restore(step, flat(self.shard))
            self.shard.load_replicated(self._replicated[step])
        self.mirror.drop_after(step)
        for s in [s for s in self._replicated if s > step]:
            del self._replicated[s]
        self.refresh(step)
        reached = max(h for h, _, _ in table)
        origin = holder_of(rt.rank, rt.world_size, self.mirror.per_host) if receiving else rt.rank
        nbytes = sum(t.nbytes for t in flat(self.shard)) if receiving else 0
        log.line(f"rank {rt.rank}: ranks {lost} lost at step {reached}: every rank goes back to step {step}, the "
                 f"newest copy in memory (refreshed every {self.mirror.every} steps), and redoes {reached - step} "
                 "step(s)")
        return Agreed(Source(FROM_PEER, survivors, reached), origin, nbytes, step), receiving

    def _gather_held(self, mine: list[int]) -> list[list[int]]:
        """Every rank's held steps (at most the two newest), in rank order."""
        t = torch.tensor(([-1, -1] + mine)[-2:], dtype=torch.int64, device=self.rt.device)
        every = [torch.empty_like(t) for _ in range(self.rt.world_size)]
        self.rt.fence.wait(dist.all_gather(every, t, async_op=True), "the agreement on the copies held")
        return [[s for s in x.tolist() if s >= 0] for x in every]

    def _build_optimizer_state(self) -> None:
        """A replacement's optimizer state's tensors, for `hand_over` to fill in place: one step at learning rate
        0 on zero gradients, without the step commit (the others are not stepping). Its values are overwritten."""
        optimizer = self.shard.optimizer
        params = self.shard.params()
        if all(optimizer.state.get(p) for p in params):
            return
        rates = [group["lr"] for group in optimizer.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        self.commit.replaying = True
        try:
            for group in optimizer.param_groups:
                group["lr"] = 0.0
            optimizer.step()
        finally:
            self.commit.replaying = False
            for group, lr in zip(optimizer.param_groups, rates, strict=True):
                group["lr"] = lr
            for p in params:
                p.grad = None

    def close(self) -> None:
        self.mirror.close()
