"""The asymmetric-key delta rule in plain PyTorch (DESIGN §4): oracle and CPU kernels.

One recurrence serves the three ops, selected by ``gate``:

- ``"none"``    chunk_delta_asym        (no g)
- ``"scalar"``  chunk_gated_delta_asym  (g ``[B,T,H]``)
- ``"channel"`` chunk_kda_asym          (g ``[B,T,H,K]``)

Shapes: ``q, k, k_tilde [B,T,H,K]``, ``v [B,T,H,V]``, ``beta [B,T,H]``. States use the public
layout of the op: ``[N,H,V,K]`` for "none"/"scalar", ``[N,H,K,V]`` for "channel"; inside, the
state is always ``S: K x V``. Outputs: ``o [B,T,H,V]`` in v's dtype and the final state in
float32 (float64 for float64 inputs).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .sequences import compute_dtype, per_sequence

GATES = ("none", "scalar", "channel")


def state_shape(gate: str, N: int, H: int, K: int, V: int) -> tuple[int, int, int, int]:
    """Public state shape of the op with this gate."""
    return (N, H, K, V) if gate == "channel" else (N, H, V, K)


def _to_kv(state: Tensor, gate: str) -> Tensor:
    """Public layout -> internal K x V (and back: the map is its own inverse)."""
    return state if gate == "channel" else state.transpose(-1, -2)


def _recurrent(q, k, kt, v, g, beta, S, *, scale, gate):
    """q,k,kt [b,t,H,K], v [b,t,H,V], g [b,t,H(,K)] or None, beta [b,t,H], S [b,H,K,V]."""
    outs = []
    for t in range(q.shape[1]):
        if gate == "scalar":
            S = torch.exp(g[:, t])[..., None, None] * S
        elif gate == "channel":
            S = torch.exp(g[:, t])[..., :, None] * S
        u = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * kt[:, t, :, :, None] * u[:, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def asym_recurrent(q, k, k_tilde, v, g, beta, initial_state=None, *, scale, gate, cu_seqlens=None):
    """Token-by-token asymmetric delta rule, differentiable by autograd (the test oracle).

    Returns ``(o, final_state)`` in the op's public state layout (see module docstring).
    """
    def fn(q_, k_, kt_, v_, g_, b_, S_):
        return _recurrent(q_, k_, kt_, v_, g_, b_, S_, scale=scale, gate=gate)

    return _run_sequences(fn, q, k, k_tilde, v, g, beta, initial_state, gate, cu_seqlens)


def _run_sequences(fn, q, k, k_tilde, v, g, beta, initial_state, gate, cu_seqlens):
    """Run ``fn(q, k, k_tilde, v, g, beta, S) -> (o, S)`` (state ``[b,H,K,V]``) on each sequence in
    the compute dtype, from ``initial_state`` (zeros if None); ``(o in v.dtype, final state in the
    public layout)``."""
    dt = compute_dtype(v)
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S0 = (torch.zeros(state_shape(gate, N, H, K, v.shape[-1]), dtype=dt, device=v.device)
          if initial_state is None else initial_state.to(dt).clone())
    cast = [x if x is None else x.to(dt) for x in (q, k, k_tilde, v, g, beta)]
    o, S = per_sequence(fn, cast, _to_kv(S0, gate), cu_seqlens)
    return o.to(v.dtype).contiguous(), _to_kv(S, gate).contiguous()


def _prepare(q, k, kt, v, g, beta, *, scale, gate, C):
    """Intra-chunk quantities of the WY form (DESIGN §4) for one batch of sequences.

    Token tensors ``[b,T,H,...]`` become ``[b,H,n,C,...]`` (zero padded: padding leaves the state
    untouched). Returns a dict with the chunked inputs, the decays (``E`` ``[..,C,C(,K)]``,
    ``eG`` ``[..,C,K or 1]``, ``last = e^{G_C}``, None without gate), the masked ``A``
    (pre-beta ``Araw``), scores ``P`` (scaled), ``Tm = (I + A)^-1``, ``W``, ``U``, ``qg``,
    ``kg`` and ``kt_end = Kt * tail`` with ``tail = e^{G_C - G}``.
    """
    b, T, H, K = q.shape
    n = -(-T // C)
    pad = n * C - T

    def chunks(x):
        x = x.movedim(2, 1)
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad)) if pad else x
        return x.reshape(b, H, n, C, *x.shape[3:])

    c = dict(q=chunks(q), k=chunks(k), kt=chunks(kt), v=chunks(v), b=chunks(beta)[..., None], n=n)
    c["strict"] = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    c["incl"] = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    qk = c["q"] @ c["kt"].transpose(-1, -2)
    kk = c["k"] @ c["kt"].transpose(-1, -2)
    if gate == "none":
        c.update(E=None, eG=None, last=None, tail=None, qg=c["q"], kg=c["k"], kt_end=c["kt"])
        Araw, P = kk, qk
    else:
        G = chunks(g if gate == "channel" else g[..., None]).cumsum(-2)   # [b,H,n,C,K or 1]
        diff = G[..., :, None, :] - G[..., None, :, :]                     # [.., t, j, K or 1]
        E = torch.exp(torch.where(c["incl"][..., None], diff, float("-inf")))
        if gate == "scalar":
            E = E[..., 0]
            Araw, P = kk * E, qk * E
        else:
            Araw = torch.einsum("...tc,...jc,...tjc->...tj", c["k"], c["kt"], E)
            P = torch.einsum("...tc,...jc,...tjc->...tj", c["q"], c["kt"], E)
        eG, tail = torch.exp(G), torch.exp(G[..., -1:, :] - G)
        c.update(E=E, eG=eG, last=eG[..., -1:, :], tail=tail, qg=c["q"] * eG, kg=c["k"] * eG,
                 kt_end=c["kt"] * tail)
    c["Araw"] = Araw.masked_fill(~c["strict"], 0)
    A = c["Araw"] * c["b"]
    c["P"] = P.masked_fill(~c["incl"], 0) * scale
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    c["Tm"] = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    c["W"] = c["Tm"] @ (c["kg"] * c["b"])
    c["U"] = c["Tm"] @ (c["v"] * c["b"])
    return c


def _step(c, i, S):
    """Chunk i from state S [b,H,K,V]: returns (v_new, o_i, next state)."""
    vnew = c["U"][:, :, i] - c["W"][:, :, i] @ S
    decayed = S if c["last"] is None else c["last"][:, :, i].transpose(-1, -2) * S
    return vnew, decayed + c["kt_end"][:, :, i].transpose(-1, -2) @ vnew


def _unchunk(x, T):
    """[b,H,n,C,D] -> [b,T,H,D]."""
    b, H, n, C = x.shape[:4]
    return x.reshape(b, H, n * C, -1)[:, :, :T].movedim(1, 2)


def _chunked(q, k, kt, v, g, beta, S, *, scale, gate, C):
    """WY chunk form of one batch of sequences (DESIGN §4); same shapes as ``_recurrent``."""
    c = _prepare(q, k, kt, v, g, beta, scale=scale, gate=gate, C=C)
    outs = []
    for i in range(c["n"]):
        vnew, S_next = _step(c, i, S)
        outs.append(scale * (c["qg"][:, :, i] @ S) + c["P"][:, :, i] @ vnew)
        S = S_next
    return _unchunk(torch.stack(outs, dim=2), q.shape[1]), S


def _chunked_bwd(q, k, kt, v, g, beta, do, states, *, scale, gate, C):
    """Backward of :func:`_chunked`, by hand (a kernel below autograd cannot use autograd).

    ``states`` stacks the initial state and the final state's gradient: ``[b,2,H,K,V]``.
    Returns ``(grads [b,T,H,2K+K+V+Kg+1], dS0 [b,H,K,V])`` with grads concatenated in the
    order dq, dk, dkt, dv, dg (Kg = K, 1 or 0 columns), dbeta.
    """
    S, dS = states[:, 0], states[:, 1]
    T = q.shape[1]
    c = _prepare(q, k, kt, v, g, beta, scale=scale, gate=gate, C=C)
    n = c["n"]
    tr = lambda x: x.transpose(-1, -2)  # noqa: E731
    starts, vnews = [], []
    for i in range(n):
        starts.append(S)
        vnew, S = _step(c, i, S)
        vnews.append(vnew)
    doc = F.pad(do.movedim(2, 1), (0, 0, 0, n * C - T)).reshape(*c["v"].shape[:3], C, -1)
    keys = ("vnew", "P", "qg", "kt_end", "last", "U", "W")
    d = {key: [None] * n for key in keys}
    for i in reversed(range(n)):
        S_i, vnew, dOi = starts[i], vnews[i], doc[:, :, i]
        dvnew = tr(c["P"][:, :, i]) @ dOi + c["kt_end"][:, :, i] @ dS
        d["P"][i] = (dOi @ tr(vnew)).masked_fill(~c["incl"], 0)
        d["qg"][i] = scale * dOi @ tr(S_i)
        d["kt_end"][i] = vnew @ tr(dS)
        dS_prev = scale * tr(c["qg"][:, :, i]) @ dOi - tr(c["W"][:, :, i]) @ dvnew
        if c["last"] is not None:
            lastT = tr(c["last"][:, :, i])                                   # [b,H,K or 1,1]
            d["last"][i] = tr((dS * S_i).sum(-1, keepdim=True))
            if gate == "scalar":
                d["last"][i] = d["last"][i].sum(-1, keepdim=True)
            dS_prev = dS_prev + lastT * dS
        else:
            dS_prev = dS_prev + dS
        d["U"][i], d["W"][i] = dvnew, -dvnew @ tr(S_i)
        dS = dS_prev
    d = {key: (torch.stack(val, 2) if val[0] is not None else None) for key, val in d.items()}
    Tm, bc = c["Tm"], c["b"]
    dTm = d["U"] @ tr(c["v"] * bc) + d["W"] @ tr(c["kg"] * bc)
    dBV, dBkg = tr(Tm) @ d["U"], tr(Tm) @ d["W"]
    dA = -(tr(Tm) @ dTm @ tr(Tm)).masked_fill(~c["strict"], 0)
    dv = dBV * bc
    dkg = dBkg * bc
    db = (dBV * c["v"]).sum(-1, keepdim=True) + (dBkg * c["kg"]).sum(-1, keepdim=True) \
        + (dA * c["Araw"]).sum(-1, keepdim=True)
    dAraw, dPraw = dA * bc, d["P"] * scale
    if gate == "channel":
        E = c["E"]
        dk = torch.einsum("...tj,...jc,...tjc->...tc", dAraw, c["kt"], E)
        dkt = torch.einsum("...tj,...tc,...tjc->...jc", dAraw, c["k"], E) \
            + torch.einsum("...tj,...tc,...tjc->...jc", dPraw, c["q"], E)
        dq = torch.einsum("...tj,...jc,...tjc->...tc", dPraw, c["kt"], E)
        dlogE = (torch.einsum("...tj,...tc,...jc->...tjc", dAraw, c["k"], c["kt"])
                 + torch.einsum("...tj,...tc,...jc->...tjc", dPraw, c["q"], c["kt"])) * E
    else:
        dAE = dAraw if c["E"] is None else dAraw * c["E"]
        dPE = dPraw if c["E"] is None else dPraw * c["E"]
        dk, dq = dAE @ c["kt"], dPE @ c["kt"]
        dkt = tr(dAE) @ c["k"] + tr(dPE) @ c["q"]
        dlogE = None if c["E"] is None else (dAE * (c["k"] @ tr(c["kt"])) + dPE * (c["q"] @ tr(c["kt"])))[..., None]
    dq = dq + (d["qg"] if c["eG"] is None else d["qg"] * c["eG"])
    dk = dk + (dkg if c["eG"] is None else dkg * c["eG"])
    dkt = dkt + (d["kt_end"] if c["tail"] is None else d["kt_end"] * c["tail"])
    parts = [dq, dk, dkt, dv]
    if gate != "none":
        parts.append(_dg_straddle(dlogE, d, c, dkg, gate))
    parts.append(db)
    grads = torch.cat([_unchunk(x, T) for x in parts], -1)
    return grads, dS


def _exclusive_cumsum(x, dim):
    """``y_s = sum_{j < s} x_j`` along ``dim`` (sums only: no difference of two running sums)."""
    return x.cumsum(dim).roll(1, dim).index_fill(dim, torch.zeros(1, dtype=torch.long, device=x.device), 0)


def _dg_straddle(dlogE, d, c, dkg, gate):
    """``dg [.., C, K or 1]`` of a chunk as sums of decayed terms only.

    Every decay is ``e^{G_a - G_b}`` (``a >= b``; ``b`` may be the chunk start, ``a`` its end) and ``g_s`` moves
    exactly the factors with ``b < s <= a``: ``dg_s`` sums ``m_ab = D_ab dL/dD_ab`` over those. The pairs of the
    scores and of ``A`` (``dlogE [.., t, j, K or 1]``) give ``sum_{t >= s} sum_{j < s} dlogE[t, j]``; the state reads
    (``q e^G``, ``k e^G``: start to ``t``) a reverse cumsum; the state writes (``kt e^{G_L - G_j}``) an exclusive
    cumsum; the carried state ``e^{G_L}`` every row. The shorter form, the reverse cumsum of ``q dq + k dk - kt dkt``,
    is equal in exact arithmetic but subtracts O(1) terms of pairs that do not straddle ``s`` (the score diagonal,
    undecayed pairs): under decays near ``e^-20`` its rounding error exceeds ``dg`` itself."""
    red = (lambda x: x.sum(-1, keepdim=True)) if gate == "scalar" else (lambda x: x)  # noqa: E731
    incl = c["incl"][..., None]                                              # [t, s, 1]: t >= s
    pairs = (_exclusive_cumsum(dlogE, -2) * incl).sum(-3)                   # [.., s, K or 1]
    reads = red(d["qg"] * c["qg"]) + red(dkg * c["kg"])
    writes = red(d["kt_end"] * c["kt_end"])
    return pairs + reads.flip(-2).cumsum(-2).flip(-2) + _exclusive_cumsum(writes, -2) + d["last"] * c["last"]


def asym_chunked(q, k, k_tilde, v, g, beta, initial_state=None, *, scale, gate, cu_seqlens=None,
                 chunk_size: int = 64):
    """Chunked (WY) asymmetric delta rule; same contract as :func:`asym_recurrent`."""
    def fn(q_, k_, kt_, v_, g_, b_, S_):
        if q_.shape[1] == 0:
            return v_.new_zeros(v_.shape), S_
        return _chunked(q_, k_, kt_, v_, g_, b_, S_, scale=scale, gate=gate, C=chunk_size)

    return _run_sequences(fn, q, k, k_tilde, v, g, beta, initial_state, gate, cu_seqlens)


def chunk_asym_fwd(q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate):
    """CPU kernel, forward: ``(o, final_state)``."""
    with torch.no_grad():
        return asym_chunked(q, k, k_tilde, v, g, beta, initial_state, scale=scale, gate=gate,
                            cu_seqlens=cu_seqlens)


def chunk_asym_bwd(do, dht, q, k, k_tilde, v, g, beta, initial_state, cu_seqlens, scale, gate):
    """CPU kernel, backward: the chunk form's backward by hand, per sequence.

    Returns ``(dq, dk, dk_tilde, dv, dg, dbeta, dh0)``, each in its input's dtype; ``dg`` is
    empty when there is no gate; ``dh0`` has the public state shape (the gradient to the
    default zero state when none was given).
    """
    dt = compute_dtype(v)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = (torch.zeros(state_shape(gate, N, H, K, V), dtype=dt, device=v.device)
          if initial_state is None else initial_state.to(dt))
    states = torch.stack([_to_kv(h0, gate), _to_kv(dht.to(dt), gate)], 1)
    tokens = [x if x is None else x.to(dt) for x in (q, k, k_tilde, v, g, beta, do)]

    def fn(q_, k_, kt_, v_, g_, b_, do_, st):
        if q_.shape[1] == 0:
            width = 3 * K + V + {"none": 0, "scalar": 1, "channel": K}[gate] + 1
            return q_.new_zeros(*q_.shape[:3], width), st[:, 1]
        return _chunked_bwd(q_, k_, kt_, v_, g_, b_, do_, st, scale=scale, gate=gate, C=64)

    grads, dS0 = per_sequence(fn, tokens, states, cu_seqlens)
    dq, dk, dkt, dv, dg, dbeta = grads.split([K, K, K, V, grads.shape[-1] - 3 * K - V - 1, 1], -1)
    dg = dg.reshape(g.shape).to(g.dtype) if g is not None else v.new_empty(0, dtype=dt)
    out = (dq.to(q.dtype), dk.to(k.dtype), dkt.to(k_tilde.dtype), dv.to(v.dtype), dg,
           dbeta[..., 0].to(beta.dtype), _to_kv(dS0, gate))
    # fresh tensors: slices of one buffer would alias each other, which custom ops forbid
    return tuple(x.clone(memory_format=torch.contiguous_format) for x in out)
