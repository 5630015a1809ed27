"""The Triton kernels as plain autograd functions with the public signatures.

``osdn_ops.triton.precond_scan`` and friends validate like the public functions, then call
the Triton forward and backward kernels directly, without the ``osdn::`` custom ops. They run
on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors (how CI tests the kernels).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import checks, memory
from . import kernels


class _PrecondScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, beta, d0, retention, cu_seqlens, hp):
        kt, dfin, ckpt, flags = kernels.precond_scan_fwd(k, beta, d0, retention, cu_seqlens, **hp, save=True)
        ctx.save_for_backward(k, beta, d0, retention, cu_seqlens, ckpt, flags)
        ctx.hp = hp
        return kt, dfin

    @staticmethod
    def backward(ctx, dk_tilde, dd_final):
        k, beta, d0, retention, cu_seqlens, ckpt, flags = ctx.saved_tensors
        dk, dbeta, dd0, dr = kernels.precond_scan_bwd(*checks.contiguous(dk_tilde, dd_final), k, beta, d0, retention,
                                                      cu_seqlens, **ctx.hp, saved=(ckpt, flags))
        return dk, dbeta, (dd0 if d0 is not None else None), (dr if retention is not None else None), None, None


class _ChunkAsym(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate):
        o, final, inverse, states = kernels.chunk_asym_fwd(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens,
                                                           scale, gate, save=True,
                                                           keep_states=memory.keeping_chunk_states())
        ctx.save_for_backward(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, inverse, states)
        ctx.scale, ctx.gate = scale, gate
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, k_tilde, v, g, beta, h0, cu, inverse, states = ctx.saved_tensors
        dq, dk, dkt, dv, dg, dbeta, dh0 = kernels.chunk_asym_bwd(*checks.contiguous(do, dht), q, k, k_tilde, v, g,
                                                                 beta, h0, cu, ctx.scale, ctx.gate, inverse=inverse,
                                                                 states=states)
        return (dq, dk, dkt, dv, (dg if g is not None else None), dbeta, (dh0 if h0 is not None else None),
                None, None, None)


def precond_scan(k: Tensor, beta: Tensor, d0: Optional[Tensor] = None, retention: Optional[Tensor] = None, *,
                 eta: float = 0.003, d_min: float = 0.5, d_max: float = 2.0, eps: float = 1e-6,
                 beta_aware: bool = True, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Triton :func:`osdn_ops.precond_scan` (same arguments and returns)."""
    hp = checks.precond_args(k, beta, d0, retention, eta=eta, d_min=d_min, d_max=d_max, eps=eps,
                             beta_aware=beta_aware, cu_seqlens=cu_seqlens)
    return _PrecondScan.apply(*checks.contiguous(k, beta, d0, retention, cu_seqlens), dict(hp, beta_aware=beta_aware))


def _asym(gate, q, k, k_tilde, v, g, beta, scale, initial_state, cu_seqlens):
    s = checks.asym_args(q, k, k_tilde, v, g, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, gate=gate)
    return _ChunkAsym.apply(*checks.contiguous(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens), s, gate)


def chunk_delta_asym(q, k, k_tilde, v, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Triton :func:`osdn_ops.chunk_delta_asym` (same arguments and returns)."""
    return _asym("none", q, k, k_tilde, v, None, beta, scale, initial_state, cu_seqlens)


def chunk_gated_delta_asym(q, k, k_tilde, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Triton :func:`osdn_ops.chunk_gated_delta_asym` (same arguments and returns)."""
    return _asym("scalar", q, k, k_tilde, v, g, beta, scale, initial_state, cu_seqlens)


def chunk_kda_asym(q, k, k_tilde, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Triton :func:`osdn_ops.chunk_kda_asym` (same arguments and returns)."""
    return _asym("channel", q, k, k_tilde, v, g, beta, scale, initial_state, cu_seqlens)
