"""The chunked (WY) CPU kernels equal the token-by-token recurrences to float64 rounding."""
import pytest
import torch

from osdn_ops.reference import GATES, asym_chunked, asym_recurrent

from .inputs import asym_problem

NAMES = ["q", "k", "k_tilde", "v", "g", "beta", "initial_state"]


def _run(fn, gate, x, **kw):
    return fn(x["q"], x["k"], x["k_tilde"], x["v"], x["g"], x["beta"], x["initial_state"], scale=0.37, gate=gate,
              cu_seqlens=x["cu_seqlens"], **kw)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 16), (64, 64), (130, 64), (100, 32)])
def test_chunked_equals_recurrent_forward_and_grads(gate, T, chunk):
    x = asym_problem(gate, T=T, requires_grad=True, seed=T)
    o1, s1 = _run(asym_recurrent, gate, x)
    o2, s2 = _run(asym_chunked, gate, x, chunk_size=chunk)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=1e-10, atol=1e-10)
    do, ds = torch.randn_like(o1), torch.randn_like(s1)
    leaves = [x[n] for n in NAMES if x[n] is not None]
    g1 = torch.autograd.grad((o1, s1), leaves, (do, ds))
    g2 = torch.autograd.grad((o2, s2), leaves, (do, ds))
    for name, a, b in zip([n for n in NAMES if x[n] is not None], g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("gate", GATES)
def test_chunked_equals_recurrent_varlen(gate):
    x = asym_problem(gate, B=1, T=150, cu_seqlens=[0, 0, 1, 70, 70, 150], seed=3)
    o1, s1 = _run(asym_recurrent, gate, x)
    o2, s2 = _run(asym_chunked, gate, x, chunk_size=32)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_chunked_strong_decay_is_finite(gate):
    x = asym_problem(gate, T=130, seed=5)
    x["g"] = -20 * torch.rand_like(x["g"])
    o1, s1 = _run(asym_recurrent, gate, x)
    o2, s2 = _run(asym_chunked, gate, x)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    torch.testing.assert_close(o2, o1, rtol=1e-9, atol=1e-9)
