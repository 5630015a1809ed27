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
    d_init = torch.ones(N, H, K, dtype=dt, device=k.device) if d0 is None else d0.to(dt).clone()
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


def _scan_bwd(k, beta, r, dkt, states, *, eta, d_min, d_max, eps, beta_aware):
    """Reverse-time adjoint of :func:`_scan` for one batch of sequences.

    ``states`` stacks ``d0`` and the gradient of ``d_final``: ``[b,2,H,K]``. Recomputes the
    trajectory ``d_t``, then walks back through the clamp (gradient where
    ``d_min <= pre <= d_max``, as torch.clamp) and the eps floor (where ``|k|^2 >= eps``).
    Returns ``(grads [b,t,H,K+2] = dk | dbeta | dretention, dd0 [b,H,K])``.
    """
    traj, _ = _scan(k, beta, r, states[:, 0], eta=eta, d_min=d_min, d_max=d_max, eps=eps,
                    beta_aware=beta_aware, trajectory=True)
    dd = states[:, 1]
    out = torch.zeros(*k.shape[:3], k.shape[3] + 2, dtype=k.dtype, device=k.device)
    for t in reversed(range(k.shape[1])):
        d, kk, bt = traj[:, t], k[:, t], beta[:, t, :, None]
        rt = 1.0 if r is None else r[:, t, :, None]
        s = kk * kk
        ssum = s.sum(-1, keepdim=True)
        nb = torch.clamp(ssum, min=eps)
        dot = (d * s).sum(-1, keepdim=True)
        ba = bt if beta_aware else 1.0
        c = eta * ba / nb
        m = 1 - ba * dot
        pre = rt * d + c * m * s
        dpre = dd * ((pre >= d_min) & (pre <= d_max))
        dz = (dpre * s).sum(-1, keepdim=True)            # z = c * m
        ds = dpre * c * m
        da = -dz * c                                        # a = ba * dot
        ds = ds + da * ba * d
        dnb = -dz * m * c / nb
        ds = ds + dnb * (ssum >= eps)
        out[:, t, :, :-2] = 2 * kk * ds + dkt[:, t] * d
        if beta_aware:
            out[:, t, :, -2] = (da * dot + dz * m * eta / nb)[..., 0]
        out[:, t, :, -1] = (dpre * d).sum(-1)
        dd = dpre * rt + da * ba * s + dkt[:, t] * kk
    return out, dd


def precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max,
                     eps, beta_aware):
    """CPU kernel, backward: the reverse-time adjoint scan, per sequence.

    Returns ``(dk, dbeta, dd0, dretention)``; ``dd0`` is ``[N,H,K]`` in the state dtype (the
    gradient to the default all-ones ``d0`` when none was given), ``dretention`` has
    retention's shape or is empty when there is no retention.
    """
    dt = compute_dtype(k)
    B, T, H, K = k.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    d_init = torch.ones(N, H, K, dtype=dt, device=k.device) if d0 is None else d0.to(dt)
    states = torch.stack([d_init, dd_final.to(dt)], 1)
    r = None if retention is None else retention.to(dt)

    def fn(k_, b_, r_, dkt_, st):
        return _scan_bwd(k_, b_, r_, dkt_, st, eta=eta, d_min=d_min, d_max=d_max, eps=eps, beta_aware=beta_aware)

    grads, dd0 = per_sequence(fn, [k.to(dt), beta.to(dt), r, dk_tilde.to(dt)], states, cu_seqlens)
    dr = grads[..., -1].to(retention.dtype) if retention is not None else k.new_empty(0, dtype=dt)
    # fresh tensors: slices of one buffer would alias each other, which custom ops forbid
    return tuple(x.clone(memory_format=torch.contiguous_format) for x in (grads[..., :-2].to(k.dtype), grads[..., -2].to(beta.dtype), dd0, dr))
