"""float64 gradcheck of every public op, for every input that takes a gradient."""
import pytest
import torch

import osdn_ops

from .inputs import asym_call, asym_problem, precond_problem

ASYM = {"none": osdn_ops.chunk_delta_asym, "scalar": osdn_ops.chunk_gated_delta_asym,
        "channel": osdn_ops.chunk_kda_asym}


@pytest.mark.parametrize("beta_aware", [True, False])
@pytest.mark.parametrize("cu", [None, [0, 3, 3, 9]])
def test_gradcheck_precond_scan(beta_aware, cu):
    x = precond_problem(B=1 if cu else 2, T=9, H=2, K=4, cu_seqlens=cu, requires_grad=True, seed=1)

    def f(k, beta, d0, r):
        return osdn_ops.precond_scan(k, beta, d0, r, eta=0.2, d_min=0.5, d_max=2.0, beta_aware=beta_aware,
                                     cu_seqlens=x["cu_seqlens"])

    assert torch.autograd.gradcheck(f, (x["k"], x["beta"], x["d0"], x["retention"]))


def test_gradcheck_precond_scan_clamped():
    """Large eta: the clamp is active on many tokens; gradients follow torch.clamp."""
    x = precond_problem(B=1, T=12, H=1, K=4, requires_grad=True, seed=2)

    def f(k, beta, d0, r):
        return osdn_ops.precond_scan(k, beta, d0, r, eta=3.0, d_min=0.7, d_max=1.3)

    kt, _ = f(*(x[n] for n in ("k", "beta", "d0", "retention")))
    ratio = (kt / x["k"]).detach()
    assert ((ratio - 0.7).abs() < 1e-12).any() or ((ratio - 1.3).abs() < 1e-12).any()
    assert torch.autograd.gradcheck(f, (x["k"], x["beta"], x["d0"], x["retention"]))


@pytest.mark.parametrize("gate", list(ASYM))
@pytest.mark.parametrize("cu", [None, [0, 5, 5, 12]])
def test_gradcheck_asym(gate, cu):
    x = asym_problem(gate, B=1 if cu else 2, T=12, H=2, K=4, V=3, cu_seqlens=cu, requires_grad=True, seed=4)
    names = [n for n in ("q", "k", "k_tilde", "v", "g", "beta", "initial_state") if x[n] is not None]

    def f(*ts):
        y = dict(x, **dict(zip(names, ts)))
        return asym_call(ASYM[gate], gate, y, scale=0.7)

    assert torch.autograd.gradcheck(f, tuple(x[n] for n in names))
