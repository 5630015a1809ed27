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
   dg = reverse cumsum of dG within the chunk (summed over channels for the scalar gate).

Forward intermediates (G, T, W, U, the chunk-start states S and Vn) are recomputed with the
forward's stage functions: the op's forward keeps only o and the final state.
Kernels: ``_dv_local`` (P^T dO, parallel), ``_dh`` (the reverse recurrence, one program per
sequence, head and V block), ``_dqkv`` (step 2, parallel), and for the channel gate
``_channel_intra`` (the per-channel E terms, which are no matrix products). No atomics: every
reduction runs inside one program in a fixed order. fp64 inputs, K or V above 256, and fp32
inputs with K above 128 (whose fp32 product tiles exceed shared memory) run the reference.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..reference import asym as ref
from .asym_chunks import CHUNK as C
from .asym_chunks import GATE_CODE, block, chunk_layout, chunk_span
from .asym_fwd import chunk_states, gate_cumsum, wy_repr
from .varlen import chunk_table


#: launch of the reverse recurrence ``_dh`` (V block: 0 picks 32 or 16 by the grid size)
DH_WARPS, DH_STAGES, DH_BV = 8, 3, 64


@triton.jit
def _mm(a, b, PREC: tl.constexpr, HALF: tl.constexpr):
    """fp32-accumulated product; HALF: operands rounded to bf16 (half-precision inputs)."""
    if HALF:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _gated_scores(a, b, G, rows, rm, hh, H, K, BK: tl.constexpr,
                  GATE: tl.constexpr, PREC: tl.constexpr):
    """[64,64] fp32 ``s[t,j] = sum_c a_tc b_jc exp(G_tc - G_jc)`` for valid t >= j, else 0.

    Only in-chunk pairs t >= j are exponentiated (rows past the chunk's end read G = 0, which
    would make the difference positive)."""
    i = tl.arange(0, 64)
    low = (i[:, None] >= i[None, :]) & rm[:, None]
    if GATE == 2:
        s = tl.zeros([64, 64], tl.float32)
        for ch in range(K):
            off = (rows * H + hh) * K + ch
            ac = tl.load(a + off, mask=rm, other=0.).to(tl.float32)
            bc = tl.load(b + off, mask=rm, other=0.).to(tl.float32)
            gc = tl.load(G + off, mask=rm, other=0.).to(tl.float32)
            s += ac[:, None] * bc[None, :] * tl.exp(tl.where(low, gc[:, None] - gc[None, :], float("-inf")))
    else:
        ak = tl.arange(0, BK)
        m = rm[:, None] & (ak < K)[None, :]
        off = (rows[:, None] * H + hh) * K + ak[None, :]
        am = tl.load(a + off, mask=m, other=0.).to(tl.float32)
        bm = tl.load(b + off, mask=m, other=0.).to(tl.float32)
        s = tl.dot(am, tl.trans(bm), input_precision=PREC)
        if GATE == 1:
            gv = tl.load(G + rows * H + hh, mask=rm, other=0.).to(tl.float32)
            s = s * tl.exp(tl.where(low, gv[:, None] - gv[None, :], float("-inf")))
        else:
            s = tl.where(low, s, 0.)
    return s


@triton.jit
def _chunk_rows(c, table, cu):
    """Chunk-table row ``c``: first token (int64), length (<= 0: no chunk), row index ``i [64]``,
    valid-row mask and token rows."""
    start, L, _ = chunk_span(c, 0, cu, table, 0, 0, 64, True)
    i = tl.arange(0, 64)
    return start, L, i, i < L, start + i


@triton.jit
def _dv_local(q, kt, G, do, dvl, table, cu, scale, H, K, V,
              BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr):
    """dvl [T,H,V] fp32 = P^T dO per chunk (the state-free part of dVn)."""
    c, hh = tl.program_id(0), tl.program_id(1)
    start, L, i, rm, rows = _chunk_rows(c, table, cu)
    if L <= 0:
        return
    P = _gated_scores(q, kt, G, rows, rm, hh, H, K, BK, GATE, PREC)
    P = tl.where(rm[:, None] & rm[None, :], P * scale, 0.)
    for v0 in range(0, V, BV):
        ov = v0 + tl.arange(0, BV)
        m = rm[:, None] & (ov < V)[None, :]
        off = (rows[:, None] * H + hh) * V + ov[None, :]
        dO = tl.load(do + off, mask=m, other=0.).to(tl.float32)
        tl.store(dvl + off, tl.dot(tl.trans(P), dO, input_precision=PREC), mask=m)


