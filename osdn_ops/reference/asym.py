"""The asymmetric-key delta rule in plain PyTorch (DESIGN §4): oracle and CPU kernels.

One recurrence serves the three ops, selected by ``gate``:

- ``"none"``    chunk_delta_asym        (no g)
- ``"scalar"``  chunk_gated_delta_asym  (g ``[B,T,H]``)
- ``"channel"`` chunk_kda_asym          (g ``[B,T,H,K]``)

Shapes: ``q, k, k_tilde [B,T,H,K]``, ``v [B,T,H,V]``, ``beta [B,T,H]``. States use the public
layout of the op: ``[N,H,V,K]`` for "none"/"scalar", ``[N,H,K,V]`` for "channel"; inside, the
state is always ``S: K x V``. Outputs: ``o [B,T,H,V]`` in v's dtype and the final state in
float32 (float64 for float64 inputs).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .sequences import compute_dtype, per_sequence

GATES = ("none", "scalar", "channel")


def state_shape(gate: str, N: int, H: int, K: int, V: int) -> tuple[int, int, int, int]:
    """Public state shape of the op with this gate."""
    return (N, H, K, V) if gate == "channel" else (N, H, V, K)


def _to_kv(state: Tensor, gate: str) -> Tensor:
    """Public layout -> internal K x V (and back: the map is its own inverse)."""
    return state if gate == "channel" else state.transpose(-1, -2)


def _recurrent(q, k, kt, v, g, beta, S, *, scale, gate):
    """q,k,kt [b,t,H,K], v [b,t,H,V], g [b,t,H(,K)] or None, beta [b,t,H], S [b,H,K,V]."""
    outs = []
    for t in range(q.shape[1]):
        if gate == "scalar":
            S = torch.exp(g[:, t])[..., None, None] * S
        elif gate == "channel":
            S = torch.exp(g[:, t])[..., :, None] * S
        u = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * kt[:, t, :, :, None] * u[:, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def asym_recurrent(q, k, k_tilde, v, g, beta, initial_state=None, *, scale, gate, cu_seqlens=None):
    """Token-by-token asymmetric delta rule, differentiable by autograd (the test oracle).

    Returns ``(o, final_state)`` in the op's public state layout (see module docstring).
    """
    dt = compute_dtype(v)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S0 = (torch.zeros(state_shape(gate, N, H, K, V), dtype=dt, device=v.device)
          if initial_state is None else initial_state.to(dt, copy=True))
    cast = [x if x is None else x.to(dt) for x in (q, k, k_tilde, v, g, beta)]

    def fn(q_, k_, kt_, v_, g_, b_, S_):
        return _recurrent(q_, k_, kt_, v_, g_, b_, S_, scale=scale, gate=gate)

    o, S = per_sequence(fn, cast, _to_kv(S0, gate), cu_seqlens)
    return o.to(v.dtype).contiguous(), _to_kv(S, gate).contiguous()


def _chunked(q, k, kt, v, g, beta, S, *, scale, gate, C):
    """WY chunk form of one batch of sequences (DESIGN §4); same shapes as ``_recurrent``."""
    b, T, H, K = q.shape
    n = -(-T // C)
    pad = n * C - T

    def chunks(x):  # [b,T,H,...] -> [b,H,n,C,...]; zero padding leaves the state untouched
        x = x.movedim(2, 1)
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad)) if pad else x
        return x.reshape(b, H, n, C, *x.shape[3:])

    qc, kc, ktc, vc = chunks(q), chunks(k), chunks(kt), chunks(v)
    bc = chunks(beta)[..., None]                                     # [b,H,n,C,1]
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if gate == "none":
        A = (kc @ ktc.transpose(-1, -2)) * bc
        P = qc @ ktc.transpose(-1, -2)
        kg, qg, kt_end = kc, qc, ktc
        last = None
    else:
        G = chunks(g if gate == "channel" else g[..., None]).cumsum(-2)   # [b,H,n,C,K or 1]
        diff = G[..., :, None, :] - G[..., None, :, :]                     # [.., t, j, K or 1]
        decay = torch.exp(torch.where(incl[..., None], diff, float("-inf")))
        if gate == "scalar":
            decay = decay[..., 0]
            A = (kc @ ktc.transpose(-1, -2)) * decay * bc
            P = (qc @ ktc.transpose(-1, -2)) * decay
        else:
            A = torch.einsum("...tc,...jc,...tjc->...tj", kc, ktc, decay) * bc
            P = torch.einsum("...tc,...jc,...tjc->...tj", qc, ktc, decay)
        eG = torch.exp(G)
        last = eG[..., -1:, :]                                              # [.., 1, K or 1]
        kg, qg = kc * eG, qc * eG
        kt_end = ktc * torch.exp(G[..., -1:, :] - G)
    A = A.masked_fill(~strict, 0)
    P = P.masked_fill(~incl, 0) * scale
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    W = Tm @ (kg * bc)
    U = Tm @ (vc * bc)
    outs = []
    for i in range(n):
        vnew = U[:, :, i] - W[:, :, i] @ S
        outs.append(scale * (qg[:, :, i] @ S) + P[:, :, i] @ vnew)
        decayed = S if last is None else last[:, :, i].transpose(-1, -2) * S
        S = decayed + kt_end[:, :, i].transpose(-1, -2) @ vnew
    o = torch.stack(outs, dim=2).reshape(b, H, n * C, -1)[:, :, :T].movedim(1, 2)
    return o, S


def asym_chunked(q, k, k_tilde, v, g, beta, initial_state=None, *, scale, gate, cu_seqlens=None,
                 chunk_size: int = 64):
    """Chunked (WY) asymmetric delta rule; same contract as :func:`asym_recurrent`."""
    dt = compute_dtype(v)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S0 = (torch.zeros(state_shape(gate, N, H, K, V), dtype=dt, device=v.device)
          if initial_state is None else initial_state.to(dt, copy=True))
    cast = [x if x is None else x.to(dt) for x in (q, k, k_tilde, v, g, beta)]

    def fn(q_, k_, kt_, v_, g_, b_, S_):
        if q_.shape[1] == 0:
            return v_.new_zeros(v_.shape), S_
        return _chunked(q_, k_, kt_, v_, g_, b_, S_, scale=scale, gate=gate, C=chunk_size)

    o, S = per_sequence(fn, cast, _to_kv(S0, gate), cu_seqlens)
    return o.to(v.dtype).contiguous(), _to_kv(S, gate).contiguous()


def chunk_asym_fwd(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate):
    """CPU kernel, forward: ``(o, final_state)``."""
    with torch.no_grad():
        return asym_chunked(q, k, k_tilde, v, g, beta, initial_state, scale=scale, gate=gate,
                            cu_seqlens=cu_seqlens)


def chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate):
    """CPU kernel, backward: the vector-Jacobian product of the recomputed chunk form.

    Returns ``(dq, dk, dk_tilde, dv, dg, dbeta, dh0)``, each in its input's dtype; ``dg`` is
    empty when there is no gate; ``dh0`` has the public state shape (the gradient to the
    default zero state when none was given).
    """
    dt = compute_dtype(v)
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = (torch.zeros(state_shape(gate, N, H, K, v.shape[-1]), dtype=dt, device=v.device)
          if initial_state is None else initial_state.to(dt))
    gg = g.to(dt) if g is not None else v.new_empty(0, dtype=dt)

    def run(q_, k_, kt_, v_, g_, b_, h_):
        return asym_chunked(q_, k_, kt_, v_, g_ if g is not None else None, b_, h_, scale=scale, gate=gate,
                            cu_seqlens=cu_seqlens)

    xs = [x.to(dt) for x in (q, k, k_tilde, v)]
    _, pull = torch.func.vjp(run, *xs, gg, beta.to(dt), h0)
    dq, dk, dkt, dv, dg, dbeta, dh0 = pull((do.to(dt), dht.to(dt)))
    dg = dg.to(g.dtype) if g is not None else dg
    grads = (dq.to(q.dtype), dk.to(k.dtype), dkt.to(k_tilde.dtype), dv.to(v.dtype), dg, dbeta.to(beta.dtype), dh0)
    return tuple(x.contiguous() for x in grads)
