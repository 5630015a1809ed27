"""Triton precond_scan backward: a reverse-time adjoint scan (DESIGN §3).

Shapes as in ``precond``: ``dk_tilde [B,T,H,K]``, ``dd_final [N,H,K]`` -> ``dk`` (k's dtype),
``dbeta`` (beta's dtype), ``dd0 [N,H,K]`` fp32, ``dretention`` (retention's dtype, or empty [0] fp32).

What is saved and what is recomputed: the forward's only outputs are ``k_tilde`` and ``d_final``,
and the autograd function keeps just the inputs, so the backward must rebuild ``d_t``. Storing the
whole trajectory would cost a fp32 ``[B,T,H,K]`` buffer (twice the bf16 keys) written and read once;
instead

1. the forward kernel (``precond_fwd``, in the same form) runs again and writes only ``d`` at every
   chunk start to a checkpoint buffer (``[slots, H, BK]`` fp32, one row per 64-token chunk);
2. one program per (sequence, head) walks the chunks backwards: recomputes the chunk's ``d_t`` from
   its checkpoint into a per-program scratch ``[C, BK]`` (it stays in L2), then runs the adjoint
   token by token from the chunk's last token to its first. The recompute goes token by token
   unless ``RECOMPUTE_PARALLEL`` (chunk-parallel form where its check passes, with the precompute
   of step 1): that form's tiles want 4-8 warps, which slow the adjoint's per-token reductions
   (one warp otherwise); which costs less is measured by benchmarks/bench_precond.py.

The adjoint of one token, with ``gpre = g * [d_min <= pre <= d_max]`` (torch.clamp's convention)::

    sigma = <gpre, s>;  da = -c sigma;  dc = (1 - a) sigma
    dr    = <gpre, d>
    ds    = c (1 - a) gpre + da b' d          (b' = beta if beta_aware else 1)
    dn    = -dc c / nb  where ||k||^2 >= eps (torch.clamp(min=eps)'s convention), else 0
    dk    = dk_tilde * d + 2 k (ds + dn)
    dbeta = da <d, s> + dc eta / nb          (beta_aware; 0 otherwise)
    g    <- r gpre + dk_tilde * k + da b' s   (the gradient to d_t)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .precond_fwd import forward_pass
from .precond_parallel import advance, num_warps, precompute
from .precond_tokens import CHUNK, block_k, flag_slots, load_token, scan_tokens, sequence_bounds, sequences, token_coefs

#: recompute each chunk's trajectory in the chunk-parallel form inside the adjoint kernel
RECOMPUTE_PARALLEL = False


@triton.jit
def token_adjoint(g, d, kv, b, r, gkt, eta, d_min, d_max, eps, BETA_AWARE: tl.constexpr):
    """One token's adjoint: returns ``(g for d_t, dk [BK], dbeta, dr)`` (see the module docstring)."""
    s, n2, nb, c, bb = token_coefs(kv, b, eta, eps, BETA_AWARE)
    ds_d = tl.sum(d * s, 0)
    a = bb * ds_d
    pre = r * d + c * (1.0 - a) * s
    gpre = tl.where((pre >= d_min) & (pre <= d_max), g, 0.0)
    sigma = tl.sum(gpre * s, 0)
    dr = tl.sum(gpre * d, 0)
    da = -c * sigma
    dc = (1.0 - a) * sigma
    ds = c * (1.0 - a) * gpre + da * bb * d
    dn = tl.where(n2 >= eps, -dc * c / nb, 0.0)
    dk = gkt * d + 2.0 * kv * (ds + dn)
    if BETA_AWARE:
        dbeta = da * ds_d + dc * eta / nb
    else:
        dbeta = dr * 0.0
    g = r * gpre + gkt * kv + da * bb * s
    return g, dk, dbeta, dr


@triton.jit
def reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t, t0, h, H, K, HAS_R: tl.constexpr, BK: tl.constexpr):
    """Token ``t``'s ``d_t`` (from the chunk scratch), key, beta, retention and ``dk_tilde``; nothing is
    read for ``t < t0`` (before the chunk)."""
    offs = tl.arange(0, BK)
    valid = t >= t0
    dt = tl.load(traj + (t - t0) * BK + offs, mask=valid, other=0.0)
    kv, b, r = load_token(k_ptr, beta_ptr, r_ptr, t, h, H, K, offs, HAS_R, valid)
    gkt = tl.load(dkt_ptr + (t * H + h) * K + offs, mask=(offs < K) & valid, other=0.0).to(tl.float32)
    return dt, kv, b, r, gkt


