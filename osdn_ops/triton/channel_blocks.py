"""Exact block form of the channel gate's in-chunk decays (DESIGN §4, KDA), for chunks that no reference row serves.

A chunk's pairs ``t >= j`` split into the blocks below the diagonal and the four diagonal 16 x 16 blocks. Below the
diagonal, column block ``J`` takes its last valid row ``R`` as the reference of the rows after it: for gates
``g <= 0`` both ``e^{G_t - G_R}`` (``t > R``) and ``e^{G_R - G_j}`` (``j <= R``) are at most 1, so one product of
scaled tiles per column block (:func:`channel_refs.block_factors`) is exact for any decay. The diagonal blocks are
formed element by element, one column of all four blocks per step (16 steps over ``[64, channels]`` tiles). The
backward (``asym_bwd``) takes this form for half inputs with K <= 128 and sums such chunks channel by channel
otherwise. Addressing as in :mod:`channel_refs`: ``rows`` [64] int64 flat token indices of the chunk
(``rows = first + i``), ``rm`` [64] the valid rows, ``hh`` the head, ``G`` ``[.., H, K]`` fp32.
"""
import triton
import triton.language as tl

from .channel_refs import block_factors, column_blocks, mm, ref_column_scores, stack_columns


@triton.jit
def _last_row(J, rm):
    """Reference row of column block ``J`` below the diagonal: its last valid row (below ``J`` where the chunk ends
    before the block, whose factors are then all zero)."""
    return tl.minimum(J + 15, tl.sum(rm.to(tl.int32), 0) - 1)


