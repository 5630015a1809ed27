"""Advancing the precond_scan state ``d`` over one chunk of tokens (DESIGN §3), as Triton helpers.

Two ways, with the same result:

* token by token (``scan_tokens``): the recurrence as written, one dependent K-reduction per token;
* chunk-parallel (``chunk_try``): without clamping the scan is affine in ``d``,
  ``d_{t+1} = r_t d_t + u_t s_t`` with the scalar ``u_t = c_t (1 - b_t <s_t, d_t>)``. Writing
  ``G_t = r_0 ... r_{t-1}`` and ``Gam[t, j] = r_{j+1} ... r_{t-1}`` (j < t), the scalars solve the
  unit lower-triangular system ``u_t + c_t b_t sum_{j<t} Gam[t,j] <s_t, s_j> u_j = c_t (1 - b_t q_t)``
  with ``q_t = G_t <s_t, d_0>``, and then ``D = G d_0^T + Gam (u * S)`` is the whole trajectory
  (one C x C Gram matrix, one C x C by C x K product). The system is solved by Jacobi sweeps
  ``u <- rhs - A u`` (A is strictly lower triangular, so sweep m makes the first m entries exact;
  for small ``eta`` the sweeps stop after a few, when ``u`` no longer changes).

  Coordinates on a bound at the chunk start whose first pre-clamp value points outward are
  *pinned*: they are held at the bound (they still enter ``<s_t, d_t>``, through ``q_t``) and the
  affine recurrence is solved for the free ones only. The result is exact when every free
  coordinate's pre-clamp value stays inside ``[d_min, d_max]`` and every pinned one keeps pointing
  outward on every token of the chunk, and the sweeps converged; otherwise (``ok`` false) the caller
  recomputes the chunk token by token. NaN/inf never pass the check.

Layout: token ``t`` (flattened over ``B*T``), head ``h`` of ``k`` is at ``(t*H + h)*K``; ``beta``
and ``retention`` at ``t*H + h``. All offsets are int64.
"""
from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64          # tokens per chunk
MAX_SWEEPS = 16     # Jacobi sweeps before a chunk gives up and goes token by token
SWEEP_TOL = 1e-6    # sweeps stop when max|du| <= SWEEP_TOL * max|u|


@triton.jit
def token_coefs(kv, b, eta, eps, BETA_AWARE: tl.constexpr):
    """One token's ``s = k*k``, ``||k||^2``, ``nb = max(||k||^2, eps)``, ``c`` and the beta factor of ``a``."""
    s = kv * kv
    n2 = tl.sum(s, 0)
    nb = tl.maximum(n2, eps)
    if BETA_AWARE:
        c = eta * b / nb
        bb = b
    else:
        c = eta / nb
        bb = b * 0.0 + 1.0
    return s, n2, nb, c, bb


