"""The precond_scan recurrence token by token (DESIGN §3), forward and adjoint, and the scan's shared helpers.

``scan_tokens`` runs the recurrence as written, one dependent K-reduction per token, and
``tokens_adjoint`` its adjoint over one chunk; they are the token-loop form of the scan and the
fallback of the chunk-parallel form (``precond_parallel``) wherever a clamp fires.

The adjoint of one token, with ``gpre = g * [d_min <= pre <= d_max]`` (torch.clamp's convention)::

    sigma = <gpre, s>;  da = -c sigma;  dc = (1 - a) sigma
    dr    = <gpre, d>
    ds    = c (1 - a) gpre + da b' d          (b' = beta if beta_aware else 1)
    dn    = -dc c / nb  where ||k||^2 >= eps (torch.clamp(min=eps)'s convention), else 0
    dk    = dk_tilde * d + 2 k (ds + dn)
    dbeta = da <d, s> + dc eta / nb          (beta_aware; 0 otherwise)
    g    <- r gpre + dk_tilde * k + da b' s   (the gradient to d_t)

Layout: token ``t`` (flattened over ``B*T``), head ``h`` of ``k`` is at ``(t*H + h)*K``; ``beta``
and ``retention`` at ``t*H + h``. All offsets are int64.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .host_math import cdiv, next_pow2

CHUNK = 64          # tokens per chunk (fallback flags, the chunk-parallel form)
GROUP = 16          # tokens per checkpoint and per serial step of the chunk-parallel form


@triton.jit
def token_coefs(kv, b, eta, eps, BETA_AWARE: tl.constexpr, AXIS: tl.constexpr = 0):
    """``s = k*k``, ``||k||^2``, ``nb = max(||k||^2, eps)``, ``c`` and the beta factor of ``a``: of one
    token (``kv [BK]``, ``b`` scalar), or of a chunk's rows (``kv [C, BK]``, ``b [C]``, ``AXIS=1``)."""
    s = kv * kv
    n2 = tl.sum(s, AXIS)
    nb = tl.maximum(n2, eps)
    if BETA_AWARE:
        c = eta * b / nb
        bb = b
    else:
        c = eta / nb
        bb = b * 0.0 + 1.0
    return s, n2, nb, c, bb


@triton.jit
def decay_logs(r, HAS_R: tl.constexpr, G: tl.constexpr):
    """Exclusive / inclusive log cumsums ``(Gam_t, Gam_{t+1})`` of retention ``r [G]`` (zeros without)."""
    if HAS_R:
        logr = tl.log(r.to(tl.float32))
        lgi = tl.cumsum(logr, 0)
        return lgi - logr, lgi
    else:
        z = tl.zeros([G], tl.float32)
        return z, z


