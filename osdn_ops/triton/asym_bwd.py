"""Backward of the asymmetric delta engine (DESIGN §4), one Triton engine for the three gates.

``GATE`` (constexpr): 0 = "none" (delta), 1 = "scalar" (g ``[B,T,H]``), 2 = "channel" (KDA,
g ``[B,T,H,K]``). Chunk length C = 64; state ``S: K x V`` inside; K, V <= 256.

Derivation (one chunk of L <= 64 tokens; G = fp32 inclusive cumsum of g in the chunk, G_L its
last valid row, E[t,j,c] = exp(G_tc - G_jc) for t >= j; S = state at the chunk start, dSn =
gradient of the state at its end)::

    A = tril(B (K e^G)(Kt e^-G)^T, -1), T = (I + A)^-1, W = T B K e^G, U = T B V
    Vn = U - W S,  P = scale tril_incl((Q e^G)(Kt e^-G)^T)
    O = scale (Q e^G) S + P Vn,   S_next = e^{G_L} S + (Kt e^{G_L - G})^T Vn

1. reverse recurrence over chunks (fp32), seeded by dht:
   dVn = P^T dO + (Kt e^{G_L-G}) dSn;  dS = e^{G_L} dSn + scale (Q e^G)^T dO - W^T dVn.
2. per chunk: dQ = scale (dO S^T) e^G + sum_j dP[t,j] kt_j E;  dP = scale dO Vn^T (incl. mask)
   dKt = (Vn dSn^T) e^{G_L-G} + sum_t dP[t,j] q_t E + sum_t beta_t dA[t,j] k_t E
   dW = -dVn S^T, dU = dVn;  d(BKg) = T^T dW, d(BV) = T^T dU, dT = dW (BKg)^T + dU (BV)^T,
   dA = -T^T dT T^T (strict mask);  dK = beta e^G T^T dW + beta sum_j dA[t,j] kt_j E,
   dV = beta T^T dU,  dbeta = rowsum(V T^T dU + Kg T^T dW) + sum_c k (sum_j dA kt E).
3. gate: every exponent is a difference G_t - G_j or G_L - G_t (never e^{-G} alone, so g down
   to -20 per token cannot overflow), hence dG = q dQ + k dK - kt dKt per token (and channel),
   plus, on the last row, e^{G_L} rowsum(S * dSn) + sum_j kt_j dKt_state,j;
   dg = reverse cumsum of dG within the chunk for the channel gate's chunks whose sums are products (below;
   some one-token step of at least -STEP_SPAN). The scalar gate and the channel gate's other chunks form the same
   sum from decayed terms only (``_scalar_dg``, :func:`channel_blocks.block_sums`), which keeps dg's relative
   accuracy where a token decays by e^-20 (the reverse cumsum subtracts O(1) undecayed terms, whose rounding then
   exceeds dg).

The forward keeps the WY inverse T (``chunk_asym_fwd(..., save=True)``; 256 B per token and head,
fp32); G, W, U (formed from the kept T), the chunk-start states S and Vn are recomputed with the
forward's stage functions, which keeps the saved activations near the inputs' size. Where the caller asks for it
(``osdn_ops.keep_chunk_states``) the forward also keeps W, Vn and S (:mod:`asym_kept`) and only G is recomputed.
Kernels: ``_dh`` (the reverse recurrence, one program per sequence, head and V block; without a gate it
forms P^T dO itself, with one ``_dv_local`` forms it in parallel first), ``_dqkv`` (step 2, parallel).
The channel gate's E terms are matrix products when every ``|G_t - G_0| <= REF_SPAN`` in the chunk
(``E = e^{G_t - G_0} e^{G_0 - G_j}``, both factors in fp32 range, as in the forward), else one product per 16-column
block when each 16-row block is within REF_SPAN of its first row ``r`` (``E = e^{G_t - G_r} e^{G_r - G_j}`` for the
columns ``j`` of that block, ``t >= j``: the first factor at most 1, the second at most ``e^REF_SPAN``);
``_dqkv`` is launched once for each, and once more for the remaining chunks and those whose every one-token step is
below -STEP_SPAN, which it forms in the exact block form (:mod:`channel_blocks`: the pairs in six levels of a
binary hierarchy of row groups, each level one product against the groups' middle rows, where both factors are at
most 1; exact for any decay).
No atomics: every reduction runs inside one program in a fixed order. fp64 inputs, K or V above 256, and
fp32 inputs with K above 128 (whose fp32 product tiles exceed shared memory) run the reference.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..reference import asym as ref
from .asym_chunks import CHUNK as C
from .asym_chunks import (GATE_CODE, block, chunk_layout, chunk_span, fill_block_v, fp32_product_precision,
                          reference_only)
from .asym_fwd import chunk_states, gate_cumsum, wy_repr
from .asym_kept import kept_views
from .channel_blocks import block_scores, block_sums
from .channel_refs import (channel_refs, mm, ref_column_scores, ref_column_sums, ref_factors, ref_scores,
                           stack_columns)
from .host_math import cdiv


#: launch of the reverse recurrence ``_dh``: warps, stages, V block (halved where few programs: ``fill_block_v``).
#: Not 4 warps for 32- and 64-wide blocks: faster without a gate (S1 0.258 -> 0.241 ms) but wrong on the H200 for a
#: shape of the property tests (an illegal memory access and a wrong initial-state gradient; benchmarks/RESULTS.md)
DH_WARPS, DH_STAGES, DH_BV = 8, 3, 64
#: warps of ``_dh`` with 16-wide V blocks (the smallest grids): H200, S3 (32768 tokens, 8 heads) 1.080 ms at
#: 8 warps, 0.721 at 4, 37 at 2.
DH_NARROW_WARPS = 4

#: warps of ``_dqkv``, and its stages for half inputs with K <= 128 and no channel gate (the loads of its loops over
#: V blocks pipelined; H200, S1 ms: 0.639 -> 0.622 ungated, 0.991 -> 0.928 with the scalar gate; the channel gate
#: got slower, 2.308 -> 2.469)
DQKV_WARPS, DQKV_STAGES = 8, 2


def _dh_narrowest(dtype: torch.dtype, GATE: int) -> int:
    """Narrowest V block ``_dh`` takes (``fill_block_v``) for inputs of ``dtype``; H200, K = V = 128
    (benchmarks/RESULTS.md, 2026-12-03): bf16 16 without the channel gate (with it S3 took 3.887 ms 16-wide at 4 warps,
    2.783 at 8, against 2.569 32-wide), fp32 32; fp16 never narrower than ``DH_BV``: without a gate its 16-wide
    products read shared memory out of bounds (compute-sanitizer) and 32-wide ones gave a wrong ``dk`` (relative
    error 0.96 on two sequence-heads, no memory error), while the same inputs on 160 sequence-heads (64-wide) were
    right for every gate."""
    if dtype == torch.float16:
        return DH_BV
    return 16 if dtype == torch.bfloat16 and GATE < 2 else 32


@triton.jit
def _decayed_sums(Xr, Xc, a, b, b_ptr, G, rows, rm, hh, H, K, BK: tl.constexpr, NREF: tl.constexpr,
                  PREC: tl.constexpr, HALF: tl.constexpr):
    """Channel gate: ``(R, C)`` [64, BK] fp32 with ``R[t,c] = sum_j Xr[t,j] b[j,c] E[t,j,c]`` and
    ``C[j,c] = sum_t Xc[t,j] a[t,c] E[t,j,c]`` (Xr, Xc [64, 64] zero above the diagonal; a, b [64, BK] fp32, ``b``
    also at ``b_ptr``) from NREF reference rows (:func:`channel_refs`): one product each (1), or one per 16-column
    block (4, :func:`ref_column_sums`); as :func:`channel_blocks.block_sums`, which also forms dg's decayed
    terms. With four references the products read fp32 operands (one tf32 pass for half inputs): such chunks' ``dg``
    is the reverse cumsum of terms much larger than itself, and with bf16-rounded operands its relative error reached
    2.1e-2 (bf16 keys, T 65536, ``g = logsigmoid(N)``; 1.3e-2 with tf32, as with an element-wise sum; H100,
    2026-12-05)."""
    if NREF == 1:
        F, Bf = ref_factors(G, rows, rm, hh, H, K, BK)
        return F * mm(Xr, b * Bf, PREC, HALF), Bf * mm(tl.trans(Xc), a * F, PREC, HALF)
    else:
        return ref_column_sums(Xr, Xc, a, b_ptr, G, rows, rm, hh, H, K, BK, PREC)


#: one-token decay ``e^-STEP_SPAN``: a chunk where every token decays every channel by more than that forms ``dg`` from
#: decayed terms (:func:`_any_mild_step`). With fp32 inputs on one chunk of equal steps the reverse cumsum's ``dg`` was
#: off by 2e-5 at 5, 1e-3 at 8 and 26 at 20 (relative), against 1e-6 for the decayed-term form.
STEP_SPAN = tl.constexpr(4.0)


@triton.jit
def _any_mild_step(G, rows, rm, hh, H, K, BK: tl.constexpr):
    """Channel gate: whether some token of the chunk decays some channel by at most ``e^-STEP_SPAN``
    (``G_t - G_{t-1} >= -STEP_SPAN``, ``G_{-1} = 0``). ``dg_s`` is the sum of the decayed terms that straddle token
    ``s``, each carrying ``e^{g_s}``; the reverse cumsum of the undecayed ``q dq + k dk - kt dkt`` forms it with an
    absolute error of fp32 rounding of those O(1) terms. Where some step is mild, the ``dg`` of that token and
    channel is of their size and the others' errors are small beside it; where none is, every ``dg`` of the chunk
    is smaller than that error allows (a chunk of tokens that each forget nearly all of every channel)."""
    i = tl.arange(0, 64)
    ak = tl.arange(0, BK)
    m = rm[:, None] & (ak < K)[None, :]
    off = (rows[:, None] * H + hh) * K + ak[None, :]
    gm = tl.load(G + off, mask=m, other=0.).to(tl.float32)
    gp = tl.load(G + off - H * K, mask=m & (i > 0)[:, None], other=0.).to(tl.float32)
    return tl.max(tl.max(tl.where(m, gm - gp, float("-inf")), 1), 0) >= -STEP_SPAN


@triton.jit
def _gated_scores(a, b, G, rows, rm, hh, H, K, BK: tl.constexpr,
                  GATE: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr):
    """[64,64] fp32 ``s[t,j] = sum_c a_tc b_jc exp(G_tc - G_jc)`` for valid t >= j, else 0
    (products as :func:`mm`).

    Only in-chunk pairs t >= j are exponentiated (rows past the chunk's end read G = 0, which
    would make the difference positive). Channel gate: the one-reference form (:func:`channel_refs` 1; the
    other forms take column blocks, :func:`_dv_local`)."""
    ak = tl.arange(0, BK)
    m = rm[:, None] & (ak < K)[None, :]
    off = (rows[:, None] * H + hh) * K + ak[None, :]
    if GATE == 2:
        am = tl.load(a + off, mask=m, other=0.).to(tl.float32)
        bm = tl.load(b + off, mask=m, other=0.).to(tl.float32)
        s = ref_scores(am, bm, G, rows, rm, hh, H, K, BK, PREC, HALF)
    else:
        am = tl.load(a + off, mask=m, other=0.)
        bm = tl.load(b + off, mask=m, other=0.)
        s = _causal(mm(am, tl.trans(bm), PREC, HALF), G, rows, rm, hh, H, GATE)
    return s


@triton.jit
def _causal(s, G, rows, rm, hh, H, GATE: tl.constexpr):
    """No gate or the scalar gate: the [64,64] products ``s[t,j]`` of a chunk's rows kept on valid t >= j (else 0),
    times ``e^{G_t - G_j}`` with the scalar gate."""
    if GATE == 1:
        return s * _scalar_decay(G, rows, rm, hh, H, False)
    i = tl.arange(0, 64)
    return tl.where((i[:, None] >= i[None, :]) & rm[:, None] & rm[None, :], s, 0.)


@triton.jit
def _scalar_decay(G, rows, rm, hh, H, STRICT: tl.constexpr):
    """Scalar gate: ``[64, 64]`` ``e^{G_t - G_j}`` on valid ``t > j`` (STRICT) or ``t >= j``, else 0."""
    i = tl.arange(0, 64)
    gv = tl.load(G + rows * H + hh, mask=rm, other=0.).to(tl.float32)
    if STRICT:
        low = i[:, None] > i[None, :]
    else:
        low = i[:, None] >= i[None, :]
    return tl.exp(tl.where(low & rm[:, None] & rm[None, :], gv[:, None] - gv[None, :], float("-inf")))


@triton.jit
def _chunk_rows(c, table, cu, T, NT, VARLEN: tl.constexpr):
    """Grid chunk ``c`` (a chunk-table row with ``VARLEN``, else chunk ``c % NT`` of batch row ``c // NT``;
    either way the chunk's row of the state tensors): first token (int64), length (<= 0: no chunk),
    row index ``i [64]``, valid-row mask and token rows."""
    if VARLEN:
        start, L, _ = chunk_span(c, 0, cu, table, 0, 0, 64, True)
    else:
        start, L, _ = chunk_span(c % NT, c // NT, cu, table, T, NT, 64, False)
    i = tl.arange(0, 64)
    return start, L, i, i < L, start + i


@triton.jit
def _v_block(v0, rows, rm, hh, H, V, BV: tl.constexpr):
    """V block ``v0..v0+BV`` of the chunk's rows in a ``[T, H, V]`` tensor: ``(ov [BV], vm [BV],
    mv [64, BV] mask, offv [64, BV] offsets)``."""
    ov = v0 + tl.arange(0, BV)
    vm = ov < V
    return ov, vm, rm[:, None] & vm[None, :], (rows[:, None] * H + hh) * V + ov[None, :]


@triton.jit
def _dv_local(q, kt, G, do, dvl, paths, table, cu, T, NT, scale, H, K, V, BK: tl.constexpr, BV: tl.constexpr,
              GATE: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr, VARLEN: tl.constexpr):
    """With a gate: dvl [T,H,V] = P^T dO per chunk (the state-free part of dVn; products as :func:`mm`). Without
    one, ``_dh`` forms it. Channel gate: also ``paths`` [chunks, H] int32, how ``_dqkv`` forms the chunk's decayed
    sums (1 or 4 reference rows, :func:`channel_refs`; 0 neither, also where no step is mild,
    :func:`_any_mild_step`: the exact block form, :mod:`channel_blocks`), so that its launches
    read one number instead of the chunk's gates."""
    c, hh = tl.program_id(0), tl.program_id(1)
    start, L, i, rm, rows = _chunk_rows(c, table, cu, T, NT, VARLEN)
    if L <= 0:
        return
    refs = 1
    if GATE == 2:
        refs = channel_refs(G, rows, rm, hh, H, K, BK)
        path = 0
        if _any_mild_step(G, rows, rm, hh, H, K, BK):
            path = refs
        tl.store(paths + c * H + hh, path)
    if refs == 1:
        P = _gated_scores(q, kt, G, rows, rm, hh, H, K, BK, GATE, PREC, HALF)
    else:
        ak = tl.arange(0, BK)
        qm = tl.load(q + (rows[:, None] * H + hh) * K + ak[None, :], mask=rm[:, None] & (ak < K)[None, :],
                     other=0.).to(tl.float32)
        if refs == 0:
            P = block_scores(q, kt, G, rows, rm, hh, H, K, BK, PREC, HALF)
        else:  # four references: P's 16-column blocks, each against its reference row
            P = stack_columns(ref_column_scores(qm, kt, G, rows, rm, hh, H, K, BK, 0, False, PREC, HALF),
                              ref_column_scores(qm, kt, G, rows, rm, hh, H, K, BK, 16, False, PREC, HALF),
                              ref_column_scores(qm, kt, G, rows, rm, hh, H, K, BK, 32, False, PREC, HALF),
                              ref_column_scores(qm, kt, G, rows, rm, hh, H, K, BK, 48, False, PREC, HALF))
    P = tl.where(rm[:, None] & rm[None, :], P * scale, 0.)
    for v0 in range(0, V, BV):
        _, _, m, off = _v_block(v0, rows, rm, hh, H, V, BV)
        dO = tl.load(do + off, mask=m, other=0.)
        tl.store(dvl + off, mm(tl.trans(P), dO, PREC, HALF).to(dvl.dtype.element_ty), mask=m)