@triton.jit
def load_token(k_ptr, beta_ptr, r_ptr, t, h, H, K, offs, HAS_R: tl.constexpr, valid=True):
    """Key ``[BK]`` (fp32, zero-padded), beta and retention of token ``t`` (int64), head ``h``.

    Nothing is read where ``valid`` is false (zeros, retention 1).
    """
    kv = tl.load(k_ptr + (t * H + h) * K + offs, mask=(offs < K) & valid, other=0.0).to(tl.float32)
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
                STORE_TRAJ: tl.constexpr, STORE_CKPT: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """Tokens ``[t0, t1)`` one by one from ``d`` ([BK] fp32); returns ``d_{t1}``.

    ``STORE_KT``: writes ``k_tilde``; ``STORE_TRAJ``: writes ``d_t`` to ``traj_ptr + (t-t0)*BK``;
    ``STORE_CKPT``: writes ``d`` at every C-th token to ``ckpt_ptr + ((t-t0)//C) * H*BK``.
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
            if (t - t0) % C == 0:
                tl.store(ckpt_ptr + ((t - t0) // C) * H * BK + offs, d)
        s, n2, nb, c, bb = token_coefs(k1, b1, eta, eps, BETA_AWARE)
        a = bb * tl.sum(d * s, 0)
        d = tl.minimum(tl.maximum(r1 * d + c * (1.0 - a) * s, d_min), d_max)
        k1, b1, r1, k2, b2, r2, k3, b3, r3, k4, b4, r4 = k2, b2, r2, k3, b3, r3, k4, b4, r4, k5, b5, r5
        k5, b5, r5, k6, b6, r6, k7, b7, r7, k8, b8, r8 = k6, b6, r6, k7, b7, r7, k8, b8, r8, kn, bn, rn
    return d


@triton.jit
def chunk_try(d, k_ptr, beta_ptr, r_ptr, t0, t1, h, H, K, eta, d_min, d_max, eps,
              HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              MAX_IT: tl.constexpr, TOL: tl.constexpr):
    """Chunk-parallel tokens ``[t0, t1)`` (``t1 - t0 <= C``) from ``d`` ([BK] fp32).

    Returns ``(D [C,BK] with d_t per row, keys [C,BK] fp32, d_{t1} [BK], ok)``; the first three are
    valid only when ``ok``.
    """
    offs = tl.arange(0, BK)
    ci = tl.arange(0, C)
    rows = t0 + ci
    mrow = rows < t1
    mk = offs < K
    kt = tl.load(k_ptr + (rows[:, None] * H + h) * K + offs[None, :], mask=mrow[:, None] & mk[None, :],
                 other=0.0).to(tl.float32)
    b = tl.load(beta_ptr + rows * H + h, mask=mrow, other=0.0).to(tl.float32)
    if HAS_R:
        r = tl.load(r_ptr + rows * H + h, mask=mrow, other=1.0).to(tl.float32)
    else:
        r = b * 0.0 + 1.0
    s = kt * kt
    nb = tl.maximum(tl.sum(s, 1), eps)
    if BETA_AWARE:
        c = eta * b / nb
        bb = b
    else:
        c = eta / nb
        bb = b * 0.0 + 1.0
    c = tl.where(mrow, c, 0.0)
    logr = tl.log(r)
    lgi = tl.cumsum(logr, 0)            # log of r_0 ... r_t
    lg = lgi - logr                     # log G_t = log of r_0 ... r_{t-1}
    # pinned coordinates: on a bound, first pre-clamp value pointing outward
    k0, b0, r0 = load_token(k_ptr, beta_ptr, r_ptr, t0, h, H, K, offs, HAS_R)
    s0, n20, nb0, c0, bb0 = token_coefs(k0, b0, eta, eps, BETA_AWARE)
    pre0 = r0 * d + c0 * (1.0 - bb0 * tl.sum(d * s0, 0)) * s0
    pin_hi = (d >= d_max) & (pre0 >= d_max) & mk
    pin_lo = (d <= d_min) & (pre0 <= d_min) & mk
    free = mk & ~(pin_hi | pin_lo)
    d_free = tl.where(free, d, 0.0)
    d_pin = d - d_free
    G = tl.exp(lg)
    q = G * tl.sum(s * d_free[None, :], 1) + tl.sum(s * d_pin[None, :], 1)
    rhs = c * (1.0 - bb * q)
    sf = tl.where(free[None, :], s, 0.0)
    gram = tl.dot(sf, tl.trans(sf), input_precision="tf32x3")
    lower = ci[:, None] > ci[None, :]
    gam = tl.where(lower, tl.exp(tl.minimum(lg[:, None] - lgi[None, :], 0.0)), 0.0)
    A = (c * bb)[:, None] * gam * gram
    u = rhs
    it = tl.full([], 0, tl.int32)
    delta = tl.full([], 1.0, tl.float32)
    scale = tl.full([], 0.0, tl.float32)
    while (it < MAX_IT) & (delta > TOL * scale):
        u_new = rhs - tl.sum(A * u[None, :], 1)
        delta = tl.max(tl.abs(u_new - u), 0)
        scale = tl.max(tl.abs(u_new), 0)
        u = u_new
        it += 1
    converged = delta <= TOL * scale
    D = G[:, None] * d_free[None, :] + tl.dot(gam, u[:, None] * sf, input_precision="tf32x3") + d_pin[None, :]
    P = r[:, None] * D + u[:, None] * s        # pre-clamp d_{t+1}
    good = ((free[None, :] & (P >= d_min) & (P <= d_max)) | (pin_hi[None, :] & (P >= d_max))
            | (pin_lo[None, :] & (P <= d_min)) | ~mk[None, :] | ~mrow[:, None])
    ok = converged & (tl.min(good.to(tl.int32)) > 0)
    last = (t1 - 1 - t0).to(tl.int32)
    d_end = tl.sum(tl.where(ci[:, None] == last, P, 0.0), 0)
    d_end = tl.where(mk, tl.minimum(tl.maximum(d_end, d_min), d_max), d)
    return D, kt, d_end, ok


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
def advance(d, k_ptr, beta_ptr, r_ptr, kt_ptr, traj_ptr, t0, t1, h, H, K, eta, d_min, d_max, eps,
            HAS_R: tl.constexpr, BETA_AWARE: tl.constexpr, CHUNKED: tl.constexpr, STORE_KT: tl.constexpr,
            STORE_TRAJ: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, MAX_IT: tl.constexpr,
            TOL: tl.constexpr):
    """``d`` over tokens ``[t0, t1)`` (at most C), storing k_tilde / the trajectory if asked.

    Returns ``(d_{t1}, fell_back)``; ``fell_back`` is 1 when the chunk went token by token.
    """
    if CHUNKED:
        D, kv, d_end, ok = chunk_try(d, k_ptr, beta_ptr, r_ptr, t0, t1, h, H, K, eta, d_min, d_max, eps,
                                     HAS_R, BETA_AWARE, C, BK, MAX_IT, TOL)
        if ok:
            ci = tl.arange(0, C)
            offs = tl.arange(0, BK)
            m = ((t0 + ci) < t1)[:, None] & (offs < K)[None, :]
            if STORE_KT:
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
    else:
        d_next = scan_tokens(d, k_ptr, beta_ptr, r_ptr, kt_ptr, traj_ptr, traj_ptr, t0, t1, h, H, K, eta, d_min,
                             d_max, eps, HAS_R, BETA_AWARE, STORE_KT, STORE_TRAJ, False, C, BK)
        fell_back = tl.full([], 1, tl.int32)
    return d_next, fell_back


@triton.jit
def load_d0(d0_ptr, n, h, H, K, HAS_D0: tl.constexpr, BK: tl.constexpr):
    """``d0[n, h]`` as fp32 [BK] (ones without d0; zero padding)."""
    offs = tl.arange(0, BK)
    if HAS_D0:
        d = tl.load(d0_ptr + (n * H + h) * K + offs, mask=offs < K, other=0.0).to(tl.float32)
    else:
        d = tl.where(offs < K, 1.0, 0.0)
    return d


def block_k(K: int) -> int:
    """Padded feature block (a power of two, at least 16 for tl.dot)."""
    return max(16, triton.next_power_of_2(K))


def num_warps(K: int, chunked: bool) -> int:
    """Few warps for the token loop (cheap reductions), more for the chunk tiles."""
    if chunked:
        return 8 if K > 128 else 4
    return 2 if K > 128 else 1


def sequences(k, cu_seqlens) -> int:
    return k.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def flag_slots(k, cu_seqlens) -> int:
    """Rows of the per-chunk scratch (checkpoints, fallback flags): ``bos // C + n + j`` is unique."""
    B, T = k.shape[:2]
    return triton.cdiv(B * T, CHUNK) + sequences(k, cu_seqlens) + 1
