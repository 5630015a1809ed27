"""The CPU backward kernels (written by hand) equal autograd through the token-by-token oracles."""
import pytest
import torch

from osdn_ops.reference import (GATES, asym_recurrent, chunk_asym_bwd, precond_scan_bwd,
                                precond_scan_recurrent)

from .inputs import asym_problem, precond_problem, rel_rms

ASYM_NAMES = ("q", "k", "k_tilde", "v", "g", "beta", "initial_state")


def _grads(outs, leaves, seeds):
    got = torch.autograd.grad(outs, leaves, seeds, allow_unused=True)
    return [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, got)]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("cu", [None, [0, 0, 1, 70, 70, 150]])
@pytest.mark.parametrize("h0", [True, False])
def test_asym_backward_kernel(gate, cu, h0):
    x = asym_problem(gate, B=1 if cu else 2, T=150, H=2, K=8, V=5, cu_seqlens=cu, initial_state=h0,
                     requires_grad=True, seed=11)
    names = [n for n in ASYM_NAMES if x[n] is not None]
    o, s = asym_recurrent(*(x[n] for n in ASYM_NAMES), scale=0.4, gate=gate, cu_seqlens=x["cu_seqlens"])
    do, ds = torch.randn_like(o), torch.randn_like(s)
    ref = _grads((o, s), [x[n] for n in names], (do, ds))
    got = chunk_asym_bwd(do, ds, *(x[n] for n in ASYM_NAMES), x["cu_seqlens"], 0.4, gate)
    got = dict(zip(ASYM_NAMES, got))
    for name, r in zip(names, ref):
        torch.testing.assert_close(got[name], r, rtol=1e-9, atol=1e-10, msg=lambda m: f"d{name}: {m}")
    if not h0:  # the gradient to the default zero state is still returned
        assert got["initial_state"].shape == s.shape and got["initial_state"].abs().sum() > 0


@pytest.mark.parametrize("beta_aware", [True, False])
@pytest.mark.parametrize("eta", [0.1, 3.0])
@pytest.mark.parametrize("cu", [None, [0, 0, 1, 20, 20, 40]])
def test_precond_backward_kernel(beta_aware, eta, cu):
    x = precond_problem(B=1 if cu else 2, T=40, H=2, K=4, cu_seqlens=cu, requires_grad=True, seed=12)
    with torch.no_grad():
        x["k"][0, 5, 0] = 0  # a zero key: the eps floor
    names = ("k", "beta", "d0", "retention")
    hp = dict(eta=eta, d_min=0.7, d_max=1.3, eps=1e-6, beta_aware=beta_aware)
    kt, d = precond_scan_recurrent(*(x[n] for n in names), cu_seqlens=x["cu_seqlens"], **hp)
    dkt, dd = torch.randn_like(kt), torch.randn_like(d)
    ref = _grads((kt, d), [x[n] for n in names], (dkt, dd))
    got = precond_scan_bwd(dkt, dd, *(x[n] for n in names), x["cu_seqlens"], *hp.values())
    for name, a, b in zip(names, got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("decay", ["all -20", "0 or -20", "uniform to -20"])
@pytest.mark.parametrize("T,cu", [(2, [0, 2, 2]), (70, None)])
def test_asym_backward_kernel_strong_decay_fp32(gate, decay, T, cu):
    """fp32 inputs under decays down to -20 per token: every gradient within 1e-4 relative of the float64 oracle's.
    Where every token decays by e^-20, ``dg`` is some 1e-9 against O(1) terms of ``q dq``, ``k dk``, ``kt dkt``:
    it must come from sums of decayed terms, not from the difference of those."""
    x = asym_problem(gate, B=1, T=T, H=2, K=8, V=5, dtype=torch.float32, cu_seqlens=cu, seed=T)
    gen = torch.Generator().manual_seed(T + 1)
    u = torch.rand(x["g"].shape, generator=gen)
    x["g"] = {"all -20": torch.full_like(u, -20.0), "0 or -20": torch.where(u < 0.5, 0.0, -20.0),
              "uniform to -20": -20 * u}[decay]
    names = [n for n in ASYM_NAMES if x[n] is not None]
    leaves = [x[n].double().requires_grad_() for n in names]
    o, s = asym_recurrent(*leaves[:6], leaves[6], scale=0.4, gate=gate, cu_seqlens=x["cu_seqlens"])
    do, ds = torch.randn_like(o), torch.randn_like(s)
    ref = _grads((o, s), leaves, (do, ds))
    got = chunk_asym_bwd(do.float(), ds.float(), *(x[n] for n in ASYM_NAMES), x["cu_seqlens"], 0.4, gate)
    got = dict(zip(ASYM_NAMES, got))
    for name, r in zip(names, ref):
        assert got[name].dtype == x[name].dtype
        assert rel_rms(got[name], r) < 1e-4, (name, rel_rms(got[name], r))