@triton.jit
def load_row(ptr, t, h, H, K, offs, mask):
    """Row ``[BK]`` of token ``t`` (int64), head ``h`` of a ``[B,T,H,K]`` tensor (keys, ``dk_tilde``) as fp32, zeros
    where ``mask`` is false."""
    return tl.load(ptr + (t * H + h) * K + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_token(k_ptr, beta_ptr, r_ptr, t, h, H, K, offs, HAS_R: tl.constexpr, valid=True):
    """Key ``[BK]`` (fp32, zero-padded), beta and retention of token ``t`` (int64), head ``h``.

    Nothing is read where ``valid`` is false (zeros, retention 1).
    """
    kv = load_row(k_ptr, t, h, H, K, offs, (offs < K) & valid)
    b = tl.load(beta_ptr + t * H + h, mask=valid, other=0.0).to(tl.float32)
    if HAS_R:
        r = tl.load(r_ptr + t * H + h, mask=valid, other=1.0).to(tl.float32)
    else:
        r = b * 0.0 + 1.0
    return kv, b, r


@triton.jit
def load_ahead(k_ptr, beta_ptr, r_ptr, t, t1, h, H, K, offs, HAS_R: tl.constexpr):
    """``load_token`` for a token that may lie past the range's end ``t1`` (then nothing is read)."""
    return load_token(k_ptr, beta_ptr, r_ptr, t, h, H, K, offs, HAS_R, t < t1)


@triton.jit
def scan_tokens(d, k_ptr, beta_ptr, r_ptr, kt_ptr, traj_ptr, ckpt_ptr, t0, t1, h, H, K, eta, d_min, d_max, eps,
                HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, STORE_KT: tl.constexpr,
                STORE_TRAJ: tl.constexpr, STORE_CKPT: tl.constexpr, CK: tl.constexpr, BK: tl.constexpr):
    """Tokens ``[t0, t1)`` one by one from ``d`` ([BK] fp32); returns ``d_{t1}``.

    ``STORE_KT``: writes ``k_tilde``; ``STORE_TRAJ``: writes ``d_t`` to ``traj_ptr + (t-t0)*BK``;
    ``STORE_CKPT``: writes ``d`` at every CK-th token to ``ckpt_ptr + ((t-t0)//CK) * H*BK``.
    The serial chain is one K-reduction per token, far shorter than a memory load, so the inputs
    are loaded eight tokens ahead (a rotation of eight register sets).
    """
    offs = tl.arange(0, BK)
    k1, b1, r1 = load_ahead(k_ptr, beta_ptr, r_ptr, t0, t1, h, H, K, offs, HAS_R)
    k2, b2, r2 = load_ahead(k_ptr, beta_ptr, r_ptr, t0 + 1, t1, h, H, K, offs, HAS_R)
    k3, b3, r3 = load_ahead(k_ptr, beta_ptr, r_ptr, t0 + 2, t1, h, H, K, offs, HAS_R)
    k4, b4, r4 = load_ahead(k_ptr, beta_ptr, r_ptr, t0 + 3, t1, h, H, K, offs, HAS_R)
    k5, b5, r5 = load_ahead(k_ptr, beta_ptr, r_ptr, t0 + 4, t1, h, H, K, offs, HAS_R)
    k6, b6, r6 = load_ahead(k_ptr, beta_ptr, r_ptr, t0 + 5, t1, h, H, K, offs, HAS_R)
    k7, b7, r7 = load_ahead(k_ptr, beta_ptr, r_ptr, t0 + 6, t1, h, H, K, offs, HAS_R)
    k8, b8, r8 = load_ahead(k_ptr, beta_ptr, r_ptr, t0 + 7, t1, h, H, K, offs, HAS_R)
    for t in range(t0, t1):
        kn, bn, rn = load_ahead(k_ptr, beta_ptr, r_ptr, t + 8, t1, h, H, K, offs, HAS_R)
        if STORE_KT:
            tl.store(kt_ptr + (t * H + h) * K + offs, (d * k1).to(kt_ptr.dtype.element_ty), mask=offs < K)
        if STORE_TRAJ:
            tl.store(traj_ptr + (t - t0) * BK + offs, d)
        if STORE_CKPT:
            if (t - t0) % CK == 0:
                tl.store(ckpt_ptr + ((t - t0) // CK) * H * BK + offs, d)
        s, n2, nb, c, bb = token_coefs(k1, b1, eta, eps, BETA_AWARE)
        a = bb * tl.sum(d * s, 0)
        d = tl.minimum(tl.maximum(r1 * d + c * (1.0 - a) * s, d_min), d_max)
        k1, b1, r1, k2, b2, r2, k3, b3, r3, k4, b4, r4 = k2, b2, r2, k3, b3, r3, k4, b4, r4, k5, b5, r5
        k5, b5, r5, k6, b6, r6, k7, b7, r7, k8, b8, r8 = k6, b6, r6, k7, b7, r7, k8, b8, r8, kn, bn, rn
    return d


@triton.jit
def token_adjoint(g, d, kv, b, r, gkt, eta, d_min, d_max, eps, BETA_AWARE: tl.constexpr):
    """One token's adjoint: returns ``(g for d_t, dk [BK], dbeta, dr)`` (see the module docstring)."""
    s, n2, nb, c, bb = token_coefs(kv, b, eta, eps, BETA_AWARE)
    ds_d = tl.sum(d * s, 0)
    a = bb * ds_d
    pre = r * d + c * (1.0 - a) * s
    gpre = tl.where((pre >= d_min) & (pre <= d_max), g, 0.0)
    sigma = tl.sum(gpre * s, 0)
    dr = tl.sum(gpre * d, 0)
    da = -c * sigma
    dc = (1.0 - a) * sigma
    ds = c * (1.0 - a) * gpre + da * bb * d
    dn = tl.where(n2 >= eps, -dc * c / nb, 0.0)
    dk = gkt * d + 2.0 * kv * (ds + dn)
    if BETA_AWARE:
        dbeta = da * ds_d + dc * eta / nb
    else:
        dbeta = dr * 0.0
    g = r * gpre + gkt * kv + da * bb * s
    return g, dk, dbeta, dr


@triton.jit
def reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t, t0, h, H, K, HAS_R: tl.constexpr, BK: tl.constexpr):
    """Token ``t``'s ``d_t`` (from the chunk scratch), key, beta, retention and ``dk_tilde``; nothing is
    read for ``t < t0`` (before the chunk)."""
    offs = tl.arange(0, BK)
    valid = t >= t0
    dt = tl.load(traj + (t - t0) * BK + offs, mask=valid, other=0.0)
    kv, b, r = load_token(k_ptr, beta_ptr, r_ptr, t, h, H, K, offs, HAS_R, valid)
    gkt = load_row(dkt_ptr, t, h, H, K, offs, (offs < K) & valid)
    return dt, kv, b, r, gkt


@triton.jit
def tokens_adjoint(g, d, traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, dk_ptr, dbeta_ptr, dr_ptr, t0, t1, h, H, K, eta,
                   d_min, d_max, eps, HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, G: tl.constexpr,
                   BK: tl.constexpr):
    """The adjoint of tokens ``[t0, t1)`` (one chunk) token by token: ``d`` is the state at ``t0`` and
    ``g`` the gradient at ``t1``. Rebuilds ``d_t`` into the program's scratch ``traj [C, BK]`` (it stays
    in L2), writes ``dk``, ``dbeta`` (and ``dretention``) of the chunk and returns the gradient at ``t0``."""
    offs = tl.arange(0, BK)
    mk = offs < K
    d = scan_tokens(d, k_ptr, beta_ptr, r_ptr, k_ptr, traj, traj, t0, t1, h, H, K, eta, d_min, d_max, eps,
                    HAS_R, BETA_AWARE, False, True, False, G, BK)
    tl.debug_barrier()
    # the serial chain (three reductions per token) is shorter than a load: inputs are loaded
    # four tokens ahead (earlier in time), in a rotation of four register sets
    d1, k1, b1, r1, g1 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 1, t0, h, H, K, HAS_R, BK)
    d2, k2, b2, r2, g2 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 2, t0, h, H, K, HAS_R, BK)
    d3, k3, b3, r3, g3 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 3, t0, h, H, K, HAS_R, BK)
    d4, k4, b4, r4, g4 = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t1 - 4, t0, h, H, K, HAS_R, BK)
    for tt in range(0, t1 - t0):
        t = t1 - 1 - tt
        dn, kn, bn, rn, gn = reverse_inputs(traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, t - 4, t0, h, H, K, HAS_R, BK)
        g, dk, dbeta, dr = token_adjoint(g, d1, k1, b1, r1, g1, eta, d_min, d_max, eps, BETA_AWARE)
        tl.store(dk_ptr + (t * H + h) * K + offs, dk.to(dk_ptr.dtype.element_ty), mask=mk)
        tl.store(dbeta_ptr + t * H + h, dbeta.to(dbeta_ptr.dtype.element_ty))
        if HAS_R:
            tl.store(dr_ptr + t * H + h, dr.to(dr_ptr.dtype.element_ty))
        d1, k1, b1, r1, g1, d2, k2, b2, r2, g2 = d2, k2, b2, r2, g2, d3, k3, b3, r3, g3
        d3, k3, b3, r3, g3, d4, k4, b4, r4, g4 = d4, k4, b4, r4, g4, dn, kn, bn, rn, gn
    tl.debug_barrier()
    return g