@triton.jit
def _dh(q, kt, W, G, do, dvl, dht, dh, dh0, dvn, first, cu, T, NT, scale, H, K,
        V, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr,
        VARLEN: tl.constexpr):
    """Reverse recurrence: dh[chunk] (grad of the chunk's end state, [K,V] fp32), dvn = dVn, dh0.

    dVn = P^T dO + (Kt e^{G_L-G}) dSn: without a gate, P = scale tril(Q Kt^T) is formed here from the q and kt
    tiles the recurrence loads anyway (off the serial path: it does not depend on dS); the gates read P^T dO from
    ``dvl`` (``_dv_local``: formed here, the decayed scores made the scalar gate's recurrence slower than the two
    kernels, S1 0.349 -> 0.438 ms on the H200). HALF: the products read half-precision operands (the inputs' own
    q, kt, W and dO; P, the fp32 state gradient and dVn rounded to bf16 for the product only) with fp32
    accumulation, so no [64, K] fp32 tile is held; the recurrence itself stays in fp32."""
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // H
    hh = nh % H
    if VARLEN:
        bos = tl.load(cu + n)
        eos = tl.load(cu + n + 1)
        f0 = tl.load(first + n)
    else:
        bos = n.to(tl.int64) * T
        eos = bos + T
        f0 = n.to(tl.int64) * NT
    nc = tl.cdiv(eos - bos, 64)
    i = tl.arange(0, 64)
    ak = tl.arange(0, BK)
    km = ak < K
    ov = iv * BV + tl.arange(0, BV)
    vm = ov < V
    sm = km[:, None] & vm[None, :]
    if GATE == 2:
        soff = ak[:, None] * V + ov[None, :]      # public [N,H,K,V]
    else:
        soff = ov[None, :] * K + ak[:, None]      # public [N,H,V,K]
    sbase = nh.to(tl.int64) * K * V
    dS = tl.load(dht + sbase + soff, mask=sm, other=0.).to(tl.float32)
    for j in range(nc):
        ic = nc - 1 - j
        start = bos + ic * 64
        L = tl.minimum(eos - start, 64)
        rm = i < L
        rows = start + i
        tl.store(dh + ((f0 + ic) * H + hh) * K * V + ak[:, None] * V + ov[None, :], dS.to(dh.dtype.element_ty),
                 mask=sm)
        mk = rm[:, None] & km[None, :]
        offk = (rows[:, None] * H + hh) * K + ak[None, :]
        ktm = tl.load(kt + offk, mask=mk, other=0.)
        qm = tl.load(q + offk, mask=mk, other=0.)
        wm = tl.load(W + offk, mask=mk, other=0.)
        if GATE == 0:
            P = scale * _causal(mm(qm, tl.trans(ktm), PREC, HALF), G, rows, rm, hh, H, GATE)
        if GATE == 1:
            gv = tl.load(G + rows * H + hh, mask=rm, other=0.).to(tl.float32)
            gl = tl.load(G + (start + L - 1) * H + hh).to(tl.float32)
            ktm = (ktm.to(tl.float32) * tl.exp(gl - gv)[:, None]).to(ktm.dtype)
            qm = (qm.to(tl.float32) * tl.exp(gv)[:, None]).to(qm.dtype)
            decay = tl.exp(gl)
        elif GATE == 2:
            gm = tl.load(G + offk, mask=mk, other=0.).to(tl.float32)
            gl = tl.load(G + ((start + L - 1) * H + hh) * K + ak, mask=km, other=0.).to(tl.float32)
            ktm = (ktm.to(tl.float32) * tl.exp(gl[None, :] - gm)).to(ktm.dtype)
            qm = (qm.to(tl.float32) * tl.exp(gm)).to(qm.dtype)
            decay = tl.exp(gl)[:, None]
        else:
            decay = 1.
        mv = rm[:, None] & vm[None, :]
        offv = (rows[:, None] * H + hh) * V + ov[None, :]
        dO = tl.load(do + offv, mask=mv, other=0.)
        if GATE == 0:
            dV = mm(tl.trans(P), dO, PREC, HALF) + mm(ktm, dS, PREC, HALF)
        else:
            dV = tl.load(dvl + offv, mask=mv, other=0.).to(tl.float32) + mm(ktm, dS, PREC, HALF)
        tl.store(dvn + offv, dV.to(dvn.dtype.element_ty), mask=mv)
        dS = decay * dS + scale * mm(tl.trans(qm), dO, PREC, HALF) - mm(tl.trans(wm), dV, PREC, HALF)
    tl.store(dh0 + sbase + soff, dS, mask=sm)


