"""Chunk addressing and shared device helpers of the asymmetric delta engine (DESIGN §4).

Every stage of the engine works on 64-token chunks that restart at each sequence start.
Tensors are token-major ``[B, T, H, D]``; a chunk is identified by its first token (a flat
token index ``b * T + t``, int64) and its length ``n <= 64``. Without ``cu_seqlens`` chunk
``c`` of batch row ``b`` starts at ``b * T + c * 64`` and owns row ``b * NT + c`` of the per-chunk
state tensor ``h``; with ``cu_seqlens`` the grid covers ``varlen.max_chunks`` chunks and
``varlen.chunk_table`` says which exist (row ``i`` of the table is row ``i`` of ``h``).

Gate modes (constexpr ``GATE``): 0 = "none", 1 = "scalar" (``G [B,T,H]``), 2 = "channel"
(``G [B,T,H,K]``), where ``G`` is the in-chunk inclusive cumsum of the log decay.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .host_math import cdiv, next_pow2
from .varlen import chunk_table, max_chunks

CHUNK = 64
GATE_CODE = {"none": 0, "scalar": 1, "channel": 2}


@dataclass
class ChunkLayout:
    """Host description of the chunk grid.

    ``n_chunks``: grid size along chunks (``cdiv(T, 64)``, or ``max_chunks`` with varlen);
    ``NT``: chunks per batch row (dense layout only); ``table``: ``[n_chunks, 2]`` int32 or None;
    ``first``: ``[N]`` int64 index of each sequence's first chunk (varlen) or None;
    ``cu``: cu_seqlens or None; ``N``: number of sequences.
    """
    n_chunks: int
    NT: int
    N: int
    table: Optional[Tensor]
    first: Optional[Tensor]
    cu: Optional[Tensor]

    @property
    def varlen(self) -> bool:
        return self.cu is not None


def chunk_layout(cu_seqlens: Optional[Tensor], B: int, T: int, C: int = CHUNK) -> ChunkLayout:
    """Grid of chunks of ``C`` tokens (64 unless given) over ``B`` rows of ``T`` tokens, or over packed
    sequences; no host sync."""
    NT = cdiv(T, C)
    if cu_seqlens is None:
        return ChunkLayout(NT, NT, B, None, None, None)
    cu = cu_seqlens
    N = cu.shape[0] - 1
    counts = (cu[1:] - cu[:-1] + C - 1) // C
    first = (torch.cumsum(counts, 0) - counts).to(torch.int64).contiguous()
    return ChunkLayout(max_chunks(T, N, C), NT, N, chunk_table(cu, T, C), first, cu)


def block(d: int) -> int:
    """Padded tile width of a feature dimension: a power of two, at least 64.

    Not 16 or 32: on the H200 with Triton 3.6, the WY kernel's half-precision product
    ``Ainv @ (beta V)`` with a 16- or 32-column ``V`` tile read shared memory out of bounds
    (compute-sanitizer memcheck; an illegal memory access without it). 64-wide tiles are the
    shape every benchmark runs; the extra columns are masked."""
    return max(64, next_pow2(d))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


#: largest K and V of the Triton kernels
MAX_DIM = 256
#: largest K of the Triton kernels for fp32 inputs: their 256-wide fp32 tiles need more shared memory than a Hopper
#: block has (H200: the forward's WY, state and output kernels asked for 256-304 KiB, 227 KiB available)
MAX_DIM_FP32 = 128


def reference_only(dtype: torch.dtype, K: int, V: int) -> bool:
    """Whether inputs of ``dtype`` with key width K and value width V run the PyTorch reference instead of the
    Triton kernels (forward and backward alike): fp64, K or V above ``MAX_DIM``, fp32 with K above
    ``MAX_DIM_FP32``."""
    return (dtype == torch.float64 or K > MAX_DIM or V > MAX_DIM
            or (dtype == torch.float32 and K > MAX_DIM_FP32))


def one_wave(programs: int, device: torch.device) -> bool:
    """Whether a grid of ``programs`` runs at most one program per SM (False off CUDA)."""
    return programs <= _sm_count(torch.device(device))


def fill_block_v(K: int, V: int, NH: int, bv: int, narrowest: int, device: torch.device) -> int:
    """V block of a recurrence over chunks with one program per (V block, sequence, head): ``bv`` (a power of
    two, at most ``block(V)``), halved while the halved grid, ``NH * cdiv(V, bv / 2)`` programs, still runs in
    one wave (at most one program per SM), down to ``narrowest``: the narrowest block the caller's kernel has
    been checked with on the GPU for its input (16, 32, or ``bv``: never halved). Only where K and V are
    multiples of 16 (K 105 / V 61 and K 100 / V 40, bf16 without a gate: ``_dh``'s 32- and 16-wide blocks gave a
    wrong initial-state gradient or an illegal memory access on the H200, 64-wide ones were right), never for K
    above 128.

    A program's chunk step is the recurrence's whole time; a narrower block shortens it as long as the extra
    programs find idle SMs. H200, bf16, K = V = 128 (benchmarks/RESULTS.md): S2 (32 sequence-heads) ran
    ``chunk_states`` 6-11% and ``_dh`` 15-35% faster as 128 programs of 32-wide blocks than as 64 of 64-wide, and
    slower as 256 of 16-wide (ms: ``_dh`` 0.152 -> 0.186, states 0.065 -> 0.100); S3 (8 sequence-heads) and
    B 2, T 16384, H 8 (16) ran faster 16-wide (``_dh`` 1.175 -> 0.721 and 0.591 -> 0.363 at 4 warps, the states
    0.491 -> 0.383); S1's 256 programs were faster 64-wide.

    The limits come from compute-sanitizer memcheck (H200, Triton 3.6), which found ``_dh``'s products reading
    shared memory out of bounds with 256-wide K tiles at 32-wide V blocks, and at 16-wide ones for bf16 at K 100,
    V 40 and for fp16 without a gate at K = V = 128; bf16 at K / V 128 / 128, 64 / 48 and 32 / 96 ran clean at 16
    with every gate, as did the state kernel for bf16 and fp16."""
    if K > 128 or K % 16 or V % 16:
        return bv
    while bv > narrowest and V > bv // 2 and one_wave(NH * cdiv(V, bv // 2), device):
        bv //= 2
    return bv


def operand_type(dtype: torch.dtype):
    """Type in which the matrix products read their operands (constexpr ``OP`` of the kernels).

    fp32 inputs multiply in fp32 (``MMA_PRECISION``); half inputs in their own type (the tensor-core
    path), except under the CPU interpreter, whose products do not support bf16: there fp32.
    """
    if dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


#: precision of the products of fp32 operands: three tf32 passes on the tensor cores (error ~2^-22 relative).
#: Exact fp32 products ("ieee") run on the CUDA cores: on S1 with fp32 inputs (H200) the ungated forward took
#: 50.0 ms and forward+backward 162 ms that way, 3.57 and 13.8 ms with "tf32x3", at float64-relative errors of
#: 6.0e-7 and 9.0e-7.
MMA_PRECISION = tl.constexpr("tf32x3")


def fp32_product_precision(dtype: torch.dtype) -> str:
    """Precision of the products that read fp32 tiles, for inputs of ``dtype``: ``MMA_PRECISION`` for fp32 inputs;
    one tf32 pass for half-precision ones, whose fp32 tiles (the WY inverse; the backward under the interpreter)
    only feed results rounded to 16 bits. On S1 the single pass moved the WY inverse by 2e-4 relative, and ``W``,
    ``U`` not beyond their bf16 rounding, with the WY stage at 0.185 instead of 0.239 ms (H200, no gate)."""
    return MMA_PRECISION.value if dtype == torch.float32 else "tf32"


def bf16_scores(dtype: torch.dtype) -> bool:
    """Whether the forward's channel-gate scores from reference rows (``channel_refs``; constexpr ``HALF``) multiply
    bf16-rounded operands: for bf16 inputs on a GPU. fp16 inputs take one tf32 pass (``fp32_product_precision``)
    instead: the factors reach ``e^{+-REF_SPAN}``, beyond fp16's range (H200: every output of an fp16 channel-gated
    op was inf/NaN with the product in fp16); fp32 inputs and the interpreter keep fp32 operands."""
    return operand_type(dtype) == tl.bfloat16


@triton.jit
def mma(a, b, OP: tl.constexpr):
    """``a @ b`` with fp32 accumulation, operands cast to OP (fp32 operands: ``MMA_PRECISION``)."""
    if OP == tl.float32:
        return tl.dot(a.to(OP), b.to(OP), input_precision=MMA_PRECISION)
    else:
        return tl.dot(a.to(OP), b.to(OP))


@triton.jit
def chunk_span(pid_c, i_b, cu, table, T, NT, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """``(first token int64, length int32 (<= 0: no chunk), h row int64)`` of grid chunk pid_c."""
    if IS_VARLEN:
        n = tl.load(table + 2 * pid_c)
        start = tl.load(table + 2 * pid_c + 1).to(tl.int64)
        eos = tl.load(cu + tl.maximum(n, 0) + 1).to(tl.int64)
        length = tl.where(n >= 0, tl.minimum(eos - start, C), 0).to(tl.int32)
        row = pid_c.to(tl.int64)
    else:
        start = i_b.to(tl.int64) * T + pid_c * C
        length = tl.minimum(T - pid_c * C, C).to(tl.int32)
        row = i_b.to(tl.int64) * NT + pid_c
    return start, length, row


@triton.jit
def load_tile(ptr, start, n, r0, c0, i_h, H, D: tl.constexpr, BR: tl.constexpr,
              BD: tl.constexpr):
    """``[BR, BD]`` tile: rows ``r0..`` (chunk-relative, valid below n), columns ``c0..`` of a
    ``[.., H, D]`` token-major tensor; zeros outside."""
    r = r0 + tl.arange(0, BR)
    c = c0 + tl.arange(0, BD)
    off = ((start + r[:, None]) * H + i_h) * D + c[None, :]
    return tl.load(ptr + off, mask=(r[:, None] < n) & (c[None, :] < D), other=0.)


@triton.jit
def store_tile(ptr, x, start, n, r0, c0, i_h, H, D: tl.constexpr, BR: tl.constexpr,
               BD: tl.constexpr):
    """Store a ``[BR, BD]`` tile where :func:`load_tile` would read it (cast to ptr's type)."""
    r = r0 + tl.arange(0, BR)
    c = c0 + tl.arange(0, BD)
    off = ((start + r[:, None]) * H + i_h) * D + c[None, :]
    tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=(r[:, None] < n) & (c[None, :] < D))


