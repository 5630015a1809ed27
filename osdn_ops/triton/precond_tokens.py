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


#: tokens per block of the token loops, forward and adjoint. A loop loads the next block's inputs while it runs the
#: current one and swaps them in at the block's end, so a load has a block of dependent steps to arrive. The rotation
#: of single-token register sets it replaced waited for each load in the step that issued it (the copy that rotates
#: the ring consumes the register; sm_90 SASS), so every token paid a memory latency. H200, bf16, kernel ms (09:21
#: UTC 2026-12-02), before / blocks of 4 / of 8: S1 token form forward 0.861 / 0.410 / 0.375, backward 1.703 / 0.981 /
#: 0.920; the adjoint chain on S1-clamp (80% of chunks token by token) 1.714 / 0.742 / 0.865; the fixup
#: (``precond_fwd``) on S1-clamp at 09:48: 0.309 at 4, 0.465 at 8 (255 registers).
TOKEN_BLOCK = tl.constexpr(4)


@triton.jit
def row_block(ptr, t, t0, t1, h, H, K, offs, STEP: tl.constexpr, U: tl.constexpr):
    """Rows ``[BK]`` (unconverted) of tokens ``t, t + STEP, ..., t + (U-1) STEP`` (int64), head ``h`` of a
    ``[B,T,H,K]`` tensor, as a tuple; zeros for tokens outside ``[t0, t1)`` (nothing is read there)."""
    rows = ()
    for i in tl.static_range(U):
        u = t + i * STEP
        rows = rows + (tl.load(ptr + (u * H + h) * K + offs, mask=(offs < K) & (u >= t0) & (u < t1), other=0.0),)
    return rows


@triton.jit
def scalar_block(ptr, t, t0, t1, h, H, other, STEP: tl.constexpr, U: tl.constexpr):
    """Per-token values (beta, retention; unconverted) of the tokens of ``row_block``, as a tuple; ``other``
    outside ``[t0, t1)``."""
    vals = ()
    for i in tl.static_range(U):
        u = t + i * STEP
        vals = vals + (tl.load(ptr + u * H + h, mask=(u >= t0) & (u < t1), other=other),)
    return vals


@triton.jit
def token_block(k_ptr, beta_ptr, r_ptr, t, t0, t1, h, H, K, offs, HAS_R: tl.constexpr, STEP: tl.constexpr,
                U: tl.constexpr):
    """Keys, betas and retentions (an empty tuple without) of a block of tokens (``row_block``)."""
    ks = row_block(k_ptr, t, t0, t1, h, H, K, offs, STEP, U)
    bs = scalar_block(beta_ptr, t, t0, t1, h, H, 0.0, STEP, U)
    if HAS_R:
        rs = scalar_block(r_ptr, t, t0, t1, h, H, 1.0, STEP, U)
    else:
        rs = ()
    return ks, bs, rs


@triton.jit
def block_token(ks, bs, rs, i: tl.constexpr, HAS_R: tl.constexpr):
    """Token ``i`` of a ``token_block``: key ``[BK]``, beta and retention (1 without), fp32."""
    if HAS_R:
        r = rs[i].to(tl.float32)
    else:
        r = 1.0
    return ks[i].to(tl.float32), bs[i].to(tl.float32), r


