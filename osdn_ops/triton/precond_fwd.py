"""Triton precond_scan forward kernel (DESIGN §3), in either form; shapes as in ``precond``.

Also the first pass of the backward: there it writes only ``d`` at every chunk start (checkpoints).
"""
from __future__ import annotations

import torch
import triton.language as tl
import triton

from .precond_parallel import advance, num_warps, precompute
from .precond_tokens import CHUNK, GROUP, block_k, load_d0, scan_tokens, sequence_bounds, sequences


@triton.jit(do_not_specialize=["T", "H", "K"])
def _precond_fwd_kernel(k_ptr, beta_ptr, d0_ptr, r_ptr, cu_ptr, m_ptr, w0_ptr, kt_ptr, dfin_ptr, flag_ptr, ckpt_ptr,
                        T, H, K, eta, d_min, d_max, eps, HAS_D0: tl.constexpr, HAS_R: tl.constexpr,
                        VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, PARALLEL: tl.constexpr,
                        STORE_KT: tl.constexpr, STATS: tl.constexpr, STORE_CKPT: tl.constexpr, C: tl.constexpr,
                        G: tl.constexpr, BK: tl.constexpr):
    """Grid (N, H). Per chunk j of sequence n (row ``slot = bos // C + n + j``): ``STATS`` writes 1 (token
    loop) / 0 to ``flag[slot, h]``; ``STORE_CKPT`` writes ``d`` at the start of the chunk's group i to
    ``ckpt[4 * slot + i, h, :BK]``."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    d = load_d0(d0_ptr, n, h, H, K, HAS_D0, BK)
    offs = tl.arange(0, BK)
    slot = bos // C + n
    ckpt = ckpt_ptr + (slot * (C // G) * H + h) * BK
    if PARALLEL:
        for t0 in range(bos, eos, C):
            row = slot + (t0 - bos) // C
            d, fell_back = advance(d, k_ptr, beta_ptr, r_ptr, m_ptr, w0_ptr, kt_ptr, kt_ptr,
                                   ckpt + (t0 - bos) // G * H * BK, t0, tl.minimum(t0 + C, eos), h, H, K, eta,
                                   d_min, d_max, eps, HAS_R, BETA_AWARE, STORE_KT, False, STORE_CKPT, C, G, BK)
            if STATS:
                tl.store(flag_ptr + row * H + h, fell_back)
    else:
        d = scan_tokens(d, k_ptr, beta_ptr, r_ptr, kt_ptr, kt_ptr, ckpt, bos, eos, h, H, K, eta, d_min, d_max, eps,
                        HAS_R, BETA_AWARE, STORE_KT, False, STORE_CKPT, G, BK)
    tl.store(dfin_ptr + (n * H + h) * K + offs, d, mask=offs < K)


def forward_pass(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, parallel, *,
                 store_kt=True, flags=None, ckpt=None, scratch=None):
    """Launch the forward kernel: ``(k_tilde or None, d_final)``.

    ``flags [flag_slots, H]`` int32 and ``ckpt [4 * flag_slots, H, BK]`` fp32 are filled if given;
    ``scratch``: the ``(M, w0)`` of :func:`precompute` (computed here when None and ``parallel``).
    """
    B, T, H, K = k.shape
    N = sequences(k, cu_seqlens)
    kt = torch.empty_like(k) if store_kt else None
    dfin = torch.empty(N, H, K, dtype=torch.float32, device=k.device)
    if N * H > 0:
        if parallel and scratch is None:
            scratch = precompute(k, beta, retention, cu_seqlens, eta, eps, beta_aware)
        M, w0 = scratch if parallel else (k, k)
        dummy = k
        BK = block_k(K)
        _precond_fwd_kernel[(N, H)](
            k, beta, d0 if d0 is not None else dummy, retention if retention is not None else dummy,
            cu_seqlens if cu_seqlens is not None else dummy, M, w0, kt if store_kt else dummy, dfin,
            flags if flags is not None else dummy, ckpt if ckpt is not None else dummy,
            T, H, K, float(eta), float(d_min), float(d_max), float(eps),
            HAS_D0=d0 is not None, HAS_R=retention is not None, VARLEN=cu_seqlens is not None,
            BETA_AWARE=bool(beta_aware), PARALLEL=bool(parallel), STORE_KT=store_kt, STATS=flags is not None,
            STORE_CKPT=ckpt is not None, C=CHUNK, G=GROUP, BK=BK, num_warps=num_warps(BK, parallel))
    return kt, dfin
