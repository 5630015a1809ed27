"""Random problems for the unit tests (fresh values every call, never zeros)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from osdn_ops.reference import state_shape


def asym_problem(gate, B=2, T=37, H=2, K=8, V=6, *, dtype=torch.float64, cu_seqlens=None, initial_state=True,
                 requires_grad=False, seed=0, device="cpu"):
    """Inputs of an asym op as a dict: q, k, k_tilde, v, g (None for gate "none"), beta, initial_state, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k = (F.normalize(rnd(B, T, H, K), dim=-1) for _ in range(2))
    k_tilde = k * (1 + 0.3 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64))
    x = dict(q=q, k=k, k_tilde=k_tilde, v=rnd(B, T, H, V),
             beta=torch.sigmoid(rnd(B, T, H)),
             g=None if gate == "none" else F.logsigmoid(rnd(B, T, H, *((K,) if gate == "channel" else ()))),
             initial_state=rnd(*state_shape(gate, N, H, K, V)) if initial_state else None)
    out = {}
    for name, t in x.items():
        if t is not None:
            t = t.to(dtype if name in ("q", "k", "k_tilde", "v") else (torch.float64 if dtype == torch.float64 else torch.float32))
            t = t.to(device).requires_grad_(requires_grad)
        out[name] = t
    out["cu_seqlens"] = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int64, device=device)
    return out


def strong_decay(x, gate, seed=0):
    """Replace the gates of an :func:`asym_problem` (none for gate "none") by fresh leaves ``-20 u^2``, u uniform in
    [0, 1): g spanning (-20, 0] per token, in-chunk cumulative gates near -600."""
    if gate != "none":
        gen = torch.Generator().manual_seed(seed)
        g = -20 * torch.rand(x["g"].shape, generator=gen) ** 2
        x["g"] = g.to(x["g"].device, x["g"].dtype).requires_grad_()
    return x


def precond_problem(B=2, T=37, H=2, K=8, *, dtype=torch.float64, cu_seqlens=None, d0=True, retention=True,
                    requires_grad=False, seed=0, device="cpu"):
    """Inputs of precond_scan as a dict: k, beta, d0, retention, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    x = dict(k=torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype),
             beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(sd),
             d0=(0.6 + torch.rand(N, H, K, generator=gen, dtype=torch.float64)).to(sd) if d0 else None,
             retention=(0.9 + 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)).to(sd) if retention else None)
    out = {n: None if t is None else t.to(device).requires_grad_(requires_grad) for n, t in x.items()}
    out["cu_seqlens"] = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int64, device=device)
    return out


def asym_call(fn, gate, x, **kw):
    """Call a public-signature asym function (osdn_ops or osdn_ops.triton) on a problem dict."""
    args = [x["q"], x["k"], x["k_tilde"], x["v"]] + ([] if gate == "none" else [x["g"]]) + [x["beta"]]
    return fn(*args, initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"], **kw)


def rel_rms(x, ref):
    """||x - ref|| / ||ref|| in float64 (NaN anywhere gives NaN, which fails any bound)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()