@triton.jit
def _gate_rows(G, rows, rm, hh, H, K, start, L, offk, mk, BK: tl.constexpr, GATE: tl.constexpr):
    """Gate factors of step 2 in a shape that broadcasts against ``[64, BK]`` tiles: ``(eg = e^G,
    ed = e^{G_L - G}, el = e^{G_L})``; 1 without a gate."""
    if GATE == 1:
        gv = tl.load(G + rows * H + hh, mask=rm, other=0.).to(tl.float32)
        gl = tl.load(G + (start + L - 1) * H + hh).to(tl.float32)
        return tl.exp(gv)[:, None], tl.exp(gl - gv)[:, None], tl.exp(gl)
    elif GATE == 2:
        ak = tl.arange(0, BK)
        gm = tl.load(G + offk, mask=mk, other=0.).to(tl.float32)
        gl = tl.load(G + ((start + L - 1) * H + hh) * K + ak, mask=ak < K, other=0.).to(tl.float32)
        return tl.exp(gm), tl.exp(gl[None, :] - gm), tl.exp(gl)
    else:
        return 1., 1., 1.


@triton.jit
def _wy_start(Ainv, beta, offa, valid, rows, rm, hh, H, BK: tl.constexpr):
    """The chunk's WY inverse T [64, 64] and beta [64] (fp32), and zeroed sums of ``_wy_v_block``'s terms."""
    Ti = tl.load(Ainv + offa, mask=valid, other=0.).to(tl.float32)
    bt = tl.load(beta + rows * H + hh, mask=rm, other=0.).to(tl.float32)
    return Ti, bt, tl.zeros([64, BK], tl.float32), tl.zeros([64, 64], tl.float32), tl.zeros([64], tl.float32)


