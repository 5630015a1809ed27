"""Triton precond_scan forward (DESIGN §3), in either form; shapes as in ``precond``.

Chunk-parallel form, four launches: the precompute (``precond_parallel``, parallel over groups), the
chain (``precond_chain``, serial: ``d`` at every group start and every token's ``w``, no clamp; in two levels
for few long sequences, ``precond_segments``), the output pass (parallel over
chunks: each group's ``d_t`` from its checkpoint and ``w``, ``k_tilde``, and a flag on every chunk where a
pre-clamp value leaves the box) and the fixup (serial, usually idle: from a sequence's first flagged
chunk on, where the unclamped chain is wrong, the token loop, rewriting ``k_tilde``, checkpoints, ``w``, flags
and ``d_final``). Token form: one serial launch.

Also the first pass of the backward: there it writes no ``k_tilde``, only the checkpoints and flags.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import precond_segments as segments
from .asym_chunks import chunk_layout
from .precond_chain import _chain_kernel
from .precond_parallel import chunk_program, group_outputs, precompute
from .precond_tokens import (CHUNK, GROUP, block_k, flag_slots, flagged_chunk, load_d0, scan_tokens, sequence_bounds,
                             sequences, token_warps)

#: warps of the serial chains (forward and adjoint, one level or per segment), the output pass and the backward's
#: adjoint pass (benchmarks/bench_precond.py). Chain kernel ms at 4 -> 1 warps (H200, bf16, profiler, 20:04 UTC
#: 2026-12-01), forward / adjoint: S1 0.093 -> 0.095 / 0.122 -> 0.105, S2 0.183 -> 0.186 / 0.239 -> 0.206,
#: S4 0.357 -> 0.261 / 0.421 -> 0.285; S3's segment chains 0.071 -> 0.056 / 0.083 -> 0.058. One warp reduces
#: a group's [16, K] tile without a barrier between warps. ``CHAIN_WARPS`` is for K <= 128; wider keys keep four
#: (``chain_warps``).
CHAIN_WARPS = 1
#: the output pass a row at a time (``group_outputs``), H200, bf16, S1 / S2 / S3 (05:25 UTC 2026-12-02): 0.042 / 0.021 /
#: 0.043 ms at one warp and two stages, 0.067 / 0.035 / 0.066 at two warps, 0.17 / 0.09 / 0.17 at two warps and
#: one stage, 0.074 / 0.037 / 0.075 at one and one; the 16-row cumulative sum it replaced took 0.073 / 0.038 / 0.073
OUT_WARPS = 1
OUT_STAGES = tl.constexpr(2)        # software-pipeline stages of the output pass's group loop
ADJOINT_OUT_WARPS = 2


def chain_warps(BK: int) -> int:
    """Warps of the serial chains for a key block of ``BK``: ``CHAIN_WARPS`` up to 128; four above, where one warp
    would hold 128 registers per [16, BK] fp32 tile (sm_90 compile: the adjoint chain spilled up to 132 bytes)."""
    return CHAIN_WARPS if BK <= 128 else 4


@triton.jit(do_not_specialize=["T", "NT"])
def _out_kernel(k_ptr, r_ptr, cu_ptr, table_ptr, ckpt_ptr, w_ptr, kt_ptr, flag_ptr, T, NT, H, K, d_min, d_max,
                HAS_R: tl.constexpr, VARLEN: tl.constexpr, STORE_KT: tl.constexpr, C: tl.constexpr, G: tl.constexpr,
                BK: tl.constexpr):
    """Grid (chunks, B*H), one program per chunk: ``k_tilde`` of its groups (``STORE_KT``) from the chain's
    checkpoints and ``w``, a group at a time (the loads of the next group in flight), and the chunk's flag
    raised to 1 (an atomic max) where some pre-clamp value lies outside the box or is NaN."""
    start, n, h, row = chunk_program(tl.program_id(0), tl.program_id(1), cu_ptr, table_ptr, T, NT, H, C, VARLEN)
    if n > 0:
        bad = tl.zeros([BK], tl.int32)
        for gi in tl.range(0, C // G, num_stages=OUT_STAGES):       # a group past the chunk's end is all masked
            d = tl.load(ckpt_ptr + (((C // G) * row + gi) * H + h) * BK + tl.arange(0, BK))
            bad = bad | group_outputs(d, k_ptr, r_ptr, w_ptr, kt_ptr, start + gi * G, start + n, h, H, K, d_min,
                                      d_max, HAS_R, STORE_KT, G, BK)
        tl.atomic_max(flag_ptr + row * H + h, tl.max(bad, 0))


@triton.jit(do_not_specialize=["T"])
def _precond_fwd_kernel(k_ptr, beta_ptr, d0_ptr, r_ptr, cu_ptr, kt_ptr, dfin_ptr, flag_ptr, ckpt_ptr, w_ptr, T, H, K,
                        eta, d_min, d_max, eps, HAS_D0: tl.constexpr, HAS_R: tl.constexpr,
                        VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, PARALLEL: tl.constexpr,
                        STORE_KT: tl.constexpr, STORE_CKPT: tl.constexpr, C: tl.constexpr, G: tl.constexpr,
                        BK: tl.constexpr):
    """Grid (N, H), the token loop (``scan_tokens``). ``PARALLEL``: the fixup, from the sequence's first flagged
    chunk on (nothing to do where none is; chunk j's flag at row ``slot + j`` with ``slot = bos // C + n``), rewriting
    ``k_tilde``, the checkpoints, every token's ``w`` and the flags (1 where a clamp fired). Otherwise the whole
    sequence. ``STORE_CKPT``: ``d`` at the start of chunk j's group i to ``ckpt[4 * (slot + j) + i, h, :BK]``.

    The fixup ran the chunk-parallel form chunk by chunk (at 8 warps, for its [16, K] tiles), with the token loop
    where a chunk failed its check. H200, bf16, kernel ms (09:55 UTC 2026-12-02), before / now (one warp): S1-clamp
    (80% of chunks flagged) 1.061 / 0.308; every sequence's first chunk flagged, so that it reruns every chunk, S1
    0.370 / 0.329, S2 0.711 / 0.650."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    offs = tl.arange(0, BK)
    slot = bos // C + n
    ckpt = ckpt_ptr + (slot * (C // G) * H + h) * BK
    if PARALLEL:
        nchunks = (eos - bos + C - 1) // C
        first = flagged_chunk(flag_ptr, slot, 0, nchunks, h, H, False, 64)
        if first < nchunks:
            ck = ckpt + first * (C // G) * H * BK
            d = scan_tokens(tl.load(ck + offs), k_ptr, beta_ptr, r_ptr, kt_ptr, kt_ptr, ck, w_ptr,
                            flag_ptr + (slot + first) * H + h, bos + first * C, eos, h, H, K, eta, d_min, d_max, eps,
                            HAS_R, BETA_AWARE, STORE_KT, False, STORE_CKPT, True, C, G, BK)
            tl.store(dfin_ptr + (n * H + h) * K + offs, d, mask=offs < K)
    else:
        d = load_d0(d0_ptr, n, h, H, K, HAS_D0, BK)
        d = scan_tokens(d, k_ptr, beta_ptr, r_ptr, kt_ptr, kt_ptr, ckpt, w_ptr, flag_ptr, bos, eos, h, H, K, eta,
                        d_min, d_max, eps, HAS_R, BETA_AWARE, STORE_KT, False, STORE_CKPT, False, C, G, BK)
        tl.store(dfin_ptr + (n * H + h) * K + offs, d, mask=offs < K)


def _checkpoint_numel(k, cu_seqlens) -> int:
    """Elements of the group-start checkpoints ``[4 * flag_slots, H, BK]``."""
    return flag_slots(k, cu_seqlens) * (CHUNK // GROUP) * k.shape[2] * block_k(k.shape[-1])


def _map_shape(k, cu_seqlens) -> tuple[int, ...]:
    """Shape of the two-level chains' segment maps (``precond_segments``), ``(0,)`` where one level runs."""
    seg = segments.segment_tokens(k, cu_seqlens)
    BK = block_k(k.shape[-1])
    return (segments.map_rows(k, cu_seqlens, seg), k.shape[2], BK, BK) if seg else (0,)


def residuals(k, cu_seqlens, keep: bool = True) -> int:
    """Size of what the forward keeps for the backward (fp32, one flat buffer; ``residual_views``); without
    ``keep``, of the part the forward itself needs (no ``Tinv^T``)."""
    B, T, H, K = k.shape
    return _checkpoint_numel(k, cu_seqlens) + B * T * H * (1 + GROUP * keep) + math.prod(_map_shape(k, cu_seqlens))


def residual_views(res, k, cu_seqlens):
    """``(ckpt [4 * flag_slots, H, BK], w [B*T, H], tinv_t [B*T, H, GROUP] or None, maps)`` views of a
    ``residuals``-sized buffer: ``d`` at every group start and every token's ``w`` as the chain wrote them, every
    group's ``Tinv^T`` as the precompute wrote it (``precond_parallel``; None without ``keep``), and with two-level
    chains the segment maps' Delta (``[map_rows, H, BK, BK]``; None with one level)."""
    B, T, H, K = k.shape
    n = _checkpoint_numel(k, cu_seqlens)
    m = n + B * T * H
    shape = _map_shape(k, cu_seqlens)
    nm = math.prod(shape)
    body = res[:res.numel() - nm]
    tt = body[m:].view(B * T, H, GROUP) if body.numel() == m + B * T * H * GROUP else None
    maps = res[res.numel() - nm:].view(shape) if nm else None
    return body[:n].view(-1, H, block_k(K)), body[n:m].view(B * T, H), tt, maps


def forward_pass(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, parallel, *,
                 store_kt=True, keep=False, scratch=None, flags=None, layout=None):
    """Launch the forward: ``(k_tilde or None, d_final, flags, residuals)``.

    ``flags [flag_slots, H]`` int32 (1: the chunk ran the token loop) come from the parallel form, as do the
    ``residuals`` (``residual_views``: ``d`` at every group start, every token's ``w`` and, with ``keep``, every
    group's ``Tinv^T``; in the token form only with ``keep``, and only the checkpoints are written).
    ``scratch``: the ``(M, w0)`` of :func:`precompute` (computed here when None and ``parallel``; it then writes no
    ``Tinv^T``); ``flags``: a tensor to fill instead of a new zeroed one (parallel
    form; the flags of existing chunks become the maximum of their value and 0 or 1); ``layout``: the inputs'
    ``chunk_layout`` (built here when None).
    """
    B, T, H, K = k.shape
    N = sequences(k, cu_seqlens)
    BK = block_k(K)
    f32 = dict(dtype=torch.float32, device=k.device)
    kt = torch.empty_like(k) if store_kt else None
    dfin = torch.empty(N, H, K, **f32)
    if parallel and flags is None:
        flags = torch.zeros(flag_slots(k, cu_seqlens), H, dtype=torch.int32, device=k.device)
    res = torch.empty(residuals(k, cu_seqlens, keep), **f32) if parallel or keep else None
    if N * H == 0:
        return kt, dfin, flags, res
    ckpt, w, tt, maps = residual_views(res, k, cu_seqlens) if res is not None else (None,) * 4
    dummy = k
    opt = dict(d0=d0 if d0 is not None else dummy, r=retention if retention is not None else dummy,
               cu=cu_seqlens if cu_seqlens is not None else dummy)
    flags_arg = flags if parallel else dummy
    if parallel:
        lay = layout or chunk_layout(cu_seqlens, B, T)
        M, w0 = (precompute(k, beta, retention, cu_seqlens, eta, eps, beta_aware, layout=lay, tinv_t=tt)
                 if scratch is None else scratch)
        seg = segments.segment_tokens(k, cu_seqlens)
        if seg:
            segments.segment_chain(k, d0, retention, cu_seqlens, M, w0, dfin, ckpt, w, maps, seg, chain_warps(BK))
        else:
            _chain_kernel[(N, H)](k, opt["d0"], opt["r"], opt["cu"], M, w0, dfin, ckpt, w, T, H, K,
                                  HAS_D0=d0 is not None, HAS_R=retention is not None, VARLEN=cu_seqlens is not None,
                                  C=CHUNK, G=GROUP, BK=BK, num_warps=chain_warps(BK))
        _out_kernel[(lay.n_chunks, B * H)](
            k, opt["r"], opt["cu"], lay.table if lay.table is not None else dummy, ckpt, w,
            kt if store_kt else dummy, flags, T, lay.NT, H, K, float(d_min), float(d_max),
            HAS_R=retention is not None, VARLEN=cu_seqlens is not None, STORE_KT=store_kt, C=CHUNK, G=GROUP, BK=BK,
            num_warps=OUT_WARPS)
    _precond_fwd_kernel[(N, H)](
        k, beta, opt["d0"], opt["r"], opt["cu"], kt if store_kt else dummy, dfin, flags_arg,
        ckpt if ckpt is not None else dummy, w if w is not None else dummy, T, H, K, float(eta), float(d_min),
        float(d_max), float(eps), HAS_D0=d0 is not None, HAS_R=retention is not None, VARLEN=cu_seqlens is not None,
        BETA_AWARE=bool(beta_aware), PARALLEL=bool(parallel), STORE_KT=store_kt, STORE_CKPT=ckpt is not None,
        C=CHUNK, G=GROUP, BK=BK, num_warps=token_warps(BK))
    return kt, dfin, flags, res
