"""Triton entry points of the asymmetric delta ops: ``chunk_asym_fwd`` and ``chunk_asym_bwd``.

Same contract as :func:`osdn_ops.reference.asym.chunk_asym_fwd` / ``chunk_asym_bwd``. The
forward composes the stages of :mod:`osdn_ops.triton.asym_fwd`; fp64 inputs, K or V above 256
and fp32 inputs with K above 128 run the reference kernel (``asym_chunks.reference_only``).
"""
from __future__ import annotations

import torch

from ..reference import asym as reference
from .asym_bwd import chunk_asym_bwd
from .asym_chunks import reference_only
from .asym_fwd import CHUNK, chunk_layout, chunk_output, chunk_states, gate_cumsum, wy_repr
from .asym_kept import kept_states_shape, kept_views

__all__ = ["chunk_asym_bwd", "chunk_asym_fwd", "kept_states_shape", "saved_shape"]


def _reference_only(q, v) -> bool:
    return reference_only(q.dtype, q.shape[-1], v.shape[-1])


def saved_shape(q, v) -> tuple[int, ...]:
    """Shape of the inverse that ``chunk_asym_fwd(..., save=True)`` keeps for ``q [B,T,H,K]``, ``v``:
    ``[B,T,H,64]``, or ``[0]`` where the reference runs."""
    return (0,) if _reference_only(q, v) else (*q.shape[:3], CHUNK)


def chunk_asym_fwd(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate, save=False,
                   keep_states=False):
    """``(o [B,T,H,V] in v.dtype, final_state fp32 in the public layout)``.

    ``save=True`` appends what the backward can reuse: the WY inverse ``Ainv [B,T,H,64]`` fp32 (:func:`wy_repr`),
    or an empty tensor where the reference ran (``reference_only``), and the kept chunk states (:mod:`asym_kept`:
    ``W``, ``v_new`` and the chunk-start states in one flat buffer in the inputs' dtype with ``keep_states``, else
    empty). The inverse alone is a quarter of the bytes of ``W``, ``U`` and the chunk states and spares the
    backward the scores and the inversion (the WY stage's costly part); the chunk states spare it the rest of the
    WY stage and the state recurrence, at four times the inverse's bytes (K = V = 128, half inputs).
    """
    if _reference_only(q, v):
        o, final = reference.chunk_asym_fwd(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate)
        empty = q.new_empty(0, dtype=torch.float32)
        return (o, final, empty, q.new_empty(0)) if save else (o, final)
    B, T = q.shape[:2]
    lay = chunk_layout(cu_seqlens, B, T)
    G = None if gate == "none" else gate_cumsum(g, cu_seqlens, layout=lay)
    kept = q.new_empty(kept_states_shape(q, v, cu_seqlens) if save and keep_states else 0)
    W_k, vn_k, h_k = kept_views(kept, q, v, cu_seqlens) if kept.numel() else (None, None, None)
    Ainv, W, U = wy_repr(k, k_tilde, v, beta, G, cu_seqlens, gate, layout=lay, w_out=W_k)
    h, v_new, final = chunk_states(k_tilde, W, U, G, initial_state, cu_seqlens, gate, layout=lay, h_dtype=k.dtype,
                                   out=None if h_k is None else (h_k, vn_k))
    o = chunk_output(q, k_tilde, v_new, h, G, scale, cu_seqlens, gate, layout=lay, out_dtype=v.dtype)
    return (o, final, Ainv, kept) if save else (o, final)
