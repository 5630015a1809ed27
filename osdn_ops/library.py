"""The ``osdn::`` custom ops: schemas, fake impls, autograd and device dispatch.

Every op's default kernel is the PyTorch implementation in ``osdn_ops.reference`` (the CPU
kernel); its CUDA kernel comes from ``osdn_ops.triton`` when Triton is importable, else the
reference. Each forward op's backward is itself a custom op (``*_backward``) with a fake impl,
so AOTAutograd traces through both without a graph break.

Tensors that may take a gradient (``initial_state`` and ``d0`` included) are positional in the
op schemas, because autograd only differentiates positional arguments; the public functions
in ``osdn_ops`` keep them keyword-only. Float hyperparameters are keyword-only plain floats:
under ``torch.compile`` each distinct value is a constant of the graph, so a new value
recompiles.

Op schemas (``gate`` names the variant: "none" delta, "scalar" gated, "channel" KDA)::

    precond_scan(k, beta, d0?, retention?, cu_seqlens?, *, eta, d_min, d_max, eps, beta_aware)
        -> (k_tilde [B,T,H,K], d_final [N,H,K], checkpoints, flags)
    precond_scan_backward(dk_tilde, dd_final, k, beta, d0?, retention?, cu_seqlens?, checkpoints?, flags?, *, ...)
        -> (dk, dbeta, dd0 [N,H,K], dretention (retention's shape, or [0]))

``checkpoints`` (fp32: ``d`` at every 16-token group start, every token's ``w`` and every group's ``Tinv^T``, one
flat buffer) and ``flags`` (int32) are what the Triton forward keeps for its backward
(``osdn_ops.triton.precond.saved_shapes``); the reference kernels return them empty (``[0]``) and
ignore them. ``osdn_ops.precond_scan`` returns only ``(k_tilde, d_final)``.
    chunk_delta_asym(q, k, k_tilde, v, beta, initial_state?, cu_seqlens?, *, scale, keep_states=False)
    chunk_gated_delta_asym(q, k, k_tilde, v, g, beta, initial_state?, cu_seqlens?, *, scale, keep_states=False)
    chunk_kda_asym(q, k, k_tilde, v, g, beta, initial_state?, cu_seqlens?, *, scale, keep_states=False)
        -> (o [B,T,H,V], final_state [N,H,V,K] or [N,H,K,V] for KDA, inverse, states)
    chunk_asym_backward(do, dht, q, k, k_tilde, v, g?, beta, initial_state?, cu_seqlens?, inverse?, states?, *,
                        scale, gate)
        -> (dq, dk, dk_tilde, dv, dg (g's shape, or [0]), dbeta, dh0 (the state's shape))

``inverse`` is the WY inverse the Triton forward keeps for its backward (fp32 ``[B,T,H,64]``,
``osdn_ops.triton.asym.saved_shape``) and ``states`` (with ``keep_states``, ``osdn_ops.memory``) its ``W``,
``v_new`` and chunk-start states in one flat buffer in the inputs' dtype (``osdn_ops.triton.asym_kept``); the
reference kernels return both empty and ignore them. The public functions return only ``(o, final_state)``.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from torch import Tensor

from . import reference
from .checks import state_dtype

Opt = Optional[Tensor]


def _num_seqs(B, cu_seqlens: Opt):
    return B if cu_seqlens is None else cu_seqlens.shape[0] - 1


# ---------------------------------------------------------------- precond_scan

def _no_saved(k):
    return k.new_empty(0, dtype=torch.float32), k.new_empty(0, dtype=torch.int32)


def _triton_path(k) -> bool:
    return k.device.type == "cuda" and importlib.util.find_spec("triton") is not None


@torch.library.custom_op("osdn::precond_scan", mutates_args=())
def precond_scan(k: Tensor, beta: Tensor, d0: Opt, retention: Opt, cu_seqlens: Opt, *, eta: float,
                 d_min: float, d_max: float, eps: float,
                 beta_aware: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    kt, dfin = reference.precond_scan_fwd(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware)
    return (kt, dfin) + _no_saved(k)


@precond_scan.register_kernel("cuda")
def _(k, beta, d0, retention, cu_seqlens, *, eta, d_min, d_max, eps, beta_aware):
    if not _triton_path(k):
        kt, dfin = reference.precond_scan_fwd(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware)
        return (kt, dfin) + _no_saved(k)
    from .triton import kernels

    return kernels.precond_scan_fwd(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware,
                                    save=True)


@precond_scan.register_fake
def _(k, beta, d0, retention, cu_seqlens, *, eta, d_min, d_max, eps, beta_aware):
    B, T, H, K = k.shape
    kt, dfin = torch.empty_like(k), k.new_empty((_num_seqs(B, cu_seqlens), H, K), dtype=state_dtype(k))
    if not _triton_path(k):
        return (kt, dfin) + _no_saved(k)
    from .triton.precond import saved_shapes

    ck, fl = saved_shapes(k, cu_seqlens)
    return kt, dfin, k.new_empty(ck, dtype=torch.float32), k.new_empty(fl, dtype=torch.int32)


@torch.library.custom_op("osdn::precond_scan_backward", mutates_args=())
def precond_scan_backward(dk_tilde: Tensor, dd_final: Tensor, k: Tensor, beta: Tensor, d0: Opt, retention: Opt,
                          cu_seqlens: Opt, checkpoints: Opt, flags: Opt, *, eta: float, d_min: float, d_max: float,
                          eps: float, beta_aware: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return reference.precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens,
                                      eta, d_min, d_max, eps, beta_aware)


@precond_scan_backward.register_kernel("cuda")
def _(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, checkpoints, flags, *, eta, d_min, d_max, eps,
      beta_aware):
    if not _triton_path(k):
        return reference.precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max,
                                          eps, beta_aware)
    from .triton import kernels

    saved = None if checkpoints is None or flags is None or checkpoints.numel() == 0 else (checkpoints, flags)
    return kernels.precond_scan_bwd(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps,
                                    beta_aware, saved=saved)


@precond_scan_backward.register_fake
def _(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, checkpoints, flags, *, eta, d_min, d_max, eps,
      beta_aware):
    B, T, H, K = k.shape
    dd0 = k.new_empty((_num_seqs(B, cu_seqlens), H, K), dtype=state_dtype(k))
    dr = torch.empty_like(retention) if retention is not None else k.new_empty(0, dtype=state_dtype(k))
    return torch.empty_like(k), torch.empty_like(beta), dd0, dr


def _grad_or_zeros(grad: Opt, shape, dtype, like: Tensor) -> Tensor:
    """An output's incoming gradient, contiguous (the kernels index dense tensors, and the gradient of a sum
    is a broadcast view), or zeros for an output that took none. The ops' autograd does not materialize
    missing gradients, so the residual outputs (checkpoints, the WY inverse) never get a zero-filled one."""
    return like.new_zeros(shape, dtype=dtype) if grad is None else grad.contiguous()


def _precond_setup(ctx, inputs, keyword_only_inputs, output):
    k, beta, d0, retention, cu_seqlens = inputs
    ctx.save_for_backward(k, beta, d0, retention, cu_seqlens, output[2], output[3])
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.set_materialize_grads(False)
    ctx.hp = keyword_only_inputs


def _precond_backward(ctx, dk_tilde, dd_final, _dcheckpoints, _dflags):
    k, beta, d0, retention, cu_seqlens, ckpt, flags = ctx.saved_tensors
    B, T, H, K = k.shape
    dk_tilde = _grad_or_zeros(dk_tilde, k.shape, k.dtype, k)
    dd_final = _grad_or_zeros(dd_final, (_num_seqs(B, cu_seqlens), H, K), state_dtype(k), k)
    dk, dbeta, dd0, dr = precond_scan_backward(dk_tilde, dd_final, k, beta, d0, retention,
                                               cu_seqlens, ckpt, flags, **ctx.hp)
    return dk, dbeta, (dd0 if d0 is not None else None), (dr if retention is not None else None), None


torch.library.register_autograd("osdn::precond_scan", _precond_backward, setup_context=_precond_setup)


# ---------------------------------------------------------------- asymmetric delta ops

@torch.library.custom_op("osdn::chunk_asym_backward", mutates_args=())
def chunk_asym_backward(do: Tensor, dht: Tensor, q: Tensor, k: Tensor, k_tilde: Tensor, v: Tensor, g: Opt,
                        beta: Tensor, initial_state: Opt, cu_seqlens: Opt, inverse: Opt, states: Opt, *,
                        scale: float, gate: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return reference.chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate)


@chunk_asym_backward.register_kernel("cuda")
def _(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, inverse, states, *, scale, gate):
    if not _triton_path(q):
        return reference.chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate)
    from .triton import kernels

    return kernels.chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate,
                                  inverse=inverse, states=states)


@chunk_asym_backward.register_fake
def _(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, inverse, states, *, scale, gate):
    dg = torch.empty_like(g) if g is not None else v.new_empty(0, dtype=state_dtype(v))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(k_tilde), torch.empty_like(v), dg,
            torch.empty_like(beta), torch.empty_like(dht))


def _asym_fake(q, v, cu_seqlens, gate, keep_states):
    B, T, H, K = q.shape
    shape = reference.state_shape(gate, _num_seqs(B, cu_seqlens), H, K, v.shape[-1])
    inverse, states = (0,), (0,)
    if _triton_path(q):
        from .triton.asym import kept_states_shape, saved_shape

        inverse = saved_shape(q, v)
        states = kept_states_shape(q, v, cu_seqlens) if keep_states and inverse != (0,) else (0,)
    return (torch.empty_like(v), v.new_empty(shape, dtype=state_dtype(v)), q.new_empty(inverse, dtype=torch.float32),
            q.new_empty(states))


def _asym_fwd(device: str, gate: str, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, keep_states):
    args = (q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate)
    if device == "cuda" and _triton_path(q):
        from .triton import kernels

        return kernels.chunk_asym_fwd(*args, save=True, keep_states=keep_states)
    return reference.chunk_asym_fwd(*args) + (q.new_empty(0, dtype=torch.float32), q.new_empty(0))


def _register_asym_autograd(op, gate: str) -> None:
    """Autograd for an asym op; ``g`` is an input of the op unless ``gate == "none"``."""

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        if gate == "none":
            q, k, k_tilde, v, beta, h0, cu = inputs
            g = None
        else:
            q, k, k_tilde, v, g, beta, h0, cu = inputs
        ctx.save_for_backward(q, k, k_tilde, v, g, beta, h0, cu, output[2], output[3])
        ctx.mark_non_differentiable(output[2], output[3])
        ctx.set_materialize_grads(False)
        ctx.scale = keyword_only_inputs["scale"]

    def backward(ctx, do, dht, _dinverse, _dstates):
        q, k, k_tilde, v, g, beta, h0, cu, inverse, states = ctx.saved_tensors
        B, T, H, K = q.shape
        V = v.shape[-1]
        do = _grad_or_zeros(do, (B, T, H, V), v.dtype, v)
        dht = _grad_or_zeros(dht, reference.state_shape(gate, _num_seqs(B, cu), H, K, V), state_dtype(v), v)
        dq, dk, dkt, dv, dg, dbeta, dh0 = chunk_asym_backward(do, dht, q, k, k_tilde, v, g, beta, h0, cu, inverse,
                                                              states, scale=ctx.scale, gate=gate)
        dh0 = dh0 if h0 is not None else None
        if gate == "none":
            return dq, dk, dkt, dv, dbeta, dh0, None
        return dq, dk, dkt, dv, dg, dbeta, dh0, None

    torch.library.register_autograd(op, backward, setup_context=setup_context)


@torch.library.custom_op("osdn::chunk_delta_asym", mutates_args=())
def chunk_delta_asym(q: Tensor, k: Tensor, k_tilde: Tensor, v: Tensor, beta: Tensor, initial_state: Opt,
                     cu_seqlens: Opt, *, scale: float, keep_states: bool = False
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _asym_fwd("cpu", "none", q, k, k_tilde, v, None, beta, initial_state, cu_seqlens, scale, keep_states)


@chunk_delta_asym.register_kernel("cuda")
def _(q, k, k_tilde, v, beta, initial_state, cu_seqlens, *, scale, keep_states=False):
    return _asym_fwd("cuda", "none", q, k, k_tilde, v, None, beta, initial_state, cu_seqlens, scale, keep_states)


@chunk_delta_asym.register_fake
def _(q, k, k_tilde, v, beta, initial_state, cu_seqlens, *, scale, keep_states=False):
    return _asym_fake(q, v, cu_seqlens, "none", keep_states)


@torch.library.custom_op("osdn::chunk_gated_delta_asym", mutates_args=())
def chunk_gated_delta_asym(q: Tensor, k: Tensor, k_tilde: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Opt, cu_seqlens: Opt, *, scale: float, keep_states: bool = False
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _asym_fwd("cpu", "scalar", q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, keep_states)


@chunk_gated_delta_asym.register_kernel("cuda")
def _(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, *, scale, keep_states=False):
    return _asym_fwd("cuda", "scalar", q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, keep_states)


@chunk_gated_delta_asym.register_fake
def _(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, *, scale, keep_states=False):
    return _asym_fake(q, v, cu_seqlens, "scalar", keep_states)


@torch.library.custom_op("osdn::chunk_kda_asym", mutates_args=())
def chunk_kda_asym(q: Tensor, k: Tensor, k_tilde: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   initial_state: Opt, cu_seqlens: Opt, *, scale: float, keep_states: bool = False
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _asym_fwd("cpu", "channel", q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, keep_states)


@chunk_kda_asym.register_kernel("cuda")
def _(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, *, scale, keep_states=False):
    return _asym_fwd("cuda", "channel", q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, keep_states)


@chunk_kda_asym.register_fake
def _(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, *, scale, keep_states=False):
    return _asym_fake(q, v, cu_seqlens, "channel", keep_states)


_register_asym_autograd(chunk_delta_asym, "none")
_register_asym_autograd(chunk_gated_delta_asym, "scalar")
_register_asym_autograd(chunk_kda_asym, "channel")

ASYM_OPS = {"none": chunk_delta_asym, "scalar": chunk_gated_delta_asym, "channel": chunk_kda_asym}
