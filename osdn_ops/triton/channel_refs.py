"""Reference-row form of the channel gate's in-chunk decays (DESIGN §4, KDA), shared by the forward and the backward.

A chunk's decayed sums need ``E[t,j,c] = e^{G_tc - G_jc}`` for ``t >= j``. Against a reference row ``J`` it factors
as ``e^{G_tc - G_Jc} e^{G_Jc - G_jc}``, so a sum over ``c`` becomes one matrix product of row-scaled and
column-scaled tiles, as long as both factors stay in fp32 range. :func:`channel_refs` picks, per chunk, one
reference (the chunk's first row; every ``|G - G_0| <= REF_SPAN``), four (the first row of each 16-token block, for
the columns of that block; each block within ``REF_SPAN``) or none (the caller's exact element-wise path).
Addressing: ``rows`` [64] int64 flat token indices of the chunk (its first token ``min(rows)``), ``rm`` [64] the
valid rows, ``hh`` the head; ``G`` is ``[.., H, K]`` fp32.
"""
import triton
import triton.language as tl

#: largest ``|G[t,c] - G[J,c]|`` over the rows a reference row ``J`` serves: its factors ``e^{+-REF_SPAN}`` stay in
#: fp32 (and bf16) range
REF_SPAN = tl.constexpr(60.0)


@triton.jit
def mm(a, b, PREC: tl.constexpr, HALF: tl.constexpr):
    """fp32-accumulated product; HALF: operands rounded to bf16 (half-precision inputs)."""
    if HALF:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def ref_gate(G, rows, rm, hh, H, K, BK: tl.constexpr, J):
    """Channel gate: ``(m, d)`` [64, BK], the valid-entry mask and ``d = G - G_J`` against the chunk's row ``J``
    (its first token plus J; 0 where the chunk has no row J)."""
    ak = tl.arange(0, BK)
    m = rm[:, None] & (ak < K)[None, :]
    gm = tl.load(G + (rows[:, None] * H + hh) * K + ak[None, :], mask=m, other=0.).to(tl.float32)
    has = J < tl.sum(rm.to(tl.int32), 0)
    gJ = tl.load(G + ((tl.min(rows, 0) + J) * H + hh) * K + ak, mask=(ak < K) & has, other=0.).to(tl.float32)
    return m, gm - gJ[None, :]


@triton.jit
def ref_ok(G, rows, rm, hh, H, K, BK: tl.constexpr, J, BS: tl.constexpr):
    """Channel gate: whether reference row ``J`` serves the columns of block ``[J, J + BS)`` (:func:`ref_factors`,
    :func:`block_factors`): ``|G_j - G_J| <= REF_SPAN`` on the block's rows and ``G_t - G_J <= REF_SPAN`` on the
    rows after it (any decay there only shrinks ``e^{G_t - G_J}``)."""
    i = tl.arange(0, 64)
    m, d = ref_gate(G, rows, rm, hh, H, K, BK, J)
    inblk = (i >= J) & (i < J + BS)
    span = tl.where(m & (i >= J)[:, None], tl.where(inblk[:, None], tl.abs(d), d), float("-inf"))
    return tl.max(tl.max(span, 1), 0) <= REF_SPAN


@triton.jit
def ref_factors(G, rows, rm, hh, H, K, BK: tl.constexpr):
    """Channel gate, one reference (the chunk's first row): ``(F, Bf)`` [64, BK] fp32, ``F[t,c] = e^{G_tc - G_0c}``
    and ``Bf[j,c] = e^{G_0c - G_jc}`` on valid rows (0 elsewhere), so that ``E[t,j,c] = F[t,c] Bf[j,c]``. Where
    :func:`ref_ok` holds for the whole chunk, both stay within ``e^{+-REF_SPAN}``."""
    m, d = ref_gate(G, rows, rm, hh, H, K, BK, 0)
    return tl.exp(tl.where(m, d, float("-inf"))), tl.exp(tl.where(m, -d, float("-inf")))


