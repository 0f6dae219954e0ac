"""The replica check (toolkit.train.replicas) and its digest (toolkit.train.digest) without processes: when it runs,
what the digest sees (every byte and its position: the divergence check it replaces summed each tensor, so swapped
rows and a differing buffer passed, issue 39 finding 9), the verdicts, and the fault injector's input. The check in
real jobs is tests/train/test_corruption.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from toolkit.contracts.ckptkey import job_key
from toolkit.launcher.plan import PlanError, make_plan
from toolkit.launcher.settings import CoreFlags, resolve
from toolkit.train import inject, replicas
from toolkit.train.agreement import DIGEST, TrainingState, verified_load
from toolkit.train.ckpt.manager import CheckpointManager, Placement
from toolkit.train.digest import Digester
from toolkit.train.faults import RuntimeConfigError, TrainerError
from toolkit.train.replicas import AGREE, CONFIG, ODD, SPLIT, Schedule, fingerprint, parse_every, verdict
from toolkit.train.runtime import WorkerEnv
from toolkit.train.shardmodel import Layout


def model_and_optimizer(norm: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)] + ([nn.BatchNorm1d(2)] if norm else [])
    model = nn.Sequential(*layers)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def twin(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    other = copy.deepcopy(model)
    return other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)


def test_the_verified_copy_goes_into_the_earlier_copys_memory() -> None:
    """A check's copy of the state reuses the host tensors of the copy before it, though the step, the learning rate
    and other plain values differ (they used to make every check allocate, and fault in, a state's size anew)."""
    first = replicas.host_copy({"step": 1, "w": torch.ones(4), "lr": 0.1, "n": np.int64(2)})
    now = {"step": 2, "w": torch.full((4,), 2.0), "lr": 0.05, "n": np.int64(3)}
    second = replicas.host_copy(now, first)
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], now["w"])
    assert second["w"] is not now["w"] and (second["step"], second["lr"], second["n"]) == (2, 0.05, 3)
    other = replicas.host_copy({"w": torch.ones(5)}, second)  # a tensor of another shape: a new one
    assert other["w"].data_ptr() != second["w"].data_ptr() and torch.equal(other["w"], torch.ones(5))


def test_it_checks_every_k_steps_and_at_doubling_distances_after_a_recovery() -> None:
    check = Schedule(world_size=3, every=50)
    check.arm(0, 0)  # the job's first formation
    assert [s for s in range(0, 120) if check.due(s)][:1] == [50]
    check.checked(50, [50, 50, 50])
    assert check.next == 100
    check.arm(2, 140)  # generation 2 formed at step 140: a recovery
    seen = []
    for s in range(140, 400):
        if check.due(s):
            seen.append(s)
            check.checked(s, [50])
    # at once (the state taken in the recovery, before a step trains on it), then doubling until the gap reaches K
    assert seen[:9] == [140, 141, 142, 144, 148, 156, 172, 204, 254]
    check.recheck(250, 262)  # a heal at 262 went back to 250: its received state checked at once, then 262 again
    assert check.due(250) and not check.due(249)
    check.checked(250, [50])
    assert check.next == 262 and check.again == 262
    check.checked(262, [50])
    assert check.next == 312 and check.again is None
    assert check.final(check.last + 1) and not check.final(check.last)  # the end of training is checked, once
    never = Schedule(world_size=3, every=0)
    never.arm(0, 0)
    assert not any(never.due(s) for s in range(1000))
    alone = Schedule(world_size=1, every=5)
    alone.arm(1, 10)
    assert not any(alone.due(s) for s in range(100))


def test_auto_takes_the_largest_proposal_and_keeps_the_check_within_its_budget() -> None:
    auto = Schedule(world_size=2, every=parse_every("auto"))
    assert auto.proposal(0.04, 0.1) == 50  # a check of 40 ms, steps of 100 ms: 0.8% every 50 steps
    assert auto.proposal(0.0001, 1.0) == 5 and auto.proposal(100.0, 0.001) == 10_000  # the bounds
    auto.arm(0, 0)
    auto.checked(20, [50, 70])
    assert auto.next == 90
    with pytest.raises(ValueError, match="verify_every=-1"):
        parse_every(-1)


