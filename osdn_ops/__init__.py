"""osdn-ops: fast, composable ops for Online Scaled DeltaNet linear attention.

Layout ``[B, T, H, D]``; with ``cu_seqlens`` (``[N+1]`` int32/int64 offsets) ``B == 1`` and
every state restarts at each sequence start. States are float32 (float64 for float64 inputs).
Each function validates its arguments (any strides are accepted: non-contiguous inputs are
copied to contiguous ones), then calls the matching ``torch.ops.osdn`` custom op:
CPU tensors run the PyTorch kernels, CUDA tensors the Triton kernels. All of them work under
``torch.compile(fullgraph=True)``; float hyperparameters are graph constants (a new value
recompiles).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import checks, library, memory
from .memory import keep_chunk_states, set_keep_chunk_states

__all__ = ["precond_scan", "chunk_delta_asym", "chunk_gated_delta_asym", "chunk_kda_asym", "osdn",
           "keep_chunk_states", "set_keep_chunk_states"]
__version__ = "0.1.0"


def precond_scan(k: Tensor, beta: Tensor, d0: Optional[Tensor] = None, retention: Optional[Tensor] = None, *,
                 eta: float = 0.003, d_min: float = 0.5, d_max: float = 2.0, eps: float = 1e-6,
                 beta_aware: bool = True, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Online diagonal preconditioner scan (DESIGN §3).

    Args:
        k: keys ``[B, T, H, K]``. beta: write strengths ``[B, T, H]``.
        d0: initial preconditioner ``[N, H, K]`` float32 (default ones).
        retention: APF retention ``r [B, T, H]`` in (0, 1] (default ones).
        eta, d_min, d_max, eps, beta_aware: the update
            ``d <- clamp(r d + c (1 - a) k*k, d_min, d_max)`` with ``a = beta <d, k*k>``,
            ``c = eta beta / max(|k|^2, eps)`` (without ``beta`` when not ``beta_aware``).
        cu_seqlens: ``[N+1]`` offsets of packed sequences (then ``B == 1``).

    Returns:
        ``k_tilde [B, T, H, K]`` (k's dtype; ``k_tilde_t = d_t * k_t`` with d before the update)
        and ``d_final [N, H, K]`` (float32).
    """
    hp = checks.precond_args(k, beta, d0, retention, eta=eta, d_min=d_min, d_max=d_max, eps=eps,
                             beta_aware=beta_aware, cu_seqlens=cu_seqlens)
    k_tilde, d_final, _, _ = library.precond_scan(*checks.contiguous(k, beta, d0, retention, cu_seqlens),
                                                  beta_aware=beta_aware, **hp)
    return k_tilde, d_final


def chunk_delta_asym(q: Tensor, k: Tensor, k_tilde: Tensor, v: Tensor, beta: Tensor, *,
                     scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                     cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Asymmetric-key delta rule: ``u_t = v_t - S k_t; S += beta_t u_t kt_t^T; o_t = scale S q_t``.

    ``q, k, k_tilde [B,T,H,K]`` (one dtype with v), ``v [B,T,H,V]``, ``beta [B,T,H]``,
    ``initial_state [N,H,V,K]`` float32. Returns ``o [B,T,H,V]`` (v's dtype) and the final
    state ``[N,H,V,K]`` float32. ``scale`` defaults to ``K ** -0.5``.
    """
    s = checks.asym_args(q, k, k_tilde, v, None, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, gate="none")
    o, state, *_ = library.chunk_delta_asym(*checks.contiguous(q, k, k_tilde, v, beta, initial_state, cu_seqlens),
                                            scale=s, keep_states=memory.keeping_chunk_states())
    return o, state


def chunk_gated_delta_asym(q: Tensor, k: Tensor, k_tilde: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                           scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                           cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Gated asymmetric delta rule: ``S_bar = exp(g_t) S; u_t = v_t - S_bar k_t; S = S_bar + beta_t u_t kt_t^T``.

    As :func:`chunk_delta_asym`, plus the log-decay ``g [B,T,H]`` (``g <= 0``, float32
    recommended). State ``[N,H,V,K]`` float32.
    """
    s = checks.asym_args(q, k, k_tilde, v, g, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, gate="scalar")
    o, state, *_ = library.chunk_gated_delta_asym(*checks.contiguous(q, k, k_tilde, v, g, beta, initial_state,
                                                                     cu_seqlens),
                                                  scale=s, keep_states=memory.keeping_chunk_states())
    return o, state


def chunk_kda_asym(q: Tensor, k: Tensor, k_tilde: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                   scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                   cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """KDA with asymmetric keys and transposed state ``S: K x V``.

    ``S_bar = Diag(exp(g_t)) S; u_t = v_t - S_bar^T k_t; S = S_bar + beta_t kt_t u_t^T;
    o_t = scale S^T q_t``, with per-channel log-decay ``g [B,T,H,K]`` (``g <= 0``). State
    ``[N,H,K,V]`` float32.
    """
    s = checks.asym_args(q, k, k_tilde, v, g, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, gate="channel")
    o, state, *_ = library.chunk_kda_asym(*checks.contiguous(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens),
                                          scale=s, keep_states=memory.keeping_chunk_states())
    return o, state


def osdn(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor] = None, *,
         scale: Optional[float] = None, initial_state: Optional[Tensor] = None, d0: Optional[Tensor] = None,
         retention: Optional[Tensor] = None, eta: float = 0.003, d_min: float = 0.5, d_max: float = 2.0,
         eps: float = 1e-6, beta_aware: bool = True,
         cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """OSDN attention: :func:`precond_scan`, then the asym op that ``g`` selects.

    ``g`` None: :func:`chunk_delta_asym`; ``g [B,T,H]``: :func:`chunk_gated_delta_asym`;
    ``g [B,T,H,K]``: :func:`chunk_kda_asym`. Returns ``(o, state, d_final)``; ``initial_state``
    and ``state`` use the chosen op's layout, ``d0``/``d_final`` are ``[N,H,K]``.
    """
    k_tilde, d_final = precond_scan(k, beta, d0, retention, eta=eta, d_min=d_min, d_max=d_max, eps=eps,
                                    beta_aware=beta_aware, cu_seqlens=cu_seqlens)
    kw = dict(scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if g is None:
        o, state = chunk_delta_asym(q, k, k_tilde, v, beta, **kw)
    elif g.dim() == 3:
        o, state = chunk_gated_delta_asym(q, k, k_tilde, v, g, beta, **kw)
    elif g.dim() == 4:
        o, state = chunk_kda_asym(q, k, k_tilde, v, g, beta, **kw)
    else:
        raise ValueError(f"g: expected [B, T, H] (gated) or [B, T, H, K] (KDA), got shape {tuple(g.shape)}")
    return o, state, d_final
