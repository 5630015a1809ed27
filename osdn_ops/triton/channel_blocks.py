"""Exact block form of the channel gate's in-chunk decays (DESIGN §4, KDA), for chunks that no reference row serves.

A chunk's pairs ``t > j`` split into six levels of a binary hierarchy over its 64 rows: the pair is of level ``L``
(32, 16, 8, 4, 2, 1) when ``t`` and ``j`` lie in one aligned group of ``2L`` rows, ``t`` in its upper half and ``j``
in its lower one. The group's reference row ``r``, the last of its lower half, lies between them (``j <= r < t``), so
for gates ``g <= 0`` both ``e^{G_t - G_r}`` and ``e^{G_r - G_j}`` are at most 1: each level is one product of scaled
tiles, exact for any decay, masked to the level's pairs (:func:`_level_masks`). The pairs ``t = j`` (``E = 1``) are
added element-wise. Six masked ``[64, 64]`` products replace a loop over the 64 columns' decays. The forward's
scores (``asym_wy``, ``asym_output``) and the backward (``asym_bwd``) take this form for every such chunk, a group of
at most 32 channels at a time (fp32 operands at :func:`exact_fp32` precision).
Addressing as in :mod:`channel_refs`: ``rows`` [64] int64 flat token indices of the chunk (``rows = first + i``),
``rm`` [64] the valid rows, ``hh`` the head, ``G`` ``[.., H, K]`` fp32.
"""
import triton
import triton.language as tl

from .channel_refs import mm


@triton.jit
def _columns(x_ptr, rows, rm, hh, H, K, ck):
    """The chunk's rows of a ``[.., H, K]`` tensor on the channels ``ck`` [BC]: ``[64, BC]`` fp32 (0 outside)."""
    return tl.load(x_ptr + (rows[:, None] * H + hh) * K + ck[None, :], mask=rm[:, None] & (ck < K)[None, :],
                   other=0.).to(tl.float32)


@triton.jit
def _level_masks(L):
    """Level ``L`` of the hierarchy, two ``[64, 64]`` masks: ``pairs[t, j]``, the level's pairs (one group of ``2L``
    rows, ``t`` in its upper half, ``j`` in its lower one), and ``segments[s, t]``, the rows ``t`` whose terms reach
    row ``s`` of ``dg``'s straddling sums (``block_sums``): in ``s``'s half of its group, ``t >= s`` in an upper half,
    ``t < s`` in a lower one."""
    i = tl.arange(0, 64)
    t, j = i[:, None], i[None, :]
    same = t // (2 * L) == j // (2 * L)
    up_t = t % (2 * L) >= L
    up_j = j % (2 * L) >= L
    return same & up_t & (j % (2 * L) < L), same & (up_t == up_j) & tl.where(up_t, j >= t, j < t)