def test_the_digest_sees_every_byte_and_its_position() -> None:
    d = Digester()
    model, opt = model_and_optimizer()
    same = fingerprint(d, model, opt)
    other, other_opt = twin(model)
    assert fingerprint(d, other, other_opt) == same
    with torch.no_grad():
        other[0].weight[[0, 1]] = other[0].weight[[1, 0]]  # two rows swapped: the same sum, other positions
    assert fingerprint(d, other, other_opt)[2] != same[2]
    for bit in (0, 13, 31):  # any single bit of any element
        flipped, flipped_opt = twin(model)
        flipped[2].bias.detach().view(torch.int32)[1] ^= 1 << bit
        assert fingerprint(d, flipped, flipped_opt)[2] != same[2]
    odd = torch.arange(13, dtype=torch.uint8)  # a size that is not a multiple of 8: its last bytes count too
    changed = odd.clone()
    changed[12] ^= 1
    assert d.tensors([odd]) != d.tensors([changed]) and d.tensors([odd]) == d.tensors([odd.clone()])
    assert d.tensors([odd[:6], odd[6:]]) != d.tensors([odd[6:], odd[:6]])  # tensors reordered


def test_buffers_and_optimizer_state_are_covered() -> None:
    d = Digester()
    model, opt = model_and_optimizer(norm=True)
    other, other_opt = twin(model)
    base = fingerprint(d, model, opt)
    other[3].running_mean += 1e-3  # a differing BatchNorm buffer
    assert fingerprint(d, other, other_opt)[2] != base[2]
    assert fingerprint(d, other, other_opt, buffers=False)[2] == fingerprint(d, model, opt, buffers=False)[2]
    for m, o in ((model, opt), (other, other_opt)):
        o.zero_grad()
        m(torch.ones(3, 4)).sum().backward()
        o.step()  # the momentum buffers exist now
    other.load_state_dict(model.state_dict())
    assert fingerprint(d, other, other_opt)[2] == fingerprint(d, model, opt)[2]
    other_opt.state[other[0].weight]["momentum_buffer"].view(-1)[3] += 1
    assert fingerprint(d, other, other_opt)[2] != fingerprint(d, model, opt)[2]


def test_the_verdicts() -> None:
    d = Digester()
    model, opt = model_and_optimizer()
    base = fingerprint(d, model, opt, proposal=7)
    bad = [*base[:2], base[2] + 1, *base[3:]]
    assert verdict([base, base, base], None, 8).kind == AGREE
    odd = verdict([base, bad, base, base], None, 8)
    assert (odd.kind, odd.odd, odd.healthy) == (ODD, (1,), (0, 2, 3))
    assert verdict([base, bad], None, 8).kind == SPLIT  # two replicas: no majority
    assert verdict([base, bad, bad, base], None, 8).kind == SPLIT  # a tie
    opt.param_groups[0]["lr"] = 0.05
    line = verdict([base, fingerprint(d, model, opt), base], 40, 41)
    assert line.kind == CONFIG and line.line == (
        "toolkit.train: after the recovery at step 40, at step 41 the learning rate differs between ranks (0.1 on "
        "ranks 0, 2, 0.05 on rank 1): an LR scheduler is likely not handed over: pass it to the Trainer, e.g. "
        "Trainer(..., state={\"sched\": scheduler}); stopping the job (it would go on with ranks that disagree)")
    assert "momentum" in verdict([base, [base[0], base[1] + 1, *base[2:]]], None, 42).line


def row(digest: int, lr: int = 1) -> list[int]:
    """A fingerprint with this state digest (and learning rate hash)."""
    return [lr, 2, digest, 3, 7]


def columns(layout: Layout) -> list[tuple[int, ...]]:
    return [layout.column(s) for s in range(layout.shards)]


