"""Stages 1 and 2 of the asymmetric delta engine: in-chunk gate cumsum and the WY representation.

``gate_cumsum``: ``G`` = inclusive cumsum of the log decay ``g`` within each 64-token chunk (fp32).
``wy_repr``: per chunk ``A = tril(B (K e^G)(Kt e^-G)^T, -1)``, ``Ainv = (I + A)^{-1}``,
``W = Ainv B (K e^G)``, ``U = Ainv B V`` (DESIGN §4). The 64 x 64 inverse is built from 16 x 16
blocks: forward substitution on the four diagonal blocks, then the block rows below
(``T_ij = -T_ii sum_{j<=m<i} A_im T_mj``) with fp32 products.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .asym_chunks import (CHUNK, GATE_CODE, ChunkLayout, block, chunk_layout, chunk_span, decayed_scores, load_tile,
                          load_vec, mma, operand_type, store_tile)


@triton.jit
def _cumsum_kernel(g, G, cu, table, T, NT, H, K: tl.constexpr, BK: tl.constexpr,
                   C: tl.constexpr, CHANNEL: tl.constexpr, IS_VARLEN: tl.constexpr):
    pid_c, pid_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = pid_bh // H, pid_bh % H
    start, n, _ = chunk_span(pid_c, i_b, cu, table, T, NT, C, IS_VARLEN)
    if n <= 0:
        return
    if CHANNEL:
        x = load_tile(g, start, n, 0, 0, i_h, H, K, C, BK).to(tl.float32)
        store_tile(G, tl.cumsum(x, axis=0), start, n, 0, 0, i_h, H, K, C, BK)
    else:
        r = tl.arange(0, C)
        x = load_vec(g, start, n, 0, i_h, H, C)
        tl.store(G + (start + r) * H + i_h, tl.cumsum(x, axis=0), mask=r < n)


def gate_cumsum(g: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int = CHUNK,
                layout: Optional[ChunkLayout] = None) -> Tensor:
    """In-chunk inclusive cumsum of ``g`` ([B,T,H] or [B,T,H,K]), fp32, same shape.

    Chunks start at every sequence start (``cu_seqlens``). ``layout``: a precomputed
    :func:`chunk_layout` (optional).
    """
    assert chunk_size == CHUNK
    B, T, H = g.shape[:3]
    K = g.shape[3] if g.dim() == 4 else 1
    G = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    lay = layout or chunk_layout(cu_seqlens, B, T)
    if lay.n_chunks * B * H > 0:
        _cumsum_kernel[(lay.n_chunks, B * H)](
            g, G, lay.cu, lay.table, T, lay.NT, H=H, K=K, BK=block(K), C=CHUNK, CHANNEL=g.dim() == 4,
            IS_VARLEN=lay.varlen)
    return G


@triton.jit
def _inv_unit_lower16(A):
    """``(I + A)^{-1}`` of a strictly lower-triangular 16 x 16 fp32 block (forward substitution)."""
    r = tl.arange(0, 16)
    Tm = (r[:, None] == r[None, :]).to(tl.float32)
    for i in range(1, 16):
        a = tl.sum(tl.where(r[:, None] == i, A, 0.), axis=0)
        new = tl.sum(a[:, None] * Tm, axis=0)
        Tm = tl.where(r[:, None] == i, Tm - new[None, :], Tm)
    return Tm


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _scaled_rows(x_ptr, beta, G, start, n, r0, c0, i_h, H, D: tl.constexpr,
                 BD: tl.constexpr, GATE: tl.constexpr):
    """``beta * x * e^G`` (GATE > 0) or ``beta * x`` (GATE == 0) for rows r0..r0+16, fp32."""
    x = load_tile(x_ptr, start, n, r0, c0, i_h, H, D, 16, BD).to(tl.float32)
    x = x * load_vec(beta, start, n, r0, i_h, H, 16)[:, None]
    r = r0 + tl.arange(0, 16)
    if GATE == 1:
        x = x * tl.exp(tl.where(r < n, load_vec(G, start, n, r0, i_h, H, 16), float("-inf")))[:, None]
    elif GATE == 2:
        Gx = load_tile(G, start, n, r0, c0, i_h, H, D, 16, BD)
        x = x * tl.exp(tl.where((r < n)[:, None], Gx, float("-inf")))
    return x


@triton.jit
def _apply_rows(out, x_ptr, beta, G, T0, T1, T2, T3, start, n, i: tl.constexpr, i_h, H,
                D: tl.constexpr, BD: tl.constexpr, GATE: tl.constexpr, OP: tl.constexpr):
    """Rows ``16i..16i+16`` of ``Ainv (beta x e^G)``: ``sum_{j<=i} T_j @ X_j`` over feature blocks."""
    for c0 in tl.static_range(0, D, BD):
        acc = mma(T0, _scaled_rows(x_ptr, beta, G, start, n, 0, c0, i_h, H, D, BD, GATE), OP)
        if i >= 1:
            acc += mma(T1, _scaled_rows(x_ptr, beta, G, start, n, 16, c0, i_h, H, D, BD, GATE), OP)
        if i >= 2:
            acc += mma(T2, _scaled_rows(x_ptr, beta, G, start, n, 32, c0, i_h, H, D, BD, GATE), OP)
        if i >= 3:
            acc += mma(T3, _scaled_rows(x_ptr, beta, G, start, n, 48, c0, i_h, H, D, BD, GATE), OP)
        store_tile(out, acc, start, n, 16 * i, c0, i_h, H, D, 16, BD)


@triton.jit
def _wy_kernel(k, kt, v, beta, G, Ainv, W, U, cu, table, T, NT, H, K: tl.constexpr,
               V: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr, BVW: tl.constexpr, C: tl.constexpr,
               GATE: tl.constexpr, IS_VARLEN: tl.constexpr, OP: tl.constexpr):
    pid_c, pid_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = pid_bh // H, pid_bh % H
    start, n, _ = chunk_span(pid_c, i_b, cu, table, T, NT, C, IS_VARLEN)
    if n <= 0:
        return
    b0 = load_vec(beta, start, n, 0, i_h, H, 16)[:, None]
    b1 = load_vec(beta, start, n, 16, i_h, H, 16)[:, None]
    b2 = load_vec(beta, start, n, 32, i_h, H, 16)[:, None]
    b3 = load_vec(beta, start, n, 48, i_h, H, 16)[:, None]
    T00 = _inv_unit_lower16(b0 * decayed_scores(k, kt, G, start, n, i_h, 0, 0, H, K, BK, 16, GATE, True, True, OP))
    T11 = _inv_unit_lower16(b1 * decayed_scores(k, kt, G, start, n, i_h, 16, 16, H, K, BK, 16, GATE, True, True, OP))
    T22 = _inv_unit_lower16(b2 * decayed_scores(k, kt, G, start, n, i_h, 32, 32, H, K, BK, 16, GATE, True, True, OP))
    T33 = _inv_unit_lower16(b3 * decayed_scores(k, kt, G, start, n, i_h, 48, 48, H, K, BK, 16, GATE, True, True, OP))
    A10 = b1 * decayed_scores(k, kt, G, start, n, i_h, 16, 0, H, K, BK, 16, GATE, False, True, OP)
    A21 = b2 * decayed_scores(k, kt, G, start, n, i_h, 32, 16, H, K, BK, 16, GATE, False, True, OP)
    A32 = b3 * decayed_scores(k, kt, G, start, n, i_h, 48, 32, H, K, BK, 16, GATE, False, True, OP)
    A20 = b2 * decayed_scores(k, kt, G, start, n, i_h, 32, 0, H, K, BK, 16, GATE, False, True, OP)
    A31 = b3 * decayed_scores(k, kt, G, start, n, i_h, 48, 16, H, K, BK, 16, GATE, False, True, OP)
    A30 = b3 * decayed_scores(k, kt, G, start, n, i_h, 48, 0, H, K, BK, 16, GATE, False, True, OP)
    T10 = -_mm(T11, _mm(A10, T00))
    T21 = -_mm(T22, _mm(A21, T11))
    T32 = -_mm(T33, _mm(A32, T22))
    T20 = -_mm(T22, _mm(A20, T00) + _mm(A21, T10))
    T31 = -_mm(T33, _mm(A31, T11) + _mm(A32, T21))
    T30 = -_mm(T33, _mm(A30, T00) + _mm(A31, T10) + _mm(A32, T20))
    Z = tl.zeros([16, 16], dtype=tl.float32)
    store_tile(Ainv, T00, start, n, 0, 0, i_h, H, C, 16, 16)
    store_tile(Ainv, Z, start, n, 0, 16, i_h, H, C, 16, 16)
    store_tile(Ainv, Z, start, n, 0, 32, i_h, H, C, 16, 16)
    store_tile(Ainv, Z, start, n, 0, 48, i_h, H, C, 16, 16)
    store_tile(Ainv, T10, start, n, 16, 0, i_h, H, C, 16, 16)
    store_tile(Ainv, T11, start, n, 16, 16, i_h, H, C, 16, 16)
    store_tile(Ainv, Z, start, n, 16, 32, i_h, H, C, 16, 16)
    store_tile(Ainv, Z, start, n, 16, 48, i_h, H, C, 16, 16)
    store_tile(Ainv, T20, start, n, 32, 0, i_h, H, C, 16, 16)
    store_tile(Ainv, T21, start, n, 32, 16, i_h, H, C, 16, 16)
    store_tile(Ainv, T22, start, n, 32, 32, i_h, H, C, 16, 16)
    store_tile(Ainv, Z, start, n, 32, 48, i_h, H, C, 16, 16)
    store_tile(Ainv, T30, start, n, 48, 0, i_h, H, C, 16, 16)
    store_tile(Ainv, T31, start, n, 48, 16, i_h, H, C, 16, 16)
    store_tile(Ainv, T32, start, n, 48, 32, i_h, H, C, 16, 16)
    store_tile(Ainv, T33, start, n, 48, 48, i_h, H, C, 16, 16)
    _apply_rows(W, k, beta, G, T00, Z, Z, Z, start, n, 0, i_h, H, K, BKW, GATE, OP)
    _apply_rows(W, k, beta, G, T10, T11, Z, Z, start, n, 1, i_h, H, K, BKW, GATE, OP)
    _apply_rows(W, k, beta, G, T20, T21, T22, Z, start, n, 2, i_h, H, K, BKW, GATE, OP)
    _apply_rows(W, k, beta, G, T30, T31, T32, T33, start, n, 3, i_h, H, K, BKW, GATE, OP)
    _apply_rows(U, v, beta, G, T00, Z, Z, Z, start, n, 0, i_h, H, V, BVW, 0, OP)
    _apply_rows(U, v, beta, G, T10, T11, Z, Z, start, n, 1, i_h, H, V, BVW, 0, OP)
    _apply_rows(U, v, beta, G, T20, T21, T22, Z, start, n, 2, i_h, H, V, BVW, 0, OP)
    _apply_rows(U, v, beta, G, T30, T31, T32, T33, start, n, 3, i_h, H, V, BVW, 0, OP)


#: launch settings of the WY kernel: feature block of the W / U products, warps, stages (best of a sweep on S1, H200)
WY_CONFIG = dict(block_out=64, num_warps=4, num_stages=2)


def wy_repr(k: Tensor, k_tilde: Tensor, v: Tensor, beta: Tensor, G: Optional[Tensor],
            cu_seqlens: Optional[Tensor], gate: str, layout: Optional[ChunkLayout] = None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """WY representation of each chunk: ``(Ainv, W, U)``.

    ``k, k_tilde [B,T,H,K]``, ``v [B,T,H,V]``, ``beta [B,T,H]``, ``G`` from :func:`gate_cumsum`
    (None for gate "none"). Returns ``Ainv [B,T,H,64]`` fp32 (row t = row t of its chunk's
    ``(I + A)^{-1}``, columns past the chunk's end zero), ``W [B,T,H,K]`` and ``U [B,T,H,V]``
    in the input dtype (k.dtype, v.dtype): the half-precision products already round their
    operands to that type.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    Ainv = torch.empty(B, T, H, CHUNK, dtype=torch.float32, device=k.device)
    W = torch.empty_like(k)
    U = torch.empty_like(v)
    lay = layout or chunk_layout(cu_seqlens, B, T)
    if lay.n_chunks * B * H == 0:
        return Ainv, W, U
    cfg = WY_CONFIG
    _wy_kernel[(lay.n_chunks, B * H)](
        k, k_tilde, v, beta, k if G is None else G, Ainv, W, U, lay.cu, lay.table, T, lay.NT,
        H=H, K=K, V=V, BK=block(K), BKW=min(block(K), cfg["block_out"]), BVW=min(block(V), cfg["block_out"]),
        C=CHUNK, GATE=GATE_CODE[gate], IS_VARLEN=lay.varlen, OP=operand_type(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return Ainv, W, U
