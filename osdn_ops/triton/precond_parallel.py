"""The chunk-parallel form of precond_scan (DESIGN §3): the parallel precompute and the group math.

Without clamping, a run of tokens is affine in the state ``d0`` at its start. A 64-token chunk is
four groups of ``GROUP = 16`` tokens; the serial chain (``precond_chain``) advances ``d`` one group
per step.
Per token ``t`` of a group: ``s_t = k_t^2``, ``n_t = max(|k_t|^2, eps)``, ``b_t = beta_t`` (beta_aware)
or 1, ``c_t = eta b_t / n_t`` (beta_aware) or ``eta / n_t``, retention ``r_t``, and the group's
exclusive log retention ``Gam_t = sum_{i<t} log r_i`` (only differences ``Gam_t - Gam_{j+1} <= 0``
are exponentiated). With ``w_t = c_t (1 - b_t <d_t, s_t>)``::

    d_t = exp(Gam_t) d0 + sum_{j<t} exp(Gam_t - Gam_{j+1}) w_j s_j
    (I + L) w = c - (c b exp(Gam)) * (S d0),   L[t,j] = c_t b_t exp(Gam_t - Gam_{j+1}) <s_t, s_j>  (j < t)

so ``w = w0 - M (S d0)`` with ``w0 = Tinv c``, ``M = Tinv diag(c b exp(Gam))``, ``Tinv = (I + L)^{-1}``.

* ``precompute`` (one program per group and head, all in parallel): the Gram matrix, ``L``, ``Tinv``
  (a product of four factors, L being nilpotent), and writes ``M`` (``[B*T, H, 16]`` fp32, row t =
  row t of its group's M) and ``w0`` (``[B*T, H]``): 68 bytes per token and head (and ``Tinv^T``, 64 more, where
  the backward needs it).
* one group from ``d0`` is ``p = S d0`` (16 independent K-reductions at once), ``w = w0 - M p`` and
  ``d_end = exp(Gam_end) d0 + sum_j exp(Gam_end - Gam_{j+1}) w_j s_j``: three short dependent steps
  for 16 tokens, where the token loop makes 16 dependent K-reductions. The chain keeps every ``w``;
  given ``w``, the output pass forms every ``d_t`` of the group (``k_tilde``) and the pre-clamp values a row at a
  time (``group_outputs``).
* the chunk is exact when every pre-clamp value ``r_t d_t + w_t s_t`` of its four groups lies in
  ``[d_min, d_max]`` (NaN fails); the output pass flags the chunks where one does not, and the fixup
  (``precond_fwd``) reruns each sequence token by token from its first flagged chunk. A coordinate on a bound
  whose pre-clamp value points outward fails the check too, so a chunk that starts pinned is flagged (no
  pinned-coordinate form).

The adjoint of a group whose chunk passed the check is affine too. With ``g_e`` the gradient of the
state at the group's end, ``f_t = dk_tilde_t * k_t`` and ``sigma_t = <g_{t+1}, s_t>``::

    g_t = r_t g_{t+1} - c_t b_t sigma_t s_t + f_t
    (I + L^T) sigma = exp(Gam_end - Gam_{t+1}) * (S g_e) + Phi,
    Phi_t = sum_{j>t} exp(Gam_j - Gam_{t+1}) <s_t, f_j>

so ``sigma = v + h0`` with ``v = Tinv^T (e * (S g_e))``, ``e_t = exp(Gam_end - Gam_{t+1})``, ``h0 = Tinv^T Phi``,
and ``g_start = exp(Gam_end) g_e + sum_j exp(Gam_j) Y_j`` with ``Y_j = f_j - c_j b_j sigma_j s_j``. With
``a_t = c_t b_t exp(Gam_t)`` that is ``g_start = exp(Gam_end) g_e + fsum - S^T (a * v)``, where
``fsum = sum_j exp(Gam_j) f_j - sum_j a_j h0_j s_j`` does not depend on ``g_e``. ``Tinv`` does not depend on
the gradients either: the forward's precompute keeps ``Tinv^T`` for the backward (``STORE_TT``), whose
precompute then only forms ``a``, ``h0`` and ``fsum`` (no Gram matrix, no inverse); the chain's step is three
short dependent reductions, and off its serial path the chain also forms ``sigma`` and keeps it. Without
retention ``Phi_t = <s_t, sum_{j>t} f_j>``, suffix sums a row at a time (exact fp32, no product). ``group_adjoint``
forms every ``d_t`` and ``g_{t+1}`` of the group from ``w`` and ``sigma`` (two triangular products) and the token
gradients.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .asym_chunks import ChunkLayout, chunk_layout, chunk_span
from .precond_tokens import (CHUNK, GROUP, block_k, chunk_slot, decay_logs, flag_slots, load_row,
                             token_coefs)
from .triangular import unit_lower_inverse


@triton.jit
def group_logs(r_ptr, rows, mrow, h, H, HAS_R: tl.constexpr, G: tl.constexpr):
    """Retention ``r [G]`` (1 on masked rows) and the log cumsums: exclusive ``lg`` (Gam_t) and
    inclusive ``lgi`` (Gam_{t+1}), fp32."""
    if HAS_R:
        r = tl.load(r_ptr + rows * H + h, mask=mrow, other=1.0).to(tl.float32)
    else:
        r = tl.full([G], 1.0, tl.float32)
    lg, lgi = decay_logs(r, HAS_R, G)
    return r, lg, lgi


@triton.jit
def chunk_program(pid_c, pid_bh, cu_ptr, table_ptr, T, NT, H, C: tl.constexpr, VARLEN: tl.constexpr):
    """Chunk ``pid_c`` of the chunk grid (``asym_chunks.chunk_span``) for column ``pid_bh`` (of B*H): ``(first
    token of the chunk (int64), its length (<= 0: no chunk), head (int64), the chunk's scratch row
    (``chunk_slot``))``."""
    i_b = pid_bh // H
    start, n, _ = chunk_span(pid_c, i_b, cu_ptr, table_ptr, T, NT, C, VARLEN)
    row = chunk_slot(pid_c, i_b, start, cu_ptr, table_ptr, T, C, VARLEN)
    return start, n, (pid_bh % H).to(tl.int64), row


@triton.jit
def group_program(cu_ptr, table_ptr, T, NT, H, C: tl.constexpr, G: tl.constexpr, VARLEN: tl.constexpr):
    """A program of a grid ``(chunks * C/G, B*H)``, one per group: ``(first token of its chunk (int64),
    chunk length (<= 0: no chunk), group index in the chunk, head (int64), the chunk's scratch row)``
    (``chunk_program``)."""
    pid_g = tl.program_id(0)
    start, n, h, row = chunk_program(pid_g // (C // G), tl.program_id(1), cu_ptr, table_ptr, T, NT, H, C, VARLEN)
    return start, n, pid_g % (C // G), h, row


@triton.jit
def load_keys(k_ptr, rows, mrow, h, H, K, BK: tl.constexpr):
    """Keys ``[G, BK]`` of token rows ``rows`` (int64), fp32, zeros where masked."""
    offs = tl.arange(0, BK)
    return tl.load(k_ptr + (rows[:, None] * H + h) * K + offs[None, :], mask=mrow[:, None] & (offs < K)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def suffix_products(k_ptr, dkt_ptr, t0, t1, h, H, K, G: tl.constexpr, BK: tl.constexpr):
    """``phi_t = <s_t, sum_{j>t} f_j>`` (``s = k^2``, ``f = dk_tilde * k``) of tokens ``[t0, min(t0 + G, t1))`` as
    ``[G]`` fp32 (zeros past the end), a row at a time from the last: the suffix sum is one ``[BK]`` add per row and
    each row one K-reduction. Triton's reverse cumulative sum over the 16 rows of a one-warp ``[16, BK]`` tile
    compiled to 760 more shuffles (sm_90, bf16, BK 128: 850 in the kernel instead of 138) and 255 registers
    instead of 188; the rows are read again here, from L1."""
    offs = tl.arange(0, BK)
    ci = tl.arange(0, G)
    acc = tl.zeros([BK], tl.float32)
    phi = tl.zeros([G], tl.float32)
    for i in tl.static_range(G - 1, -1, -1):
        t = t0 + i
        m = (offs < K) & (t < t1)
        kv = load_row(k_ptr, t, h, H, K, offs, m)
        phi = tl.where(ci == i, tl.sum(kv * kv * acc, 0), phi)
        acc += load_row(dkt_ptr, t, h, H, K, offs, m) * kv
    return phi


#: warps of the precompute (one program per group) without / with the adjoint terms;
#: benchmarks/bench_precond.py times the choices.
PRECOMPUTE_WARPS = {False: 1, True: 1}


def precompute_precision(k: Tensor) -> str:
    """Input precision of the precompute's Gram matrix and inverse (and of ``precond_segments``' maps): one tf32
    pass for 16-bit keys, three (~fp32) for fp32 keys. Both only shape the small terms ``c_t b_t <s_t, s_j>``
    (c is eta / |k|^2), so a tf32 rounding of them moves ``d`` far below bf16's resolution. With bf16 keys on
    S1 the single pass (then also for the adjoint's ``<s_t, f_j>``, now always three) moved ``k_tilde``,
    ``d_final`` and the gradients by at most 3.6e-4 relative and cut the forward precompute from 0.126 to
    0.066 ms and the backward's from 0.410 to 0.155 ms (H200). The adjoint pass's in-group sums
    (``group_adjoint``) take the same precision: a single pass moved its gradients by at most 4.3e-5 relative
    (S1-S3)."""
    return "tf32" if k.element_size() == 2 else "tf32x3"


@triton.jit(do_not_specialize=["T", "NT"])
def _precompute_kernel(k_ptr, beta_ptr, r_ptr, dkt_ptr, cu_ptr, table_ptr, m_ptr, w0_ptr, tt_ptr, a_ptr, h0_ptr,
                       fs_ptr, T, NT, H, K, eta, eps, HAS_R: tl.constexpr, VARLEN: tl.constexpr,
                       BETA_AWARE: tl.constexpr, FWD: tl.constexpr, STORE_TT: tl.constexpr, ADJOINT: tl.constexpr,
                       C: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """Grid (chunks * C/G, B*H), one program per group. ``FWD``: forms ``Tinv`` and writes the group's ``M`` rows
    and ``w0`` (with ``STORE_TT`` also ``Tinv^T``'s rows to ``tt``). ``ADJOINT`` (reads ``Tinv^T`` from ``tt``;
    with ``FWD`` only together with ``STORE_TT``): writes ``a``, ``h0`` and ``fsum`` (``[BK]`` fp32 at row
    ``(C/G * chunk_slot + group) * H + h`` of ``fs``; the module docstring)."""
    start, n, gi, h, row = group_program(cu_ptr, table_ptr, T, NT, H, C, G, VARLEN)
    ci = tl.arange(0, G)
    rows = start + gi * G + ci
    mrow = (gi * G + ci) < n
    b = tl.load(beta_ptr + rows * H + h, mask=mrow, other=0.0).to(tl.float32)
    r, lg, lgi = group_logs(r_ptr, rows, mrow, h, H, HAS_R, G)
    rg = (rows[:, None] * H + h) * G + ci[None, :]
    # the keys after beta and the retention logs: S1's forward precompute 0.048 -> 0.045 ms (H200, bf16)
    kv = load_keys(k_ptr, rows, mrow, h, H, K, BK)
    s, n2, nb, c, bb = token_coefs(kv, b, eta, eps, BETA_AWARE, 1)
    c = tl.where(mrow, c, 0.0)
    if FWD:
        gram = tl.dot(s, tl.trans(s), input_precision=PREC)
        L = tl.where(ci[:, None] > ci[None, :],
                     (c * bb)[:, None] * tl.exp(tl.minimum(lg[:, None] - lgi[None, :], 0.0)) * gram, 0.0)
        Tinv = unit_lower_inverse(L, G, LOG2G, PREC)
        tl.store(m_ptr + rg, Tinv * (c * bb * tl.exp(lg))[None, :], mask=mrow[:, None])
        tl.store(w0_ptr + rows * H + h, tl.sum(Tinv * c[None, :], 1), mask=mrow)
        if STORE_TT:
            tl.store(tt_ptr + rg, tl.trans(Tinv), mask=mrow[:, None])
    if ADJOINT:     # Tinv^T read back also where it was just formed: the same sums as from saved residuals
        tl.debug_barrier()
        TT = tl.load(tt_ptr + rg, mask=mrow[:, None], other=0.0)
        f = load_keys(dkt_ptr, rows, mrow, h, H, K, BK) * kv
        # phi feeds sigma, and dbeta is proportional to sigma: kept at ~fp32
        if HAS_R:       # F[t, j] = <s_t, f_j>, weighted
            F = tl.dot(s, tl.trans(f), input_precision="tf32x3")
            up = tl.exp(tl.minimum(lg[None, :] - lgi[:, None], 0.0))
            phi = tl.sum(tl.where(ci[:, None] < ci[None, :], up * F, 0.0), 1)
        else:           # phi_t = <s_t, sum_{j>t} f_j>: exact fp32 suffix sums, no product
            phi = suffix_products(k_ptr, dkt_ptr, start + gi * G, start + n, h, H, K, G, BK)
        a = c * bb * tl.exp(lg)
        tl.store(a_ptr + rows * H + h, a, mask=mrow)
        h0 = tl.sum(TT * phi[None, :], 1)
        tl.store(h0_ptr + rows * H + h, h0, mask=mrow)
        offs = tl.arange(0, BK)
        tl.store(fs_ptr + (((C // G) * row + gi) * H + h) * BK + offs,
                 tl.sum(tl.exp(lg)[:, None] * f - (a * h0)[:, None] * s, 0), mask=gi * G < n)


def precompute(k: Tensor, beta: Tensor, retention: Optional[Tensor], cu_seqlens: Optional[Tensor], eta: float,
               eps: float, beta_aware: bool, dk_tilde: Optional[Tensor] = None,
               layout: Optional[ChunkLayout] = None, tinv_t: Optional[Tensor] = None,
               forward_terms: bool = True) -> tuple[Tensor, ...]:
    """``(M [B*T, H, GROUP] fp32, w0 [B*T, H] fp32)`` of every group (groups restart at chunk starts).

    ``tinv_t`` (``[B*T, H, GROUP]`` fp32): with the forward terms, ``Tinv^T``'s rows are written there; without
    (``forward_terms=False``, only with ``dk_tilde``), they are read from it and ``M``, ``w0`` come back as None.
    With ``dk_tilde`` the result is ``(M, w0, Tinv^T, a [B*T, H], h0 [B*T, H], fsum [4 * flag_slots, H, BK])``
    (``Tinv^T`` in a new buffer where none is given).
    """
    B, T, H, K = k.shape
    BK = block_k(K)
    f32 = dict(dtype=torch.float32, device=k.device)
    adjoint = dk_tilde is not None
    assert forward_terms or (adjoint and tinv_t is not None)
    if forward_terms:
        M, w0 = torch.empty(B * T, H, GROUP, **f32), torch.empty(B * T, H, **f32)
        if adjoint and tinv_t is None:
            tinv_t = torch.empty(B * T, H, GROUP, **f32)
    else:
        M = w0 = k
    if adjoint:
        a, h0 = torch.empty(B * T, H, **f32), torch.empty(B * T, H, **f32)
        fs = torch.empty(flag_slots(k, cu_seqlens) * (CHUNK // GROUP), H, BK, **f32)
    else:
        a = h0 = fs = k
    lay = layout or chunk_layout(cu_seqlens, B, T)
    if lay.n_chunks * B * H > 0:
        _precompute_kernel[(lay.n_chunks * (CHUNK // GROUP), B * H)](
            k, beta, retention if retention is not None else k, dk_tilde if adjoint else k,
            cu_seqlens if cu_seqlens is not None else k, lay.table if lay.table is not None else k, M, w0,
            tinv_t if tinv_t is not None else k, a, h0, fs, T, lay.NT, H, K, float(eta), float(eps),
            HAS_R=retention is not None, VARLEN=cu_seqlens is not None, BETA_AWARE=bool(beta_aware),
            FWD=forward_terms, STORE_TT=forward_terms and tinv_t is not None, ADJOINT=adjoint, C=CHUNK, G=GROUP,
            LOG2G=GROUP.bit_length() - 1, BK=BK, PREC=precompute_precision(k), num_warps=PRECOMPUTE_WARPS[adjoint])
    if not forward_terms:
        M = w0 = None
    return (M, w0, tinv_t, a, h0, fs) if adjoint else (M, w0)


@triton.jit
def group_states(d, kv, w, lg, lgi, PREC: tl.constexpr, G: tl.constexpr):
    """Every ``d_t`` of a group in the parallel form (``[G, BK]``, row t), from ``d`` ([BK] fp32) at its start
    and its ``w`` ([G], zeros on masked rows); ``kv`` the keys [G, BK] fp32, ``lg, lgi`` from ``group_logs``. The
    in-group sums are a triangular product (``tl.dot``, input precision ``PREC``)."""
    ci = tl.arange(0, G)
    lam = tl.where(ci[:, None] > ci[None, :], tl.exp(tl.minimum(lg[:, None] - lgi[None, :], 0.0)), 0.0)
    return tl.exp(lg)[:, None] * d[None, :] + tl.dot(lam, w[:, None] * (kv * kv), input_precision=PREC)


@triton.jit
def group_outputs(d, k_ptr, r_ptr, w_ptr, kt_ptr, t0, t1, h, H, K, d_min, d_max, HAS_R: tl.constexpr,
                  STORE_KT: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """``k_tilde`` of tokens ``[t0, min(t0 + G, t1))`` (``STORE_KT``) from ``d`` at the group's start and the
    chain's ``w``, a row at a time (``d_{t+1} = r_t d_t + w_t s_t``: elementwise, no reduction and no sum over the
    group's rows); returns ``bad`` ([BK] int32): 1 where a pre-clamp value lies outside the box or is NaN."""
    offs = tl.arange(0, BK)
    bad = tl.zeros([BK], tl.int32)
    for i in tl.static_range(G):
        t = t0 + i
        m = (offs < K) & (t < t1)
        kv = load_row(k_ptr, t, h, H, K, offs, m)
        w = tl.load(w_ptr + t * H + h, mask=t < t1, other=0.0)
        if STORE_KT:
            tl.store(kt_ptr + (t * H + h) * K + offs, (d * kv).to(kt_ptr.dtype.element_ty), mask=m)
        if HAS_R:
            d = tl.load(r_ptr + t * H + h, mask=t < t1, other=1.0).to(tl.float32) * d + w * kv * kv
        else:
            d = d + w * kv * kv
        bad = bad | tl.where(((d >= d_min) & (d <= d_max)) | ~m, 0, 1)
    return bad


@triton.jit
def group_adjoint(g, d, k_ptr, beta_ptr, r_ptr, dkt_ptr, w_ptr, sig_ptr, dk_ptr, dbeta_ptr, dr_ptr, t0, t1, h, H,
                  K, eta, eps, HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, PREC: tl.constexpr, G: tl.constexpr,
                  BK: tl.constexpr):
    """Adjoint of tokens ``[t0, min(t0 + G, t1))`` of a chunk that passed the forward's check: ``g`` [BK]
    is the gradient of ``d`` at the group's end, ``d`` the state at its start, ``w`` (the forward chain's) and
    ``sigma`` (the adjoint chain's) per token at ``w_ptr``, ``sig_ptr`` (rows as the keys'). Writes ``dk``,
    ``dbeta`` (and ``dretention`` with ``HAS_R``) of the group's tokens.

    The in-group sums ``d_t`` and ``g_{t+1}`` are triangular products at input precision ``PREC``
    (``precompute_precision``), with or without retention: Triton's cumulative sum over the 16 rows of a tile costs
    hundreds of shuffles. H200, bf16, S1 / S2 / S3: this kernel took 0.168 / 0.086 / 0.173 ms with both sums
    cumulative, 0.141 / 0.072 / 0.148 with both products (either one alone was slower than none)."""
    ci = tl.arange(0, G)
    offs = tl.arange(0, BK)
    rows = t0 + ci
    mrow = rows < t1
    kv = load_keys(k_ptr, rows, mrow, h, H, K, BK)
    w = tl.load(w_ptr + rows * H + h, mask=mrow, other=0.0)
    _, lg, lgi = group_logs(r_ptr, rows, mrow, h, H, HAS_R, G)
    D = group_states(d, kv, w, lg, lgi, PREC, G)
    sigma = tl.load(sig_ptr + rows * H + h, mask=mrow, other=0.0)
    b = tl.load(beta_ptr + rows * H + h, mask=mrow, other=0.0).to(tl.float32)
    s, n2, nb, c, bb = token_coefs(kv, b, eta, eps, BETA_AWARE, 1)
    c = tl.where(mrow, c, 0.0)
    gkt = load_keys(dkt_ptr, rows, mrow, h, H, K, BK)
    Y = gkt * kv - (c * bb * sigma)[:, None] * s
    lg_end = tl.sum(tl.where(mrow, lgi - lg, 0.0), 0)
    up = tl.where(ci[:, None] < ci[None, :], tl.exp(tl.minimum(lg[None, :] - lgi[:, None], 0.0)), 0.0)
    Gt = tl.exp(lg_end - lgi)[:, None] * g[None, :] + tl.dot(up, Y, input_precision=PREC)       # Gt[t] = g_{t+1}
    x = tl.sum(D * s, 1)
    a = bb * x
    da = -c * sigma
    dc = (1.0 - a) * sigma
    ds = (c * (1.0 - a))[:, None] * Gt + (da * bb)[:, None] * D
    dn = tl.where(n2 >= eps, -dc * c / nb, 0.0)
    dk = gkt * D + 2.0 * kv * (ds + dn[:, None])
    m = mrow[:, None] & (offs < K)[None, :]
    tl.store(dk_ptr + (rows[:, None] * H + h) * K + offs[None, :], dk.to(dk_ptr.dtype.element_ty), mask=m)
    if BETA_AWARE:
        dbeta = da * x + dc * eta / nb
    else:
        dbeta = x * 0.0
    tl.store(dbeta_ptr + rows * H + h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mrow)
    if HAS_R:
        tl.store(dr_ptr + rows * H + h, tl.sum(Gt * D, 1).to(dr_ptr.dtype.element_ty), mask=mrow)