def test_under_hsdp_each_shards_column_is_judged_on_its_own() -> None:
    """Shards differ by design; the ranks of one shard's column (its replicas) must agree."""
    two = Layout(2, 2)  # columns (0, 2) and (1, 3)
    shards = [row(10), row(11), row(10), row(11)]
    assert verdict(shards, None, 8, columns(two)).kind == AGREE
    assert verdict(shards, None, 8).kind == SPLIT  # judged as DDP replicas they would differ
    flipped = [row(10), row(99), row(10), row(11)]  # rank 1's shard: two replicas, no majority
    found = verdict(flipped, None, 8, columns(two))
    assert (found.kind, found.groups) == (SPLIT, ((1,), (3,)))
    assert replicas.split_line(found.groups, ["a", "b", "c", "d"], two) == (
        "shard 1's replicas differ with no majority (ranks 1 (b); ranks 3 (d)): with two replica groups no majority "
        "can name the faulty one")
    assert verdict([row(10), row(11, lr=5), row(10), row(11)], 4, 8, columns(two)).kind == CONFIG  # across columns
    three = Layout(3, 2)  # columns (0, 2, 4) and (1, 3, 5)
    found = verdict([row(10), row(11), row(10), row(99), row(10), row(11)], None, 8, columns(three))
    assert (found.kind, found.odd, found.healthy) == (ODD, (3,), (0, 1, 2, 4, 5))
    found = verdict([row(10), row(11), row(98), row(99), row(10), row(11)], None, 8, columns(three))
    assert (found.kind, found.odd) == (ODD, (2, 3))  # one odd rank in each column
    four = Layout(4, 2)  # shard 0's column ties two to two, shard 1's has a majority: no majority overall
    found = verdict([row(10), row(11), row(10), row(11), row(98), row(11), row(98), row(99)], None, 8, columns(four))
    assert (found.kind, found.groups) == (SPLIT, ((0, 2), (4, 6), (1, 3, 5), (7,)))
    assert replicas.split_line(found.groups, ["h"] * 8, four) == (
        "shard 0's replicas differ with no majority (ranks 0 (h), 2 (h); ranks 4 (h), 6 (h)); shard 1's replicas "
        "differ (ranks 1 (h), 3 (h), 5 (h); ranks 7 (h))")


def test_an_hsdp_rank_outside_its_columns_majority_is_named_and_takes_its_shard_from_the_column() -> None:
    three = Layout(3, 2)
    check = replicas.ReplicaCheck(SimpleNamespace(world_size=6, rank=0), None, 4, buffers=False, host="h",  # type: ignore
                         layout=three)
    found = verdict([row(10), row(11), row(10), row(99), row(10), row(11)], None, 8, columns(three))
    assert check.heal_line(found, {3: "rank 3 on h"}, "steps 5-8", 4, object()) == (  # type: ignore[arg-type]
        "rank 3 on h differs from the majority of its shard's replicas (shard 1: ranks 1, 5); it started in steps "
        "5-8; every rank goes back to step 4 (the last good check), rank 3 on h receiving its shard from rank 1, and "
        "redoes the steps")


def test_pure_fsdp_has_no_replica_to_compare_and_says_so_once(capsys: pytest.CaptureFixture[str]) -> None:
    """One replica group: never a check (so never a verdict), and one line from rank 0 when the check is asked for
    (a number or "auto"), none when it is off."""
    for rank, every in ((0, None), (1, None), (0, 4), (0, 0)):
        check = replicas.ReplicaCheck(SimpleNamespace(world_size=4, rank=rank), None, every, buffers=False,  # type: ignore
                             host="h", layout=Layout(1, 4))
        check.arm(0, 0)
        assert not any(check.due(s) for s in range(100)) and not check.due(100, end=True)
    assert capsys.readouterr().out == f"rank 0: {replicas.NO_REPLICA}\n" * 2


