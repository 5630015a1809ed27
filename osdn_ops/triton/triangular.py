"""Inverse of a small unit lower triangular tile, shared by the WY stage and the precond precompute."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(L, G: tl.constexpr, LOG2G: tl.constexpr, PREC: tl.constexpr):
    """``(I + L)^{-1}`` of a strictly lower triangular ``[G, G]`` fp32 tile (``G = 2^LOG2G``): L is nilpotent,
    so the inverse is the finite product ``(I - L)(I + L^2)(I + L^4)...(I + L^(G/2))``, ``2 (LOG2G - 1)``
    dependent products (a forward substitution would be ``G - 1`` dependent steps), on the tensor cores in
    ``PREC``: "tf32x3" is three tf32 passes (error ~2^-22 relative; plain fp32 products ran on the CUDA cores
    at several times the cost), "tf32" one, "ieee" exact fp32."""
    ri = tl.arange(0, G)
    eye = (ri[:, None] == ri[None, :]).to(tl.float32)
    Tm = eye - L
    P = L
    for _i in tl.static_range(LOG2G - 1):
        P = tl.dot(P, P, input_precision=PREC)
        Tm = tl.dot(Tm, eye + P, input_precision=PREC)
    return Tm
