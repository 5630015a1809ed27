"""The Triton kernel entry points, with the same contract as the reference CPU kernels.

``precond_scan_fwd/bwd`` (osdn_ops.triton.precond) and ``chunk_asym_fwd/bwd``
(osdn_ops.triton.asym): see ``osdn_ops.reference`` for the argument lists and shapes.
"""
from .asym import chunk_asym_bwd, chunk_asym_fwd
from .precond import precond_scan_bwd, precond_scan_fwd

__all__ = ["chunk_asym_bwd", "chunk_asym_fwd", "precond_scan_bwd", "precond_scan_fwd"]