@triton.jit
def _dh(q, kt, W, G, do, dvl, dht, dh, dh0, dvn, first, cu, scale, H, K,
        V, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr):
    """Reverse recurrence: dh[chunk] (grad of the chunk's end state, [K,V] fp32), dvn = dVn, dh0.

    HALF: the products read half-precision operands (the inputs' own q, kt, W and dO; the fp32 state
    gradient and dVn rounded to bf16 for the product only) with fp32 accumulation, so no [64, K] fp32
    tile is held; the recurrence itself stays in fp32."""
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // H
    hh = nh % H
    bos = tl.load(cu + n)
    eos = tl.load(cu + n + 1)
    nc = tl.cdiv(eos - bos, 64)
    f0 = tl.load(first + n)
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
        tl.store(dh + ((f0 + ic) * H + hh) * K * V + ak[:, None] * V + ov[None, :], dS, mask=sm)
        mk = rm[:, None] & km[None, :]
        offk = (rows[:, None] * H + hh) * K + ak[None, :]
        ktm = tl.load(kt + offk, mask=mk, other=0.)
        qm = tl.load(q + offk, mask=mk, other=0.)
        wm = tl.load(W + offk, mask=mk, other=0.)
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
        dV = tl.load(dvl + offv, mask=mv, other=0.) + _mm(ktm, dS, PREC, HALF)
        tl.store(dvn + offv, dV, mask=mv)
        dS = decay * dS + scale * _mm(tl.trans(qm), dO, PREC, HALF) - _mm(tl.trans(wm), dV, PREC, HALF)
    tl.store(dh0 + sbase + soff, dS, mask=sm)


