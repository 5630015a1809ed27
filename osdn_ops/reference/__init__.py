"""Pure-PyTorch implementations: token-by-token oracles and the chunked CPU kernels."""
from .asym import GATES, asym_chunked, asym_recurrent, chunk_asym_bwd, chunk_asym_fwd, state_shape
from .precond import precond_scan_bwd, precond_scan_fwd, precond_scan_recurrent
from .symmetric import delta_rule, gated_delta_rule, kda

__all__ = [
    "GATES", "asym_chunked", "asym_recurrent", "chunk_asym_bwd", "chunk_asym_fwd", "state_shape",
    "precond_scan_bwd", "precond_scan_fwd", "precond_scan_recurrent", "delta_rule", "gated_delta_rule", "kda",
]
