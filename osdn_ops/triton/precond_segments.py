"""Two-level chains of the chunk-parallel precond_scan, for few long sequences (DESIGN §3).

The serial chains of ``precond_chain`` run one program per (sequence, head), about 0.8 us per 16-token
group. With few sequences and heads (S3: 8 programs for 132 SMs) that serial time is all there is.
Without clamping, a run of groups maps ``d`` affinely: ``d_end = A d + b``. So each sequence is cut into
segments of ``SEG`` tokens (a multiple of 64) and:

1. ``_segment_map_kernel`` (one program per segment and head, all in parallel): the segment's map,
   ``A = alpha I + Delta`` (``Delta [BK, BK]`` fp32, alpha the product of the retentions) and ``b``, built group
   by group with the chain's own step applied to a matrix: ``W = -M S A``, ``A <- exp(Gam_end) A + (E S)^T W``
   (the identity part kept apart). Every product takes the keys' precision
   (``precond_parallel.precompute_precision``): one tf32 pass for 16-bit keys, three (~fp32) for fp32 keys. On S3
   (bf16, H200) one pass instead of three took the maps from 0.577 to 0.336 ms (forward) and 0.568 to 0.325 ms
   (adjoint) and moved ``k_tilde``, the unclamped ``d`` at the segment starts and the gradients by up to 1e-3
   relative (norms), below bf16's resolution of 3.9e-3; the chains inside a segment stay exact fp32.
2. ``_segment_carry_kernel`` (one program per sequence and head): ``d`` at every segment start, one
   matrix-vector product per segment, the next segments' maps loading meanwhile (``CARRY_STAGES``).
3. ``_segment_chain_kernel`` (one program per segment and head): the ordinary chain from the segment's
   start, writing the group checkpoints as ``precond_chain`` does; the last segment of a sequence writes the
   unclamped ``d_final`` (so a sequence of one segment gets it from the chain alone).

The adjoint runs the transposed step ``g_start = exp(Gam_end) g + fsum - S^T (Mbc (S g))`` (``Mbc = diag(a)
Tinv^T diag(e)``, formed per group from the forward's ``Tinv^T``) backwards: ``g_start = A^T g_end + b'``. Its
linear part is the transpose of the forward's map (``Mbc``'s terms are ``M``'s transposed), so the forward keeps
its ``Delta`` for the backward (``map_rows``; ``precond_fwd.residuals``) and the adjoint's map kernel forms only
the offset ``b'`` (the adjoint chain from ``g_end = 0``), a vector per group instead of a ``[BK, BK]`` product:
on S3 (H200, bf16) the adjoint's maps took 0.327 ms, its offsets 0.124 in a plain loop and 0.054 with the
adjoint chain's software-pipelined step (``segment_offset``; S2 0.064 -> 0.028, outputs bitwise equal). A
segment with a chunk that the forward ran token by token has no affine map: the carry runs the serial adjoint
through it (token by token in the flagged chunks, as ``precond_chain.adjoint_groups`` does) and the per-segment
pass skips it. The adjoint carry is launched twice, one program per (sequence, head) each time: at four warps for
the chains with no flagged chunk (maps only, a whole ``[BK, BK]`` map at a time) and at one warp for the others,
whose token adjoint a warp runs fastest (a reduction within one warp needs no barrier) and whose maps it applies a
tile at a time (``apply_transposed``); each launch's programs for the other kind of chain return at once. The
gradient of ``d0`` comes from the first segment's chain (or from the carry where it ran that segment).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import asym_chunks
from .asym_chunks import chunk_layout, chunk_span
from .host_math import cdiv, next_pow2
from .precond_chain import ADJOINT_STAGES, adjoint_groups, adjoint_raw, adjoint_step, chain_groups
from .precond_parallel import group_logs, load_keys, precompute_precision
from .precond_tokens import CHUNK, GROUP, block_k, flagged_chunk, load_d0, sequence_bounds, sequences
from .varlen import max_chunks

#: warps of the map kernel, forward (a [BK, BK] fp32 tile; H200, S3, both directions: 1.114 / 1.190 / 2.392 ms at
#: 4 / 8 / 16 warps with three-pass products, 0.661 / 1.010 ms at 4 / 8 with one pass) and adjoint (offsets only:
#: S3 0.124 / 0.131 / 0.129 ms at 1 / 2 / 4 warps before its loop was pipelined)
MAP_WARPS = {False: 4, True: 1}
#: warps of the forward carry and of the adjoint carry of chains without a flagged chunk (S3 adjoint carry 0.060 ms
#: at 4 warps, 0.144 at 1, before its loop was pipelined), and of the adjoint carry of chains with one (``SERIAL``).
#: H200, bf16, adjoint carry ms when a single launch did both kinds, the maps a tile at a time (09:49 UTC
#: 2026-12-03), at 1 / 2 / 4 warps: S3 0.062 / 0.106 / 0.113 (0.040 with whole maps at 4), S3 with a retention
#: that keeps the clamp firing 14.3 / 32.8 / 35.7 (35.1 with whole maps at 4)
CARRY_WARPS = 4
SERIAL_CARRY_WARPS = 1
#: software-pipeline stages of the carries' loops over segments (the maps of the next segments loaded into shared
#: memory, 64 KiB each at BK 128, while the current one is applied). H200, bf16, forward / adjoint carry ms: S3
#: 0.075 / 0.063 in a plain loop, 0.049 / 0.054 at 2 stages, 0.040 / 0.039 at 3; S2 0.018 / 0.016, 0.013 / 0.015,
#: 0.011 / 0.012 (outputs bitwise equal)
CARRY_STAGES = tl.constexpr(3)


def segment_tokens(k: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    """Segment length of the two-level chains, or 0 for the one-level chains.

    Two levels when K <= 128, there are at most a quarter as many (sequence, head) chains as SMs and sequences
    average at least eight segments; segments are sized for about two programs per SM (at least 256 tokens). On the
    H200 the forward maps cost about 1.1 ns per token and head (bf16 keys, no retention), the adjoint's offsets
    about 0.2 ns, the serial chains about 50 ns (forward) and 80 ns (adjoint) per token of a sequence.
    Forward+backward kernels, ms: S3 (8 chains, 1024-token segments) 5.04 in one level, 1.09 in two; S2 (32 chains,
    512-token segments) 0.587 in one level, 0.529 in two (0.540 with 256-token segments, 0.655 with 1024); S1 (128
    chains) 0.574 in one level, 0.88 in two with 256- or 512-token segments, so it stays at one. (Before the
    adjoint's offsets and the carries were pipelined and the maps without retention skipped their rescale; since
    then S3 takes 0.90 and S2 0.44 in two levels.)"""
    B, T, H, K = k.shape
    N = sequences(k, cu_seqlens)
    sms = asym_chunks._sm_count(k.device)
    if N * H == 0 or N * H > sms // 4 or K > 128:       # a [256, 256] fp32 map would not fit in registers
        return 0
    seg = max(256, next_pow2(cdiv(B * T * H, 2 * sms)))
    return seg if B * T // N >= 8 * seg else 0


def map_rows(k: Tensor, cu_seqlens: Optional[Tensor], seg: int) -> int:
    """Segment rows of the maps (``[rows, H, BK, BK]``), from the shapes alone: ``B * cdiv(T, seg)``, or the
    bound ``varlen.max_chunks`` of the packed layout."""
    B, T = k.shape[:2]
    return B * cdiv(T, seg) if cu_seqlens is None else max_chunks(T, sequences(k, cu_seqlens), seg)


@triton.jit
def segment_program(cu_ptr, table_ptr, T, NS, H, SEG: tl.constexpr, VARLEN: tl.constexpr):
    """A program of a grid ``(segment rows, B*H)``: ``(sequence (int64), its bounds bos, eos, the segment's
    first token, its length (<= 0: no segment), its row, head)``."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    i_b = pid_bh // H
    start, n, row = chunk_span(pid, i_b, cu_ptr, table_ptr, T, NS, SEG, VARLEN)
    if VARLEN:
        seq = tl.maximum(tl.load(table_ptr + 2 * pid), 0).to(tl.int64)
    else:
        seq = i_b.to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, seq, T, VARLEN)
    return seq, bos, eos, start, n, row, (pid_bh % H).to(tl.int64)