@triton.jit(do_not_specialize=["T", "H", "K"])
def _precond_bwd_kernel(dkt_ptr, ddf_ptr, k_ptr, beta_ptr, r_ptr, cu_ptr, m_ptr, w0_ptr, dk_ptr, dbeta_ptr, dr_ptr,
                        dd0_ptr, ckpt_ptr, traj_ptr, T, H, K, eta, d_min, d_max, eps, HAS_R: tl.constexpr,
                        VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, PARALLEL: tl.constexpr, C: tl.constexpr,
                        BK: tl.constexpr):
    """Grid (N, H). ``ckpt`` rows ``(bos // C + n + j) * H + h`` (filled by the forward kernel);
    ``traj`` ``[N*H, C, BK]``; ``m``, ``w0``: the parallel form's precompute."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    offs = tl.arange(0, BK)
    mk = offs < K
    slot = bos // C + n
    g = tl.load(ddf_ptr + (n * H + h) * K + offs, mask=mk, other=0.0).to(tl.float32)
    traj = traj_ptr + (n * H + h) * C * BK
    nchunks = (eos - bos + C - 1) // C
    for jj in range(0, nchunks):
        j = nchunks - 1 - jj
        t0 = bos + j * C
        t1 = tl.minimum(t0 + C, eos)
        d = tl.load(ckpt_ptr + ((slot + j) * H + h) * BK + offs)
        if PARALLEL:
            d, fb = advance(d, k_ptr, beta_ptr, r_ptr, m_ptr, w0_ptr, k_ptr, traj, t0, t1, h, H, K, eta, d_min,
                            d_max, eps, HAS_R, BETA_AWARE, False, True, C, BK)
        else:
            d = scan_tokens(d, k_ptr, beta_ptr, r_ptr, k_ptr, traj, traj, t0, t1, h, H, K, eta, d_min, d_max, eps,
                            HAS_R, BETA_AWARE, False, True, False, C, BK)
        tl.debug_barrier()
        # the serial chain (three reductions per token) is shorter than a load: inputs are loaded
        # four tokens ahead (earlier in time), in a rotation of four register sets
        d1, k1, b1, r1, g1 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 1, t0, h, H, K, HAS_R, BK)
        d2, k2, b2, r2, g2 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 2, t0, h, H, K, HAS_R, BK)
        d3, k3, b3, r3, g3 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 3, t0, h, H, K, HAS_R, BK)
        d4, k4, b4, r4, g4 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 4, t0, h, H, K, HAS_R, BK)
        for tt in range(0, t1 - t0):
            t = t1 - 1 - tt
            dn, kn, bn, rn, gn = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t - 4, t0, h, H, K, HAS_R, BK)
            g, dk, dbeta, dr = token_adjoint(g, d1, k1, b1, r1, g1, eta, d_min, d_max, eps, BETA_AWARE)
            tl.store(dk_ptr + (t * H + h) * K + offs, dk.to(dk_ptr.dtype.element_ty), mask=mk)
            tl.store(dbeta_ptr + t * H + h, dbeta.to(dbeta_ptr.dtype.element_ty))
            if HAS_R:
                tl.store(dr_ptr + t * H + h, dr.to(dr_ptr.dtype.element_ty))
            d1, k1, b1, r1, g1, d2, k2, b2, r2, g2 = d2, k2, b2, r2, g2, d3, k3, b3, r3, g3
            d3, k3, b3, r3, g3, d4, k4, b4, r4, g4 = d4, k4, b4, r4, g4, dn, kn, bn, rn, gn
        tl.debug_barrier()
    tl.store(dd0_ptr + (n * H + h) * K + offs, g, mask=mk)


def backward(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, parallel):
    """Launch the checkpoint pass and the backward kernel; returns ``(dk, dbeta, dd0, dretention)``.

    ``parallel``: the checkpoint pass (and, with ``RECOMPUTE_PARALLEL``, the in-kernel recompute) in
    the chunk-parallel form (padded K <= 128), else the token loop.
    """
    B, T, H, K = k.shape
    N = sequences(k, cu_seqlens)
    BK = block_k(K)
    dk = torch.empty_like(k)
    dbeta = torch.empty_like(beta)
    dd0 = torch.empty(N, H, K, dtype=torch.float32, device=k.device)
    dr = torch.empty_like(retention) if retention is not None else torch.empty(0, dtype=torch.float32,
                                                                               device=k.device)
    if N * H > 0:
        recompute = bool(parallel and RECOMPUTE_PARALLEL)
        scratch = precompute(k, beta, retention, cu_seqlens, eta, eps, beta_aware) if parallel else (k, k)
        ckpt = torch.empty(flag_slots(k, cu_seqlens), H, BK, dtype=torch.float32, device=k.device)
        forward_pass(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, parallel,
                     store_kt=False, ckpt=ckpt, scratch=scratch if parallel else None)
        traj = torch.empty(N * H, CHUNK, BK, dtype=torch.float32, device=k.device)
        _precond_bwd_kernel[(N, H)](
            dk_tilde.contiguous(), dd_final.contiguous(), k, beta,
            retention if retention is not None else k, cu_seqlens if cu_seqlens is not None else k,
            scratch[0], scratch[1], dk, dbeta, dr if retention is not None else dk, dd0, ckpt, traj,
            T, H, K, float(eta), float(d_min), float(d_max), float(eps),
            HAS_R=retention is not None, VARLEN=cu_seqlens is not None,
            BETA_AWARE=bool(beta_aware), PARALLEL=recompute, C=CHUNK, BK=BK, num_warps=num_warps(BK, recompute))
    return dk, dbeta, dd0, dr
