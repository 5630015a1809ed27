"""The chunk states that the asym forward keeps for its backward where asked to (``osdn_ops.keep_chunk_states``).

One flat buffer in the inputs' dtype holds ``W [B,T,H,K]``, ``v_new [B,T,H,V]`` and the chunk-start states
``h [B, NT, H, K, V]`` (varlen: ``[1, max_chunks, H, K, V]``), in that order, as the forward's stages wrote them
(:func:`asym_fwd.wy_repr`, :func:`asym_fwd.chunk_states`). With it the backward runs neither its WY pass (``W``
from the kept inverse) nor its state recurrence. It costs ``2 (K + V + K V / 64)`` bytes per token and head for
half inputs (1024 at K = V = 128, four times the inverse's 256), held from the forward to the backward.
"""
from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from .asym_chunks import CHUNK
from .host_math import cdiv
from .varlen import max_chunks


def _parts(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[tuple[int, ...], ...]:
    """Shapes of ``W``, ``v_new`` and ``h``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    rows = (B, cdiv(T, CHUNK)) if cu_seqlens is None else (1, max_chunks(T, cu_seqlens.shape[0] - 1, CHUNK))
    return (B, T, H, K), (B, T, H, V), (*rows, H, K, V)


def kept_states_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[int]:
    """``(numel,)`` of the buffer for inputs ``q [B,T,H,K]``, ``v [B,T,H,V]``."""
    return (sum(math.prod(s) for s in _parts(q, v, cu_seqlens)),)


def kept_views(buf: Tensor, q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(W, v_new, h)``: views of a ``kept_states_shape`` buffer."""
    views, at = [], 0
    for shape in _parts(q, v, cu_seqlens):
        views.append(buf[at:at + math.prod(shape)].view(shape))
        at += math.prod(shape)
    return tuple(views)
