"""Backward of the asymmetric delta ops (placeholder).

The Triton backward replaces this: until then ``chunk_asym_bwd`` runs the reference
CPU kernel (:func:`osdn_ops.reference.asym.chunk_asym_bwd`), same arguments and returns.
"""
from ..reference.asym import chunk_asym_bwd as _reference_bwd


def chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate):
    """Reference backward; the Triton backward replaces it. Returns ``(dq, dk, dk_tilde, dv, dg, dbeta, dh0)``."""
    return _reference_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate)
