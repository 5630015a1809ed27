"""Every argument rule raises a TypeError/ValueError naming the argument, the expected and the actual."""
import pytest
import torch

import osdn_ops

from .inputs import asym_call, asym_problem, precond_problem

ASYM = {"none": osdn_ops.chunk_delta_asym, "scalar": osdn_ops.chunk_gated_delta_asym,
        "channel": osdn_ops.chunk_kda_asym}


def _precond(**over):
    x = precond_problem(B=2, T=10, H=2, K=4, dtype=torch.float32, seed=0)
    kw = dict(eta=0.003, d_min=0.5, d_max=2.0, eps=1e-6, beta_aware=True, cu_seqlens=None)
    args = dict(k=x["k"], beta=x["beta"], d0=x["d0"], retention=x["retention"])
    for key, val in over.items():
        (args if key in args else kw)[key] = val
    return osdn_ops.precond_scan(args["k"], args["beta"], args["d0"], args["retention"], **kw)


PRECOND_CASES = [
    (dict(eta=-0.1), ValueError, r"eta: expected >= 0.0, got -0.1"),
    (dict(eta=float("nan")), ValueError, r"eta: expected a finite number, got nan"),
    (dict(eta="0.1"), TypeError, r"eta: expected a float, got str"),
    (dict(d_min=0.0), ValueError, r"d_min: expected > 0.0, got 0.0"),
    (dict(d_min=-1.0), ValueError, r"d_min: expected > 0.0, got -1.0"),
    (dict(d_min=2.5, d_max=2.0), ValueError, r"d_min, d_max: expected d_min <= d_max, got d_min = 2.5 > d_max = 2.0"),
    (dict(eps=0.0), ValueError, r"eps: expected > 0.0, got 0.0"),
    (dict(beta_aware=1), TypeError, r"beta_aware: expected a bool, got int"),
    (dict(k=torch.ones(2, 10, 2, 4, dtype=torch.int32)), TypeError, r"k: expected dtype in .*float32.*, got torch.int32"),
    (dict(k=torch.randn(2, 10, 2)), ValueError, r"k: expected 4 dimensions, got shape \(2, 10, 2\)"),
    (dict(k=[1.0]), TypeError, r"k: expected a torch.Tensor, got list"),
    (dict(beta=torch.rand(2, 10, 3)), ValueError, r"beta: expected shape \[B, T, H\] of k = \(2, 10, 2\), got \(2, 10, 3\)"),
    (dict(beta=torch.rand(2, 10, 2, 1)), ValueError, r"beta: expected 3 dimensions, got shape \(2, 10, 2, 1\)"),
    (dict(retention=torch.rand(2, 9, 2)), ValueError, r"retention: expected shape \[B, T, H\] of k = \(2, 10, 2\), got \(2, 9, 2\)"),
    (dict(retention=torch.zeros(2, 10, 2)), ValueError, r"retention: expected values in \(0.0, 1.0\], got values in \[0.0, 0.0\]"),
    (dict(retention=torch.full((2, 10, 2), 1.5)), ValueError, r"retention: expected values in \(0.0, 1.0\], got values in \[1.5, 1.5\]"),
    (dict(d0=torch.ones(3, 2, 4)), ValueError, r"d0: expected shape \[N, H, K\] = \(2, 2, 4\), got \(3, 2, 4\)"),
    (dict(d0=torch.ones(2, 2, 4, dtype=torch.bfloat16)), TypeError, r"d0: expected dtype torch.float32 .*got torch.bfloat16"),
    (dict(d0=torch.ones(2, 2, 4, device="meta")), ValueError, r"d0: expected device cpu \(the device of k\), got meta"),
]


@pytest.mark.parametrize("over,exc,msg", PRECOND_CASES, ids=[c[2][:40] for c in PRECOND_CASES])
def test_precond_scan_errors(over, exc, msg):
    with pytest.raises(exc, match=msg):
        _precond(**over)