@triton.jit
def load_vec(ptr, start, n, r0, i_h, H, BR: tl.constexpr):
    """``[BR]`` per-token values of a ``[.., H]`` tensor, fp32, zeros past n."""
    r = r0 + tl.arange(0, BR)
    return tl.load(ptr + (start + r) * H + i_h, mask=r < n, other=0.).to(tl.float32)


@triton.jit
def decayed_scores(a_ptr, b_ptr, G, start, n, i_h, H, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                   GATE: tl.constexpr, STRICT: tl.constexpr, OP: tl.constexpr):
    """``[C, C]`` fp32 scores of a chunk without a gate or with the scalar one: ``X[t, j] = sum_c a[t,c] b[j,c]
    exp(G[t] - G[j])`` on ``t > j`` (STRICT) or ``t >= j``, zero elsewhere and outside the chunk. The scalar gate
    multiplies the product by the exponentials of the masked differences, never of a positive exponent. (The channel
    gate's scores: :mod:`channel_refs`, :mod:`channel_blocks`.)"""
    r = tl.arange(0, C)
    rv = r < n
    if STRICT:
        m = r[:, None] > r[None, :]
    else:
        m = r[:, None] >= r[None, :]
    m = m & rv[:, None] & rv[None, :]
    a = load_tile(a_ptr, start, n, 0, 0, i_h, H, K, C, BK)
    b = load_tile(b_ptr, start, n, 0, 0, i_h, H, K, C, BK)
    x = mma(a, tl.trans(b), OP)
    if GATE == 1:
        g = load_vec(G, start, n, 0, i_h, H, C)
        x = x * tl.exp(tl.where(m, g[:, None] - g[None, :], float("-inf")))
    else:
        x = tl.where(m, x, 0.)
    return x
