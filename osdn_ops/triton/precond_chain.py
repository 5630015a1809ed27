"""The serial part of the chunk-parallel precond_scan: one program per (sequence, head) carries ``d``
(forward) or its gradient ``g`` (adjoint) from one 16-token group to the next, and nothing else.

Notation of ``precond_parallel``. Per group, with ``s_t = k_t^2`` and ``e_t = exp(Gam_end - Gam_{t+1})``:

* forward (``chain_step``): ``p = S d``, ``w = w0 - M p``, ``d_end = exp(Gam_end) d + sum_t e_t w_t s_t``;
* adjoint (``adjoint_step``, groups in reverse): ``q = S g``, ``v = Tinv^T (e q)``,
  ``g_start = exp(Gam_end) g + fsum - sum_t a_t v_t s_t``, with ``Tinv^T`` kept by the forward and ``a``,
  ``fsum`` from the backward's precompute; off the serial path, ``sigma = h0 + v``.

Each is three short dependent reductions. The forward chain applies no clamp: it writes ``d`` at every
group start (``ckpt``), every token's ``w`` and a provisional ``d_final``; the output pass (``precond_fwd``)
forms each group's ``d_t`` from its checkpoint and ``w`` (row by row, no reduction over K), writes
``k_tilde`` and flags the chunks whose pre-clamp values leave the box, and a fixup pass reruns each sequence
from its first flagged chunk. The adjoint chain writes the gradient at every group end (``gck``, same rows as
``ckpt``) and every token's ``sigma`` for the parallel adjoint pass, and runs chunks the forward flagged token
by token itself. The forward keeps ``ckpt``, ``w`` and ``Tinv^T`` for the backward, whose adjoint pass so
needs no matrix at all.

Inputs of a group do not depend on the chain, so the group loops are software-pipelined: Triton's
``tl.range(num_stages=...)`` issues the loads of the next groups (asynchronously, into shared memory) while the
current one runs (``CHAIN_STAGES``, ``ADJOINT_STAGES``). That needs the key rows' alignment known when compiling
(``H`` and ``K`` are specialized, see ``precond``). On the H200 (S1 / S2, bf16, profiler) the forward chain took
0.115 / 0.224 ms with the loads rotated by hand two groups ahead, 0.171 / 0.327 ms pipelined without the
alignment and 0.093 / 0.183 ms pipelined with it; the adjoint chain 0.159 / 0.313, 0.219 / 0.425 and
0.123 / 0.241 ms (at four warps; at one, ``precond_fwd.CHAIN_WARPS``, the adjoint chain takes 0.105 / 0.206). A
branch inside a loop stops the pipelining, so the adjoint handles the chunks the forward flagged between runs of
unflagged ones.

The products with ``M`` and ``Tinv^T`` reduce over axis 0 of the transposed tile: the vector then arrives in the
layout the next reduction wants, and a step takes half the warp shuffles (sm_90, bf16, K 128: 106 -> 54). With that
and the groups inside a sequence run without row masks, the chains took (H200, profiler, S1 / S3 / S4) 0.067 /
0.039 / 0.189 ms forward (from 0.096 / 0.054 / 0.262) and 0.098 / 0.052 / 0.264 ms adjoint (from 0.107 / 0.058 /
0.290). Running the trailing unflagged groups before the adjoint's loop saved a little more on those shapes but
cost 15-50% on clamp-heavy ones (S1-clamp, retention), so it is not done.

The forward step is bound by instruction issue, not by its dependency path: about 560 PTX instructions a group
(sm_90, bf16, K 128), issued by one warp. So forms that shorten the path but add work were slower (H100, S1, chain
kernel ms, against 0.066): carrying ``p`` and forming the next group's ``S d`` beside ``w`` (a stored cross Gram for
the rest) 0.114, its precompute 0.050 -> 0.089; the key columns split over 2 or 4 warps (Gluon) 0.074-0.084; keys
and ``M`` by TMA 0.070 (benchmarks/RESULTS.md, runs of 2026-12-07 23:58 and 2026-12-08 00:17).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .precond_tokens import decay_logs, flagged_chunk, load_d0, sequence_bounds, tokens_adjoint

#: software-pipeline stages of the forward and adjoint group loops
CHAIN_STAGES = tl.constexpr(4)
ADJOINT_STAGES = tl.constexpr(3)


@triton.jit
def raw_matrix(x_ptr, t0, t1, h, H, G: tl.constexpr, FULL: tl.constexpr = False):
    """A ``[G, G]`` fp32 per-row matrix (M or Tinv^T) of tokens ``[t0, min(t0 + G, t1))``; zeros past the end."""
    ci = tl.arange(0, G)
    rows = t0 + ci
    if FULL:
        return tl.load(x_ptr + (rows[:, None] * H + h) * G + ci[None, :])
    return tl.load(x_ptr + (rows[:, None] * H + h) * G + ci[None, :], mask=(rows < t1)[:, None], other=0.0)


@triton.jit
def raw_rows(k_ptr, x_ptr, t0, t1, h, H, K, G: tl.constexpr, BK: tl.constexpr, FULL: tl.constexpr = False):
    """Keys ``[G, BK]`` and a ``[G, G]`` fp32 per-row matrix (M or Tinv^T) of tokens ``[t0, min(t0 + G, t1))``,
    unconverted; zeros past the end."""
    ci = tl.arange(0, G)
    offs = tl.arange(0, BK)
    rows = t0 + ci
    mrow = (rows < t1) | FULL
    kv = tl.load(k_ptr + (rows[:, None] * H + h) * K + offs[None, :], mask=mrow[:, None] & (offs < K)[None, :],
                 other=0.0)
    return kv, raw_matrix(x_ptr, t0, t1, h, H, G, FULL)


@triton.jit
def raw_scalars(ptr, t0, t1, h, H, other, G: tl.constexpr, FULL: tl.constexpr = False):
    """``[G]`` per-token values (w0 or retention) of tokens ``[t0, min(t0 + G, t1))``; ``other`` past the end."""
    rows = t0 + tl.arange(0, G)
    if FULL:
        return tl.load(ptr + rows * H + h)
    return tl.load(ptr + rows * H + h, mask=rows < t1, other=other)


@triton.jit
def chain_step(d, kv, M, w0, r, HAS_R: tl.constexpr, G: tl.constexpr):
    """``(d at the end of a group, the group's w [G])`` from ``d`` at its start (raw inputs from
    ``raw_rows``/``raw_scalars``)."""
    s = kv.to(tl.float32) * kv.to(tl.float32)
    p = tl.sum(s * d[None, :], 1)
    w = w0 - tl.sum(tl.trans(M) * p[:, None], 0)
    lg, lgi = decay_logs(r, HAS_R, G)
    lg_end = tl.sum(lgi - lg, 0)
    return tl.exp(lg_end) * d + tl.sum((tl.exp(tl.minimum(lg_end - lgi, 0.0)) * w)[:, None] * s, 0), w


@triton.jit
def adjoint_step(g, kv, TT, a, h0, r, fsum, HAS_R: tl.constexpr, G: tl.constexpr):
    """``(the gradient at a group's start, the group's sigma [G])`` from ``g`` at its end (raw inputs, zeros
    past the end); sigma is off the serial path."""
    s = kv.to(tl.float32) * kv.to(tl.float32)
    q = tl.sum(s * g[None, :], 1)
    lg, lgi = decay_logs(r, HAS_R, G)
    lg_end = tl.sum(lgi - lg, 0)
    if HAS_R:
        q = tl.exp(tl.minimum(lg_end - lgi, 0.0)) * q
    v = tl.sum(tl.trans(TT) * q[:, None], 0)
    return tl.exp(lg_end) * g + fsum - tl.sum((a * v)[:, None] * s, 0), h0 + v


@triton.jit
def group_bounds(bos, eos, i, G: tl.constexpr):
    """Tokens ``[t0, t1)`` of group ``i`` of a sequence; groups never cross a chunk."""
    t0 = bos + i * G
    return t0, tl.minimum(t0 + G, eos)


@triton.jit
def chain_raw(k_ptr, m_ptr, w0_ptr, r_ptr, bos, eos, i, h, H, K, HAS_R: tl.constexpr, G: tl.constexpr,
              BK: tl.constexpr, FULL: tl.constexpr = False):
    """Raw inputs of forward group ``i``: keys, M, w0, retention (ones without)."""
    t0, t1 = group_bounds(bos, eos, i, G)
    kv, m = raw_rows(k_ptr, m_ptr, t0, t1, h, H, K, G, BK, FULL)
    w0 = raw_scalars(w0_ptr, t0, t1, h, H, 0.0, G, FULL)
    if HAS_R:
        r = raw_scalars(r_ptr, t0, t1, h, H, 1.0, G, FULL)
    else:
        r = tl.full([G], 1.0, tl.float32)
    return kv, m, w0, r


@triton.jit
def adjoint_raw(k_ptr, tt_ptr, a_ptr, h0_ptr, r_ptr, fs, bos, eos, i, h, H, K, HAS_R: tl.constexpr, G: tl.constexpr,
                BK: tl.constexpr, FULL: tl.constexpr = False):
    """Raw inputs of adjoint group ``i``: keys, Tinv^T, a, h0, retention and fsum (``FULL``: no row masks)."""
    t0, t1 = group_bounds(bos, eos, i, G)
    kv, tt = raw_rows(k_ptr, tt_ptr, t0, t1, h, H, K, G, BK, FULL)
    a = raw_scalars(a_ptr, t0, t1, h, H, 0.0, G, FULL)
    h0 = raw_scalars(h0_ptr, t0, t1, h, H, 0.0, G, FULL)
    if HAS_R:
        r = raw_scalars(r_ptr, t0, t1, h, H, 1.0, G, FULL)
    else:
        r = tl.full([G], 1.0, tl.float32)
    f = tl.load(fs + i * H * BK + tl.arange(0, BK))
    return kv, tt, a, h0, r, f


@triton.jit
def chain_group(d, k_ptr, m_ptr, w0_ptr, r_ptr, ckpt, w_ptr, bos, eos, i, h, H, K, HAS_R: tl.constexpr,
                G: tl.constexpr, BK: tl.constexpr, FULL: tl.constexpr):
    """Forward group ``i``: ``d`` at its start to ``ckpt + i * H*BK``, its tokens' ``w`` to ``w_ptr``; returns ``d``
    at its end. ``FULL``: the group lies inside the sequence (no row masks)."""
    kv, m, w0, r = chain_raw(k_ptr, m_ptr, w0_ptr, r_ptr, bos, eos, i, h, H, K, HAS_R, G, BK, FULL)
    tl.store(ckpt + i * H * BK + tl.arange(0, BK), d)
    d, w = chain_step(d, kv, m, w0, r, HAS_R, G)
    t0, t1 = group_bounds(bos, eos, i, G)
    rows = t0 + tl.arange(0, G)
    tl.store(w_ptr + rows * H + h, w, mask=(rows < t1) | FULL)
    return d


@triton.jit
def chain_groups(d, k_ptr, m_ptr, w0_ptr, r_ptr, ckpt, w_ptr, bos, eos, i_lo, i_hi, h, H, K, HAS_R: tl.constexpr,
                 G: tl.constexpr, BK: tl.constexpr):
    """The forward chain over groups ``[i_lo, i_hi)`` of the sequence ``[bos, eos)`` from ``d`` at group
    ``i_lo``'s start: ``d`` at each group start to ``ckpt + i * H*BK``, each token's ``w`` to ``w_ptr`` (rows as
    the keys'); returns ``d`` after group ``i_hi - 1``. The groups inside the sequence run without row masks (sm_90,
    bf16, K 128: 649 -> 548 instructions a step); a partial last group runs after them."""
    i_full = tl.minimum(i_hi, (eos - bos) // G)
    for i in tl.range(i_lo, i_full, num_stages=CHAIN_STAGES):
        d = chain_group(d, k_ptr, m_ptr, w0_ptr, r_ptr, ckpt, w_ptr, bos, eos, i, h, H, K, HAS_R, G, BK, True)
    for i in range(i_full, i_hi):
        d = chain_group(d, k_ptr, m_ptr, w0_ptr, r_ptr, ckpt, w_ptr, bos, eos, i, h, H, K, HAS_R, G, BK, False)
    return d


@triton.jit(do_not_specialize=["T"])
def _chain_kernel(k_ptr, d0_ptr, r_ptr, cu_ptr, m_ptr, w0_ptr, dfin_ptr, ckpt_ptr, w_ptr, T, H, K,
                  HAS_D0: tl.constexpr, HAS_R: tl.constexpr, VARLEN: tl.constexpr, C: tl.constexpr,
                  G: tl.constexpr, BK: tl.constexpr):
    """Grid (N, H): the forward chain; ``d`` at group i's start goes to ckpt row ``(C/G * slot + i) * H + h``
    (``slot = bos // C + n``), each token's ``w`` to ``w_ptr``, the unclamped ``d`` at the sequence's end to
    ``dfin``."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    d = load_d0(d0_ptr, n, h, H, K, HAS_D0, BK)
    offs = tl.arange(0, BK)
    ckpt = ckpt_ptr + ((C // G) * (bos // C + n) * H + h) * BK
    d = chain_groups(d, k_ptr, m_ptr, w0_ptr, r_ptr, ckpt, w_ptr, bos, eos, 0, (eos - bos + G - 1) // G, h, H, K,
                     HAS_R, G, BK)
    tl.store(dfin_ptr + (n * H + h) * K + offs, d, mask=offs < K)


@triton.jit
def adjoint_group(g, k_ptr, tt_ptr, a_ptr, hs_ptr, r_ptr, fs, gck, bos, eos, i, h, H, K, HAS_R: tl.constexpr,
                  G: tl.constexpr, BK: tl.constexpr, FULL: tl.constexpr):
    """Adjoint group ``i``: ``g`` at its end to ``gck + i * H*BK``, its tokens' sigma over their ``h0`` at ``hs_ptr``;
    returns the gradient at its start. ``FULL``: the group lies inside the sequence (no row masks)."""
    kv, tt, a, h0, r, f = adjoint_raw(k_ptr, tt_ptr, a_ptr, hs_ptr, r_ptr, fs, bos, eos, i, h, H, K, HAS_R, G, BK,
                                      FULL)
    tl.store(gck + i * H * BK + tl.arange(0, BK), g)
    g, sigma = adjoint_step(g, kv, tt, a, h0, r, f, HAS_R, G)
    t0, t1 = group_bounds(bos, eos, i, G)
    rows = t0 + tl.arange(0, G)
    tl.store(hs_ptr + rows * H + h, sigma, mask=(rows < t1) | FULL)
    return g


@triton.jit
def adjoint_run(g, k_ptr, tt_ptr, a_ptr, hs_ptr, r_ptr, fs, gck, bos, eos, i_start, i_end, h, H, K,
                HAS_R: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """Adjoint groups ``i_end - 1`` down to ``i_start`` (``adjoint_group``): the sequence's partial last group with
    row masks, the others without, in a loop without branches (it pipelines). Returns the gradient at ``i_start``."""
    if (i_end > i_start) & (bos + i_end * G > eos):
        i_end -= 1
        g = adjoint_group(g, k_ptr, tt_ptr, a_ptr, hs_ptr, r_ptr, fs, gck, bos, eos, i_end, h, H, K, HAS_R, G, BK,
                          False)
    for ii in tl.range(0, i_end - i_start, num_stages=ADJOINT_STAGES):
        g = adjoint_group(g, k_ptr, tt_ptr, a_ptr, hs_ptr, r_ptr, fs, gck, bos, eos, i_end - 1 - ii, h, H, K, HAS_R, G,
                          BK, True)
    return g


@triton.jit
def adjoint_groups(g, dkt_ptr, k_ptr, beta_ptr, r_ptr, tt_ptr, a_ptr, hs_ptr, fs, flag_ptr, dk_ptr, dbeta_ptr,
                   dr_ptr, ckpt, gck, traj, bos, eos, slot, i_lo, i_hi, h, H, K, eta, d_min, d_max, eps,
                   HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, C: tl.constexpr, G: tl.constexpr,
                   BK: tl.constexpr):
    """The adjoint chain over groups ``i_hi - 1`` down to ``i_lo`` (whole chunks) of the sequence ``[bos, eos)``
    from the gradient ``g`` at group ``i_hi - 1``'s end: ``g`` at each group's end to ``gck + i * H*BK`` and each
    token's sigma over its ``h0`` at ``hs_ptr`` (rows as the keys'; each is read once, by the step that writes
    it); a chunk that ``flag`` marks runs the token adjoint instead (its token gradients are written here).
    Returns the gradient at group ``i_lo``'s start."""
    NG: tl.constexpr = C // G
    i_end = i_hi
    while i_end > i_lo:
        j = (i_end - 1) // NG
        if tl.load(flag_ptr + (slot + j) * H + h) != 0:
            d = tl.load(ckpt + j * NG * H * BK + tl.arange(0, BK))
            g = tokens_adjoint(g, d, traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, dk_ptr, dbeta_ptr, dr_ptr, bos + j * C,
                               tl.minimum(bos + (j + 1) * C, eos), h, H, K, eta, d_min, d_max, eps, HAS_R,
                               BETA_AWARE, G, BK)
            i_end = j * NG
        else:       # back to the last flagged chunk
            i_start = tl.maximum((flagged_chunk(flag_ptr, slot, i_lo // NG, j, h, H, True, 64) + 1) * NG, i_lo)
            g = adjoint_run(g, k_ptr, tt_ptr, a_ptr, hs_ptr, r_ptr, fs, gck, bos, eos, i_start, i_end, h, H, K, HAS_R,
                            G, BK)
            i_end = i_start
    return g


@triton.jit(do_not_specialize=["T"])
def _adjoint_kernel(dkt_ptr, ddf_ptr, k_ptr, beta_ptr, r_ptr, cu_ptr, tt_ptr, a_ptr, hs_ptr, fs_ptr, flag_ptr,
                    dk_ptr, dbeta_ptr, dr_ptr, dd0_ptr, ckpt_ptr, gck_ptr, traj_ptr, T, H, K, eta, d_min, d_max, eps,
                    HAS_R: tl.constexpr, VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, PARALLEL: tl.constexpr,
                    C: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """Grid (N, H): the serial adjoint from ``dd_final`` back to ``dd0``.

    ``PARALLEL``: the adjoint chain, writing ``g`` at each group's end to ``gck`` (rows as ``ckpt``), and
    the token loop for the chunks ``flag`` marks (chunk rows ``slot + j``); they get their token gradients
    here. Otherwise every chunk runs the token loop. ``ckpt``: ``d`` at group starts (the forward's);
    ``traj`` ``[N*H, C, BK]`` scratch; ``tt`` (the forward's Tinv^T), ``a``, ``hs`` (h0, overwritten by sigma),
    ``fs``: the precompute's terms for the chain."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bos, eos = sequence_bounds(cu_ptr, n, T, VARLEN)
    offs = tl.arange(0, BK)
    NG: tl.constexpr = C // G
    slot = bos // C + n
    ckpt = ckpt_ptr + (NG * slot * H + h) * BK
    g = tl.load(ddf_ptr + (n * H + h) * K + offs, mask=offs < K, other=0.0).to(tl.float32)
    traj = traj_ptr + (n * H + h) * C * BK
    if PARALLEL:
        g = adjoint_groups(g, dkt_ptr, k_ptr, beta_ptr, r_ptr, tt_ptr, a_ptr, hs_ptr,
                           fs_ptr + (NG * slot * H + h) * BK, flag_ptr, dk_ptr, dbeta_ptr, dr_ptr, ckpt,
                           gck_ptr + (NG * slot * H + h) * BK, traj, bos, eos, slot, 0, (eos - bos + G - 1) // G, h, H,
                           K, eta, d_min, d_max, eps, HAS_R, BETA_AWARE, C, G, BK)
    else:
        nc = (eos - bos + C - 1) // C
        for jj in range(0, nc):
            j = nc - 1 - jj
            d = tl.load(ckpt + j * NG * H * BK + offs)
            g = tokens_adjoint(g, d, traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, dk_ptr, dbeta_ptr, dr_ptr, bos + j * C,
                               tl.minimum(bos + (j + 1) * C, eos), h, H, K, eta, d_min, d_max, eps, HAS_R,
                               BETA_AWARE, G, BK)
    tl.store(dd0_ptr + (n * H + h) * K + offs, g, mask=offs < K)