@triton.jit
def _band(X):
    """``[64, 16]``: the diagonal 16 x 16 blocks of a ``[64, 64]`` tile, ``band[t, jj] = X[t, 16 (t // 16) + jj]``."""
    i = tl.arange(0, 64)
    blk = tl.arange(0, 4)
    X3 = tl.reshape(X, [64, 4, 16])
    return tl.sum(tl.where(blk[None, :, None] == (i // 16)[:, None, None], X3, 0.), 1)


@triton.jit
def _diagonal_column(G, gt, b_ptr, rows, rm, hh, H, K, ck, jj):
    """Column ``jj`` of each diagonal block, ``j = 16 (t // 16) + jj`` for row ``t``, on the channels ``ck``
    [BC]: ``(e, bc)`` [64, BC] fp32 with ``e = e^{G_t - G_j}`` on valid rows at or after ``jj`` in their block (else
    0) and ``bc`` = b's row ``j``. ``gt`` [64, BC]: the chunk's G rows on those channels."""
    i = tl.arange(0, 64)
    km = (rm & (i % 16 >= jj))[:, None] & (ck < K)[None, :]
    offc = ((rows - i % 16 + jj)[:, None] * H + hh) * K + ck[None, :]
    gc = tl.load(G + offc, mask=km, other=0.).to(tl.float32)
    bc = tl.load(b_ptr + offc, mask=km, other=0.).to(tl.float32)
    return tl.exp(tl.where(km, gt - gc, float("-inf"))), bc


@triton.jit
def _columns(x_ptr, rows, rm, hh, H, K, ck):
    """The chunk's rows of a ``[.., H, K]`` tensor on the channels ``ck`` [BC]: ``[64, BC]`` fp32 (0 outside)."""
    return tl.load(x_ptr + (rows[:, None] * H + hh) * K + ck[None, :], mask=rm[:, None] & (ck < K)[None, :],
                   other=0.).to(tl.float32)


@triton.jit
def block_scores(a, b_ptr, G, rows, rm, hh, H, K, BK: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr):
    """Channel gate, exact block form: ``[64, 64]`` ``s[t,j] = sum_c a_tc b_jc E[t,j,c]`` on valid ``t >= j``
    (else 0). ``a`` [64, BK] fp32; ``b`` read from ``b_ptr``, a ``[.., H, K]`` tensor. Below the diagonal one
    product per column block (as :func:`ref_column_scores`, products as ``mm``)."""
    i = tl.arange(0, 64)
    s = stack_columns(ref_column_scores(a, b_ptr, G, rows, rm, hh, H, K, BK, 0, _last_row(0, rm), 16, True, PREC,
                                        HALF),
                      ref_column_scores(a, b_ptr, G, rows, rm, hh, H, K, BK, 16, _last_row(16, rm), 32, True, PREC,
                                        HALF),
                      ref_column_scores(a, b_ptr, G, rows, rm, hh, H, K, BK, 32, _last_row(32, rm), 48, True, PREC,
                                        HALF),
                      tl.zeros([64, 16], tl.float32))
    ck = tl.arange(0, BK)
    gt = _columns(G, rows, rm, hh, H, K, ck)
    col = tl.arange(0, 16)
    band = tl.zeros([64, 16], tl.float32)
    for jj in range(16):
        e, bc = _diagonal_column(G, gt, b_ptr, rows, rm, hh, H, K, ck, jj)
        band = tl.where(col[None, :] == jj, tl.sum(a * bc * e, 1)[:, None], band)
    tiled = tl.reshape(tl.broadcast_to(band[:, None, :], [64, 4, 16]), [64, 64])
    return s + tl.where(i[:, None] // 16 == i[None, :] // 16, tiled, 0.)


@triton.jit
def _below(xr, rs, ag, b_ptr, G, rows, rm, hh, H, K, ck, J, PREC: tl.constexpr):
    """:func:`block_sums` for the pairs of column block ``J..J+15`` below the diagonal, on the channels ``ck``
    [BC] (``ag`` [64, BC]: a on them): its part of ``R`` and ``S`` on the rows after the block, and of ``C`` and
    ``S`` on the block's rows, each [64, BC]."""
    i = tl.arange(0, 64)
    r = tl.arange(0, 16)
    F, Bf, offb, bm = block_factors(G, rows, rm, hh, H, K, ck, J, _last_row(J, rm), J + 16)
    bl = tl.load(b_ptr + offb, mask=bm, other=0.).to(tl.float32)
    Rj = F * mm(xr, bl * Bf, PREC, False)
    Cj = Bf * mm(tl.trans(xr * rs[:, None]), ag * F, PREC, False)
    # S on the rows after the block: every pair of the block with t >= s; on the block's rows s: the pairs j < s
    Sr = tl.where((i >= J + 16)[:, None], tl.cumsum(ag * rs[:, None] * Rj, 0, reverse=True), 0.)
    earlier = (r[None, :] < r[:, None]).to(tl.float32)
    return Rj, Sr + _rows_at(tl.dot(earlier, bl * Cj, input_precision="ieee"), J), _rows_at(Cj, J)


@triton.jit
def _rows_at(c, J):
    """``[64, N]``: the ``[16, N]`` block ``c`` on rows ``J..J+15``, 0 elsewhere."""
    N: tl.constexpr = c.shape[1]
    i = tl.arange(0, 64)
    return tl.where((i // 16 == J // 16)[:, None], tl.reshape(tl.broadcast_to(c[None, :, :], [4, 16, N]), [64, N]),
                    0.)


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
    A group of at most 32 channels at a time (few live registers beside the accumulators): below the diagonal two
    products per column block (fp32 operands, ``PREC``), then the diagonal blocks column by column."""
    i = tl.arange(0, 64)
    x0, x1, x2, _ = column_blocks(X)
    NG: tl.constexpr = (BK + 31) // 32
    BC: tl.constexpr = BK // NG
    col = tl.arange(0, 16)
    band = _band(X)
    rdot = tl.zeros([64], tl.float32)
    for g in tl.static_range(NG):    # unrolled: these products in a loop were miscompiled (H100, fp32 operands)
        c0 = g * BC
        ck = c0 + tl.arange(0, BC)
        ag = _columns(a_ptr, rows, rm, hh, H, K, ck)
        Rg, Sg, Cg = _below(x0, rs, ag, b_ptr, G, rows, rm, hh, H, K, ck, 0, PREC)
        R1, S1, C1 = _below(x1, rs, ag, b_ptr, G, rows, rm, hh, H, K, ck, 16, PREC)
        Rg += R1
        Sg += S1
        Cg += C1
        R1, S1, C1 = _below(x2, rs, ag, b_ptr, G, rows, rm, hh, H, K, ck, 32, PREC)
        Rg += R1
        Sg += S1
        Cg += C1
        gt = _columns(G, rows, rm, hh, H, K, ck)
        for jj in range(16):
            e, bc = _diagonal_column(G, gt, b_ptr, rows, rm, hh, H, K, ck, jj)
            x = tl.sum(tl.where(col[None, :] == jj, band, 0.), 1)
            Rg += x[:, None] * bc * e
            pc = (x * rs)[:, None] * ag * e
            total = tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(pc, [4, 16, BC]), 1)[:, None, :], [4, 16, BC]),
                               [64, BC])
            Cg += tl.where((i % 16 == jj)[:, None], total, 0.)
            after = tl.reshape(tl.cumsum(tl.reshape(pc * bc, [4, 16, BC]), 1, reverse=True), [64, BC])
            Sg += tl.where((i % 16 > jj)[:, None], after, 0.)
        accR = _in_columns(accR, scR[:, None] * Rg, c0)
        rdot += tl.sum(ag * Rg, 1)
        accC = _in_columns(accC, Cg, c0)
        accS = _in_columns(accS, Sg, c0)
    return accR, accC, accS, rdot