def test_the_injector_reads_its_variable_under_toolkit_only_and_names_a_bad_entry() -> None:
    env = {"TOOLKIT_INJECT_CORRUPTION": "rank=1,step=7,in=optimizer,bit=3; rank=2,step=9"}
    assert inject.Injector.from_env(env, 1, toolkit_mode=False) is None  # alone or under torchrun: never
    mine = inject.Injector.from_env(env, 1, toolkit_mode=True)
    assert mine is not None and mine.pending == [inject.Flip(1, 7, "optimizer", 0, 0, 3)]
    assert inject.Injector.from_env(env, 0, toolkit_mode=True) is None  # nothing for rank 0
    model, opt = model_and_optimizer()
    before = model[0].weight.detach().clone()
    flips = inject.Injector((inject.Flip(0, 2, bit=31),), 0)
    assert flips.after_step(1, model, opt) == []
    assert flips.after_step(2, model, opt) == ["injected corruption after step 2: flipped bit 31 of params "
                                               "0.weight[0]"]
    assert model[0].weight[0, 0] == -before[0, 0] and flips.after_step(2, model, opt) == []  # once only
    recovered = inject.Injector(inject.parse("rank=0,step=5,in=recovered,bit=31"), 0)
    assert recovered.after_step(5, model, opt) == [] and recovered.after_recovery(0, 9, model, opt) == []
    assert recovered.after_recovery(1, 4, model, opt) == []  # a recovery before step 5
    assert recovered.after_recovery(2, 9, model, opt) == [
        "injected corruption after the recovery at step 9: flipped bit 31 of params 0.weight[0]"]
    assert model[0].weight[0, 0] == before[0, 0] and recovered.pending == []  # flipped back: once only
    for text, says in (("rank=1", "give rank= and step="), ("rank=1,step=x", "whole numbers"),
                       ("rank=1,step=2,in=grads", "in=params, in=optimizer or in=recovered"),
                       ("rank=1,step=0", "step >= 1"),
                       ("rank=1,step=2,colour=red", "key=value pairs")):
        with pytest.raises(inject.InjectionError, match=says) as e:
            inject.parse(text)
        assert str(e.value).startswith("TOOLKIT_INJECT_CORRUPTION: ")


def test_a_checkpoint_whose_state_differs_from_its_recorded_digest_is_refused_with_one_line(tmp_path) -> None:
    """Real files, the job's key: a checkpoint records the digest of the state at the save; a state changed after
    the digest was taken and before it was written (as a failing staging copy would) is refused at restore."""
    model, opt = model_and_optimizer()
    manager = CheckpointManager(tmp_path / "ckpt", keep_max=3, placement=Placement("h"), key=job_key("k" * 32),
                                async_write=False)
    held = TrainingState(None, model, opt, {}, manager)  # type: ignore[arg-type]  # no runtime: no agreement here
    manager.save(3, held.checkpoint(3))
    good = verified_load(manager, 3)
    assert DIGEST not in good and torch.equal(good["model"]["0.weight"], model[0].weight)
    state = held.checkpoint(5)
    state["model"]["0.weight"].data[0, 0] += 1.0  # after the digest, before the write
    manager.save(5, state)
    assert manager.load(5)["model"]["0.weight"][0, 0] == model[0].weight[0, 0]  # the file itself is authentic
    with pytest.raises(TrainerError) as e:
        verified_load(manager, 5)
    assert str(e.value) == (f"checkpoint of step 5 in {tmp_path / 'ckpt' / 'host_h'}: its state does not match the "
                            "digest recorded when it was saved (it changed in memory before it was written): "
                            "refused; move its files aside to resume from the previous checkpoint")
    manager.close()


def test_verify_every_goes_from_the_flag_to_the_worker_and_a_bad_value_is_one_line(tmp_path) -> None:
    """--verify-every (or toolkit.verify_every in fabric.yaml) -> the plan's TOOLKIT_VERIFY_EVERY in each worker's
    env file -> WorkerEnv.verify_every, which a Trainer without verify_every= uses."""
    (tmp_path / "train.py").write_text("")
    settings = resolve({"verify_every": "25"}, {}, CoreFlags(), tmp_path, environ={})
    plan = make_plan(settings.inventory, settings.options, str(settings.project))
    env = {k: v for k, v in plan.process("worker_0").env.items() if k != "TOOLKIT_TOKEN_FILE"}  # not written here
    assert env["TOOLKIT_VERIFY_EVERY"] == "25"
    assert WorkerEnv.from_env(env).verify_every == 25
    auto = resolve({}, {"verify_every": "auto"}, CoreFlags(), tmp_path, environ={})
    assert "TOOLKIT_VERIFY_EVERY" not in make_plan(auto.inventory, auto.options, str(tmp_path)).process(
        "worker_0").env and WorkerEnv.from_env({}).verify_every == "auto"
    with pytest.raises(PlanError, match=r"^--verify-every 'often': give a number of steps"):
        resolve({"verify_every": "often"}, {}, CoreFlags(), tmp_path, environ={})
    with pytest.raises(RuntimeConfigError, match=r"^TOOLKIT_VERIFY_EVERY='-3': expected a number of steps"):
        WorkerEnv.from_env({**env, "TOOLKIT_VERIFY_EVERY": "-3"})