@triton.jit
def _wy_v_block(Ti, bt, hs, offv, mv, v, dvn, dv, PREC: tl.constexpr, HALF: tl.constexpr):
    """The WY terms of one V block (``offv``, ``mv``: its [64, BV] offsets and mask; ``hs``: its [BK, BV] state
    tile): stores dv = beta T^T dVn and returns the block's parts of ``dVn S^T`` [64, BK], ``dVn (beta V)^T``
    [64, 64] and ``rowsum(V * T^T dVn)`` [64]."""
    dV = tl.load(dvn + offv, mask=mv, other=0.)
    vv = tl.load(v + offv, mask=mv, other=0.).to(tl.float32)
    dBV = mm(tl.trans(Ti), dV, PREC, HALF)
    tl.store(dv + offv, (bt[:, None] * dBV).to(dv.dtype.element_ty), mask=mv)
    return mm(dV, tl.trans(hs), PREC, HALF), mm(dV, tl.trans(vv * bt[:, None]), PREC, HALF), tl.sum(vv * dBV, 1)


@triton.jit
def _straddle(pairs, i):
    """``[64]``: ``sum_{t >= s, j < s} pairs[t, j]`` for every row ``s`` of a ``[64, 64]`` tile, as sums only:
    the reverse cumsum over ``t`` gives ``w[s, j] = sum_{t >= s} pairs[t, j]``, then ``j < s`` is summed."""
    w = tl.cumsum(pairs, 0, reverse=True)
    return tl.sum(tl.where(i[None, :] < i[:, None], w, 0.), 1)