@triton.jit
def _dqkv(q, k, kt, v, beta, G, Ainv, h, vn, dvn, dh, do, dq, dk, dkt, dv, dbeta, dg, dP_buf, dA_buf, last_buf,
          table, cu, scale, H, K, V, BK: tl.constexpr,
          BV: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr,
          HALF: tl.constexpr):
    """Step 2 per chunk. GATE 0/1: final dq, dk, dkt, dv, dbeta (, dg). GATE 2: dv final; fp32 partial
    dq, dk, dkt, dbeta without the E terms, plus dP, dA ([T,H,64]) and the last-row dG ([chunks,H,K])."""
    c, hh = tl.program_id(0), tl.program_id(1)
    start, L, i, rm, rows = _chunk_rows(c, table, cu)
    if L <= 0:
        return
    ak = tl.arange(0, BK)
    km = ak < K
    sbase = (c.to(tl.int64) * H + hh) * K * V
    offa = (rows[:, None] * H + hh) * 64 + i[None, :]
    Ti = tl.load(Ainv + offa, mask=rm[:, None] & rm[None, :], other=0.).to(tl.float32)
    bt = tl.load(beta + rows * H + hh, mask=rm, other=0.).to(tl.float32)
    dq_i = tl.zeros([64, BK], tl.float32)
    dw_i = tl.zeros([64, BK], tl.float32)
    dkt_s = tl.zeros([64, BK], tl.float32)
    lastv = tl.zeros([BK], tl.float32)
    dPm = tl.zeros([64, 64], tl.float32)
    dTu = tl.zeros([64, 64], tl.float32)
    db = tl.zeros([64], tl.float32)
    for v0 in range(0, V, BV):
        ov = v0 + tl.arange(0, BV)
        vm = ov < V
        mv = rm[:, None] & vm[None, :]
        offv = (rows[:, None] * H + hh) * V + ov[None, :]
        dO = tl.load(do + offv, mask=mv, other=0.).to(tl.float32)
        Vn = tl.load(vn + offv, mask=mv, other=0.).to(tl.float32)
        dV = tl.load(dvn + offv, mask=mv, other=0.)
        vv = tl.load(v + offv, mask=mv, other=0.).to(tl.float32)
        offs = sbase + ak[:, None] * V + ov[None, :]
        sm = km[:, None] & vm[None, :]
        hs = tl.load(h + offs, mask=sm, other=0.)
        dSn = tl.load(dh + offs, mask=sm, other=0.)
        dq_i += _mm(dO, tl.trans(hs), PREC, HALF)
        dw_i += _mm(dV, tl.trans(hs), PREC, HALF)
        dkt_s += _mm(Vn, tl.trans(dSn), PREC, HALF)
        lastv += tl.sum(hs * dSn, 1)
        dPm += _mm(dO, tl.trans(Vn), PREC, HALF)
        dTu += _mm(dV, tl.trans(vv * bt[:, None]), PREC, HALF)
        dBV = _mm(tl.trans(Ti), dV, PREC, HALF)
        tl.store(dv + offv, (bt[:, None] * dBV).to(dv.dtype.element_ty), mask=mv)
        db += tl.sum(vv * dBV, 1)
    mk = rm[:, None] & km[None, :]
    offk = (rows[:, None] * H + hh) * K + ak[None, :]
    qm = tl.load(q + offk, mask=mk, other=0.).to(tl.float32)
    km_ = tl.load(k + offk, mask=mk, other=0.).to(tl.float32)
    ktm = tl.load(kt + offk, mask=mk, other=0.).to(tl.float32)
    if GATE == 1:
        gv = tl.load(G + rows * H + hh, mask=rm, other=0.).to(tl.float32)
        gm = gv[:, None] + tl.zeros([64, BK], tl.float32)
        gl = tl.load(G + (start + L - 1) * H + hh).to(tl.float32) + tl.zeros([BK], tl.float32)
    elif GATE == 2:
        gm = tl.load(G + offk, mask=mk, other=0.).to(tl.float32)
        gl = tl.load(G + ((start + L - 1) * H + hh) * K + ak, mask=km, other=0.).to(tl.float32)
    else:
        gm = tl.zeros([64, BK], tl.float32)
        gl = tl.zeros([BK], tl.float32)
    eg = tl.exp(gm)
    dqm = scale * dq_i * eg
    dktm = dkt_s * tl.exp(gl[None, :] - gm)
    lastc = tl.exp(gl) * lastv + tl.sum(ktm * dktm, 0)
    dW = -dw_i
    kg = km_ * eg
    dBK = _mm(tl.trans(Ti), dW, PREC, HALF)
    dkm = bt[:, None] * eg * dBK
    db += tl.sum(kg * dBK, 1)
    dT = _mm(dW, tl.trans(kg * bt[:, None]), PREC, HALF) + dTu
    dA = -_mm(_mm(tl.trans(Ti), dT, PREC, HALF), tl.trans(Ti), PREC, HALF)
    valid = rm[:, None] & rm[None, :]
    dA = tl.where(valid & (i[:, None] > i[None, :]), dA, 0.)
    dPm = tl.where(valid & (i[:, None] >= i[None, :]), dPm * scale, 0.)
    if GATE == 2:
        tl.store(dP_buf + offa, dPm, mask=valid)
        tl.store(dA_buf + offa, dA, mask=valid)
        tl.store(last_buf + (c.to(tl.int64) * H + hh) * K + ak, lastc, mask=km)
        tl.store(dq + offk, dqm, mask=mk)
        tl.store(dk + offk, dkm, mask=mk)
        tl.store(dkt + offk, dktm, mask=mk)
        tl.store(dbeta + rows * H + hh, db, mask=rm)
    else:
        if GATE == 1:
            D = tl.exp(tl.where(valid & (i[:, None] >= i[None, :]), gv[:, None] - gv[None, :], float("-inf")))
            dPm = dPm * D
            dA = dA * D
        dqm += _mm(dPm, ktm, PREC, HALF)
        dkr = _mm(dA, ktm, PREC, HALF)
        dkm += bt[:, None] * dkr
        db += tl.sum(km_ * dkr, 1)
        dktm += (_mm(tl.trans(dPm), qm, PREC, HALF)
                 + _mm(tl.trans(dA * bt[:, None]), km_, PREC, HALF))
        if GATE == 1:
            dGt = tl.sum(qm * dqm + km_ * dkm - ktm * dktm, 1)
            dgt = tl.cumsum(dGt, 0, reverse=True) + tl.sum(lastc, 0)
            tl.store(dg + rows * H + hh, dgt.to(dg.dtype.element_ty), mask=rm)
        tl.store(dq + offk, dqm.to(dq.dtype.element_ty), mask=mk)
        tl.store(dk + offk, dkm.to(dk.dtype.element_ty), mask=mk)
        tl.store(dkt + offk, dktm.to(dkt.dtype.element_ty), mask=mk)
        tl.store(dbeta + rows * H + hh, db.to(dbeta.dtype.element_ty), mask=rm)


