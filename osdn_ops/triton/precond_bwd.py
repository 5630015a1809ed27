"""Triton precond_scan backward: a reverse-time adjoint scan (DESIGN §3).

Shapes as in ``precond``: ``dk_tilde [B,T,H,K]``, ``dd_final [N,H,K]`` -> ``dk`` (k's dtype),
``dbeta`` (beta's dtype), ``dd0 [N,H,K]`` fp32, ``dretention`` (retention's dtype, or empty [0] fp32).

What is saved and what is recomputed: the forward's only outputs are ``k_tilde`` and ``d_final``,
and the autograd function keeps just the inputs, so the backward must rebuild ``d_t``. Storing the
whole trajectory would cost a fp32 ``[B,T,H,K]`` buffer (twice the bf16 keys) written and read once;
instead

1. the forward kernel (``precond_fwd``, in the same form) runs again and writes only ``d`` at every
   16-token group start (``[4 * slots, H, BK]`` fp32, an eighth of the bf16 keys' bytes) and, in the
   parallel form, which chunks it ran token by token;
2. one program per (sequence, head) walks the chunks backwards. A chunk that passed the parallel form's
   check runs the adjoint group by group (``precond_parallel.group_adjoint``: each group's ``d_t`` are
   rebuilt from its checkpoint with one group step, its ``g_t`` from the gradient at its end, three
   short dependent steps per 16 tokens). Any other chunk (token-loop form, or a clamp fired) rebuilds
   its ``d_t`` token by token into a per-program scratch ``[C, BK]`` (it stays in L2) and runs the
   adjoint token by token from its last token to its first.

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
from .precond_parallel import group_adjoint, num_warps, precompute
from .precond_tokens import (CHUNK, GROUP, block_k, flag_slots, load_token, scan_tokens, sequence_bounds, sequences,
                             token_coefs)


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
def _precond_bwd_kernel(dkt_ptr, ddf_ptr, k_ptr, beta_ptr, r_ptr, cu_ptr, m_ptr, w0_ptr, mb_ptr, h0_ptr, flag_ptr,
                        dk_ptr, dbeta_ptr, dr_ptr, dd0_ptr, ckpt_ptr, traj_ptr, T, H, K, eta, d_min, d_max, eps,
                        HAS_R: tl.constexpr, VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, PARALLEL: tl.constexpr,
                        C: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """Grid (N, H). ``ckpt`` rows ``(4 * (bos // C + n + j) + i) * H + h`` and ``flag`` (``PARALLEL``) rows
    ``(bos // C + n + j) * H + h``, both filled by the forward kernel; ``traj`` ``[N*H, C, BK]``;
    ``m``, ``w0``, ``mb``, ``h0``: the parallel form's precompute."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    offs = tl.arange(0, BK)
    mk = offs < K
    slot = bos // C + n
    NG: tl.constexpr = C // G
    g = tl.load(ddf_ptr + (n * H + h) * K + offs, mask=mk, other=0.0).to(tl.float32)
    traj = traj_ptr + (n * H + h) * C * BK
    nchunks = (eos - bos + C - 1) // C
    for jj in range(0, nchunks):
        j = nchunks - 1 - jj
        t0 = bos + j * C
        t1 = tl.minimum(t0 + C, eos)
        ckpt = ckpt_ptr + (((slot + j) * NG) * H + h) * BK
        if PARALLEL:
            tokens = tl.load(flag_ptr + (slot + j) * H + h) != 0
        else:
            tokens = True
        if tokens:
            d = tl.load(ckpt + offs)
            d = scan_tokens(d, k_ptr, beta_ptr, r_ptr, k_ptr, traj, traj, t0, t1, h, H, K, eta, d_min, d_max, eps,
                            HAS_R, BETA_AWARE, False, True, False, G, BK)
            tl.debug_barrier()
            # the serial chain (three reductions per token) is shorter than a load: inputs are loaded
            # four tokens ahead (earlier in time), in a rotation of four register sets
            d1, k1, b1, r1, g1 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 1, t0, h, H, K, HAS_R, BK)
            d2, k2, b2, r2, g2 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 2, t0, h, H, K, HAS_R, BK)
            d3, k3, b3, r3, g3 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 3, t0, h, H, K, HAS_R, BK)
            d4, k4, b4, r4, g4 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 4, t0, h, H, K, HAS_R, BK)
            for tt in range(0, t1 - t0):
                t = t1 - 1 - tt
                dn, kn, bn, rn, gn = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t - 4, t0, h, H, K, HAS_R,
                                                    BK)
                g, dk, dbeta, dr = token_adjoint(g, d1, k1, b1, r1, g1, eta, d_min, d_max, eps, BETA_AWARE)
                tl.store(dk_ptr + (t * H + h) * K + offs, dk.to(dk_ptr.dtype.element_ty), mask=mk)
                tl.store(dbeta_ptr + t * H + h, dbeta.to(dbeta_ptr.dtype.element_ty))
                if HAS_R:
                    tl.store(dr_ptr + t * H + h, dr.to(dr_ptr.dtype.element_ty))
                d1, k1, b1, r1, g1, d2, k2, b2, r2, g2 = d2, k2, b2, r2, g2, d3, k3, b3, r3, g3
                d3, k3, b3, r3, g3, d4, k4, b4, r4, g4 = d4, k4, b4, r4, g4, dn, kn, bn, rn, gn
            tl.debug_barrier()
        else:
            for i in tl.static_range(NG):       # a group past t1 is all masked: g passes through
                gi = NG - 1 - i
                d = tl.load(ckpt + gi * H * BK + offs)
                g = group_adjoint(g, d, k_ptr, beta_ptr, r_ptr, dkt_ptr, m_ptr, w0_ptr, mb_ptr, h0_ptr, dk_ptr,
                                  dbeta_ptr, dr_ptr, t0 + gi * G, t1, h, H, K, eta, d_min, d_max, eps, HAS_R,
                                  BETA_AWARE, G, BK)
    tl.store(dd0_ptr + (n * H + h) * K + offs, g, mask=mk)


