"""The chunk-parallel form of precond_scan (DESIGN §3): a parallel precompute and a short serial step.

Without clamping, a chunk of tokens is affine in the state ``d0`` at its start. Per token ``t`` of the
chunk: ``s_t = k_t^2``, ``n_t = max(|k_t|^2, eps)``, ``b_t = beta_t`` (beta_aware) or 1,
``c_t = eta b_t / n_t`` (beta_aware) or ``eta / n_t``, retention ``r_t``, and the exclusive log
retention ``Gam_t = sum_{i<t} log r_i`` (differences ``Gam_t - Gam_{j+1} <= 0`` only). With
``w_t = c_t (1 - b_t <d_t, s_t>)``::

    d_t = exp(Gam_t) d0 + sum_{j<t} exp(Gam_t - Gam_{j+1}) w_j s_j
    (I + L) w = c - (c b exp(Gam)) * (S d0),   L[t,j] = c_t b_t exp(Gam_t - Gam_{j+1}) <s_t, s_j>  (j < t)

so ``w = w0 - M (S d0)`` with ``w0 = Tinv c``, ``M = Tinv diag(c b exp(Gam))``, ``Tinv = (I + L)^{-1}``.

* ``precompute`` (one program per chunk and head, all in parallel): the Gram matrix, ``L``, ``Tinv``
  (16 x 16 diagonal blocks by forward substitution, then the blocks below, as the asym WY stage),
  and writes ``M`` (``[B*T, H, 64]`` fp32, row t = row t of its chunk's M) and ``w0`` (``[B*T, H]``).
* ``chunk_step`` (inside the serial program of a sequence): ``p = S d0``, ``w = w0 - M p``,
  ``D = exp(Gam) d0 + Lam (w * S)`` (one 64 x 64 by 64 x K product), ``d_end``; the chunk is exact
  when every pre-clamp value ``r_t d_t + w_t s_t`` lies in ``[d_min, d_max]`` (NaN fails); otherwise
  the caller redoes it token by token. A coordinate on a bound whose pre-clamp value points outward
  fails the check too, so a chunk that starts pinned runs the token loop (no pinned-coordinate form).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .asym_chunks import chunk_layout, chunk_span
from .asym_wy import _invert_diagonal, _merge_blocks
from .precond_tokens import scan_tokens, token_coefs

#: the parallel form covers padded key widths up to this (wider: token loop; its [64, K] fp32 tiles
#: would not fit the registers)
MAX_PARALLEL_BK = 128


@triton.jit
def chunk_logs(r_ptr, rows, mrow, h, H, HAS_R: tl.constexpr, C: tl.constexpr):
    """Retention ``r [C]`` (1 on masked rows) and the log cumsums: exclusive ``lg`` (Gam_t) and
    inclusive ``lgi`` (Gam_{t+1}), fp32."""
    if HAS_R:
        r = tl.load(r_ptr + rows * H + h, mask=mrow, other=1.0).to(tl.float32)
        logr = tl.log(r)
        lgi = tl.cumsum(logr, 0)
        lg = lgi - logr
    else:
        r = tl.full([C], 1.0, tl.float32)
        lgi = tl.zeros([C], tl.float32)
        lg = lgi
    return r, lg, lgi


@triton.jit(do_not_specialize=["T", "NT", "H", "K"])
def _precompute_kernel(k_ptr, beta_ptr, r_ptr, cu_ptr, table_ptr, m_ptr, w0_ptr, T, NT, H, K, eta, eps,
                       HAS_R: tl.constexpr, VARLEN: tl.constexpr, BETA_AWARE: tl.constexpr, C: tl.constexpr,
                       BK: tl.constexpr):
    """Grid (chunks, B*H): writes the chunk's ``M`` rows and ``w0`` (the module docstring)."""
    pid_c, pid_bh = tl.program_id(0), tl.program_id(1)
    i_b, h = pid_bh // H, (pid_bh % H).to(tl.int64)
    start, n, _ = chunk_span(pid_c, i_b, cu_ptr, table_ptr, T, NT, C, VARLEN)
    if n <= 0:
        return
    ci = tl.arange(0, C)
    offs = tl.arange(0, BK)
    rows = start + ci
    mrow = ci < n
    kv = tl.load(k_ptr + (rows[:, None] * H + h) * K + offs[None, :], mask=mrow[:, None] & (offs < K)[None, :],
                 other=0.0).to(tl.float32)
    b = tl.load(beta_ptr + rows * H + h, mask=mrow, other=0.0).to(tl.float32)
    s, _, nb, c, bb = token_coefs(kv, b, eta, eps, BETA_AWARE, 1)
    c = tl.where(mrow, c, 0.0)
    r, lg, lgi = chunk_logs(r_ptr, rows, mrow, h, H, HAS_R, C)
    gram = tl.dot(s, tl.trans(s), input_precision="ieee")
    lower = ci[:, None] > ci[None, :]
    L = tl.where(lower, (c * bb)[:, None] * tl.exp(tl.minimum(lg[:, None] - lgi[None, :], 0.0)) * gram, 0.0)
    rc = (rows[:, None] * H + h) * C + ci[None, :]
    tl.store(m_ptr + rc, L, mask=mrow[:, None])
    tl.debug_barrier()
    _invert_diagonal(m_ptr, start, n, h, H, C)
    tl.debug_barrier()
    _merge_blocks(m_ptr, start, n, h, H, C)
    tl.debug_barrier()
    Tinv = tl.load(m_ptr + rc, mask=mrow[:, None], other=0.0)
    w0 = tl.sum(Tinv * c[None, :], 1)
    M = Tinv * (c * bb * tl.exp(lg))[None, :]
    tl.debug_barrier()
    tl.store(m_ptr + rc, M, mask=mrow[:, None])
    tl.store(w0_ptr + rows * H + h, w0, mask=mrow)


