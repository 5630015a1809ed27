"""Triton precond_scan backward: a reverse-time adjoint scan (DESIGN §3).

Shapes as in ``precond``: ``dk_tilde [B,T,H,K]``, ``dd_final [N,H,K]`` -> ``dk`` (k's dtype),
``dbeta`` (beta's dtype), ``dd0 [N,H,K]`` fp32, ``dretention`` (retention's dtype, or empty [0] fp32).

What is saved and what is recomputed: storing the whole trajectory ``d_t`` would cost a fp32
``[B,T,H,K]`` buffer (twice the bf16 keys) written and read once. The forward keeps instead what its
chain wrote anyway: ``d`` at every 16-token group start (``[4 * slots, H, BK]`` fp32, an eighth of the
bf16 keys' bytes), every token's ``w`` (``[B*T, H]`` fp32, 4 bytes a token and head), every group's
``Tinv^T`` (``[B*T, H, 16]`` fp32, a quarter of the keys' bytes), with two-level chains every segment's map
(``precond_segments``: the adjoint's maps are their transposes) and which chunks ran token by token
(``saved``); the backward rebuilds every ``d_t`` of a group from its checkpoint and ``w`` with a triangular
product (``precond_parallel.group_adjoint``), and its precompute needs no Gram matrix or inverse. Without them
(``saved=None``) the forward runs again (``precond_fwd``, same form, no ``k_tilde``). Then, in the chunk-parallel
form:

1. the precompute of the adjoint terms (``precond_parallel``, parallel over groups; ``Tinv`` and the forward's
   ``M`` and ``w0`` only when the forward runs again);
2. the adjoint chain (``precond_chain._adjoint_kernel``, one program per (sequence, head), chunks
   backwards; in two levels for few long sequences, ``precond_segments``): the gradient at every group
   end and every token's ``sigma``, three short dependent steps per group; a chunk that ran token by token
   in the forward gets its whole adjoint here, token by token (``tokens_adjoint``);
3. the adjoint pass (``_adjoint_out_kernel``, parallel over chunks): every other chunk's token gradients
   from its checkpoints, ``w`` and ``sigma``, group by group (``precond_parallel.group_adjoint``).

The token form runs step 2 with every chunk token by token. The token adjoint is in ``precond_tokens``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .asym_chunks import chunk_layout
from .precond_chain import _adjoint_kernel
from . import precond_fwd
from . import precond_segments as segments
from .precond_fwd import forward_pass
from .precond_parallel import chunk_program, group_adjoint, precompute, precompute_precision
from .precond_tokens import CHUNK, GROUP, block_k, sequences, token_warps


@triton.jit(do_not_specialize=["T", "NT"])
def _adjoint_out_kernel(dkt_ptr, k_ptr, beta_ptr, r_ptr, cu_ptr, table_ptr, w_ptr, sig_ptr, flag_ptr, ckpt_ptr,
                        gck_ptr, dk_ptr, dbeta_ptr, dr_ptr, T, NT, H, K, eta, eps, HAS_R: tl.constexpr,
                        VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, PREC: tl.constexpr, C: tl.constexpr,
                        G: tl.constexpr, BK: tl.constexpr):
    """Grid (chunks, B*H), one program per chunk: the token gradients of its groups (a chunk the forward did not
    flag), a group at a time, from ``d`` at the group's start (``ckpt``), the gradient at its end (``gck``) and the
    tokens' ``w`` and ``sigma``; ``PREC`` the input precision of its in-group sums (``group_adjoint``). A group past
    the chunk's end is all masked.

    The loop is not software-pipelined: H200, bf16, S1 / S2 / S3 (07:28 UTC 2026-12-02), this kernel took 0.138 /
    0.071 / 0.142 ms (twice) against 0.142 / 0.073 / 0.149 with one program per group, and 0.167 / 0.091 / 0.169 and
    0.179 / 0.092 / 0.177 with the next group's loads in flight (2 and 3 stages; 2 warps, outputs bitwise equal).
    At 1 / 4 warps and 2 stages: 0.205 / 0.228 ms on S1."""
    start, n, h, row = chunk_program(tl.program_id(0), tl.program_id(1), cu_ptr, table_ptr, T, NT, H, C, VARLEN)
    if n > 0:
        if tl.load(flag_ptr + row * H + h) == 0:
            for gi in tl.range(0, C // G, num_stages=1):
                r = (((C // G) * row + gi) * H + h) * BK + tl.arange(0, BK)
                group_adjoint(tl.load(gck_ptr + r), tl.load(ckpt_ptr + r), k_ptr, beta_ptr, r_ptr, dkt_ptr, w_ptr,
                              sig_ptr, dk_ptr, dbeta_ptr, dr_ptr, start + gi * G, start + n, h, H, K, eta, eps, HAS_R,
                              BETA_AWARE, PREC, G, BK)


def backward(dk_tilde, dd_final, k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware, parallel,
             saved=None):
    """Launch the backward (see the module docstring); returns ``(dk, dbeta, dd0, dretention)``.

    ``parallel``: the chunk-parallel form (the token loop where its check fails), else the token loop.
    ``saved``: the forward's ``(residuals, flags)`` (``precond.saved_shapes``); None reruns the forward chain.
    """
    B, T, H, K = k.shape
    N = sequences(k, cu_seqlens)
    BK = block_k(K)
    dk = torch.empty_like(k)
    dbeta = torch.empty_like(beta)
    dd0 = torch.empty(N, H, K, dtype=torch.float32, device=k.device)
    dr = torch.empty_like(retention) if retention is not None else torch.empty(0, dtype=torch.float32,
                                                                               device=k.device)
    if N * H == 0:
        return dk, dbeta, dd0, dr
    dk_tilde = dk_tilde.contiguous()
    dummy = k
    opt = dict(r=retention if retention is not None else dummy, cu=cu_seqlens if cu_seqlens is not None else dummy,
               dr=dr if retention is not None else dummy)
    flags_v = dict(HAS_R=retention is not None, VARLEN=cu_seqlens is not None, BETA_AWARE=bool(beta_aware))
    lay = chunk_layout(cu_seqlens, B, T) if parallel else None
    if saved is not None:
        res, flags = saved
        ckpt, w, tt, maps = precond_fwd.residual_views(res, k, cu_seqlens)
    else:
        tt = None
    if parallel:
        M, w0, tt, a, h0, fs = precompute(k, beta, retention, cu_seqlens, eta, eps, beta_aware, dk_tilde, layout=lay,
                                          tinv_t=tt, forward_terms=saved is None)
    else:
        tt = a = h0 = fs = dummy
    if saved is None:
        _, _, flags, res = forward_pass(k, beta, d0, retention, cu_seqlens, eta, d_min, d_max, eps, beta_aware,
                                        parallel, store_kt=False, keep=not parallel,
                                        scratch=(M, w0) if parallel else None, layout=lay)
        ckpt, w, _, maps = precond_fwd.residual_views(res, k, cu_seqlens)
    gck = torch.empty_like(ckpt) if parallel else dummy
    seg = segments.segment_tokens(k, cu_seqlens) if parallel else 0
    if seg:
        segments.segment_adjoint(dk_tilde, dd_final.contiguous(), k, beta, retention, cu_seqlens, tt, a, h0, fs,
                                 flags, dk, dbeta, dr, dd0, ckpt, gck, maps, seg, eta, d_min, d_max, eps, beta_aware,
                                 precond_fwd.chain_warps(BK))
    else:
        traj = torch.empty(N * H, CHUNK, BK, dtype=torch.float32, device=k.device)
        _adjoint_kernel[(N, H)](
            dk_tilde, dd_final.contiguous(), k, beta, opt["r"], opt["cu"], tt, a, h0, fs,
            flags if parallel else dummy, dk, dbeta, opt["dr"], dd0, ckpt, gck, traj,
            T, H, K, float(eta), float(d_min), float(d_max), float(eps), PARALLEL=bool(parallel), C=CHUNK, G=GROUP,
            BK=BK, num_warps=precond_fwd.chain_warps(BK) if parallel else token_warps(BK), **flags_v)
    if parallel:                            # h0 now holds sigma (the adjoint chain wrote it over h0)
        _adjoint_out_kernel[(lay.n_chunks, B * H)](
            dk_tilde, k, beta, opt["r"], opt["cu"], lay.table if lay.table is not None else dummy, w, h0, flags, ckpt,
            gck, dk, dbeta, opt["dr"], T, lay.NT, H, K, float(eta), float(eps), PREC=precompute_precision(k), C=CHUNK,
            G=GROUP, BK=BK, num_warps=precond_fwd.ADJOINT_OUT_WARPS, **flags_v)
    return dk, dbeta, dd0, dr
