"""Triton precond_scan: forward kernel and the kernel entry points (DESIGN §3).

Shapes: ``k [B,T,H,K]``, ``beta [B,T,H]``, ``d0 [N,H,K]`` fp32 or None (ones),
``retention [B,T,H]`` or None (ones), ``cu_seqlens [N+1]`` or None (N = B).
``precond_scan_fwd -> (k_tilde [B,T,H,K] in k's dtype, d_final [N,H,K] fp32)``;
``precond_scan_bwd -> (dk, dbeta, dd0 [N,H,K] fp32, dretention or empty [0] fp32)``.

One program per (sequence, head) carries ``d`` in registers through the sequence, chunk by chunk
(``precond_chunked``): each chunk is tried in the chunk-parallel form and recomputed token by
token where that form's check fails (``CHUNKED``), or always token by token. K > 256 and float64
keys go to the reference kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .precond_bwd import backward
from .precond_chunked import (CHUNK, MAX_SWEEPS, SWEEP_TOL, advance, block_k, flag_slots, load_d0, num_warps,
                              scan_tokens, sequence_bounds, sequences)

MAX_K = 256
# The token loop by default: measured on an H200 (2026-11-30, torch 2.11, triton 3.6; median ms,
# chunk-parallel / token loop): S1 fwd 3.05 / 0.94, fwd+bwd 6.54 / 3.74; S2 fwd 3.31 / 1.85;
# S3 fwd 25.5 / 14.6. The chunk-parallel form (still serial over chunks inside one program, its
# [64, K] fp32 tiles spill registers at 4 warps) stays selectable (``chunked=True``) and gives
# the fallback statistics.
CHUNKED_DEFAULT = False


@triton.jit(do_not_specialize=["T", "H", "K"])
def _precond_fwd_kernel(k_ptr, beta_ptr, d0_ptr, r_ptr, cu_ptr, kt_ptr, dfin_ptr, flag_ptr, T, H, K,
                        eta, d_min, d_max, eps, HAS_D0: tl.constexpr, HAS_R: tl.constexpr,
                        VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, CHUNKED: tl.constexpr,
                        STATS: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, MAX_IT: tl.constexpr,
                        TOL: tl.constexpr):
    """Grid (N, H). ``STATS``: writes 1 (fell back) / 0 per chunk to ``flag[bos // C + n + j, h]``."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    d = load_d0(d0_ptr, n, h, H, K, HAS_D0, BK)
    if CHUNKED:
        slot = bos // C + n
        for t0 in range(bos, eos, C):
            t1 = tl.minimum(t0 + C, eos)
            d, fell_back = advance(d, k_ptr, beta_ptr, r_ptr, kt_ptr, k_ptr, t0, t1, h, H, K, eta, d_min, d_max,
                                   eps, HAS_R, BETA_AWARE, CHUNKED, True, False, C, BK, MAX_IT, TOL)
            if STATS:
                tl.store(flag_ptr + (slot + (t0 - bos) // C) * H + h, fell_back)
    else:
        d = scan_tokens(d, k_ptr, beta_ptr, r_ptr, kt_ptr, k_ptr, k_ptr, bos, eos, h, H, K, eta, d_min, d_max, eps,
                        HAS_R, BETA_AWARE, True, False, False, C, BK)
    offs = tl.arange(0, BK)
    tl.store(dfin_ptr + (n * H + h) * K + offs, d, mask=offs < K)


def _forward(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, chunked, flags=None):
    B, T, H, K = k.shape
    N = sequences(k, cu_seqlens)
    kt = torch.empty_like(k)
    dfin = torch.empty(N, H, K, dtype=torch.float32, device=k.device)
    if N * H > 0:
        dummy = k
        _precond_fwd_kernel[(N, H)](
            k, beta, d0 if d0 is not None else dummy, retention if retention is not None else dummy,
            cu_seqlens if cu_seqlens is not None else dummy, kt, dfin, flags if flags is not None else dummy,
            T, H, K, float(eta), float(d_min), float(d_max), float(eps),
            HAS_D0=d0 is not None, HAS_R=retention is not None, VARLEN=cu_seqlens is not None,
            BETA_AWARE=bool(beta_aware), CHUNKED=bool(chunked), STATS=flags is not None, C=CHUNK, BK=block_k(K),
            MAX_IT=MAX_SWEEPS, TOL=SWEEP_TOL, num_warps=num_warps(K, chunked))
    return kt, dfin


def _use_reference(k) -> bool:
    return k.dtype == torch.float64 or k.shape[-1] > MAX_K


def precond_scan_fwd(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, chunked=None):
    """Forward kernel: ``(k_tilde, d_final)``; ``chunked`` picks the form (default CHUNKED_DEFAULT)."""
    if _use_reference(k):
        return reference.precond_scan_fwd(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware)
    chunked = CHUNKED_DEFAULT if chunked is None else chunked
    return _forward(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, chunked)


def precond_fallback_share(k, beta, d0=None, retention=None, cu_seqlens=None, *, eta, d_min, d_max, eps,
                           beta_aware) -> float:
    """Share of (chunk, head) pairs whose chunk-parallel check failed (for benchmarks; syncs the host)."""
    if _use_reference(k):
        return 1.0
    flags = torch.full((flag_slots(k, cu_seqlens), k.shape[2]), -1, dtype=torch.int32, device=k.device)
    _forward(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, True, flags)
    total = (flags >= 0).sum()
    return float((flags == 1).sum() / total.clamp(min=1))


def precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware,
                     chunked=None):
    """Backward kernel: ``(dk, dbeta, dd0, dretention)`` (see the module docstring)."""
    if _use_reference(k):
        return reference.precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min,
                                          d_max, eps, beta_aware)
    chunked = CHUNKED_DEFAULT if chunked is None else chunked
    return backward(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware,
                    chunked)
