"""Triton precond_scan: the kernel entry points (DESIGN §3).

Shapes: ``k [B,T,H,K]``, ``beta [B,T,H]``, ``d0 [N,H,K]`` fp32 or None (ones),
``retention [B,T,H]`` or None (ones), ``cu_seqlens [N+1]`` or None (N = B).
``precond_scan_fwd -> (k_tilde [B,T,H,K] in k's dtype, d_final [N,H,K] fp32)``, with ``save=True`` followed by
the backward's residuals ``(checkpoints, flags)`` (``saved_shapes``; ``checkpoints`` holds ``d`` at every group
start, every token's ``w``, every group's ``Tinv^T`` and any segment maps);
``precond_scan_bwd -> (dk, dbeta, dd0 [N,H,K] fp32, dretention or empty [0] fp32)``; given the residuals
(``saved``) it does not rerun the forward.

Two forms (``form``):

* ``"parallel"`` (default): a parallel precompute over all 16-token groups (``precond_parallel``);
  one program per (sequence, head) carries only ``d`` from group to group, three short dependent
  steps per 16 tokens instead of 16 dependent K-reductions (``precond_chain``); a parallel pass forms
  ``k_tilde`` from the chain's checkpoints and per-token ``w`` and flags the chunks where a clamp fires (or
  that start with a coordinate pinned on a bound and pointing outward), and a fixup redoes each sequence from its
  first flagged chunk, token by token (``precond_fwd``). The backward's adjoint runs the
  same way (``precond_bwd``).
* ``"tokens"``: one program per (sequence, head), token by token (``precond_tokens``).

The default is measured on the H200 by ``benchmarks/bench_precond.py`` (see benchmarks/RESULTS.md).

The kernels leave ``T`` (and the chunk and segment counts) unspecialized, so a new length does not recompile,
but specialize ``H`` and ``K``: Triton then knows that key rows start 16-element aligned, vectorizes their loads
and can pipeline them. On the H200 (bf16, kernels called directly) that, with the pipelined chains of
``precond_chain``, took forward+backward from 0.837 to 0.662 ms on S1, 0.827 to 0.658 on S2 and 2.107 to 1.930
on S3.

K > 256 and float64 keys go to the reference kernels.
"""
from __future__ import annotations

import torch

from .. import reference
from .precond_bwd import backward
from .precond_fwd import forward_pass, residuals
from .precond_tokens import flag_slots

MAX_K = 256
FORMS = ("parallel", "tokens")
DEFAULT_FORM = "parallel"


def _pick(form) -> bool:
    """True for the chunk-parallel form."""
    form = DEFAULT_FORM if form is None else form
    assert form in FORMS, form
    return form == "parallel"


def _use_reference(k) -> bool:
    return k.dtype == torch.float64 or k.shape[-1] > MAX_K


def saved_shapes(k, cu_seqlens) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the forward's residuals for the backward: one flat fp32 buffer with ``d`` at every 16-token
    group start, every token's ``w``, every group's ``Tinv^T`` and, where the chains run in two levels, every
    segment's map (``precond_fwd.residual_views``), and the chunks that ran token by token (``[flag_slots, H]``
    int32); ``(0,)`` each where the reference kernels run (they keep nothing).

    Keeping them costs 100 bytes per token and head (0.39 of the bf16 keys' bytes at K = 128), and with two levels
    ``4 BK^2 / seg`` more (64 at K = 128 and S3's 1024-token segments, 128 with S2's 512); it saves the backward a
    second forward chain, its precompute the Gram matrices and inverses and its maps the ``[BK, BK]`` products."""
    if _use_reference(k):
        return (0,), (0,)
    return (residuals(k, cu_seqlens),), (flag_slots(k, cu_seqlens), k.shape[2])


def precond_scan_fwd(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, form=None, save=False):
    """Forward kernel: ``(k_tilde, d_final)``, and with ``save`` the residuals ``(checkpoints, flags)`` of
    ``saved_shapes`` after them; ``form`` is "parallel" (default) or "tokens"."""
    if _use_reference(k):
        out = reference.precond_scan_fwd(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware)
        return out + (k.new_empty(0, dtype=torch.float32), k.new_empty(0, dtype=torch.int32)) if save else out
    parallel = _pick(form)
    kt, dfin, flags, ckpt = forward_pass(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware,
                                         parallel, keep=save)
    if not save:
        return kt, dfin
    if flags is None:                   # the token form: no chunk is flagged, all run the token loop
        flags = torch.zeros(saved_shapes(k, cu_seqlens)[1], dtype=torch.int32, device=k.device)
    return kt, dfin, ckpt, flags


def precond_fallback_share(k, beta, d0=None, retention=None, cu_seqlens=None, *, eta, d_min, d_max, eps,
                           beta_aware) -> float:
    """Share of (chunk, head) pairs that the parallel form ran token by token (benchmarks; syncs the host).

    1.0 where the parallel form does not apply (reference sizes: float64 keys, K > 256).
    """
    if _use_reference(k):
        return 1.0
    flags = torch.full((flag_slots(k, cu_seqlens), k.shape[2]), -1, dtype=torch.int32, device=k.device)
    forward_pass(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, True, store_kt=False,
                 flags=flags)          # rows of chunks that exist get 0 or 1
    total = (flags >= 0).sum()
    return float((flags == 1).sum() / total.clamp(min=1))


def precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware,
                     form=None, saved=None):
    """Backward kernel: ``(dk, dbeta, dd0, dretention)`` (see the module docstring). ``saved``: the
    ``(checkpoints, flags)`` of a forward of the same form on the same inputs, or None (recomputed)."""
    if _use_reference(k):
        return reference.precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min,
                                          d_max, eps, beta_aware)
    return backward(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware,
                    _pick(form), saved)