@triton.jit
def seq_segments(first_ptr, n, NS, eos, bos, SEG: tl.constexpr, VARLEN: tl.constexpr):
    """Row of sequence ``n``'s first segment and its number of segments."""
    if VARLEN:
        r0 = tl.load(first_ptr + n)
    else:
        r0 = n * NS
    return r0, (eos - bos + SEG - 1) // SEG


@triton.jit
def segment_clean(flag_ptr, slot, j0, n, h, H, SEG: tl.constexpr, C: tl.constexpr):
    """Whether no chunk of the segment (chunks ``j0..`` of the sequence at scratch row ``slot``, ``n``
    tokens) is flagged."""
    jj = tl.arange(0, SEG // C)
    fl = tl.load(flag_ptr + (slot + j0 + jj) * H + h, mask=jj * C < n, other=0)
    return tl.max(fl, 0) == 0


@triton.jit
def segment_offset(k_ptr, tt_ptr, a_ptr, r_ptr, fs, start, n, h, H, K, HAS_R: tl.constexpr, G: tl.constexpr,
                   BK: tl.constexpr):
    """The adjoint map's offset ``b'`` and ``alpha`` of the segment ``[start, start + n)``: the adjoint chain's
    step (``precond_chain.adjoint_step``) from a zero gradient at its end, groups backwards, with its loads
    software-pipelined as the chain's are (``fs``: the segment's first group's fsum row)."""
    b = tl.zeros([BK], tl.float32)
    alpha = tl.full([], 1.0, tl.float32)
    ngs = (n + G - 1) // G
    for ii in tl.range(0, ngs, num_stages=ADJOINT_STAGES):
        i = ngs - 1 - ii
        kv, tt, a, _, r, f = adjoint_raw(k_ptr, tt_ptr, a_ptr, a_ptr, r_ptr, fs, start, start + n, i, h, H, K, HAS_R,
                                         G, BK)
        b, _ = adjoint_step(b, kv, tt, a, a, r, f, HAS_R, G)
        if HAS_R:
            alpha = alpha * tl.exp(tl.sum(tl.log(r), 0))
    return b, alpha


@triton.jit
def split4(g, BK: tl.constexpr):
    """The four quarters ``g[i*BK/4 : (i+1)*BK/4]`` of ``g [BK]``, as a tuple."""
    x = tl.permute(tl.reshape(g, [2, 2, BK // 4]), (2, 0, 1))      # [c, b, a] = g[(2b + a) BK/4 + c]
    lo, hi = tl.split(x)                                             # a = 0, 1
    p0, p2 = tl.split(lo)
    p1, p3 = tl.split(hi)
    return p0, p1, p2, p3


@triton.jit
def join4(p, BK: tl.constexpr):
    """``split4``'s inverse: the quarters ``p`` as one ``[BK]`` vector."""
    x = tl.join(tl.join(p[0], p[2]), tl.join(p[1], p[3]))           # [c, b, a] = p[2b + a][c]
    return tl.reshape(tl.permute(x, (1, 2, 0)), [BK])


@triton.jit
def apply_transposed(a_ptr, g, TILED: tl.constexpr, BK: tl.constexpr):
    """``A^T g`` of the row-major ``[BK, BK]`` map at ``a_ptr``. ``TILED``: a ``[BK/4, BK/4]`` tile at a time, so
    that a program of one warp holds a tile in registers, not the map (128 fp32 registers a thread at four warps
    and BK 128)."""
    if TILED:
        CB: tl.constexpr = BK // 4
        i = tl.arange(0, CB)
        gq = split4(g, BK)
        out = ()
        for cb in tl.static_range(4):
            acc = tl.zeros([CB], tl.float32)
            for rb in tl.static_range(4):
                A = tl.load(a_ptr + (rb * CB + i[:, None]) * BK + cb * CB + i[None, :])
                acc += tl.sum(A * gq[rb][:, None], 0)
            out = out + (acc,)
        return join4(out, BK)
    else:
        offs = tl.arange(0, BK)
        return tl.sum(tl.load(a_ptr + offs[:, None] * BK + offs[None, :]) * g[:, None], 0)


@triton.jit
def adjoint_maps(g, amap_ptr, bmap_ptr, alpha_ptr, gend_ptr, r0, j_lo, j_hi, h, H, TILED: tl.constexpr,
                 BK: tl.constexpr):
    """The adjoint through segments ``j_hi - 1`` down to ``j_lo`` (map rows ``r0 + j``) by their maps, in a loop
    without branches (it pipelines): stores ``g`` at each one's end to ``gend``, returns ``g`` at ``j_lo``'s
    start."""
    offs = tl.arange(0, BK)
    for jj in tl.range(0, j_hi - j_lo, num_stages=CARRY_STAGES):
        base = (r0 + j_hi - 1 - jj) * H + h
        tl.store(gend_ptr + base * BK + offs, g)
        g = (tl.load(alpha_ptr + base) * g + apply_transposed(amap_ptr + base * BK * BK, g, TILED, BK)
             + tl.load(bmap_ptr + base * BK + offs))
    return g


@triton.jit(do_not_specialize=["T", "NS"])
def _segment_map_kernel(k_ptr, r_ptr, x_ptr, a_ptr, v_ptr, cu_ptr, table_ptr, flag_ptr, amap_ptr, bmap_ptr, alpha_ptr,
                        T, NS, H, K, HAS_R: tl.constexpr, VARLEN: tl.constexpr, ADJOINT: tl.constexpr,
                        SEG: tl.constexpr, C: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
                        PREC: tl.constexpr):
    """Grid (segment rows, B*H): the segment's map to ``amap [rows, H, BK, BK]`` (Delta), ``bmap [rows, H, BK]``
    and ``alpha [rows, H]``. Forward: ``x`` is M, ``v`` w0, groups in order. ``ADJOINT``: only ``bmap`` (b') and
    ``alpha``; ``x`` is Tinv^T, ``a`` the precompute's ``a``, ``v`` fsum (rows as the checkpoints), groups
    backwards; a segment with a flagged chunk is skipped (the carry runs it serially). Maps nothing applies are not
    built: the forward carry never applies a sequence's last segment's, the adjoint carry never its first's (the
    forward builds that one for the adjoint, unless the sequence is one segment)."""
    seq, bos, eos, start, n, row, h = segment_program(cu_ptr, table_ptr, T, NS, H, SEG, VARLEN)
    if ADJOINT:
        used = start > bos
    else:
        used = (start > bos) | (start + n < eos)
    if (n > 0) & used:
        NG: tl.constexpr = C // G
        slot = bos // C + seq
        if ADJOINT:
            clean = segment_clean(flag_ptr, slot, (start - bos) // C, n, h, H, SEG, C)
        else:
            clean = True
        if clean:
            offs = tl.arange(0, BK)
            if ADJOINT:
                fs = v_ptr + ((NG * slot + (start - bos) // G) * H + h) * BK
                b, alpha = segment_offset(k_ptr, x_ptr, a_ptr, r_ptr, fs, start, n, h, H, K, HAS_R, G, BK)
            else:
                ci = tl.arange(0, G)
                delta = tl.zeros([BK, BK], tl.float32)
                alpha = tl.full([], 1.0, tl.float32)
                b = tl.zeros([BK], tl.float32)
                for i in range(0, (n + G - 1) // G):
                    rows = start + i * G + ci
                    mrow = (i * G + ci) < n
                    kv = load_keys(k_ptr, rows, mrow, h, H, K, BK)
                    s = kv * kv
                    X = tl.load(x_ptr + (rows[:, None] * H + h) * G + ci[None, :], mask=mrow[:, None], other=0.0)
                    wb = -tl.sum(X * tl.sum(s * b[None, :], 1)[None, :], 1)
                    # W = -X S A = -(alpha X S + X (S Delta)); A <- exp(Gam_end) A + (E S)^T W
                    SD = tl.dot(s, delta, input_precision=PREC)
                    W = -(alpha * tl.dot(X, s, input_precision=PREC) + tl.dot(X, SD, input_precision=PREC))
                    w0 = tl.load(v_ptr + rows * H + h, mask=mrow, other=0.0)
                    if HAS_R:
                        r, lg, lgi = group_logs(r_ptr, rows, mrow, h, H, HAS_R, G)
                        lg_end = tl.sum(lgi - lg, 0)
                        ee = tl.exp(lg_end)
                        E = tl.exp(tl.minimum(lg_end - lgi, 0.0))
                        b = ee * b + tl.sum(((w0 + wb) * E)[:, None] * s, 0)
                        delta = tl.dot(tl.trans(E[:, None] * s), W, acc=ee * delta, input_precision=PREC)
                        alpha = alpha * ee
                    else:   # no retention: ee = E = alpha = 1, no rescale of the map (H200, S3: 0.346 -> 0.293 ms)
                        b = b + tl.sum((w0 + wb)[:, None] * s, 0)
                        delta = tl.dot(tl.trans(s), W, acc=delta, input_precision=PREC)
            base = row * H + h
            if not ADJOINT:
                tl.store(amap_ptr + (base * BK + offs[:, None]) * BK + offs[None, :], delta)
            tl.store(bmap_ptr + base * BK + offs, b)
            tl.store(alpha_ptr + base, alpha)


@triton.jit(do_not_specialize=["T", "NS"])
def _segment_carry_kernel(d0_ptr, cu_ptr, first_ptr, amap_ptr, bmap_ptr, alpha_ptr, dstart_ptr, dfin_ptr, T, NS, H,
                          K, HAS_D0: tl.constexpr, VARLEN: tl.constexpr, SEG: tl.constexpr, BK: tl.constexpr):
    """Grid (N, H), forward: ``d`` at every segment start to ``dstart [rows, H, BK]`` (``d0`` to ``dfin`` for an empty
    sequence; otherwise the last segment's chain writes it)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    r0, ns = seq_segments(first_ptr, n, NS, eos, bos, SEG, VARLEN)
    offs = tl.arange(0, BK)
    d = load_d0(d0_ptr, n, h, H, K, HAS_D0, BK)
    for j in tl.range(0, ns - 1, num_stages=CARRY_STAGES):     # the loads of the next maps in flight
        base = (r0 + j) * H + h
        tl.store(dstart_ptr + base * BK + offs, d)
        A = tl.load(amap_ptr + (base * BK + offs[:, None]) * BK + offs[None, :])
        d = tl.load(alpha_ptr + base) * d + tl.sum(A * d[None, :], 1) + tl.load(bmap_ptr + base * BK + offs)
    if ns > 0:
        tl.store(dstart_ptr + ((r0 + ns - 1) * H + h) * BK + offs, d)
    else:
        tl.store(dfin_ptr + (n * H + h) * K + offs, d, mask=offs < K)


@triton.jit(do_not_specialize=["T", "NS"])
def _segment_chain_kernel(k_ptr, r_ptr, cu_ptr, table_ptr, m_ptr, w0_ptr, dstart_ptr, ckpt_ptr, w_ptr, dfin_ptr, T, NS,
                          H, K, HAS_R: tl.constexpr, VARLEN: tl.constexpr, SEG: tl.constexpr, C: tl.constexpr,
                          G: tl.constexpr, BK: tl.constexpr):
    """Grid (segment rows, B*H), forward: the chain through one segment from its start (``dstart``), writing
    ``d`` at each group start to the checkpoints (rows of ``precond_chain._chain_kernel``) and each token's ``w``;
    the sequence's last segment writes the unclamped ``d`` at its end to ``dfin``."""
    seq, bos, eos, start, n, row, h = segment_program(cu_ptr, table_ptr, T, NS, H, SEG, VARLEN)
    if n > 0:
        offs = tl.arange(0, BK)
        d = tl.load(dstart_ptr + (row * H + h) * BK + offs)
        ckpt = ckpt_ptr + ((C // G) * (bos // C + seq) * H + h) * BK
        i_lo = (start - bos) // G
        d = chain_groups(d, k_ptr, m_ptr, w0_ptr, r_ptr, ckpt, w_ptr, bos, eos, i_lo, i_lo + (n + G - 1) // G, h, H,
                         K, HAS_R, G, BK)
        if start + n == eos:
            tl.store(dfin_ptr + (seq * H + h) * K + offs, d, mask=offs < K)


@triton.jit(do_not_specialize=["T", "NS"])
def _segment_adjoint_carry_kernel(dkt_ptr, ddf_ptr, k_ptr, beta_ptr, r_ptr, cu_ptr, first_ptr, tt_ptr, a_ptr, hs_ptr,
                                  fs_ptr,
                                  flag_ptr, dk_ptr, dbeta_ptr, dr_ptr, dd0_ptr, ckpt_ptr, gck_ptr, traj_ptr, amap_ptr,
                                  bmap_ptr, alpha_ptr, gend_ptr, T, NS, H, K, eta, d_min, d_max, eps,
                                  HAS_R: tl.constexpr, VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr,
                                  SERIAL: tl.constexpr, SEG: tl.constexpr, C: tl.constexpr, G: tl.constexpr,
                                  BK: tl.constexpr):
    """Grid (N, H), adjoint, for the chains with a flagged chunk (``SERIAL``) or for the others (a program of the
    other kind returns at once): segments backwards from ``dd_final``; ``g`` at every segment's end to ``gend``; a
    segment with a flagged chunk runs the serial adjoint here (``adjoint_groups``), others but the first apply their
    map (``amap``: the forward's Delta, applied transposed, a tile at a time where ``SERIAL``; ``bmap``: b'), a run
    of them at a time (one search of the flags per run). The gradient at the sequence's start goes to ``dd0`` where
    the sequence is empty or its first segment ran here; otherwise the first segment's adjoint chain writes it."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    r0, ns = seq_segments(first_ptr, n, NS, eos, bos, SEG, VARLEN)
    offs = tl.arange(0, BK)
    NG: tl.constexpr = C // G
    slot = bos // C + n
    CS: tl.constexpr = SEG // C
    nc = (eos - bos + C - 1) // C
    if (flagged_chunk(flag_ptr, slot, 0, nc, h, H, True, 128) >= 0) == SERIAL:
        g = tl.load(ddf_ptr + (n * H + h) * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        if SERIAL:
            j_end = tl.full([], 0, tl.int64) + ns
            while j_end > 0:
                last = flagged_chunk(flag_ptr, slot, 0, tl.minimum(j_end * CS, nc), h, H, True, 128)
                jd = tl.where(last >= 0, last // CS, -1)            # the last segment below j_end with a flagged chunk
                j_next = jd + 1
                if jd == j_end - 1:
                    j = jd
                    tl.store(gend_ptr + ((r0 + j) * H + h) * BK + offs, g)
                    t0 = bos + j * SEG
                    g = adjoint_groups(g, dkt_ptr, k_ptr, beta_ptr, r_ptr, tt_ptr, a_ptr, hs_ptr,
                                       fs_ptr + (NG * slot * H + h) * BK, flag_ptr, dk_ptr, dbeta_ptr, dr_ptr,
                                       ckpt_ptr + (NG * slot * H + h) * BK,
                                       gck_ptr + (NG * slot * H + h) * BK, traj_ptr + (n * H + h) * C * BK, bos, eos,
                                       slot, j * (SEG // G), j * (SEG // G) + (tl.minimum(SEG, eos - t0) + G - 1) // G,
                                       h, H, K, eta, d_min, d_max, eps, HAS_R, BETA_AWARE, C, G, BK)
                    j_next = jd
                else:       # a run of unflagged segments: their maps
                    g = adjoint_maps(g, amap_ptr, bmap_ptr, alpha_ptr, gend_ptr, r0, tl.maximum(jd + 1, 1), j_end,
                                     h, H, True, BK)
                    if jd < 0:                              # the first segment: its own adjoint chain goes on
                        tl.store(gend_ptr + (r0 * H + h) * BK + offs, g)
                j_end = j_next
            if segment_clean(flag_ptr, slot, 0, tl.minimum(SEG, eos - bos), h, H, SEG, C) == 0:
                tl.store(dd0_ptr + (n * H + h) * K + offs, g, mask=offs < K)
        else:
            if ns > 0:      # every map but the first segment's, whose own adjoint chain goes on from gend
                g = adjoint_maps(g, amap_ptr, bmap_ptr, alpha_ptr, gend_ptr, r0, 1, ns, h, H, False, BK)
                tl.store(gend_ptr + (r0 * H + h) * BK + offs, g)
            else:
                tl.store(dd0_ptr + (n * H + h) * K + offs, g, mask=offs < K)


@triton.jit(do_not_specialize=["T", "NS"])
def _segment_adjoint_kernel(dkt_ptr, k_ptr, beta_ptr, r_ptr, cu_ptr, table_ptr, tt_ptr, a_ptr, hs_ptr, fs_ptr,
                            flag_ptr, dk_ptr, dbeta_ptr, dr_ptr, dd0_ptr, ckpt_ptr, gck_ptr, gend_ptr, T, NS, H, K, eta,
                            d_min, d_max, eps,
                            HAS_R: tl.constexpr, VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, SEG: tl.constexpr,
                            C: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """Grid (segment rows, B*H), adjoint: the adjoint chain through one segment without flagged chunks from
    ``g`` at its end (``gend``), writing ``g`` at each group's end (``gck``) and, in a sequence's first segment, the
    gradient at its start to ``dd0``; flagged segments were done by the carry."""
    seq, bos, eos, start, n, row, h = segment_program(cu_ptr, table_ptr, T, NS, H, SEG, VARLEN)
    if n > 0:
        NG: tl.constexpr = C // G
        slot = bos // C + seq
        if segment_clean(flag_ptr, slot, (start - bos) // C, n, h, H, SEG, C):
            offs = tl.arange(0, BK)
            g = tl.load(gend_ptr + (row * H + h) * BK + offs)
            i_lo = (start - bos) // G
            # no chunk here is flagged, so the token adjoint never runs and needs no scratch (ckpt stands in)
            g = adjoint_groups(g, dkt_ptr, k_ptr, beta_ptr, r_ptr, tt_ptr, a_ptr, hs_ptr,
                               fs_ptr + (NG * slot * H + h) * BK, flag_ptr,
                               dk_ptr, dbeta_ptr, dr_ptr, ckpt_ptr + (NG * slot * H + h) * BK,
                               gck_ptr + (NG * slot * H + h) * BK, ckpt_ptr, bos, eos, slot, i_lo,
                               i_lo + (n + G - 1) // G, h, H, K, eta, d_min, d_max, eps, HAS_R, BETA_AWARE, C, G, BK)
            if start == bos:
                tl.store(dd0_ptr + (seq * H + h) * K + offs, g, mask=offs < K)


def _segment_maps(k, retention, cu_seqlens, x, a, v, flags, amap, seg: int, adjoint: bool):
    """Layout, the maps of every segment (``_segment_map_kernel``; forward: Delta to ``amap``, ``[map_rows, H,
    BK, BK]`` fp32) as ``(bmap, alpha, a [map_rows, H, BK] buffer for the state at each segment boundary)``, and the
    launch arguments both directions share."""
    B, T, H, K = k.shape
    BK = block_k(K)
    assert seg % CHUNK == 0
    lay = chunk_layout(cu_seqlens, B, T, seg)              # "chunks" of seg tokens: the segments
    slots = map_rows(k, cu_seqlens, seg)
    assert amap.shape == (slots, H, BK, BK), amap.shape
    f32 = dict(dtype=torch.float32, device=k.device)
    bmap, alpha, bound = (torch.empty(slots, H, BK, **f32), torch.empty(slots, H, **f32),
                          torch.empty(slots, H, BK, **f32))
    cu = cu_seqlens if cu_seqlens is not None else k
    table = lay.table if lay.table is not None else k
    r = retention if retention is not None else k
    common = dict(HAS_R=retention is not None, VARLEN=cu_seqlens is not None, SEG=seg, BK=BK)
    _segment_map_kernel[(lay.n_chunks, B * H)](k, r, x, a, v, cu, table, flags, amap, bmap, alpha, T, lay.NT, H, K,
                                             ADJOINT=adjoint, C=CHUNK, G=GROUP, PREC=precompute_precision(k),
                                             num_warps=MAP_WARPS[adjoint], **common)
    maps = (bmap, alpha, bound)
    return lay, maps, dict(cu=cu, table=table, r=r, first=lay.first if lay.first is not None else k), common


def segment_chain(k, d0, retention, cu_seqlens, M, w0, dfin, ckpt, w, amap, seg: int, chain_warps: int):
    """The forward chain in two levels (segments of ``seg`` tokens): writes ``ckpt``, ``w`` and the unclamped
    ``dfin`` as ``precond_chain._chain_kernel`` does, and the segments' Delta to ``amap`` (for the backward).
    ``M, w0``: the precompute's."""
    B, T, H, K = k.shape
    lay, (bmap, alpha, dstart), a, common = _segment_maps(k, retention, cu_seqlens, M, k, w0, k, amap, seg, False)
    _segment_carry_kernel[(sequences(k, cu_seqlens), H)](
        d0 if d0 is not None else k, a["cu"], a["first"], amap, bmap, alpha, dstart, dfin, T, lay.NT, H, K,
        HAS_D0=d0 is not None, VARLEN=common["VARLEN"], SEG=seg, BK=common["BK"], num_warps=CARRY_WARPS)
    _segment_chain_kernel[(lay.n_chunks, B * H)](k, a["r"], a["cu"], a["table"], M, w0, dstart, ckpt, w, dfin, T,
                                                 lay.NT, H, K, C=CHUNK, G=GROUP, num_warps=chain_warps, **common)


def segment_adjoint(dk_tilde, dd_final, k, beta, retention, cu_seqlens, tt, acoef, hs, fs, flags, dk, dbeta, dr, dd0,
                    ckpt, gck, amap, seg: int, eta, d_min, d_max, eps, beta_aware, chain_warps: int):
    """The adjoint chain in two levels: writes ``gck``, sigma over ``hs`` (h0), ``dd0`` and the token gradients of
    flagged chunks as ``precond_chain._adjoint_kernel`` does (``PARALLEL``). ``tt``, ``amap``: the forward's Tinv^T
    and segment maps; ``acoef, hs, fs``: the backward precompute's."""
    B, T, H, K = k.shape
    N = sequences(k, cu_seqlens)
    lay, (bmap, alpha, gend), a, common = _segment_maps(k, retention, cu_seqlens, tt, acoef, fs, flags, amap, seg, True)
    dr_arg = dr if retention is not None else k
    hp = (float(eta), float(d_min), float(d_max), float(eps))
    traj = torch.empty(N * H, CHUNK, common["BK"], dtype=torch.float32, device=k.device)
    for serial, warps in ((False, CARRY_WARPS), (True, SERIAL_CARRY_WARPS)):
        _segment_adjoint_carry_kernel[(N, H)](
            dk_tilde, dd_final, k, beta, a["r"], a["cu"], a["first"], tt, acoef, hs, fs, flags, dk, dbeta, dr_arg,
            dd0, ckpt, gck, traj, amap, bmap, alpha, gend, T, lay.NT, H, K, *hp, BETA_AWARE=bool(beta_aware),
            SERIAL=serial, C=CHUNK, G=GROUP, num_warps=warps, **common)
    _segment_adjoint_kernel[(lay.n_chunks, B * H)](
        dk_tilde, k, beta, a["r"], a["cu"], a["table"], tt, acoef, hs, fs, flags, dk, dbeta, dr_arg, dd0, ckpt, gck,
        gend, T, lay.NT, H, K, *hp, BETA_AWARE=bool(beta_aware), C=CHUNK, G=GROUP, num_warps=chain_warps, **common)
