"""Stage 3 of the asymmetric delta engine: the chunk-to-chunk state recurrence.

One program per (V block, sequence, head) walks the sequence's chunks in order, holding the
``K x V`` state ``S`` in fp32 registers (DESIGN §4):

    h[c]   = S                                          (state at the chunk's start)
    Vnew   = U - W S
    S      = Diag(e^{G_C}) S + (Kt * e^{G_C - G})^T Vnew   (G_C: G at the chunk's last token)
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .asym_chunks import (CHUNK, GATE_CODE, ChunkLayout, block, chunk_layout, fill_block_v, load_tile, mma,
                          one_wave, operand_type, store_tile)
from .host_math import cdiv


@triton.jit
def _states_kernel(kt, W, U, G, h, vnew, h0, ht, cu, first, T, NT, H, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr,
                   IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, PUBLIC_KV: tl.constexpr,
                   OP: tl.constexpr):
    i_v, pid_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = pid_nh // H, pid_nh % H
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        L = tl.load(cu + i_n + 1).to(tl.int64) - bos
        nch = tl.cdiv(L, C)
        base = tl.load(first + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        L = bos * 0 + T
        nch = NT
        base = i_n.to(tl.int64) * NT
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    smask = (ck[:, None] < K) & (cv[None, :] < V)
    if PUBLIC_KV:
        soff = ck[:, None] * V + cv[None, :]
    else:
        soff = cv[None, :] * K + ck[:, None]
    sbase = (i_n.to(tl.int64) * H + i_h) * K * V
    if HAS_H0:
        S = tl.load(h0 + sbase + soff, mask=smask, other=0.).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    hoff = ck[:, None] * V + cv[None, :]
    r = tl.arange(0, C)
    for c in range(0, nch):
        start = bos + c * C
        n = tl.minimum(L - c * C, C).to(tl.int32)
        tl.store(h + ((base + c) * H + i_h) * K * V + hoff, S.to(h.dtype.element_ty), mask=smask)
        w = load_tile(W, start, n, 0, 0, i_h, H, K, C, BK)
        vn = load_tile(U, start, n, 0, i_v * BV, i_h, H, V, C, BV).to(tl.float32)
        vn -= mma(w, S.to(OP), OP)
        store_tile(vnew, vn, start, n, 0, i_v * BV, i_h, H, V, C, BV)
        kk = load_tile(kt, start, n, 0, 0, i_h, H, K, C, BK)
        if GATE == 1:
            g = tl.load(G + (start + r) * H + i_h, mask=r < n, other=0.)
            glast = tl.load(G + (start + n - 1) * H + i_h)
            kk = (kk * tl.exp(tl.where(r < n, glast - g, float("-inf")))[:, None]).to(OP)
            S *= tl.exp(glast)
        elif GATE == 2:
            Gc = load_tile(G, start, n, 0, 0, i_h, H, K, C, BK)
            glast = tl.load(G + ((start + n - 1) * H + i_h) * K + ck, mask=ck < K, other=0.)
            kk = (kk * tl.exp(tl.where((r < n)[:, None], glast[None, :] - Gc, float("-inf")))).to(OP)
            S *= tl.exp(glast)[:, None]
        S += mma(tl.trans(kk), vn.to(OP), OP)
    tl.store(ht + sbase + soff, S, mask=smask)


#: launch settings of the state kernel: V block (halved where few programs: ``fill_block_v``), warps, and the depth of
#: the software pipeline that loads the next chunks' tiles while the serial products run: ``num_stages`` where an SM
#: runs more than one program (the other program hides the loads), ``deep_stages`` where it runs at most one
#: (``one_wave``). H200, bf16, K = V = 128, ms a launch at 2 / 3 / 4 stages (benchmarks/RESULTS.md): S2 (128
#: programs) none 0.118 / - / 0.069, scalar 0.136 / 0.112 / 0.112, channel 0.188 / 0.156 / -; S1 (256 programs)
#: none 0.117 / - / 0.115, scalar 0.128 / 0.166 / 0.157, channel 0.164 / 0.258 / -. The deep pipeline applies to
#: 16-bit tiles at most 128 wide, and to the channel gate at 3 stages: beyond that it needs more than a Hopper
#: block's 227 KiB of shared memory (benchmarks/compile_sm90.py).
STATES_CONFIG = dict(block_v=64, num_warps=4, num_stages=2, deep_stages=4)


def chunk_states(k_tilde: Tensor, W: Tensor, U: Tensor, G: Optional[Tensor], initial_state: Optional[Tensor],
                 cu_seqlens: Optional[Tensor], gate: str, layout: Optional[ChunkLayout] = None,
                 h_dtype: torch.dtype = torch.float32, out: Optional[tuple[Tensor, Tensor]] = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Chunk-start states, ``Vnew`` and the final state: ``(h, v_new, final_state)``.

    ``k_tilde, W [B,T,H,K]``, ``U [B,T,H,V]`` (W, U from :func:`wy_repr`), ``G`` from
    :func:`gate_cumsum` or None, ``initial_state`` in the op's public layout (none/scalar
    ``[N,H,V,K]``, channel ``[N,H,K,V]``) or None for zeros.
    Returns ``h [B,NT,H,K,V]`` (varlen: ``[1,max_chunks,H,K,V]``, row = chunk-table row; rows of
    absent chunks are left unwritten) in ``h_dtype`` (fp32 by default; the forward keeps it in
    the input dtype, the type its products read it in), ``v_new [B,T,H,V]`` in U's dtype, and
    ``final_state`` fp32 in the public layout. ``out``: contiguous ``(h, v_new)`` of those shapes and dtypes to write
    into (the forward's kept states, :mod:`asym_kept`).
    """
    B, T, H, K = k_tilde.shape
    V = U.shape[-1]
    lay = layout or chunk_layout(cu_seqlens, B, T)
    N = lay.N
    if out is None:
        h = torch.empty(1 if lay.varlen else B, lay.n_chunks, H, K, V, dtype=h_dtype, device=W.device)
        v_new = torch.empty_like(U)
    else:
        h, v_new = out
    public = (N, H, K, V) if gate == "channel" else (N, H, V, K)
    final = torch.empty(public, dtype=torch.float32, device=W.device)
    if N * H == 0:
        return h, v_new, final
    cfg = STATES_CONFIG
    BV = fill_block_v(K, V, N * H, min(block(V), cfg["block_v"]), 16 if W.element_size() == 2 else 32, W.device)
    stages = cfg["num_stages"]
    if W.element_size() == 2 and block(K) <= 128 and one_wave(N * H * cdiv(V, BV), W.device):
        stages = min(cfg["deep_stages"], 3) if gate == "channel" else cfg["deep_stages"]
    _states_kernel[(cdiv(V, BV), N * H)](
        k_tilde, W, U, k_tilde if G is None else G, h, v_new, initial_state, final, lay.cu, lay.first, T, lay.NT,
        H=H, K=K, V=V, BK=block(K), BV=BV, C=CHUNK, GATE=GATE_CODE[gate], IS_VARLEN=lay.varlen,
        HAS_H0=initial_state is not None, PUBLIC_KV=gate == "channel", OP=operand_type(W.dtype),
        num_warps=cfg["num_warps"], num_stages=stages)
    return h, v_new, final
