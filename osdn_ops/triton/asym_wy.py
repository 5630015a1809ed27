"""Stages 1 and 2 of the asymmetric delta engine: in-chunk gate cumsum and the WY representation.

``gate_cumsum``: ``G`` = inclusive cumsum of the log decay ``g`` within each 64-token chunk (fp32).
``wy_repr``: per chunk ``A = tril(B (K e^G)(Kt e^-G)^T, -1)``, ``Ainv = (I + A)^{-1}``,
``W = Ainv B (K e^G)``, ``U = Ainv B V`` (DESIGN §4). One program per (chunk, head) writes ``A``
into its own rows of the ``Ainv`` output and completes the inverse there in registers: the four
diagonal 16 x 16 blocks as finite products (A is nilpotent), then the blocks below them
(``T_ij = -T_ii sum_{j<=m<i} A_im T_mj``); ``W`` and ``U`` are then single 64-row products with the
finished inverse. Given the inverse of an earlier call (the
backward's recompute), the kernel forms only ``W`` and ``U`` (constexpr ``INVERT`` off).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .asym_chunks import (CHUNK, GATE_CODE, ChunkLayout, bf16_scores, block, chunk_layout, chunk_span,
                          decayed_scores, fp32_product_precision, load_tile, load_vec, mma, operand_type, store_tile)
from .channel_blocks import block_scores
from .channel_refs import channel_refs, ref_column_scores, ref_scores
from .triangular import unit_lower_inverse


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
def _stage_scores(k, kt, beta, G, Ainv, start, n, i_h, H, K: tl.constexpr, BK: tl.constexpr,
                  C: tl.constexpr, GATE: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr):
    """Write ``A = tril(B (K e^G)(Kt e^-G)^T, -1)`` of the chunk into its Ainv rows (scratch).

    Gates none / scalar: one 64 x 64 product. Channel gate: one product of scaled tiles, or one per 16-column block,
    where the chunk allows reference rows (:func:`channel_refs`), else the exact block form
    (:func:`channel_blocks.block_scores`)."""
    if GATE == 2:
        r = tl.arange(0, C)
        rows = start + r
        refs = channel_refs(G, rows, r < n, i_h, H, K, BK)
        bt = load_vec(beta, start, n, 0, i_h, H, C)[:, None]
        if refs == 4:
            a = load_tile(k, start, n, 0, 0, i_h, H, K, C, BK).to(tl.float32)
            for j in tl.static_range(4):
                Aj = ref_column_scores(a, kt, G, rows, r < n, i_h, H, K, BK, 16 * j, True, PREC, HALF)
                store_tile(Ainv, bt * Aj, start, n, 0, 16 * j, i_h, H, C, C, 16)
        else:
            if refs == 1:
                a = load_tile(k, start, n, 0, 0, i_h, H, K, C, BK).to(tl.float32)
                b = load_tile(kt, start, n, 0, 0, i_h, H, K, C, BK).to(tl.float32)
                A = ref_scores(a, b, G, rows, r < n, i_h, H, K, BK, PREC, HALF)
            else:
                A = block_scores(k, kt, G, rows, r < n, i_h, H, K, BK, PREC, HALF)
            store_tile(Ainv, bt * tl.where(r[:, None] > r[None, :], A, 0.), start, n, 0, 0, i_h, H, C, C, C)
    else:
        A = decayed_scores(k, kt, G, start, n, i_h, H, K, BK, C, GATE, True, OP)
        store_tile(Ainv, load_vec(beta, start, n, 0, i_h, H, C)[:, None] * A, start, n, 0, 0, i_h, H, C, C, C)


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _invert_blocks(Ainv, start, n, i_h, H, C: tl.constexpr, PREC: tl.constexpr):
    """Replace ``A`` in the chunk's scratch rows by ``(I + A)^{-1}``, in registers: the four diagonal 16 x 16
    blocks ``T_ii = (I + A_ii)^{-1}`` (:func:`unit_lower_inverse`), then the blocks below them,
    ``T_ij = -T_ii sum_{j<=m<i} A_im T_mj``; blocks above the diagonal are set to zero. Products in ``PREC``
    (``asym_chunks.fp32_product_precision``)."""
    T00 = unit_lower_inverse(load_tile(Ainv, start, n, 0, 0, i_h, H, C, 16, 16), 16, 4, PREC)
    T11 = unit_lower_inverse(load_tile(Ainv, start, n, 16, 16, i_h, H, C, 16, 16), 16, 4, PREC)
    T22 = unit_lower_inverse(load_tile(Ainv, start, n, 32, 32, i_h, H, C, 16, 16), 16, 4, PREC)
    T33 = unit_lower_inverse(load_tile(Ainv, start, n, 48, 48, i_h, H, C, 16, 16), 16, 4, PREC)
    A10 = load_tile(Ainv, start, n, 16, 0, i_h, H, C, 16, 16)
    A21 = load_tile(Ainv, start, n, 32, 16, i_h, H, C, 16, 16)
    A32 = load_tile(Ainv, start, n, 48, 32, i_h, H, C, 16, 16)
    A20 = load_tile(Ainv, start, n, 32, 0, i_h, H, C, 16, 16)
    A31 = load_tile(Ainv, start, n, 48, 16, i_h, H, C, 16, 16)
    A30 = load_tile(Ainv, start, n, 48, 0, i_h, H, C, 16, 16)
    T10 = -_mm(T11, _mm(A10, T00, PREC), PREC)
    T21 = -_mm(T22, _mm(A21, T11, PREC), PREC)
    T32 = -_mm(T33, _mm(A32, T22, PREC), PREC)
    T20 = -_mm(T22, _mm(A20, T00, PREC) + _mm(A21, T10, PREC), PREC)
    T31 = -_mm(T33, _mm(A31, T11, PREC) + _mm(A32, T21, PREC), PREC)
    T30 = -_mm(T33, _mm(A30, T00, PREC) + _mm(A31, T10, PREC) + _mm(A32, T20, PREC), PREC)
    tl.debug_barrier()
    store_tile(Ainv, T00, start, n, 0, 0, i_h, H, C, 16, 16)
    store_tile(Ainv, T11, start, n, 16, 16, i_h, H, C, 16, 16)
    store_tile(Ainv, T22, start, n, 32, 32, i_h, H, C, 16, 16)
    store_tile(Ainv, T33, start, n, 48, 48, i_h, H, C, 16, 16)
    store_tile(Ainv, T10, start, n, 16, 0, i_h, H, C, 16, 16)
    store_tile(Ainv, T20, start, n, 32, 0, i_h, H, C, 16, 16)
    store_tile(Ainv, T21, start, n, 32, 16, i_h, H, C, 16, 16)
    store_tile(Ainv, T30, start, n, 48, 0, i_h, H, C, 16, 16)
    store_tile(Ainv, T31, start, n, 48, 16, i_h, H, C, 16, 16)
    store_tile(Ainv, T32, start, n, 48, 32, i_h, H, C, 16, 16)
    Z = tl.zeros([16, 16], dtype=tl.float32)
    for i in tl.static_range(3):
        for j in tl.static_range(i + 1, 4):
            store_tile(Ainv, Z, start, n, 16 * i, 16 * j, i_h, H, C, 16, 16)


@triton.jit
def _apply(out, Ti, x_ptr, beta, G, start, n, i_h, H, D: tl.constexpr, BD: tl.constexpr, C: tl.constexpr,
           GATE: tl.constexpr, OP: tl.constexpr):
    """``out = Ainv (beta x e^G)`` (GATE > 0) or ``Ainv (beta x)`` for the chunk, over feature blocks."""
    r = tl.arange(0, C)
    rv = r < n
    b = load_vec(beta, start, n, 0, i_h, H, C)
    if GATE == 1:
        b = b * tl.exp(tl.where(rv, load_vec(G, start, n, 0, i_h, H, C), float("-inf")))
    for c0 in tl.static_range(0, D, BD):
        x = load_tile(x_ptr, start, n, 0, c0, i_h, H, D, C, BD).to(tl.float32) * b[:, None]
        if GATE == 2:
            Gx = load_tile(G, start, n, 0, c0, i_h, H, D, C, BD)
            x = x * tl.exp(tl.where(rv[:, None], Gx, float("-inf")))
        store_tile(out, mma(Ti, x, OP), start, n, 0, c0, i_h, H, D, C, BD)


@triton.jit
def _wy_kernel(k, kt, v, beta, G, Ainv, W, U, cu, table, T, NT, H, K: tl.constexpr,
               V: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr, BVW: tl.constexpr, C: tl.constexpr,
               GATE: tl.constexpr, IS_VARLEN: tl.constexpr, OP: tl.constexpr, INVERT: tl.constexpr,
               PREC: tl.constexpr, HALF: tl.constexpr):
    """One chunk and head: ``INVERT``: the scores and ``Ainv`` into the Ainv rows, then ``W, U``; else
    ``W, U`` from the inverse already in those rows (kept by an earlier call)."""
    pid_c, pid_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = pid_bh // H, pid_bh % H
    start, n, _ = chunk_span(pid_c, i_b, cu, table, T, NT, C, IS_VARLEN)
    if n <= 0:
        return
    if INVERT:
        _stage_scores(k, kt, beta, G, Ainv, start, n, i_h, H, K, BK, C, GATE, OP, PREC, HALF)
        tl.debug_barrier()
        _invert_blocks(Ainv, start, n, i_h, H, C, PREC)
        tl.debug_barrier()
    Ti = load_tile(Ainv, start, n, 0, 0, i_h, H, C, C, C)
    _apply(W, Ti, k, beta, G, start, n, i_h, H, K, BKW, C, GATE, OP)
    _apply(U, Ti, v, beta, G, start, n, i_h, H, V, BVW, C, 0, OP)


#: launch settings of the WY kernel: feature block of the W / U products, warps, stages (best of a sweep on S1, H200)
WY_CONFIG = dict(block_out=128, num_warps=4, num_stages=2)


def wy_repr(k: Tensor, k_tilde: Tensor, v: Tensor, beta: Tensor, G: Optional[Tensor],
            cu_seqlens: Optional[Tensor], gate: str, layout: Optional[ChunkLayout] = None,
            inverse: Optional[Tensor] = None, w_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """WY representation of each chunk: ``(Ainv, W, U)``.

    ``k, k_tilde [B,T,H,K]``, ``v [B,T,H,V]``, ``beta [B,T,H]``, ``G`` from :func:`gate_cumsum`
    (None for gate "none"). Returns ``Ainv [B,T,H,64]`` fp32 (row t = row t of its chunk's
    ``(I + A)^{-1}``, columns past the chunk's end zero), ``W [B,T,H,K]`` and ``U [B,T,H,V]``
    in the input dtype (k.dtype, v.dtype): the half-precision products already round their
    operands to that type. ``inverse``: the ``Ainv`` of an earlier call on the same inputs; the
    scores and the inversion are then skipped and only ``W``, ``U`` are formed from it. ``w_out``: a contiguous
    tensor of ``W``'s shape and dtype to write ``W`` into (the forward's kept states, :mod:`asym_kept`).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    Ainv = torch.empty(B, T, H, CHUNK, dtype=torch.float32, device=k.device) if inverse is None else inverse
    W = torch.empty_like(k) if w_out is None else w_out
    U = torch.empty_like(v)
    lay = layout or chunk_layout(cu_seqlens, B, T)
    if lay.n_chunks * B * H == 0:
        return Ainv, W, U
    cfg = WY_CONFIG
    _wy_kernel[(lay.n_chunks, B * H)](
        k, k_tilde, v, beta, k if G is None else G, Ainv, W, U, lay.cu, lay.table, T, lay.NT,
        H=H, K=K, V=V, BK=block(K), BKW=min(block(K), cfg["block_out"]), BVW=min(block(V), cfg["block_out"]),
        C=CHUNK, GATE=GATE_CODE[gate], IS_VARLEN=lay.varlen, OP=operand_type(k.dtype), INVERT=inverse is None,
        PREC=fp32_product_precision(k.dtype), HALF=bf16_scores(k.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return Ainv, W, U
