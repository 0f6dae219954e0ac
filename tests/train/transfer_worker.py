"""One rank of a real gloo group for the state-transfer tests (tests/train/test_transfer.py); prints JSON lines.

Usage: python transfer_worker.py SCENARIO RANK WORLD PORT [PORT2]

exact: ranks 0 and 1 hold a trained state (model with tied, non-contiguous, float64, float16, bfloat16, int64 and
  bool tensors; AdamW with its moments; extra state with numpy, tuples, int keys, NaN); rank 2 is a replacement
  (other initial values, an optimizer never stepped); rank 3 a survivor a step behind (its own optimizer state).
  Every rank prints the digest of its whole state after the transfer, where its parameters live, and the digest
  after one more step on the same batch.
killed: ranks 0 and 1 hold a state of 48 tensors of 1 MB; rank 0 sends it to rank 2 and, after its sixth tensor,
  waits (a slow sender) and says so, so that the test can kill it in the middle of the transfer. Then ranks 1 and
  2 form a new group on PORT2 and rank 1 sends.
tampered: world 2, rank 1 changes a byte of each message of its first receive (a byte changed in flight).
abandoned: world 2, the group built inside a fence as the runtime builds it (toolkit.train.fence); rank 0 sends
  one 400 MB tensor and says so (the test kills it meanwhile); rank 1 receives it with the fence, and a thread of
  its own trips the fence when the test says so on stdin (as the runtime's control thread does when a new
  generation is announced); it prints how the transfer ended and how long after the trip. The group's timeout is
  120 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from toolkit.train import transfer
from toolkit.train.faults import Abandoned
from toolkit.train.fence import Fence, opened_since, tcp_sockets


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 20000)  # a 1.3 MB weight: travels as its own message
        self.head = nn.Linear(20000, 50, bias=False)
        self.out = nn.Linear(16, 50, bias=False)
        self.out.weight = self.emb.weight  # tied: one storage, two names
        self.wide = nn.Parameter(torch.randn(24, 16).t())  # non-contiguous (and so is its AdamW state)
        self.exact = nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.register_buffer("f16", torch.randn(7).half())
        self.register_buffer("b16", torch.randn(9).bfloat16())
        self.register_buffer("counts", torch.arange(11))
        self.register_buffer("mask", torch.rand(13) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        h = self.head(torch.relu(self.body(e)))
        return h + self.out(e) + (e @ self.wide).sum() + self.exact.float().sum() + self.f16.float().sum()


class Extra:
    """Extra state as a user may hand it over: numpy, numpy scalars, tuples, int keys, NaN, None."""

    def __init__(self, value: float) -> None:
        self.state = {"np": np.arange(6.0) * value, "scalar": np.float32(value), "pair": (1, value, "a"),
                      "by_id": {3: "x", 7: None}, "nan": float("nan"), "nested": [[value], {"k": True}]}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def digest(obj: Any) -> str:
    h = hashlib.sha256()

    def walk(o: Any) -> None:
        h.update(type(o).__name__.encode())
        if isinstance(o, torch.Tensor):
            h.update(f"{o.dtype}{tuple(o.shape)}".encode())
            h.update(o.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, np.ndarray | np.generic):
            h.update(f"{o.dtype}{np.shape(o)}".encode() + np.ascontiguousarray(o).tobytes())
        elif isinstance(o, float):
            h.update(o.hex().encode())
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(k)
                walk(v)
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()


def capture(model: nn.Module, opt: torch.optim.Optimizer, extra: Extra, step: int) -> dict[str, Any]:
    """As the Trainer captures its state."""
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "extra": {"x": extra.state_dict()}}


def restore(model: nn.Module, opt: torch.optim.Optimizer, extra: Extra, state: dict[str, Any]) -> None:
    """As the Trainer restores one."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    extra.load_state_dict(state["extra"]["x"])


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(99)
    opt.zero_grad()
    model(torch.randint(0, 50, (4,), generator=g)).square().mean().backward()
    opt.step()