@triton.jit
def _level_factors(G, gx, rows, rm, hh, H, K, ck, L):
    """Level ``L``'s factors on the channels ``ck`` [BC], ``(F, Bf)`` [64, BC] fp32: ``F = e^{G_t - G_r}`` on the
    valid rows of upper halves, ``Bf = e^{G_r - G_j}`` on those of lower halves (0 elsewhere), ``r`` the row's group
    reference (the last row of the group's lower half). ``gx`` [64, BC]: the chunk's G rows on those channels. For
    ``g <= 0`` both are at most 1."""
    i = tl.arange(0, 64)
    ref = (i // (2 * L)) * (2 * L) + L - 1
    up = (i % (2 * L) >= L)[:, None]
    m = (rm & (ref < tl.sum(rm.to(tl.int32), 0)))[:, None] & (ck < K)[None, :]
    gr = tl.load(G + ((rows - i + ref)[:, None] * H + hh) * K + ck[None, :], mask=m, other=0.).to(tl.float32)
    D = tl.exp(tl.where(m, tl.where(up, gx - gr, gr - gx), float("-inf")))
    return tl.where(up, D, 0.), tl.where(up, 0., D)


@triton.constexpr_function
def exact_fp32(prec):
    """Precision of the block form's products for the kernels' ``PREC``: exact ("ieee") where that is three-pass tf32
    (fp32 inputs), whose products in an earlier block form were miscompiled (an illegal shared-memory read, or wrong
    gradients, on an H100 with Triton 3.6: benchmarks/RESULTS.md, 2026-12-06); else ``prec``."""
    return "ieee" if prec == "tf32x3" else prec


@triton.jit
def block_scores(a_ptr, b_ptr, G, rows, rm, hh, H, K, BK: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr):
    """Channel gate, exact block form: ``[64, 64]`` fp32 ``s[t,j] = sum_c a_tc b_jc E[t,j,c]`` on valid ``t >= j``
    (else 0), ``a`` and ``b`` read from ``a_ptr`` and ``b_ptr`` (``[.., H, K]`` tensors). One product a level and
    group of at most 32 channels (as :func:`channel_refs.mm`; fp32 operands at :func:`exact_fp32` of ``PREC``)."""
    i = tl.arange(0, 64)
    NG: tl.constexpr = (BK + 31) // 32
    BC: tl.constexpr = BK // NG
    BP: tl.constexpr = exact_fp32(PREC)
    s = tl.zeros([64, 64], tl.float32)
    diag = tl.zeros([64], tl.float32)
    for g in range(NG):
        ck = g * BC + tl.arange(0, BC)
        a = _columns(a_ptr, rows, rm, hh, H, K, ck)
        b = _columns(b_ptr, rows, rm, hh, H, K, ck)
        gx = _columns(G, rows, rm, hh, H, K, ck)
        diag += tl.sum(a * b, 1)
        for lv in range(6):
            L = 1 << lv
            F, Bf = _level_factors(G, gx, rows, rm, hh, H, K, ck, L)
            pairs, _ = _level_masks(L)
            s += tl.where(pairs, mm(a * F, tl.trans(b * Bf), BP, HALF), 0.)
    return s + tl.where((i[:, None] == i[None, :]) & rm[:, None], diag[:, None], 0.)


@triton.jit
def _in_columns(acc, x, c0):
    """``acc`` [64, BK] plus ``x`` [64, BC] in the columns ``c0..c0+BC``."""
    BK: tl.constexpr = acc.shape[1]
    BC: tl.constexpr = x.shape[1]
    ak = tl.arange(0, BK)
    wide = tl.reshape(tl.broadcast_to(x[:, None, :], [64, BK // BC, BC]), [64, BK])
    return acc + tl.where(((ak >= c0) & (ak < c0 + BC))[None, :], wide, 0.)


@triton.jit
def block_sums(X, rs, a_ptr, b_ptr, G, rows, rm, hh, H, K, BK: tl.constexpr, accR, scR, accC, accS,
               PREC: tl.constexpr):
    """Channel gate, exact block form, added to the caller's ``[64, BK]`` fp32 accumulators: ``accR += scR R``,
    ``accC += C``, ``accS += S``, with ``R[t,c] = sum_j X[t,j] b[j,c] E[t,j,c]``, ``C[j,c] = sum_t X[t,j] rs_t
    a[t,c] E[t,j,c]`` and ``S[s,c] = sum_{t >= s, j < s} X[t,j] rs_t a[t,c] b[j,c] E[t,j,c]`` (the decays' part of
    ``dg``, summed from decayed terms only); also returns ``sum_c a R`` [64]. ``X`` [64, 64] zero above the
    diagonal, ``rs``, ``scR`` [64] row scales, ``a`` and ``b`` read from ``a_ptr`` and ``b_ptr`` (``[.., H, K]``).
    A group of at most 32 channels at a time (few live registers beside the accumulators), three products a level
    (fp32 operands, :func:`exact_fp32` of ``PREC``): ``R`` and ``C`` of the level's pairs, and their part of ``S``:
    a level's pair ``(t, j)`` straddles the rows ``j < s <= t``, so ``S`` gets ``rs a R`` summed over the rows at or
    after ``s`` in an upper half and ``b C`` over the rows before ``s`` in a lower one (the level's ``segments``)."""
    i = tl.arange(0, 64)
    xd = tl.sum(tl.where(i[:, None] == i[None, :], X, 0.), 1)
    NG: tl.constexpr = (BK + 31) // 32
    BC: tl.constexpr = BK // NG
    BP: tl.constexpr = exact_fp32(PREC)
    rdot = tl.zeros([64], tl.float32)
    for g in range(NG):
        c0 = g * BC
        ck = c0 + tl.arange(0, BC)
        ag = _columns(a_ptr, rows, rm, hh, H, K, ck)
        bg = _columns(b_ptr, rows, rm, hh, H, K, ck)
        gx = _columns(G, rows, rm, hh, H, K, ck)
        Rg = xd[:, None] * bg
        Cg = (xd * rs)[:, None] * ag
        Sg = tl.zeros([64, BC], tl.float32)
        for lv in range(6):
            L = 1 << lv
            F, Bf = _level_factors(G, gx, rows, rm, hh, H, K, ck, L)
            pairs, segments = _level_masks(L)
            XL = tl.where(pairs, X, 0.)
            RL = F * mm(XL, bg * Bf, BP, False)
            CL = Bf * mm(tl.trans(XL * rs[:, None]), ag * F, BP, False)
            Rg += RL
            Cg += CL
            Sg += mm(segments.to(tl.float32), rs[:, None] * ag * RL + bg * CL, BP, False)
        accR = _in_columns(accR, scR[:, None] * Rg, c0)
        rdot += tl.sum(ag * Rg, 1)
        accC = _in_columns(accC, Cg, c0)
        accS = _in_columns(accS, Sg, c0)
    return accR, accC, accS, rdot