def backward(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, parallel):
    """Launch the checkpoint pass and the backward kernel; returns ``(dk, dbeta, dd0, dretention)``.

    ``parallel``: both in the chunk-parallel form (the token loop where its check fails), else the
    token loop.
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
        dk_tilde = dk_tilde.contiguous()
        slots = flag_slots(k, cu_seqlens)
        if parallel:
            M, w0, Mb, h0 = precompute(k, beta, retention, cu_seqlens, eta, eps, beta_aware, dk_tilde)
            flags = torch.empty(slots, H, dtype=torch.int32, device=k.device)
        else:
            M = w0 = Mb = h0 = flags = k
        ckpt = torch.empty(slots * (CHUNK // GROUP), H, BK, dtype=torch.float32, device=k.device)
        forward_pass(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, parallel,
                     store_kt=False, ckpt=ckpt, flags=flags if parallel else None,
                     scratch=(M, w0) if parallel else None)
        traj = torch.empty(N * H, CHUNK, BK, dtype=torch.float32, device=k.device)
        _precond_bwd_kernel[(N, H)](
            dk_tilde, dd_final.contiguous(), k, beta,
            retention if retention is not None else k, cu_seqlens if cu_seqlens is not None else k,
            M, w0, Mb, h0, flags, dk, dbeta, dr if retention is not None else dk, dd0, ckpt, traj,
            T, H, K, float(eta), float(d_min), float(d_max), float(eps),
            HAS_R=retention is not None, VARLEN=cu_seqlens is not None,
            BETA_AWARE=bool(beta_aware), PARALLEL=bool(parallel), C=CHUNK, G=GROUP, BK=BK,
            num_warps=num_warps(BK, parallel))
    return dk, dbeta, dd0, dr