@triton.jit
def sequence_bounds(cu_ptr, n, T, VARLEN: tl.constexpr):
    """First and one-past-last flattened token (int64) of sequence ``n``."""
    if VARLEN:
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    else:
        bos = n * T
        eos = bos + T
    return bos, eos


@triton.jit
def load_d0(d0_ptr, n, h, H, K, HAS_D0: tl.constexpr, BK: tl.constexpr):
    """``d0[n, h]`` as fp32 [BK] (ones without d0; zero padding)."""
    offs = tl.arange(0, BK)
    if HAS_D0:
        d = tl.load(d0_ptr + (n * H + h) * K + offs, mask=offs < K, other=0.0).to(tl.float32)
    else:
        d = tl.where(offs < K, 1.0, 0.0)
    return d


@triton.jit
def flagged_chunk(flag_ptr, slot, j_lo, j_hi, h, H, LAST: tl.constexpr, FB: tl.constexpr):
    """Among chunks ``j`` in ``[j_lo, j_hi)`` of the sequence whose flag rows start at ``slot``: the first whose
    flag is set (``j_hi`` if none), or with ``LAST`` the last one (``j_lo - 1`` if none). Reads ``FB`` flags at a
    time from the end it searches from and stops at the first block with a set flag, so a search costs one load
    per ``FB`` chunks between that end and the hit (the adjoint chain's searches, one per run of unflagged chunks,
    then read each flag about once)."""
    none = tl.full([], 0, tl.int64) + (j_lo - 1 if LAST else j_hi)
    found = none
    if LAST:
        j1 = tl.full([], 0, tl.int64) + j_hi
        while (found == none) & (j1 > j_lo):
            j0 = tl.maximum(j1 - FB, j_lo)
            jj = j0 + tl.arange(0, FB).to(tl.int64)
            f = tl.load(flag_ptr + (slot + jj) * H + h, mask=jj < j1, other=0)
            found = tl.max(tl.where(f != 0, jj, none), 0)
            j1 = j0
    else:
        j0 = tl.full([], 0, tl.int64) + j_lo
        while (found == none) & (j0 < j_hi):
            jj = j0 + tl.arange(0, FB).to(tl.int64)
            f = tl.load(flag_ptr + (slot + jj) * H + h, mask=jj < j_hi, other=0)
            found = tl.min(tl.where(f != 0, jj, none), 0)
            j0 += FB
    return found


