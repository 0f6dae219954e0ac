#!/usr/bin/env python3
"""A small GPT-style language model on toolkit.train with AdamW: about 670 MB of model + optimizer state.

The configuration of bench/recovery_at_size.py (in-place recovery at a size users train, against torchrun's restart
of the same script from its newest checkpoint). It runs as any ported script does: alone, under torchrun, under
toolkit. Synthetic tokens (a function of the seed), so it needs no data set.

Output: `epoch: E, step: S, loss is L` per step; the Trainer's `rank R: resumed from step S ...` lines; at the end
`state: N bytes of model + optimizer, peak RSS M MB` per rank and, on rank 0, `final parameters: - sha256 HEX` (a
digest of the parameters' names and bytes, so that runs can be compared bit for bit from their logs).
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import toolkit.train
from toolkit.train import determinism


class LM(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks with a causal mask, a head tied to the input
    embedding."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        nn.init.normal_(self.tokens.weight, std=0.02)
        self.positions = nn.Parameter(torch.zeros(seq, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x) + self.positions[: x.shape[1]]
        return self.head(self.norm(self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sequences", type=int, default=240, help="sequences in the data set (an epoch)")
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step")
    args = p.parse_args()
    determinism.configure(1)
    determinism.seed_all(args.seed)
    model = LM(args.vocab, args.width, args.layers, heads=12, seq=args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the CPU kernel: 5x faster here
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.sequences, args.seq + 1), generator=g)
    rt = toolkit.train.init(timeout=120)
    sampler = DistributedSampler(TensorDataset(tokens), rt.world_size, rt.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(TensorDataset(tokens), batch_size=args.batch_size, sampler=sampler)
    trainer = toolkit.train.Trainer(rt, model, optimizer, loader, ckpt_every=args.ckpt_every, keep=2, seed=args.seed)
    for (batch,) in trainer.batches(args.epochs):
        with trainer.step() as step:
            optimizer.zero_grad(set_to_none=True)
            logits = trainer.model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            print(f"epoch: {trainer.epoch}, step: {step}, loss is {loss.item():.6f}", flush=True)
        time.sleep(args.step_delay)
    trainer.finish()
    state = sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
        if isinstance(t, torch.Tensor))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"state: {state} bytes of model + optimizer, peak RSS {peak:.0f} MB", flush=True)
    if rt.rank == 0:
        print(f"final parameters: - sha256 {digest(model)}", flush=True)


if __name__ == "__main__":
    main()
