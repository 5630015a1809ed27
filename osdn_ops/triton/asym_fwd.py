"""Forward stages of the asymmetric delta engine (DESIGN §4), shared by the three gate modes.

    G            = gate_cumsum(g, cu_seqlens)                          (gated modes only)
    Ainv, W, U   = wy_repr(k, k_tilde, v, beta, G, cu_seqlens, gate)
    h, v_new, hT = chunk_states(k_tilde, W, U, G, initial_state, cu_seqlens, gate)
    o            = chunk_output(q, k_tilde, v_new, h, G, scale, cu_seqlens, gate)

Every stage also takes ``layout=`` (a :func:`chunk_layout`, to share the varlen chunk table
between stages). See each function for shapes and dtypes.
"""
from .asym_chunks import CHUNK, ChunkLayout, chunk_layout
from .asym_output import chunk_output
from .asym_states import chunk_states
from .asym_wy import gate_cumsum, wy_repr

__all__ = ["CHUNK", "ChunkLayout", "chunk_layout", "chunk_output", "chunk_states", "gate_cumsum", "wy_repr"]
