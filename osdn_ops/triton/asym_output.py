"""Stage 4 of the asymmetric delta engine: the chunk outputs.

``O = scale ((Q e^G) S + tril_incl((Q e^G)(Kt e^-G)^T) Vnew)`` per chunk (DESIGN §4), with ``S``
the chunk-start state from :func:`chunk_states`. One program per (V block, chunk, batch*head).
Without a gate and with the scalar gate the scores are one 64 x 64 product (:func:`decayed_scores`); with the channel
gate one product of scaled tiles, or one per 16-column block, where the chunk allows reference rows
(:func:`channel_refs`), else the exact block form (:func:`channel_blocks.block_scores`), so every exponent stays
non-positive.
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
from .host_math import cdiv


@triton.jit
def _state_part(q, G, S, start, n, i_h, H, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr,
                OP: tl.constexpr):
    """``[C, BV]`` fp32 ``(Q e^G) S``: the chunk's reads of its start state."""
    r = tl.arange(0, C)
    qq = load_tile(q, start, n, 0, 0, i_h, H, K, C, BK)
    if GATE == 1:
        eg = tl.exp(tl.where(r < n, load_vec(G, start, n, 0, i_h, H, C), float("-inf")))
        qq = qq * eg[:, None]
    elif GATE == 2:
        Gq = load_tile(G, start, n, 0, 0, i_h, H, K, C, BK)
        qq = qq * tl.exp(tl.where((r < n)[:, None], Gq, float("-inf")))
    return mma(qq.to(OP), S, OP)


@triton.jit
def _rows_out(q, vnew, G, o, S, P, start, n, i_v, i_h, H, scale, K: tl.constexpr, V: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, OP: tl.constexpr):
    """``o = scale ((Q e^G) S + P Vnew)`` for the whole chunk, given the ``[C, C]`` scores ``P``."""
    acc = _state_part(q, G, S, start, n, i_h, H, K, BK, C, GATE, OP)
    vn = load_tile(vnew, start, n, 0, i_v * BV, i_h, H, V, C, BV).to(OP)
    acc += mma(P.to(OP), vn, OP)
    store_tile(o, acc * scale, start, n, 0, i_v * BV, i_h, H, V, C, BV)


@triton.jit
def _output_kernel(q, kt, vnew, h, G, o, cu, table, T, NT, scale, H, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr,
                   IS_VARLEN: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, HALF: tl.constexpr):
    i_v, pid_c, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = pid_bh // H, pid_bh % H
    start, n, row = chunk_span(pid_c, i_b, cu, table, T, NT, C, IS_VARLEN)
    if n <= 0:
        return
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    S = tl.load(h + (row * H + i_h) * K * V + ck[:, None] * V + cv[None, :],
                mask=(ck[:, None] < K) & (cv[None, :] < V), other=0.).to(OP)
    if GATE == 2:
        r = tl.arange(0, C)
        refs = channel_refs(G, start + r, r < n, i_h, H, K, BK)
        if refs == 4:
            rows_o = _state_part(q, G, S, start, n, i_h, H, K, BK, C, GATE, OP)
            a = load_tile(q, start, n, 0, 0, i_h, H, K, C, BK).to(tl.float32)
            for j in tl.static_range(4):
                Pj = ref_column_scores(a, kt, G, start + r, r < n, i_h, H, K, BK, 16 * j, False, PREC, HALF)
                vj = load_tile(vnew, start, n, 16 * j, i_v * BV, i_h, H, V, 16, BV).to(OP)
                rows_o += mma(Pj.to(OP), vj, OP)
            store_tile(o, rows_o * scale, start, n, 0, i_v * BV, i_h, H, V, C, BV)
        else:
            if refs == 1:
                a = load_tile(q, start, n, 0, 0, i_h, H, K, C, BK).to(tl.float32)
                b = load_tile(kt, start, n, 0, 0, i_h, H, K, C, BK).to(tl.float32)
                P = ref_scores(a, b, G, start + r, r < n, i_h, H, K, BK, PREC, HALF)
            else:
                P = block_scores(q, kt, G, start + r, r < n, i_h, H, K, BK, PREC, HALF)
            _rows_out(q, vnew, G, o, S, P, start, n, i_v, i_h, H, scale, K, V, BK, BV, C, GATE, OP)
    else:
        P = decayed_scores(q, kt, G, start, n, i_h, H, K, BK, C, GATE, False, OP)
        _rows_out(q, vnew, G, o, S, P, start, n, i_v, i_h, H, scale, K, V, BK, BV, C, GATE, OP)


#: launch settings of the output kernel: V block, warps, stages (best of a sweep on S1, H200)
OUTPUT_CONFIG = dict(block_v=128, num_warps=4, num_stages=2)


def chunk_output(q: Tensor, k_tilde: Tensor, v_new: Tensor, h: Tensor, G: Optional[Tensor], scale: float,
                 cu_seqlens: Optional[Tensor], gate: str, layout: Optional[ChunkLayout] = None,
                 out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Chunk outputs ``o [B,T,H,V]`` (dtype ``out_dtype``, default v_new's, which is v's).

    ``q, k_tilde [B,T,H,K]``, ``v_new [B,T,H,V]`` and ``h`` from :func:`chunk_states`, ``G``
    from :func:`gate_cumsum` or None.
    """
    B, T, H, K = q.shape
    V = v_new.shape[-1]
    o = torch.empty(B, T, H, V, dtype=out_dtype or v_new.dtype, device=q.device)
    lay = layout or chunk_layout(cu_seqlens, B, T)
    if lay.n_chunks * B * H == 0:
        return o
    cfg = OUTPUT_CONFIG
    BV = min(block(V), cfg["block_v"])
    _output_kernel[(cdiv(V, BV), lay.n_chunks, B * H)](
        q, k_tilde, v_new, h, q if G is None else G, o, lay.cu, lay.table, T, lay.NT, scale,
        H=H, K=K, V=V, BK=block(K), BV=BV, C=CHUNK, GATE=GATE_CODE[gate], IS_VARLEN=lay.varlen,
        OP=operand_type(q.dtype), PREC=fp32_product_precision(q.dtype), HALF=bf16_scores(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o
