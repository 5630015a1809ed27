"""What the asym ops keep from their forward for their backward: a memory-for-time setting.

By default the CUDA forward of :func:`osdn_ops.chunk_delta_asym` and its two siblings keeps, beside its inputs,
only each chunk's WY inverse (256 bytes per token and head), and the backward recomputes ``W``, ``U``, the
chunk-start states and ``v_new`` (one more WY pass and one more chunk recurrence), as fla does. Inside
``keep_chunk_states()`` (or after ``set_keep_chunk_states(True)``) the forward also keeps ``W``, ``v_new`` and the
chunk-start states, ``2 (K + V + K V / 64)`` bytes per token and head for bf16/fp16 inputs (1024 at
K = V = 128, twice that for fp32), held until the backward, which then skips both recomputations. The peak of one
op's forward+backward does not grow (the backward would allocate them anyway); what grows is what a model holds
between its forward and its backward, once per layer. CPU tensors and inputs that run the reference kernels keep
nothing either way; the Triton functions of :mod:`osdn_ops.triton` follow the setting too (also under
``TRITON_INTERPRET=1`` on CPU tensors, how CI tests it).

The setting is process-wide (not per thread), like ``torch.backends`` flags. It is read when a forward runs, or,
under ``torch.compile``, when it is traced: a compiled function keeps what it was traced with (Dynamo guards on the
setting and retraces when it changes).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

_keep = False


def set_keep_chunk_states(enabled: bool) -> None:
    """Keep (True) or recompute (False, the default) the asym ops' chunk states for the backward."""
    global _keep
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    _keep = enabled


@contextlib.contextmanager
def keep_chunk_states(enabled: bool = True) -> Iterator[None]:
    """Within the block, forwards keep their chunk states (``enabled``) or not; the previous setting comes back on
    exit."""
    before = _keep
    set_keep_chunk_states(enabled)
    try:
        yield
    finally:
        set_keep_chunk_states(before)


def keeping_chunk_states() -> bool:
    """The current setting."""
    return _keep
