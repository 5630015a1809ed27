"""The symmetric parents of the asym ops, token by token, in the paper's convention.

Independent of ``asym.py`` (own loops and state layouts), so that the reduction property
"an asym op with ``k_tilde = k`` is its parent" compares two code paths.

- :func:`delta_rule`       DeltaNet,       state ``S: V x K``: ``S_t = S_{t-1}(I - b k k^T) + b v k^T``
- :func:`gated_delta_rule` Gated DeltaNet, state ``S: V x K``: ``S_t = a_t S_{t-1}(I - b k k^T) + b v k^T``
- :func:`kda`              KDA,            state ``S: K x V``: ``S_t = (I - b k k^T) Diag(a_t) S_{t-1} + b k v^T``

with ``a_t = exp(g_t)``, ``b = beta_t``; outputs ``o_t = scale S_t q_t`` (KDA: ``scale S_t^T q_t``).
Shapes: ``q, k [B,T,H,K]``, ``v [B,T,H,V]``, ``beta [B,T,H]``, ``g [B,T,H]`` (gated) or
``[B,T,H,K]`` (KDA), ``initial_state [N,H,V,K]`` (KDA ``[N,H,K,V]``), ``cu_seqlens [N+1]``.
Returns ``o [B,T,H,V]`` (v's dtype) and the final state (float32; float64 for float64 v).
Everything is computed in the state dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["delta_rule", "gated_delta_rule", "kda"]


def _bounds(B: int, T: int, cu_seqlens: Optional[Tensor]) -> list[tuple[int, int, int]]:
    """(batch row, first token, end token) of each sequence, in state order."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def _run(step, q, k, v, g, beta, initial_state, scale, cu_seqlens, state_rows: int, state_cols: int):
    """Drive ``step(S, q_t, k_t, v_t, g_t, beta_t) -> S`` per sequence and head; ``o_t = scale * out(S, q_t)``."""
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    B, T, H, _ = q.shape
    seqs = _bounds(B, T, cu_seqlens)
    o = torch.zeros(v.shape, dtype=dt, device=v.device)
    final = torch.zeros(len(seqs), H, state_rows, state_cols, dtype=dt, device=v.device)
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    g = None if g is None else g.to(dt)
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = (torch.zeros(state_rows, state_cols, dtype=dt, device=v.device) if initial_state is None
                 else initial_state[n, h].to(dt))
            for t in range(start, end):
                S, out = step(S, q[b, t, h], k[b, t, h], v[b, t, h], None if g is None else g[b, t, h], beta[b, t, h])
                o[b, t, h] = scale * out
            final[n, h] = S
    return o.to(v.dtype), final


def _delta_step(S, q, k, v, g, b):
    """V x K state; gated when ``g`` is a scalar log-decay."""
    eye = torch.eye(k.shape[0], dtype=S.dtype, device=S.device)
    alpha = 1.0 if g is None else torch.exp(g)
    S = alpha * S @ (eye - b * torch.outer(k, k)) + b * torch.outer(v, k)
    return S, S @ q


def _kda_step(S, q, k, v, g, b):
    """K x V state, per-channel log-decay ``g [K]``."""
    eye = torch.eye(k.shape[0], dtype=S.dtype, device=S.device)
    S = (eye - b * torch.outer(k, k)) @ torch.diag(torch.exp(g)) @ S + b * torch.outer(k, v)
    return S, S.transpose(0, 1) @ q


def delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Optional[Tensor] = None, *,
               scale: float, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """DeltaNet. State ``[N,H,V,K]``."""
    K, V = k.shape[-1], v.shape[-1]
    return _run(_delta_step, q, k, v, None, beta, initial_state, scale, cu_seqlens, V, K)


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     initial_state: Optional[Tensor] = None, *, scale: float,
                     cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet, scalar log-decay ``g [B,T,H]``. State ``[N,H,V,K]``."""
    K, V = k.shape[-1], v.shape[-1]
    return _run(_delta_step, q, k, v, g, beta, initial_state, scale, cu_seqlens, V, K)


def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor] = None, *,
        scale: float, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """KDA, per-channel log-decay ``g [B,T,H,K]``. State ``[N,H,K,V]``."""
    K, V = k.shape[-1], v.shape[-1]
    return _run(_kda_step, q, k, v, g, beta, initial_state, scale, cu_seqlens, K, V)