@triton.jit
def _scalar_dg(paired, reads, writes, carry, i):
    """Scalar gate, ``dg [64]`` of a chunk from decayed terms only (the straddle form of
    ``osdn_ops.reference.asym``): ``g_s`` moves the decays ``e^{G_a - G_b}`` with ``b < s <= a``, so
    ``dg_s = sum_{t >= s, j < s} pairs[t, j] + sum_{t >= s} reads_t + sum_{j < s} writes_j + carry``.
    ``paired [64]``: that first sum (:func:`_straddle`) of ``pairs``, ``D dL/dD`` of the in-chunk scores and ``A``;
    ``reads``: the state reads' ``q dq``, ``k dk`` parts; ``writes``: the state write's ``kt dkt`` part; ``carry``:
    the carried state's. (The reverse cumsum of ``q dq + k dk - kt dkt`` is equal in exact arithmetic, but where
    every decay is near ``e^-20`` its rounding error exceeds ``dg`` itself.)"""
    before = tl.sum(tl.where(i[:, None] < i[None, :], writes[:, None], 0.), 0)     # sum_{j < s} writes_j
    return paired + tl.cumsum(reads, 0, reverse=True) + before + carry


@triton.jit
def _dqkv(q, k, kt, v, beta, G, Ainv, h, vn, dvn, dh, do, dq, dk, dkt, dv, dbeta, dg, paths,
          table, cu, T, NT, scale, H, K, V, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
          PREC: tl.constexpr, HALF: tl.constexpr, REFS: tl.constexpr, VARLEN: tl.constexpr):
    """Step 2 per chunk: final dq, dk, dkt, dv, dbeta (, dg) from (1) the state and score terms (dq final, dkt's
    first part) and (2) the WY terms (dv, dk, the rest of dkt, dbeta, dg). Without a gate one pass over V blocks
    forms both (the state tile read once); with one, two passes keep fewer ``[64, K]`` tiles alive (on the H200,
    S1 ms: one pass 0.624 -> 0.561 without a gate, but 0.925 -> 1.097 with the scalar gate). Channel gate:
    launched three times, each launch taking the chunks of one way of forming the decayed sums (``paths``, from
    ``_dv_local``): ``REFS`` 1 or 4 reference rows (:func:`channel_refs`: products of scaled tiles, dg as the
    reverse cumsum of dG) or 0 (:func:`channel_blocks.block_sums`: the exact block form, dg from decayed terms), the
    last also for every chunk without a mild step (:func:`_any_mild_step`). The common one-reference case thus
    compiles without the block form's loops."""
    c, hh = tl.program_id(0), tl.program_id(1)
    start, L, i, rm, rows = _chunk_rows(c, table, cu, T, NT, VARLEN)
    if L <= 0:
        return
    if GATE == 2:
        if tl.load(paths + c * H + hh) != REFS:
            return
    ak = tl.arange(0, BK)
    km = ak < K
    sbase = (c.to(tl.int64) * H + hh) * K * V
    offa = (rows[:, None] * H + hh) * 64 + i[None, :]
    valid = rm[:, None] & rm[None, :]
    mk = rm[:, None] & km[None, :]
    offk = (rows[:, None] * H + hh) * K + ak[None, :]
    if GATE == 0:
        Ti, bt, dw_i, dTu, db = _wy_start(Ainv, beta, offa, valid, rows, rm, hh, H, BK)
    # pass 1: dO S^T, Vn dSn^T, dP = dO Vn^T (and without a gate the WY terms of pass 2)
    dq_i = tl.zeros([64, BK], tl.float32)
    dkt_s = tl.zeros([64, BK], tl.float32)
    lastv = tl.zeros([BK], tl.float32)
    dPm = tl.zeros([64, 64], tl.float32)
    for v0 in range(0, V, BV):
        ov, vm, mv, offv = _v_block(v0, rows, rm, hh, H, V, BV)
        dO = tl.load(do + offv, mask=mv, other=0.)
        Vn = tl.load(vn + offv, mask=mv, other=0.)
        offs = sbase + ak[:, None] * V + ov[None, :]
        sm = km[:, None] & vm[None, :]
        hs = tl.load(h + offs, mask=sm, other=0.)
        dSn = tl.load(dh + offs, mask=sm, other=0.)
        dq_i += mm(dO, tl.trans(hs), PREC, HALF)
        dkt_s += mm(Vn, tl.trans(dSn), PREC, HALF)
        lastv += tl.sum(hs.to(tl.float32) * dSn.to(tl.float32), 1)
        dPm += mm(dO, tl.trans(Vn), PREC, HALF)
        if GATE == 0:
            dw_b, dTu_b, db_b = _wy_v_block(Ti, bt, hs, offv, mv, v, dvn, dv, PREC, HALF)
            dw_i += dw_b
            dTu += dTu_b
            db += db_b
    qm = tl.load(q + offk, mask=mk, other=0.).to(tl.float32)
    ktm = tl.load(kt + offk, mask=mk, other=0.).to(tl.float32)
    eg, ed, el = _gate_rows(G, rows, rm, hh, H, K, start, L, offk, mk, BK, GATE)
    dqm = scale * dq_i * eg
    dktm = dkt_s * ed
    lastc = el * lastv + tl.sum(ktm * dktm, 0)
    if GATE == 1:  # dg's state terms: q's reads (k's follow), kt's writes, the carried state
        reads = tl.sum(qm * dqm, 1)
        writes = tl.sum(ktm * dktm, 1)
        carry = tl.sum(el * lastv, 0)
    elif GATE == 2:
        if REFS == 0:  # the same per channel, summed as they come: sum_{j < s} writes_j is the cumsum moved down a row
            down = (i[None, :] == i[:, None] - 1).to(tl.float32)
            dgm = tl.cumsum(qm * dqm, 0, reverse=True) + mm(down, tl.cumsum(ktm * dktm, 0), PREC, False) \
                + (el * lastv)[None, :]
    dPm = tl.where(valid & (i[:, None] >= i[None, :]), dPm * scale, 0.)
    if GATE == 2:
        if REFS == 0:  # the scores' decays: dq, dkt and their pairs' part of dg
            one = tl.full([64], 1., tl.float32)
            dqm, dktm, dgm, _ = block_sums(dPm, one, q, kt, G, rows, rm, hh, H, K, BK, dqm, one, dktm, dgm, PREC)
        else:
            R, Cm = _decayed_sums(dPm, dPm, qm, ktm, kt, G, rows, rm, hh, H, K, BK, REFS, PREC, HALF)
            dqm += R
            dktm += Cm
    else:
        if GATE == 1:
            dPm = dPm * _scalar_decay(G, rows, rm, hh, H, False)
            pairs = _straddle(dPm * mm(qm, tl.trans(ktm), PREC, HALF), i)   # the scores' decays: D dL/dD
            # A's K Kt^T here, beside Q Kt^T: in pass 2 its fp32 operands took 64 KB more shared memory (K = 128)
            kk = mm(tl.load(k + offk, mask=mk, other=0.).to(tl.float32), tl.trans(ktm), PREC, HALF)
        dqm += mm(dPm, ktm, PREC, HALF)
        dktm += mm(tl.trans(dPm), qm, PREC, HALF)
    tl.store(dq + offk, dqm.to(dq.dtype.element_ty), mask=mk)
    if GATE == 2:
        if REFS > 0:
            dG = qm * dqm - ktm * dktm               # dG = q dq + k dk - kt dkt, first part
    if GATE > 0:  # pass 2: the WY representation, dW = -dVn S^T, dU = dVn
        Ti, bt, dw_i, dTu, db = _wy_start(Ainv, beta, offa, valid, rows, rm, hh, H, BK)
        for v0 in range(0, V, BV):
            ov, vm, mv, offv = _v_block(v0, rows, rm, hh, H, V, BV)
            hs = tl.load(h + sbase + ak[:, None] * V + ov[None, :], mask=km[:, None] & vm[None, :], other=0.)
            dw_b, dTu_b, db_b = _wy_v_block(Ti, bt, hs, offv, mv, v, dvn, dv, PREC, HALF)
            dw_i += dw_b
            dTu += dTu_b
            db += db_b
    km_ = tl.load(k + offk, mask=mk, other=0.).to(tl.float32)
    eg, ed, el = _gate_rows(G, rows, rm, hh, H, K, start, L, offk, mk, BK, GATE)
    dW = -dw_i
    kg = km_ * eg
    dBK = mm(tl.trans(Ti), dW, PREC, HALF)
    dkm = bt[:, None] * eg * dBK
    if GATE == 1:
        reads += tl.sum(km_ * dkm, 1)
    elif GATE == 2:
        if REFS == 0:
            dgm += tl.cumsum(km_ * dkm, 0, reverse=True)
    db += tl.sum(kg * dBK, 1)
    dT = mm(dW, tl.trans(kg * bt[:, None]), PREC, HALF) + dTu
    dA = -mm(mm(tl.trans(Ti), dT, PREC, HALF), tl.trans(Ti), PREC, HALF)
    dA = tl.where(valid & (i[:, None] > i[None, :]), dA, 0.)
    if GATE == 2 and REFS == 0:  # A's decays: dk, dkt, dbeta and their pairs' part of dg
        dkm, dktm, dgm, rdot = block_sums(dA, bt, k, kt, G, rows, rm, hh, H, K, BK, dkm, bt, dktm, dgm, PREC)
        db += rdot
    else:
        if GATE == 2:
            dkr, dktB = _decayed_sums(dA, dA * bt[:, None], km_, ktm, kt, G, rows, rm, hh, H, K, BK, REFS, PREC,
                                      HALF)
        else:
            if GATE == 1:
                dA = dA * _scalar_decay(G, rows, rm, hh, H, True)
                pairs += _straddle(dA * bt[:, None] * kk, i)   # A's decays
            dkr = mm(dA, ktm, PREC, HALF)
            dktB = mm(tl.trans(dA * bt[:, None]), km_, PREC, HALF)
        dkm += bt[:, None] * dkr
        db += tl.sum(km_ * dkr, 1)
        dktm += dktB
    if GATE == 1:
        dgt = _scalar_dg(pairs, reads, writes, carry, i)
        tl.store(dg + rows * H + hh, dgt.to(dg.dtype.element_ty), mask=rm)
    elif GATE == 2:
        if REFS > 0:
            dgm = tl.cumsum(dG + km_ * dkm - ktm * dktB, 0, reverse=True) + lastc[None, :]
        tl.store(dg + offk, dgm.to(dg.dtype.element_ty), mask=mk)
    tl.store(dk + offk, dkm.to(dk.dtype.element_ty), mask=mk)
    tl.store(dkt + offk, dktm.to(dkt.dtype.element_ty), mask=mk)
    tl.store(dbeta + rows * H + hh, db.to(dbeta.dtype.element_ty), mask=rm)


def chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate, inverse=None,
                   states=None):
    """Triton backward: ``(dq, dk, dk_tilde, dv, dg, dbeta, dh0)`` (contract of
    ``osdn_ops.reference.chunk_asym_bwd``); dh0 in the public state layout, fp32. ``inverse``: the
    WY inverse kept by ``chunk_asym_fwd(..., save=True)`` (None or empty: recomputed); ``states``: the chunk states
    kept by ``chunk_asym_fwd(..., save=True, keep_states=True)`` (:mod:`asym_kept`; None or empty: recomputed; read
    only together with the inverse)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if reference_only(q.dtype, K, V):
        return ref.chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate)
    dev = q.device
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dg = torch.empty(0, dtype=torch.float32, device=dev) if g is None else torch.empty_like(g)
    if B * T == 0 or N == 0:
        dg = dg if g is None else torch.zeros_like(g)
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(k_tilde), torch.zeros_like(v), dg,
                torch.zeros_like(beta), dht.float().clone().contiguous())
    GATE = GATE_CODE[gate]
    lay = chunk_layout(cu_seqlens, B, T)
    VARLEN = lay.varlen
    # grid chunk c: a chunk-table row (varlen, int64 offsets), else chunk c % NT of batch row c // NT
    M = lay.n_chunks if VARLEN else B * lay.NT
    cu = cu_seqlens.to(torch.int64) if VARLEN else q
    table, first = (lay.table, lay.first) if VARLEN else (q, q)
    G = None if g is None else gate_cumsum(g, cu_seqlens, C, layout=lay)
    kept = inverse if inverse is not None and inverse.numel() > 0 else None
    BK = block(K)
    PREC = fp32_product_precision(q.dtype)
    # Half inputs: the products round their operands to bf16 (fp32 operand tiles need up to 200 KB of
    # shared memory in _dqkv), so the buffers only ever read as product operands (the chunk states h,
    # dVl = P^T dO, dVn, the chunk-end state gradients dh) are kept in the input dtype: half the bytes,
    # the same products. The CPU interpreter has no bf16 products, so there everything stays fp32.
    HALF = q.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") != "1"
    work = dict(dtype=q.dtype if HALF else torch.float32, device=dev)
    if kept is not None and states is not None and states.numel() > 0:     # the forward's W, v_new and h
        Ainv = kept
        W, vn, h = kept_views(states, q, v, cu_seqlens)
        h = h.to(work["dtype"])             # a copy only for half inputs in the interpreter
    else:
        Ainv, W, U = wy_repr(k, k_tilde, v, beta, G, cu_seqlens, gate, layout=lay, inverse=kept)
        h, vn, _ = chunk_states(k_tilde, W, U, G, initial_state, cu_seqlens, gate, layout=lay,
                                h_dtype=work["dtype"])
        del U
    Gp = beta if G is None else G                 # never read when GATE == 0

    f32 = dict(dtype=torch.float32, device=dev)
    dvl = do                                      # never read without a gate (_dh forms P^T dO)
    paths = torch.empty(M, H, dtype=torch.int32, device=dev) if GATE == 2 else q   # read with the channel gate only
    if GATE > 0:
        dvl = torch.empty(B, T, H, V, **work)
        _dv_local[(M, H)](q, k_tilde, Gp, do, dvl, paths, table, cu, T, lay.NT, scale, H, K, V, BK, min(64, block(V)),
                          GATE, PREC, HALF, VARLEN, num_warps=4)
    dh = torch.empty(M, H, K, V, **work)
    dvn = torch.empty(B, T, H, V, **work)
    dh0 = torch.empty(ref.state_shape(gate, N, H, K, V), **f32)
    # pipelined loads of three [64, 256] half tiles need 368 KB of shared memory (227 KB on the H200); half tiles
    # of K <= 128 must keep the pipeline: at 1 stage (8 warps, 32-wide V blocks) the launch made an illegal
    # memory access on the H200 (benchmarks/RESULTS.md, 2026-12-03 13:04)
    stages = DH_STAGES if HALF and BK <= 128 else 1
    BVH = fill_block_v(K, V, N * H, DH_BV, _dh_narrowest(q.dtype, GATE), dev)
    warps = DH_NARROW_WARPS if BVH < 32 else DH_WARPS
    _dh[(cdiv(V, BVH), N * H)](q, k_tilde, W, Gp, do, dvl, dht, dh, dh0, dvn, first, cu, T, lay.NT, scale, H, K,
                               V, BK, BVH, GATE, PREC, HALF, VARLEN, num_warps=warps, num_stages=stages)
    del dvl

    dv = torch.empty_like(v)
    dq, dk, dkt, dbeta = (torch.empty_like(x) for x in (q, k, k_tilde, beta))
    # 32-wide V blocks for K = 256 (register limit) and for the channel gate with V >= 32 (10-12% faster on
    # S1/S2 than 64-wide, benchmarks/RESULTS.md); the other gates are faster with 64-wide ones
    BV = 32 if BK > 128 or (GATE == 2 and V >= 32) else min(64, block(V))
    for refs in (1, 4, 0) if GATE == 2 else (1,):
        _dqkv[(M, H)](q, k, k_tilde, v, beta, Gp, Ainv, h, vn, dvn, dh, do, dq, dk, dkt, dv, dbeta, dg, paths, table,
                      cu, T, lay.NT, scale, H, K, V, BK, BV, GATE, PREC, HALF, refs, VARLEN,
                      num_warps=DQKV_WARPS, num_stages=DQKV_STAGES if HALF and BK <= 128 and GATE < 2 else 1)
    return dq, dk, dkt, dv, dg, dbeta, dh0