@triton.jit
def scan_tokens(d, k_ptr, beta_ptr, r_ptr, kt_ptr, traj_ptr, ckpt_ptr, w_ptr, flag_ptr, t0, t1, h, H, K, eta, d_min,
                d_max, eps, HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, STORE_KT: tl.constexpr,
                STORE_TRAJ: tl.constexpr, STORE_CKPT: tl.constexpr, FIXUP: tl.constexpr, C: tl.constexpr,
                CK: tl.constexpr, BK: tl.constexpr):
    """Tokens ``[t0, t1)`` one by one from ``d`` ([BK] fp32); returns ``d_{t1}``.

    ``STORE_KT``: writes ``k_tilde``; ``STORE_TRAJ``: writes ``d_t`` to ``traj_ptr + (t-t0)*BK``;
    ``STORE_CKPT``: writes ``d`` at every CK-th token (a multiple of ``TOKEN_BLOCK``) to
    ``ckpt_ptr + ((t-t0)//CK) * H*BK``. ``FIXUP`` (``t0`` a chunk start): also every token's
    ``w = c (1 - a)`` at ``w_ptr`` (rows as beta's) and, for every ``C`` tokens from ``t0``, the flag at
    ``flag_ptr + j*H`` (chunk j): 1 where a pre-clamp value left the box (or is NaN), else 0, as the output pass
    flags them; the backward's adjoint pass then takes the chunks flagged 0 from the checkpoints and ``w``.

    The serial chain is one K-reduction per token, far shorter than a memory load, so the inputs are loaded a
    block of ``TOKEN_BLOCK`` tokens ahead; the last block's steps past ``t1`` leave ``d`` as it is and write
    nothing.
    """
    U: tl.constexpr = TOKEN_BLOCK
    offs = tl.arange(0, BK)
    bad = tl.zeros([BK], tl.int32)
    ks, bs, rs = token_block(k_ptr, beta_ptr, r_ptr, t0, t0, t1, h, H, K, offs, HAS_R, 1, U)
    for tb in range(t0, t1, U):
        nks, nbs, nrs = token_block(k_ptr, beta_ptr, r_ptr, tb + U, t0, t1, h, H, K, offs, HAS_R, 1, U)
        if STORE_CKPT:
            if (tb - t0) % CK == 0:
                tl.store(ckpt_ptr + ((tb - t0) // CK) * H * BK + offs, d)
        for i in tl.static_range(U):
            t = tb + i
            valid = t < t1
            kv, b, r = block_token(ks, bs, rs, i, HAS_R)
            if STORE_KT:
                tl.store(kt_ptr + (t * H + h) * K + offs, (d * kv).to(kt_ptr.dtype.element_ty), mask=(offs < K) & valid)
            if STORE_TRAJ:
                tl.store(traj_ptr + (t - t0) * BK + offs, d, mask=(offs < BK) & valid)
            s, n2, nb, c, bb = token_coefs(kv, b, eta, eps, BETA_AWARE)
            w = c * (1.0 - bb * tl.sum(d * s, 0))
            pre = r * d + w * s
            if FIXUP:
                tl.store(w_ptr + t * H + h, w, mask=valid)
                bad = bad | tl.where(((pre >= d_min) & (pre <= d_max)) | (offs >= K) | ~valid, 0, 1)
            d = tl.where(valid, tl.minimum(tl.maximum(pre, d_min), d_max), d)
        if FIXUP:
            if ((tb + U - t0) % C == 0) | (tb + U >= t1):
                tl.store(flag_ptr + ((tb - t0) // C) * H, tl.max(bad, 0))
                bad = tl.zeros([BK], tl.int32)
        ks, bs, rs = nks, nbs, nrs
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
def tokens_adjoint(g, d, traj, dkt_ptr, k_ptr, beta_ptr, r_ptr, dk_ptr, dbeta_ptr, dr_ptr, t0, t1, h, H, K, eta,
                   d_min, d_max, eps, HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, G: tl.constexpr,
                   BK: tl.constexpr):
    """The adjoint of tokens ``[t0, t1)`` (one chunk) token by token: ``d`` is the state at ``t0`` and
    ``g`` the gradient at ``t1``. Rebuilds ``d_t`` into the program's scratch ``traj [C, BK]`` (it stays
    in L2), writes ``dk``, ``dbeta`` (and ``dretention``) of the chunk and returns the gradient at ``t0``.
    The serial chain (three reductions per token) is shorter than a load: the inputs of a block of
    ``TOKEN_BLOCK`` tokens (earlier in time) are loaded while the block after it runs."""
    U: tl.constexpr = TOKEN_BLOCK
    offs = tl.arange(0, BK)
    mk = offs < K
    # only the trajectory is written: the k_tilde, checkpoint, w and flag pointers and the flag chunk C go unused
    d = scan_tokens(d, k_ptr, beta_ptr, r_ptr, k_ptr, traj, traj, traj, traj, t0, t1, h, H, K, eta, d_min, d_max,
                    eps, HAS_R, BETA_AWARE, False, True, False, False, G, G, BK)
    tl.debug_barrier()
    tr = traj - t0 * BK                 # d_t at tr + t*BK
    dts = row_block(tr, t1 - 1, t0, t1, 0, 1, BK, offs, -1, U)
    gs = row_block(dkt_ptr, t1 - 1, t0, t1, h, H, K, offs, -1, U)
    ks, bs, rs = token_block(k_ptr, beta_ptr, r_ptr, t1 - 1, t0, t1, h, H, K, offs, HAS_R, -1, U)
    for jb in range(0, t1 - t0, U):
        tb = t1 - 1 - jb
        nds = row_block(tr, tb - U, t0, t1, 0, 1, BK, offs, -1, U)
        ngs = row_block(dkt_ptr, tb - U, t0, t1, h, H, K, offs, -1, U)
        nks, nbs, nrs = token_block(k_ptr, beta_ptr, r_ptr, tb - U, t0, t1, h, H, K, offs, HAS_R, -1, U)
        for i in tl.static_range(U):
            t = tb - i
            valid = t >= t0
            kv, b, r = block_token(ks, bs, rs, i, HAS_R)
            gn, dk, dbeta, dr = token_adjoint(g, dts[i], kv, b, r, gs[i].to(tl.float32), eta, d_min, d_max, eps,
                                              BETA_AWARE)
            g = tl.where(valid, gn, g)
            tl.store(dk_ptr + (t * H + h) * K + offs, dk.to(dk_ptr.dtype.element_ty), mask=mk & valid)
            tl.store(dbeta_ptr + t * H + h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)
            if HAS_R:
                tl.store(dr_ptr + t * H + h, dr.to(dr_ptr.dtype.element_ty), mask=valid)
        dts, gs, ks, bs, rs = nds, ngs, nks, nbs, nrs
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


def token_warps(BK: int) -> int:
    """Warps of the token loops (the token form and the parallel form's fixup): one reduction per token is cheapest
    within one warp; two above BK 128."""
    return 2 if BK > 128 else 1


def flag_slots(k, cu_seqlens) -> int:
    """Rows of the per-chunk scratch (fallback flags; checkpoints have GROUP-token rows, four per chunk
    row): ``bos // C + n + j`` is unique for chunk j of sequence n (its groups: rows ``4 * that + i``)."""
    B, T = k.shape[:2]
    return cdiv(B * T, CHUNK) + sequences(k, cu_seqlens) + 1
