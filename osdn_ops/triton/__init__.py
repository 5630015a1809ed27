"""Triton implementations: the CUDA kernels of the ``osdn::`` ops, and direct entry points.

``osdn_ops.triton.precond_scan``, ``chunk_delta_asym``, ``chunk_gated_delta_asym`` and
``chunk_kda_asym`` take the public arguments and return the public outputs, with autograd,
and run on CUDA tensors or (``TRITON_INTERPRET=1``) on CPU tensors.
"""
from .functions import chunk_delta_asym, chunk_gated_delta_asym, chunk_kda_asym, precond_scan

__all__ = ["chunk_delta_asym", "chunk_gated_delta_asym", "chunk_kda_asym", "precond_scan"]