@triton.jit
def chunk_slot(pid_c, i_b, start, cu_ptr, table_ptr, T, C: tl.constexpr, VARLEN: tl.constexpr):
    """Per-chunk scratch row (``bos // C + n + j``, see ``flag_slots``) of the chunk of the chunk grid
    (``asym_chunks.chunk_span``) that starts at token ``start``; only meaningful where the chunk exists."""
    if VARLEN:
        seq = tl.maximum(tl.load(table_ptr + 2 * pid_c), 0).to(tl.int64)
        bos = tl.load(cu_ptr + seq).to(tl.int64)
    else:
        seq = i_b.to(tl.int64)
        bos = seq * T
    return bos // C + seq + (start - bos) // C


def block_k(K: int) -> int:
    """Padded feature block (a power of two, at least 16 for tl.dot)."""
    return max(16, next_pow2(K))


def sequences(k, cu_seqlens) -> int:
    return k.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def flag_slots(k, cu_seqlens) -> int:
    """Rows of the per-chunk scratch (fallback flags; checkpoints have GROUP-token rows, four per chunk
    row): ``bos // C + n + j`` is unique for chunk j of sequence n (its groups: rows ``4 * that + i``)."""
    B, T = k.shape[:2]
    return cdiv(B * T, CHUNK) + sequences(k, cu_seqlens) + 1