@triton.jit
def channel_refs(G, rows, rm, hh, H, K, BK: tl.constexpr):
    """Channel gate: how the chunk's decayed sums ``E[t,j,c] = e^{G_tc - G_jc}`` are formed. 1: from the chunk's
    first row alone (every ``|G - G_0| <= REF_SPAN``, one product per sum); 4: from the first row of each 16-row
    block, for the columns of that block (each block within REF_SPAN of its first row; one product per 16-column
    block); 0: neither (the caller's element-wise path)."""
    if ref_ok(G, rows, rm, hh, H, K, BK, 0, 64):
        refs = 1
    else:
        refs = 4
        for b in tl.static_range(4):
            if not ref_ok(G, rows, rm, hh, H, K, BK, 16 * b, 16):
                refs = 0
    return refs


@triton.jit
def ref_scores(a, b, G, rows, rm, hh, H, K, BK: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr):
    """Channel gate, one reference (:func:`channel_refs` 1): ``[64, 64]`` ``s[t,j] = sum_c a_tc b_jc E[t,j,c]`` (a, b
    [64, BK] fp32) on valid t >= j (else 0) as one product of scaled tiles."""
    i = tl.arange(0, 64)
    F, Bf = ref_factors(G, rows, rm, hh, H, K, BK)
    s = mm(a * F, tl.trans(b * Bf), PREC, HALF)
    return tl.where((i[:, None] >= i[None, :]) & rm[:, None], s, 0.)


@triton.jit
def block_factors(G, rows, rm, hh, H, K, ak, J):
    """The block's first row ``J`` as the reference of the columns of block ``J..J+15`` (four references,
    :func:`channel_refs`), on the channels ``ak`` [BC]: ``(F, Bf, offb, bm)`` with ``F`` [64, BC] fp32
    ``= e^{G_tc - G_Jc}`` on valid rows ``t >= J`` (else 0), ``Bf`` [16, BC] fp32 ``= e^{G_Jc - G_(J+j)c}`` on the
    block's valid rows (else 0), and the block rows' offsets and mask in a ``[.., H, K]`` tensor, so that callers read
    only the block's rows of their column operand."""
    i = tl.arange(0, 64)
    jj = J + tl.arange(0, 16)
    n = tl.sum(rm.to(tl.int32), 0)
    first = tl.min(rows, 0)
    m = rm[:, None] & (ak < K)[None, :]
    bm = (jj < n)[:, None] & (ak < K)[None, :]
    gR = tl.load(G + ((first + J) * H + hh) * K + ak, mask=(ak < K) & (J < n), other=0.).to(tl.float32)
    gt = tl.load(G + (rows[:, None] * H + hh) * K + ak[None, :], mask=m, other=0.).to(tl.float32)
    F = tl.exp(tl.where(m & (i >= J)[:, None], gt - gR[None, :], float("-inf")))
    offb = ((first + jj)[:, None] * H + hh) * K + ak[None, :]
    gb = tl.load(G + offb, mask=bm, other=0.).to(tl.float32)
    return F, tl.exp(tl.where(bm, gR[None, :] - gb, float("-inf"))), offb, bm


@triton.jit
def ref_column_scores(a, b_ptr, G, rows, rm, hh, H, K, BK: tl.constexpr, J, STRICT: tl.constexpr,
                      PREC: tl.constexpr, HALF: tl.constexpr):
    """Channel gate: the ``[64, 16]`` columns ``J..J+15`` of the chunk's scores, ``s[t,j] = sum_c a_tc b_(J+j)c
    E[t,J+j,c]`` on valid ``t > J + j`` (STRICT) or ``t >= J + j`` (else 0), as one product against reference row
    ``J`` (:func:`block_factors`; products as :func:`mm`). ``a`` [64, BK] fp32; ``b_ptr`` a
    ``[.., H, K]`` tensor whose block rows are read here, so only the block's factors ``[16, BK]`` are formed."""
    i = tl.arange(0, 64)
    jj = J + tl.arange(0, 16)
    F, Bf, offb, bm = block_factors(G, rows, rm, hh, H, K, tl.arange(0, BK), J)
    bb = tl.load(b_ptr + offb, mask=bm, other=0.).to(tl.float32) * Bf
    s = mm(a * F, tl.trans(bb), PREC, HALF)
    if STRICT:
        keep = i[:, None] > jj[None, :]
    else:
        keep = i[:, None] >= jj[None, :]
    return tl.where(keep & rm[:, None], s, 0.)


