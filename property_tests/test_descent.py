"""Single-step descent: with r = 1 and eta <= 1/L the preconditioner update never increases h_t (DESIGN §3)."""
import torch
from hypothesis import given
from hypothesis import strategies as st

import osdn_ops
from osdn_ops.reference import precond_scan_recurrent

from .helpers import DEVICE, few, require_triton


@st.composite
def steps(draw):
    """One token per head: k [1,1,H,K], beta [1,1,H], d0 in the box, eta = frac / max_h L_h (fp64)."""
    H, K = draw(st.integers(1, 4)), draw(st.integers(1, 48))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**63 - 1)))
    norm = draw(st.sampled_from((1e-4, 1e-2, 1.0, 10.0, 1e3)))
    k = torch.randn(1, 1, H, K, generator=gen, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True) * norm * (0.5 + torch.rand(1, 1, H, 1, generator=gen, dtype=torch.float64))
    beta = torch.rand(1, 1, H, generator=gen, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    d_min = draw(st.floats(0.01, 2.0))
    d_max = draw(st.one_of(st.floats(d_min, 4.0), st.just(1e3)))  # a wide box rarely binds
    d0 = d_min + (min(d_max, d_min + 2) - d_min) * torch.rand(1, H, K, generator=gen, dtype=torch.float64)
    eps, beta_aware = draw(st.sampled_from((1e-6, 1e-3))), draw(st.booleans())
    s = k[0, 0] ** 2
    n = s.sum(-1).clamp_min(eps)
    b = beta[0, 0] if beta_aware else torch.ones_like(beta[0, 0])
    L = (b ** 2 * (s ** 2).sum(-1) / n).max().item()
    eta = draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0))) / L  # 1/L (the largest allowed step) often
    retention = torch.ones(1, 1, H, dtype=torch.float64) if draw(st.booleans()) else None
    return dict(k=k, beta=beta, d0=d0, retention=retention,
                hp=dict(eta=eta, d_min=d_min, d_max=d_max, eps=eps, beta_aware=beta_aware))


def _surrogate(d, case):
    """h_t(d) = ((1 - b <d, s>)^2 - 1) / (2 n) per head; b = beta (beta_aware) or 1."""
    s = case["k"][0, 0] ** 2
    n = s.sum(-1).clamp_min(case["hp"]["eps"])
    b = case["beta"][0, 0] if case["hp"]["beta_aware"] else 1.0
    return ((1 - b * (d.double() * s).sum(-1)) ** 2 - 1) / (2 * n)


def _check(case, d_new):
    before, after = _surrogate(case["d0"][0], case), _surrogate(d_new[0].cpu(), case)
    slack = 1e-10 * before.abs() + 1e-300
    assert (after <= before + slack).all(), f"h_t increased: {before.tolist()} -> {after.tolist()}"


@given(steps())
def test_descent_oracle(case):
    _, d_new = precond_scan_recurrent(case["k"], case["beta"], case["d0"], case["retention"], **case["hp"])
    _check(case, d_new)


@given(steps())
def test_descent_public_op(case):
    _, d_new = osdn_ops.precond_scan(case["k"], case["beta"], case["d0"], case["retention"], **case["hp"])
    _check(case, d_new)


@few()
@given(steps())
def test_descent_triton(case):
    """Triton kernel in fp32 (the surrogate is evaluated in fp64 on the returned d)."""
    mod = require_triton()
    f32 = {n: (None if case[n] is None else case[n].float().to(DEVICE)) for n in ("k", "beta", "d0", "retention")}
    _, d_new = mod.precond_scan(f32["k"], f32["beta"], f32["d0"], f32["retention"], **case["hp"])
    before = _surrogate(f32["d0"][0].cpu(), case)
    after = _surrogate(d_new[0].cpu(), case)
    assert (after <= before + 1e-5 * before.abs() + 1e-30).all(), f"h_t increased: {before} -> {after}"
