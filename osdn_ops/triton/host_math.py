"""Integer helpers of the kernels' host code (grid sizes, tile widths).

Plain Python on purpose: in Triton 3.6 ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr
functions, and a call from host code costs about 3 µs (it unwraps its arguments as constexprs), against
tens of nanoseconds here; a forward+backward of an op makes a dozen or more such calls.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