def group(rank: int, world: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def exact(rank: int, world: int, port: int) -> None:
    torch.manual_seed(0 if rank < 2 else rank)  # the holders' states are the same; the others' differ
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = Extra(2.5 if rank < 2 else -1.0)
    steps = {0: 3, 1: 3, 2: 0, 3: 2}[rank]
    for _ in range(steps):
        train_step(model, opt)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    group(rank, world, port)
    holders = [0, 1]
    received, nbytes = transfer.share(capture(model, opt, extra, steps), holders, rank=rank, world=world,
                                      device=torch.device("cpu"))
    if received is not None:
        restore(model, opt, extra, received)
        steps = received["step"]
    state = capture(model, opt, extra, steps)
    in_place = all(p.data_ptr() == before[n] for n, p in model.named_parameters())
    train_step(model, opt)
    print(json.dumps({"rank": rank, "digest": digest(state), "bytes": nbytes, "in_place": in_place,
                      "tied": model.out.weight is model.emb.weight, "step": steps,
                      "contiguous": model.wide.is_contiguous(), "exp_avg_types": sorted(
                          {str(s["exp_avg"].dtype) for s in opt.state.values()}),
                      "after_step": digest(model.state_dict())}), flush=True)
    dist.destroy_process_group()


def killed(rank: int, port: int, port2: int) -> None:
    fill = 0.0 if rank == 2 else 1.0
    state = {"step": 7, "layers": [torch.full((1 << 18,), fill + i) for i in range(48)]}  # 48 x 1 MB
    group(rank, 3, port)
    if rank == 2:
        try:
            transfer.share(state, [0, 1], rank=2, world=3, device=torch.device("cpu"))
            failed = None
        except RuntimeError as e:
            failed = str(e).splitlines()[0][:200]
        new = sum(1 for i, t in enumerate(state["layers"]) if bool((t == 1.0 + i).all()))
        print(json.dumps({"rank": 2, "failed": failed, "received_before": new}), flush=True)
    elif rank == 0:
        real = transfer._Link.post_send
        posted = [0]

        def slow(link: transfer._Link, buf: torch.Tensor, tag: int) -> list:
            if posted[0] == 2 + 6:  # header, description, six tensors posted: they go out meanwhile
                print(json.dumps({"rank": 0, "waiting": True}), flush=True)
                time.sleep(60)  # a slow sender: killed by the test meanwhile
            posted[0] += 1
            return real(link, buf, tag)

        transfer._Link.post_send = slow  # type: ignore[method-assign]
        transfer.share(state, [0, 1], rank=0, world=3, device=torch.device("cpu"))
    else:
        transfer.share(state, [0, 1], rank=rank, world=3, device=torch.device("cpu"))
    if rank == 1 or rank == 2:  # the survivors: a new group, the other holder sends
        dist.destroy_process_group()
        group(rank - 1, 2, port2)
        received, nbytes = transfer.share(state, [0], rank=rank - 1, world=2, device=torch.device("cpu"))
        final = received if received is not None else state
        print(json.dumps({"rank": rank, "digest": digest(final), "bytes": nbytes}), flush=True)
        dist.destroy_process_group()


def abandoned(rank: int, port: int) -> None:
    fence = Fence()
    fence.arm(1)
    before = tcp_sockets()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    fence.add_sockets(opened_since(before))
    state = {"big": torch.full((100_000_000,), float(1 - rank))}  # 400 MB: one message, received in place
    tripped: list[float] = []

    def trip() -> None:  # as the runtime's control thread trips it: from another thread, when told (stdin)
        if sys.stdin.readline().strip() == "trip":
            tripped.append(time.monotonic())
            fence.overtaken(2)

    threading.Thread(target=trip, daemon=True).start()
    dist.barrier()
    print(json.dumps({"rank": rank, "transferring": True}), flush=True)
    try:
        transfer.share(state, [0], rank=rank, world=2, device=torch.device("cpu"), fence=fence)
        outcome = "completed"
    except Abandoned as e:
        outcome = f"abandoned: {e}"
    except RuntimeError as e:
        outcome = f"failed: {str(e).splitlines()[0][:200]}"
    ended = time.monotonic()
    print(json.dumps({"rank": rank, "outcome": outcome, "after_trip": ended - tripped[0] if tripped else None,
                      "cut": bool((state["big"][:1000] == 1.0).all() and (state["big"][-1000:] == 0.0).all())}),
          flush=True)
    os._exit(0)  # the abandoned receive is still blocked in gloo until its timeout: leave without joining it


def tampered(rank: int, port: int) -> None:
    """World 2: rank 0 sends a 2 MB tensor (its own message) and small ones (packed); rank 1 changes one byte of each
    message as it arrives, the first time only (`tamper`), and prints what it ends with."""
    torch.manual_seed(0 if rank == 0 else 1)
    state = {"step": 5, "big": torch.randn(1 << 19), "small": [torch.randn(7), torch.arange(5)]}
    group(rank, 2, port)
    changed = []

    def tamper(attempt: int, message: int, buf: torch.Tensor) -> None:
        if attempt == 0:
            buf.view(torch.uint8)[-1] ^= 0x10
            changed.append(message)

    received, nbytes = transfer.share(state, [0], rank=rank, world=2, device=torch.device("cpu"), tamper=tamper)
    final = received if received is not None else state
    print(json.dumps({"rank": rank, "digest": digest(final), "bytes": nbytes, "changed": changed}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    if scenario == "exact":
        exact(rank, world, port)
    elif scenario == "abandoned":
        abandoned(rank, port)
    elif scenario == "tampered":
        tampered(rank, port)
    else:
        killed(rank, port, int(sys.argv[5]))


if __name__ == "__main__":
    main()
