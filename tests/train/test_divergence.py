"""The Trainer's check for a silent divergence after a recovery (toolkit.train.divergence), without processes: when
it runs, what a fingerprint holds, and the one line a mismatch gives. The check in a real job is in
tests/train/test_own_scripts.py."""

from __future__ import annotations

import copy

import torch
from torch import nn

from toolkit.train.divergence import DivergenceCheck, fingerprint, verdict


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_it_checks_after_a_recovery_at_doubling_distances_and_never_otherwise() -> None:
    check = DivergenceCheck(world_size=3)
    check.arm(0, 0)  # the job's first formation: nothing to compare yet
    assert not any(check.due(s) for s in range(100))
    check.arm(2, 40)  # generation 2 formed at step 40: a recovery
    assert [s for s in range(200) if check.due(s)] == [41, 42, 44, 48, 56, 72, 104, 168]
    check.arm(3, 45)  # another recovery starts the schedule again
    assert [s for s in range(40, 60) if check.due(s)] == [46, 47, 49, 53]
    alone = DivergenceCheck(world_size=1)
    alone.arm(1, 10)
    assert not any(alone.due(s) for s in range(100))


def test_the_fingerprint_is_the_same_for_the_same_state_and_names_what_differs() -> None:
    model, opt = model_and_optimizer()
    twin_model = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin_model.parameters(), lr=0.1, momentum=0.9)
    same = fingerprint(model, opt)
    assert fingerprint(twin_model, twin_opt) == same and all(0 <= v < 1 << 63 for v in same[:3])
    twin_opt.param_groups[0]["lr"] = 0.1 * 0.97  # a scheduler that stepped from another epoch
    lr = fingerprint(twin_model, twin_opt)
    assert (lr[0] != same[0], lr[1:3]) == (True, same[1:3])
    twin_opt.param_groups[0]["lr"] = 0.1
    twin_opt.param_groups[0]["momentum"] = 0.8
    assert fingerprint(twin_model, twin_opt)[1] != same[1]
    twin_opt.param_groups[0]["momentum"] = 0.9
    with torch.no_grad():
        twin_model[0].weight[0, 0] += 1e-7  # one value, a few bits off
    assert fingerprint(twin_model, twin_opt)[:2] == same[:2] and fingerprint(twin_model, twin_opt)[2] != same[2]


def test_a_mismatch_is_one_line_naming_the_likely_missing_state() -> None:
    model, opt = model_and_optimizer()
    base = fingerprint(model, opt)
    assert verdict([base, base, base], 40, 41) is None
    opt.param_groups[0]["lr"] = 0.05
    other = fingerprint(model, opt)
    line = verdict([base, other, base], 40, 41)
    assert line == ("toolkit.train: after the recovery at step 40, at step 41 the learning rate differs between ranks "
                    "(0.1 on ranks 0, 2, 0.05 on rank 1): an LR scheduler is likely not handed over: pass it to the "
                    "Trainer, e.g. Trainer(..., state={\"sched\": scheduler}); stopping the job (it would go on with "
                    "ranks that disagree; checkpoints after step 40 carry the difference)")
    assert "momentum" in verdict([base, [base[0], base[1] + 1, *base[2:]]], 40, 42)
    assert "the parameters differ" in verdict([base, [base[0], base[1], base[2] + 1, base[3]]], 40, 44)
