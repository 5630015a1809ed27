"""Running a per-sequence function over a batch or over packed variable-length sequences.

Every op restarts its states at each sequence start. Without ``cu_seqlens`` the B rows
are the sequences (N = B) and run as one batch; with ``cu_seqlens`` (B == 1) sequence n
is tokens ``[cu_seqlens[n], cu_seqlens[n+1])`` and runs alone, as a batch of one.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor


def compute_dtype(t: Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def per_sequence(
    fn: Callable[..., tuple[Tensor, Tensor]],
    tokens: Sequence[Optional[Tensor]],
    state: Tensor,
    cu_seqlens: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """Apply ``fn(*tokens, state) -> (out [b,t,...], state [b,...])`` per sequence.

    ``tokens``: tensors (or None) shaped ``[B, T, ...]``; ``state``: ``[N, ...]``.
    Returns ``out [B, T, ...]`` and the final states ``[N, ...]``.
    """
    if cu_seqlens is None:
        return fn(*tokens, state)
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        piece = [None if x is None else x[:, s:e] for x in tokens]
        out, st = fn(*piece, state[n : n + 1])
        outs.append(out)
        states.append(st)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)