CU_CASES = [
    ([0, 4, 10], dict(B=2), ValueError, r"cu_seqlens: packed sequences need batch size B == 1, got B = 2"),
    ([1, 4, 10], {}, ValueError, r"cu_seqlens: expected cu_seqlens\[0\] == 0, got 1"),
    ([0, 6, 4, 10], {}, ValueError, r"cu_seqlens: expected non-decreasing offsets, got cu_seqlens\[2\] = 4 < cu_seqlens\[1\] = 6"),
    ([0, 4, 9], {}, ValueError, r"cu_seqlens: expected cu_seqlens\[-1\] == T = 10, got 9"),
    ([0], {}, ValueError, r"cu_seqlens: expected \[N\+1\] offsets with N >= 1, got shape \(1,\)"),
]


@pytest.mark.parametrize("cu,shape,exc,msg", CU_CASES, ids=[c[3][:40] for c in CU_CASES])
def test_cu_seqlens_errors(cu, shape, exc, msg):
    x = precond_problem(T=10, H=2, K=4, d0=False, **dict(dict(B=1), **shape))
    with pytest.raises(exc, match=msg):
        osdn_ops.precond_scan(x["k"], x["beta"], cu_seqlens=torch.tensor(cu))
    y = asym_problem("scalar", T=10, H=2, K=4, V=3, initial_state=False, **dict(dict(B=1), **shape))
    y["cu_seqlens"] = torch.tensor(cu)
    with pytest.raises(exc, match=msg):
        asym_call(osdn_ops.chunk_gated_delta_asym, "scalar", y)


def test_cu_seqlens_dtype_and_state_count():
    x = precond_problem(B=1, T=10, H=2, K=4, d0=False)
    with pytest.raises(TypeError, match=r"cu_seqlens: expected dtype in \['torch.int32', 'torch.int64'\], got torch.float32"):
        osdn_ops.precond_scan(x["k"], x["beta"], cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match=r"d0: expected shape \[N, H, K\] = \(3, 2, 4\), got \(1, 2, 4\)"):
        osdn_ops.precond_scan(x["k"], x["beta"], torch.ones(1, 2, 4, dtype=torch.float64),
                              cu_seqlens=torch.tensor([0, 2, 2, 10]))


def _asym_case(gate, **over):
    x = asym_problem(gate, B=2, T=10, H=2, K=4, V=3, dtype=torch.float32, seed=1)
    x.update(over)
    return asym_call(ASYM[gate], gate, x, **({"scale": over["scale"]} if "scale" in over else {}))


ASYM_CASES = [
    (dict(q=torch.randn(2, 10, 2, 5)), ValueError, r"k: expected shape \[B, T, H, K\] of q = \(2, 10, 2, 5\), got \(2, 10, 2, 4\)"),
    (dict(k_tilde=torch.randn(2, 10, 3, 4)), ValueError, r"k_tilde: expected shape \[B, T, H, K\] of q = \(2, 10, 2, 4\), got \(2, 10, 3, 4\)"),
    (dict(v=torch.randn(2, 11, 2, 3)), ValueError, r"v: expected shape \[B, T, H, V\] with q's B, T, H = \(2, 10, 2, 3\), got \(2, 11, 2, 3\)"),
    (dict(v=torch.randn(2, 10, 2, 3, dtype=torch.float64)), TypeError, r"v: expected dtype torch.float32 \(the dtype of q\), got torch.float64"),
    (dict(k=torch.ones(2, 10, 2, 4, dtype=torch.int64)), TypeError, r"k: expected dtype in .*, got torch.int64"),
    (dict(beta=torch.rand(2, 10)), ValueError, r"beta: expected 3 dimensions, got shape \(2, 10\)"),
    (dict(beta=torch.rand(2, 10, 1)), ValueError, r"beta: expected shape \[B, T, H\] of q = \(2, 10, 2\), got \(2, 10, 1\)"),
    (dict(initial_state=torch.zeros(3, 2, 3, 4)), ValueError, r"initial_state: expected shape \[N, H, V, K\] = \(2, 2, 3, 4\), got \(3, 2, 3, 4\)"),
    (dict(initial_state=torch.zeros(2, 2, 4, 3)), ValueError, r"initial_state: expected shape \[N, H, V, K\] = \(2, 2, 3, 4\), got \(2, 2, 4, 3\)"),
    (dict(initial_state=torch.zeros(2, 2, 3, 4, dtype=torch.bfloat16)), TypeError, r"initial_state: expected dtype torch.float32"),
    (dict(initial_state=torch.zeros(2, 2, 3, 4, device="meta")), ValueError, r"initial_state: expected device cpu \(the device of q\), got meta"),
    (dict(scale=float("inf")), ValueError, r"scale: expected a finite number, got inf"),
    (dict(scale=True), TypeError, r"scale: expected a float, got bool"),
]