def precompute(k: Tensor, beta: Tensor, retention: Optional[Tensor], cu_seqlens: Optional[Tensor], eta: float,
               eps: float, beta_aware: bool) -> tuple[Tensor, Tensor]:
    """``(M [B*T, H, 64] fp32, w0 [B*T, H] fp32)`` of every chunk (chunks restart at sequence starts)."""
    B, T, H, K = k.shape
    M = torch.empty(B * T, H, 64, dtype=torch.float32, device=k.device)
    w0 = torch.empty(B * T, H, dtype=torch.float32, device=k.device)
    lay = chunk_layout(cu_seqlens, B, T)
    if lay.n_chunks * B * H > 0:
        _precompute_kernel[(lay.n_chunks, B * H)](
            k, beta, retention if retention is not None else k, cu_seqlens if cu_seqlens is not None else k,
            lay.table if lay.table is not None else k, M, w0, T, lay.NT, H, K, float(eta), float(eps),
            HAS_R=retention is not None, VARLEN=cu_seqlens is not None, BETA_AWARE=bool(beta_aware), C=64,
            BK=max(16, triton.next_power_of_2(K)), num_warps=4)
    return M, w0


@triton.jit
def chunk_step(d, k_ptr, r_ptr, m_ptr, w0_ptr, t0, t1, h, H, K, d_min, d_max, HAS_R: tl.constexpr,
               C: tl.constexpr, BK: tl.constexpr):
    """Tokens ``[t0, t1)`` (at most C) from ``d`` ([BK] fp32) in the chunk-parallel form.

    Returns ``(D [C, BK] with d_t per row, keys [C, BK] fp32, d_{t1} [BK], ok)``; they hold only when
    ``ok`` (no clamp fired, nothing NaN).
    """
    ci = tl.arange(0, C)
    offs = tl.arange(0, BK)
    rows = t0 + ci
    mrow = rows < t1
    mk = offs < K
    kv = tl.load(k_ptr + (rows[:, None] * H + h) * K + offs[None, :], mask=mrow[:, None] & mk[None, :],
                 other=0.0).to(tl.float32)
    M = tl.load(m_ptr + (rows[:, None] * H + h) * C + ci[None, :], mask=mrow[:, None], other=0.0)
    w0 = tl.load(w0_ptr + rows * H + h, mask=mrow, other=0.0)
    r, lg, lgi = chunk_logs(r_ptr, rows, mrow, h, H, HAS_R, C)
    s = kv * kv
    p = tl.sum(s * d[None, :], 1)
    w = w0 - tl.sum(M * p[None, :], 1)
    ws = w[:, None] * s
    lower = ci[:, None] > ci[None, :]
    lam = tl.where(lower, tl.exp(tl.minimum(lg[:, None] - lgi[None, :], 0.0)), 0.0)
    D = tl.exp(lg)[:, None] * d[None, :] + tl.dot(lam, ws, input_precision="tf32x3")
    P = r[:, None] * D + ws                                      # pre-clamp d_{t+1}
    good = ((P >= d_min) & (P <= d_max)) | ~mk[None, :] | ~mrow[:, None]
    ok = tl.min(good.to(tl.int32)) > 0
    lg_end = tl.sum(tl.where(mrow, lgi - lg, 0.0), 0)             # Gam at the chunk's end
    d_end = tl.exp(lg_end) * d + tl.sum((tl.exp(tl.minimum(lg_end - lgi, 0.0)) * w)[:, None] * s, 0)
    return D, kv, d_end, ok


@triton.jit
def advance(d, k_ptr, beta_ptr, r_ptr, m_ptr, w0_ptr, kt_ptr, traj_ptr, t0, t1, h, H, K, eta, d_min, d_max, eps,
            HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, STORE_KT: tl.constexpr, STORE_TRAJ: tl.constexpr,
            C: tl.constexpr, BK: tl.constexpr):
    """``d`` over tokens ``[t0, t1)`` (at most C): the chunk-parallel form, or the token loop where its
    check fails. ``STORE_KT``: writes ``k_tilde``; ``STORE_TRAJ``: writes ``d_t`` to
    ``traj_ptr + (t - t0) * BK``. Returns ``(d_{t1}, fell_back)`` (1: the token loop ran)."""
    D, kv, d_end, ok = chunk_step(d, k_ptr, r_ptr, m_ptr, w0_ptr, t0, t1, h, H, K, d_min, d_max, HAS_R, C, BK)
    if ok:
        ci = tl.arange(0, C)
        offs = tl.arange(0, BK)
        if STORE_KT:
            m = ((t0 + ci) < t1)[:, None] & (offs < K)[None, :]
            tl.store(kt_ptr + ((t0 + ci)[:, None] * H + h) * K + offs[None, :],
                     (D * kv).to(kt_ptr.dtype.element_ty), mask=m)
        if STORE_TRAJ:
            tl.store(traj_ptr + ci[:, None] * BK + offs[None, :], D)
        d_next = d_end
        fell_back = tl.full([], 0, tl.int32)
    else:
        d_next = scan_tokens(d, k_ptr, beta_ptr, r_ptr, kt_ptr, traj_ptr, traj_ptr, t0, t1, h, H, K, eta, d_min,
                             d_max, eps, HAS_R, BETA_AWARE, STORE_KT, STORE_TRAJ, False, C, BK)
        fell_back = tl.full([], 1, tl.int32)
    return d_next, fell_back


def num_warps(BK: int, parallel: bool) -> int:
    """Warps of the serial programs: few for the token loop (cheap reductions), more for the
    parallel form's [64, BK] tiles."""
    if parallel:
        return 4 if BK <= 64 else 8
    return 2 if BK > 128 else 1