@triton.jit
def column_blocks(X):
    """The four ``[64, 16]`` column blocks of a ``[64, 64]`` tile, in order."""
    lo, hi = tl.split(tl.permute(tl.reshape(X, [64, 2, 32]), (0, 2, 1)))
    x0, x1 = tl.split(tl.permute(tl.reshape(lo, [64, 2, 16]), (0, 2, 1)))
    x2, x3 = tl.split(tl.permute(tl.reshape(hi, [64, 2, 16]), (0, 2, 1)))
    return x0, x1, x2, x3


@triton.jit
def _join_rows(a, b):
    """``[2M, N]``: ``a`` [M, N] above ``b`` [M, N]."""
    M: tl.constexpr = a.shape[0]
    N: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), [2 * M, N])


@triton.jit
def _join_columns(a, b):
    """``[M, 2N]``: ``a`` [M, N] left of ``b`` [M, N]."""
    M: tl.constexpr = a.shape[0]
    N: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [M, 2 * N])


@triton.jit
def stack_rows(c0, c1, c2, c3):
    """``[64, N]`` from four ``[16, N]`` row blocks, in order."""
    return _join_rows(_join_rows(c0, c1), _join_rows(c2, c3))


@triton.jit
def stack_columns(c0, c1, c2, c3):
    """``[64, 64]`` from four ``[64, 16]`` column blocks, in order (the inverse of :func:`column_blocks`)."""
    return _join_columns(_join_columns(c0, c1), _join_columns(c2, c3))


@triton.jit
def _block_sums(xr, xc, a, b_ptr, G, rows, rm, hh, H, K, BK: tl.constexpr, J, PREC: tl.constexpr):
    """:func:`ref_column_sums` for the column block ``J..J+15``: its part of ``R`` [64, BK] and its rows of ``C``
    [16, BK]."""
    F, Bf, offb, bm = block_factors(G, rows, rm, hh, H, K, tl.arange(0, BK), J)
    bb = tl.load(b_ptr + offb, mask=bm, other=0.).to(tl.float32) * Bf
    return F * mm(xr, bb, PREC, False), Bf * mm(tl.trans(xc), a * F, PREC, False)


@triton.jit
def ref_column_sums(Xr, Xc, a, b_ptr, G, rows, rm, hh, H, K, BK: tl.constexpr, PREC: tl.constexpr):
    """Channel gate, four references (:func:`channel_refs`): ``(R, C)`` [64, BK] fp32 with
    ``R[t,c] = sum_j Xr[t,j] b[j,c] E[t,j,c]`` and ``C[j,c] = sum_t Xc[t,j] a[t,c] E[t,j,c]`` (Xr, Xc [64, 64] zero
    above the diagonal; ``a`` [64, BK] fp32; ``b`` read from ``b_ptr``, a ``[.., H, K]`` tensor). Each 16-column
    block ``J`` takes one ``[64, 16] x [16, BK]`` product for ``R`` and one ``[16, 64] x [64, BK]`` for its rows of
    ``C``, against reference row ``J``: a quarter of the work of four full ``[64, 64] x [64, BK]`` products, whose
    factor ``e^{G_J - G_j}`` is zero outside the block. Products of fp32 operands (``PREC``)."""
    xr0, xr1, xr2, xr3 = column_blocks(Xr)
    xc0, xc1, xc2, xc3 = column_blocks(Xc)
    R, c0 = _block_sums(xr0, xc0, a, b_ptr, G, rows, rm, hh, H, K, BK, 0, PREC)
    r1, c1 = _block_sums(xr1, xc1, a, b_ptr, G, rows, rm, hh, H, K, BK, 16, PREC)
    r2, c2 = _block_sums(xr2, xc2, a, b_ptr, G, rows, rm, hh, H, K, BK, 32, PREC)
    r3, c3 = _block_sums(xr3, xc3, a, b_ptr, G, rows, rm, hh, H, K, BK, 48, PREC)
    return R + r1 + r2 + r3, stack_rows(c0, c1, c2, c3)
