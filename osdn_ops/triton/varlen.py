"""Chunk bookkeeping for packed sequences, computed on the device without a host sync.

With ``cu_seqlens`` (``[N+1]``, B == 1) the number of chunks depends on the lengths, which the
host must not read (CUDA graphs, torch.compile). Kernels therefore launch over an upper bound,
``cdiv(T, C) + N`` chunks, and read from a table which ones exist.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .host_math import cdiv


def max_chunks(T: int, N: int, C: int) -> int:
    """Upper bound on the chunks of N packed sequences of total length T (chunk length C)."""
    return cdiv(T, C) + N


def chunk_table(cu_seqlens: Tensor, T: int, C: int) -> Tensor:
    """``[max_chunks, 2]`` int32 rows ``(sequence n, first token)``; ``n = -1`` past the last chunk.

    Chunks are numbered sequence by sequence; chunk j of sequence n starts at
    ``cu_seqlens[n] + j * C`` and ends at ``min(start + C, cu_seqlens[n + 1])``.
    """
    cu = cu_seqlens.to(torch.int64)
    N = cu.shape[0] - 1
    counts = (cu[1:] - cu[:-1] + C - 1) // C                      # [N] chunks per sequence
    first = torch.cumsum(counts, 0) - counts                       # [N] index of each sequence's first chunk
    idx = torch.arange(max_chunks(T, N, C), device=cu.device)
    seq = torch.searchsorted(first + counts, idx, right=True)      # sequence owning chunk idx
    valid = seq < N
    seq_c = seq.clamp(max=N - 1)
    start = cu[seq_c] + (idx - first[seq_c]) * C
    return torch.stack([torch.where(valid, seq_c, -1), torch.where(valid, start, 0)], 1).to(torch.int32).contiguous()