@pytest.mark.parametrize("over,exc,msg", ASYM_CASES, ids=[c[2][:40] for c in ASYM_CASES])
def test_delta_asym_errors(over, exc, msg):
    with pytest.raises(exc, match=msg):
        _asym_case("none", **over)


GATE_CASES = [
    ("scalar", dict(g=torch.randn(2, 10, 2, 4)), ValueError, r"g: expected 3 dimensions, got shape \(2, 10, 2, 4\)"),
    ("scalar", dict(g=-torch.rand(2, 10, 1)), ValueError, r"g: expected shape \[B, T, H\] of q = \(2, 10, 2\), got \(2, 10, 1\)"),
    ("scalar", dict(g=torch.rand(2, 10, 2) + 0.1), ValueError, r"g: expected values in \(-inf, 0.0\], got values in"),
    ("scalar", dict(g=torch.full((2, 10, 2), float("-inf"))), ValueError, r"g: expected values in \(-inf, 0.0\]"),
    ("scalar", dict(g=torch.full((2, 10, 2), float("nan"))), ValueError, r"g: expected values in \(-inf, 0.0\]"),
    ("scalar", dict(g=-torch.ones(2, 10, 2, dtype=torch.int32)), TypeError, r"g: expected dtype in .*, got torch.int32"),
    ("channel", dict(g=-torch.rand(2, 10, 2)), ValueError, r"g: expected 4 dimensions, got shape \(2, 10, 2\)"),
    ("channel", dict(g=-torch.rand(2, 10, 2, 3)), ValueError, r"g: expected shape \[B, T, H, K\] of q = \(2, 10, 2, 4\), got \(2, 10, 2, 3\)"),
    ("channel", dict(initial_state=torch.zeros(2, 2, 3, 4)), ValueError, r"initial_state: expected shape \[N, H, K, V\] = \(2, 2, 4, 3\), got \(2, 2, 3, 4\)"),
    ("channel", dict(g=-torch.rand(2, 10, 2, 4, device="meta")), ValueError, r"g: expected device cpu \(the device of q\), got meta"),
]


@pytest.mark.parametrize("gate,over,exc,msg", GATE_CASES, ids=[c[3][:40] for c in GATE_CASES])
def test_gated_errors(gate, over, exc, msg):
    with pytest.raises(exc, match=msg):
        _asym_case(gate, **over)


def test_osdn_rejects_a_gate_of_the_wrong_rank():
    x = asym_problem("none", B=1, T=4, H=2, K=4, V=3, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"g: expected \[B, T, H\] \(gated\) or \[B, T, H, K\] \(KDA\), got shape \(1, 4\)"):
        osdn_ops.osdn(x["q"], x["k"], x["v"], x["beta"], -torch.rand(1, 4))


def test_value_checks_can_be_switched_off(monkeypatch):
    """OSDN_OPS_CHECK_VALUES=0 skips the checks that read values (here: retention > 1 passes)."""
    monkeypatch.setenv("OSDN_OPS_CHECK_VALUES", "0")
    kt, _ = _precond(retention=torch.full((2, 10, 2), 1.5))
    assert torch.isfinite(kt).all()


def test_non_contiguous_inputs_are_accepted():
    x = precond_problem(B=2, T=10, H=2, K=4, dtype=torch.float32, seed=0)
    strided = torch.randn(2, 10, 2, 8)[..., ::2]
    kt1, d1 = osdn_ops.precond_scan(strided, x["beta"])
    kt2, d2 = osdn_ops.precond_scan(strided.contiguous(), x["beta"])
    torch.testing.assert_close(kt1, kt2)
    torch.testing.assert_close(d1, d2)