@triton.jit
def _channel_intra(q, k, kt, beta, G, dP_buf, dA_buf, last_buf, pdq, pdk, pdkt, pdbeta, dq, dk, dkt, dbeta, dg,
                   table, cu, H, K):
    """Channel gate: add the E terms channel by channel, then dg = reverse cumsum of dG + last-row term."""
    c, hh = tl.program_id(0), tl.program_id(1)
    start, L, i, rm, rows = _chunk_rows(c, table, cu)
    if L <= 0:
        return
    valid = rm[:, None] & rm[None, :]
    offa = (rows[:, None] * H + hh) * 64 + i[None, :]
    dPm = tl.load(dP_buf + offa, mask=valid, other=0.)
    dA = tl.load(dA_buf + offa, mask=valid, other=0.)
    low = (i[:, None] >= i[None, :]) & rm[:, None]
    bt = tl.load(beta + rows * H + hh, mask=rm, other=0.).to(tl.float32)
    db = tl.load(pdbeta + rows * H + hh, mask=rm, other=0.)
    lbase = (c.to(tl.int64) * H + hh) * K
    for ch in range(K):
        off = (rows * H + hh) * K + ch
        qc = tl.load(q + off, mask=rm, other=0.).to(tl.float32)
        kc = tl.load(k + off, mask=rm, other=0.).to(tl.float32)
        ktc = tl.load(kt + off, mask=rm, other=0.).to(tl.float32)
        gc = tl.load(G + off, mask=rm, other=0.).to(tl.float32)
        E = tl.exp(tl.where(low, gc[:, None] - gc[None, :], float("-inf")))
        dPE = dPm * E
        dAE = dA * E
        dqc = tl.load(pdq + off, mask=rm, other=0.) + tl.sum(dPE * ktc[None, :], 1)
        dkr = tl.sum(dAE * ktc[None, :], 1)
        dkc = tl.load(pdk + off, mask=rm, other=0.) + bt * dkr
        db += kc * dkr
        dktc = (tl.load(pdkt + off, mask=rm, other=0.) + tl.sum(dPE * qc[:, None], 0)
                + tl.sum(dAE * (bt * kc)[:, None], 0))
        dG = qc * dqc + kc * dkc - ktc * dktc
        dgc = tl.cumsum(dG, 0, reverse=True) + tl.load(last_buf + lbase + ch)
        tl.store(dq + off, dqc.to(dq.dtype.element_ty), mask=rm)
        tl.store(dk + off, dkc.to(dk.dtype.element_ty), mask=rm)
        tl.store(dkt + off, dktc.to(dkt.dtype.element_ty), mask=rm)
        tl.store(dg + off, dgc.to(dg.dtype.element_ty), mask=rm)
    tl.store(dbeta + rows * H + hh, db.to(dbeta.dtype.element_ty), mask=rm)


def chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate):
    """Triton backward: ``(dq, dk, dk_tilde, dv, dg, dbeta, dh0)`` (contract of
    ``osdn_ops.reference.chunk_asym_bwd``); dh0 in the public state layout, fp32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if q.dtype == torch.float64 or K > 256 or V > 256 or (q.dtype == torch.float32 and K > 128):
        return ref.chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate)
    dev = q.device
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dg = torch.empty(0, dtype=torch.float32, device=dev) if g is None else torch.empty_like(g)
    if B * T == 0 or N == 0:
        dg = dg if g is None else torch.zeros_like(g)
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(k_tilde), torch.zeros_like(v), dg,
                torch.zeros_like(beta), dht.float().clone().contiguous())
    GATE = GATE_CODE[gate]
    cu = (torch.arange(B + 1, device=dev, dtype=torch.int64) * T if cu_seqlens is None
          else cu_seqlens.to(torch.int64))
    table = chunk_table(cu, B * T, C)
    M = table.shape[0]
    counts = (cu[1:] - cu[:-1] + C - 1) // C
    first = (torch.cumsum(counts, 0) - counts).contiguous()

    lay = chunk_layout(cu_seqlens, B, T)  # one chunk grid for the three recompute stages
    G = None if g is None else gate_cumsum(g, cu_seqlens, C, layout=lay)
    Ainv, W, U = wy_repr(k, k_tilde, v, beta, G, cu_seqlens, gate, layout=lay)
    h, vn, _ = chunk_states(k_tilde, W, U, G, initial_state, cu_seqlens, gate, layout=lay)
    Gp = beta if G is None else G                 # never read when GATE == 0

    BK = block(K)
    PREC = "ieee" if q.dtype == torch.float32 else "tf32"
    # _dqkv rounds its product operands to bf16 for half inputs (its fp32 operands need up to 200 KB of
    # shared memory); the CPU interpreter has no bf16 products, so there it keeps fp32 operands
    HALF = q.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") != "1"
    f32 = dict(dtype=torch.float32, device=dev)
    dvl = torch.empty(B, T, H, V, **f32)
    _dv_local[(M, H)](q, k_tilde, Gp, do, dvl, table, cu, scale, H, K, V, BK, min(64, block(V)), GATE, PREC,
                      num_warps=4)
    dh = torch.empty(M, H, K, V, **f32)
    dvn = torch.empty(B, T, H, V, **f32)
    dh0 = torch.empty(ref.state_shape(gate, N, H, K, V), **f32)
    BVh = DH_BV or (32 if N * H * triton.cdiv(V, 32) >= 256 else 16)
    _dh[(triton.cdiv(V, BVh), N * H)](q, k_tilde, W, Gp, do, dvl, dht, dh, dh0, dvn, first, cu, scale, H, K, V,
                                       BK, BVh, GATE, PREC, HALF, num_warps=DH_WARPS,
                                       num_stages=DH_STAGES if HALF else 1)

    dv = torch.empty_like(v)
    dq, dk, dkt, dbeta = (torch.empty_like(x) for x in (q, k, k_tilde, beta))
    BV = 32 if BK > 128 else min(64, block(V))
    if GATE == 2:
        pq, pk, pkt = (torch.empty(B, T, H, K, **f32) for _ in range(3))
        pb = torch.empty(B, T, H, **f32)
        dPb, dAb = torch.empty(B, T, H, C, **f32), torch.empty(B, T, H, C, **f32)
        last = torch.empty(M, H, K, **f32)
        _dqkv[(M, H)](q, k, k_tilde, v, beta, G, Ainv, h, vn, dvn, dh, do, pq, pk, pkt, dv, pb, dg, dPb, dAb, last,
                      table, cu, scale, H, K, V, BK, BV, GATE, PREC, HALF, num_warps=8, num_stages=1)
        _channel_intra[(M, H)](q, k, k_tilde, beta, G, dPb, dAb, last, pq, pk, pkt, pb, dq, dk, dkt, dbeta, dg,
                               table, cu, H, K, num_warps=4)
    else:
        _dqkv[(M, H)](q, k, k_tilde, v, beta, Gp, Ainv, h, vn, dvn, dh, do, dq, dk, dkt, dv, dbeta, dg, dvl, dvl,
                      dvl, table, cu, scale, H, K, V, BK, BV, GATE, PREC, HALF, num_warps=8, num_stages=1)
    return dq, dk, dkt, dv, dg, dbeta, dh0
