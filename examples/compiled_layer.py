"""A small OSDN attention model under torch.compile(fullgraph=True), trained on associative recall.

The task: a sequence of (key, value) token pairs, then a query key; the model must output the
value that followed that key. Each layer projects q, k, v, beta (and optionally a scalar or
per-channel gate), runs a short causal convolution over k, then ``osdn_ops.osdn``
(precond_scan followed by the asym delta rule). Runs on the CPU in under a minute:

    python examples/compiled_layer.py --steps 30
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import osdn_ops


class OSDNAttention(nn.Module):
    """Multi-head OSDN attention: ``x [B, T, D] -> [B, T, D]``; ``gate`` in none/scalar/channel."""

    def __init__(self, dim: int, heads: int, head_dim: int, gate: str = "none", conv: int = 4):
        super().__init__()
        self.h, self.dk, self.gate = heads, head_dim, gate
        self.qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.beta = nn.Linear(dim, heads)
        self.g = {"none": None, "scalar": nn.Linear(dim, heads), "channel": nn.Linear(dim, heads * head_dim)}[gate]
        self.conv = nn.Conv1d(heads * head_dim, heads * head_dim, conv, groups=heads * head_dim, padding=conv - 1)
        self.out = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k = rearrange(self.conv(rearrange(k, "b t c -> b c t"))[..., :T], "b c t -> b t c")  # short causal conv
        q, k, v = (rearrange(t, "b t (h d) -> b t h d", h=self.h) for t in (q, k, v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = torch.sigmoid(self.beta(x))
        g = None
        if self.g is not None:
            g = F.logsigmoid(self.g(x)) / 16
            g = g if self.gate == "scalar" else rearrange(g, "b t (h d) -> b t h d", h=self.h)
        o, _, _ = osdn_ops.osdn(q, k, v, beta, g, eta=0.003)
        return self.out(rearrange(o, "b t h d -> b t (h d)"))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, heads: int = 2, head_dim: int = 32, layers: int = 2,
                 gate: str = "none"):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(OSDNAttention(dim, heads, head_dim, gate) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return self.head(x)


def recall_batch(batch: int, pairs: int, keys: int, values: int, gen: torch.Generator):
    """Tokens ``[batch, 2 * pairs + 1]`` (k1 v1 ... kn vn k?) and the value each query asks for."""
    k = torch.stack([torch.randperm(keys, generator=gen)[:pairs] for _ in range(batch)])
    v = keys + torch.randint(0, values, (batch, pairs), generator=gen)
    ask = torch.randint(0, pairs, (batch,), generator=gen)
    tokens = torch.cat([torch.stack([k, v], -1).flatten(1), k.gather(1, ask[:, None])], 1)
    return tokens, v.gather(1, ask[:, None])[:, 0]


def train(steps: int = 30, gate: str = "none", seed: int = 0, log=print) -> list[float]:
    """Train for ``steps`` steps; returns the losses."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    keys, values, pairs = 16, 16, 8
    model = Model(keys + values, gate=gate)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    @torch.compile(fullgraph=True)
    def loss_fn(tokens, target):
        return F.cross_entropy(model(tokens)[:, -1], target)

    losses = []
    for step in range(steps):
        tokens, target = recall_batch(32, pairs, keys, values, gen)
        loss = loss_fn(tokens, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"step {step:4d}  loss {loss.item():.3f}")
    return losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gate", choices=["none", "scalar", "channel"], default="none")
    args = ap.parse_args()
    train(args.steps, args.gate)
