"""Advancing the precond_scan state ``d`` token by token (DESIGN §3), and the scan's shared helpers.

``scan_tokens`` runs the recurrence as written, one dependent K-reduction per token; it is the
token-loop form of the scan and the fallback of the chunk-parallel form (``precond_parallel``)
wherever a clamp fires.

Layout: token ``t`` (flattened over ``B*T``), head ``h`` of ``k`` is at ``(t*H + h)*K``; ``beta``
and ``retention`` at ``t*H + h``. All offsets are int64.
"""
from __future__ import annotations

import triton
import triton.language as tl

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


def block_k(K: int) -> int:
    """Padded feature block (a power of two, at least 16 for tl.dot)."""
    return max(16, triton.next_power_of_2(K))


def sequences(k, cu_seqlens) -> int:
    return k.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def flag_slots(k, cu_seqlens) -> int:
    """Rows of the per-chunk scratch (fallback flags; checkpoints have GROUP-token rows, four per chunk
    row): ``bos // C + n + j`` is unique for chunk j of sequence n."""
    B, T = k.shape[:2]
    return triton.cdiv(B * T, CHUNK) + sequences(k, cu_seqlens) + 1
