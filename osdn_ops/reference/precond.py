"""precond_scan in plain PyTorch: the token-by-token oracle and the CPU kernels (DESIGN §3).

Shapes: ``k [B,T,H,K]``, ``beta [B,T,H]``, ``d0 [N,H,K]`` (default ones),
``retention [B,T,H]`` (default ones), ``cu_seqlens [N+1]`` or None.
Returns ``k_tilde [B,T,H,K]`` (k's dtype) and ``d_final [N,H,K]`` (float32, float64 for
float64 keys). Computation runs in float32 (float64 for float64 keys).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .sequences import compute_dtype, per_sequence


def _scan(k, beta, r, d, *, eta, d_min, d_max, eps, beta_aware, trajectory=False):
    """One batch of sequences: k [b,t,H,K], beta/r [b,t,H], d [b,H,K] -> (k_tilde, d_final).

    With ``trajectory`` the first output holds ``d_t`` (the value used at token t) instead.
    """
    outs = []
    for t in range(k.shape[1]):
        kt = k[:, t]
        bt = beta[:, t, :, None]
        s = kt * kt
        nb = torch.clamp(s.sum(-1, keepdim=True), min=eps)
        outs.append(d if trajectory else d * kt)
        a = (d * s).sum(-1, keepdim=True)
        if beta_aware:
            a = bt * a
            c = eta * bt / nb
        else:
            c = eta / nb
        decay = d if r is None else r[:, t, :, None] * d
        d = torch.clamp(decay + c * (1 - a) * s, d_min, d_max)
    if outs:
        out = torch.stack(outs, dim=1)
    else:
        out = k.new_zeros(k.shape)
    return out, d


def precond_scan_recurrent(
    k: Tensor,
    beta: Tensor,
    d0: Optional[Tensor] = None,
    retention: Optional[Tensor] = None,
    *,
    eta: float,
    d_min: float,
    d_max: float,
    eps: float,
    beta_aware: bool,
    cu_seqlens: Optional[Tensor] = None,
    trajectory: bool = False,
) -> tuple[Tensor, Tensor]:
    """Token-by-token precond_scan, differentiable by autograd (the test oracle).

    With ``trajectory=True`` the first output is ``d_t`` per token (``[B,T,H,K]``, compute
    dtype) rather than ``k_tilde``, for invariant checks.
    """
    dt = compute_dtype(k)
    B, T, H, K = k.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    d_init = torch.ones(N, H, K, dtype=dt, device=k.device) if d0 is None else d0.to(dt, copy=True)
    r = None if retention is None else retention.to(dt)

    def fn(k_, b_, r_, d_):
        return _scan(k_, b_, r_, d_, eta=eta, d_min=d_min, d_max=d_max, eps=eps,
                     beta_aware=beta_aware, trajectory=trajectory)

    out, d_final = per_sequence(fn, [k.to(dt), beta.to(dt), r], d_init, cu_seqlens)
    return (out if trajectory else out.to(k.dtype)).contiguous(), d_final


def precond_scan_fwd(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware):
    """CPU kernel, forward: see the module docstring for shapes."""
    with torch.no_grad():
        return precond_scan_recurrent(k, beta, d0, retention, eta=eta, d_min=d_min, d_max=d_max,
                                      eps=eps, beta_aware=beta_aware, cu_seqlens=cu_seqlens)


def precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max,
                     eps, beta_aware):
    """CPU kernel, backward: the vector-Jacobian product of the recomputed scan.

    ``torch.func.vjp`` rather than ``torch.autograd`` because a custom op's kernel runs below
    the autograd dispatch keys. Returns ``(dk, dbeta, dd0, dretention)``; ``dd0`` is
    ``[N,H,K]`` in the state dtype (the gradient to the default all-ones ``d0`` when none was
    given), ``dretention`` has retention's shape or is empty when there is no retention.
    """
    dt = compute_dtype(k)
    B, T, H, K = k.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    d_init = torch.ones(N, H, K, dtype=dt, device=k.device) if d0 is None else d0.to(dt)
    r = retention.to(dt) if retention is not None else k.new_empty(0, dtype=dt)

    def scan(k_, b_, d_, r_):
        return precond_scan_recurrent(k_, b_, d_, r_ if retention is not None else None, eta=eta, d_min=d_min,
                                      d_max=d_max, eps=eps, beta_aware=beta_aware, cu_seqlens=cu_seqlens)

    _, pull = torch.func.vjp(scan, k.to(dt), beta.to(dt), d_init, r)
    dk, dbeta, dd0, dr = pull((dk_tilde.to(dt), dd_final.to(dt)))
    dr = dr.to(retention.dtype) if retention is not None else dr
    return tuple(x.contiguous() for x in (dk.to(k.dtype), dbeta.to(beta.dtype), dd0, dr))
