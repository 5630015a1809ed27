"""Public API behaviour: dtypes, defaults, empty inputs, state passing, the composite."""
import pytest
import torch

import osdn_ops
from osdn_ops.reference import asym_recurrent, precond_scan_recurrent

from .inputs import asym_call, asym_problem, precond_problem, rel_rms

ASYM = {"none": osdn_ops.chunk_delta_asym, "scalar": osdn_ops.chunk_gated_delta_asym,
        "channel": osdn_ops.chunk_kda_asym}
NAMES = ("q", "k", "k_tilde", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("gate", list(ASYM))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_asym_dtypes_and_accuracy(gate, dtype):
    x = asym_problem(gate, B=2, T=70, H=2, K=16, V=8, dtype=dtype, seed=2)
    o, s = asym_call(ASYM[gate], gate, x)
    assert o.dtype == dtype and s.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref = {n: None if t is None else t.double() for n, t in x.items() if n != "cu_seqlens"}
    o_ref, s_ref = asym_recurrent(*(ref[n] for n in NAMES), scale=16 ** -0.5, gate=gate)
    bound = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert rel_rms(o, o_ref) < bound and rel_rms(s, s_ref) < bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_precond_dtypes(dtype):
    x = precond_problem(T=20, K=8, dtype=dtype, seed=3)
    kt, d = osdn_ops.precond_scan(x["k"], x["beta"], x["d0"], x["retention"])
    assert kt.dtype == dtype and d.dtype == torch.float32
    kt_ref, d_ref = precond_scan_recurrent(x["k"].double(), x["beta"].double(), x["d0"].double(),
                                           x["retention"].double(), eta=0.003, d_min=0.5, d_max=2.0, eps=1e-6,
                                           beta_aware=True)
    assert rel_rms(kt, kt_ref) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert rel_rms(d, d_ref) < 1e-6


def test_default_scale_is_inverse_sqrt_k():
    x = asym_problem("none", K=16, seed=4)
    o1, _ = asym_call(osdn_ops.chunk_delta_asym, "none", x)
    o2, _ = asym_call(osdn_ops.chunk_delta_asym, "none", x, scale=0.25)
    torch.testing.assert_close(o1, o2)


def test_precond_defaults_are_ones_and_no_retention():
    x = precond_problem(T=15, seed=5)
    kt1, d1 = osdn_ops.precond_scan(x["k"], x["beta"])
    ones = torch.ones(2, 2, 8, dtype=torch.float64)
    kt2, d2 = osdn_ops.precond_scan(x["k"], x["beta"], ones, torch.ones(2, 15, 2, dtype=torch.float64))
    torch.testing.assert_close(kt1, kt2)
    torch.testing.assert_close(d1, d2)
    torch.testing.assert_close(kt1[:, 0], x["k"][:, 0])  # the first token is written with d0 = 1


@pytest.mark.parametrize("gate", list(ASYM))
def test_zero_length_passes_states_through(gate):
    x = asym_problem(gate, B=2, T=0, H=2, K=4, V=3, dtype=torch.float32, seed=6)
    o, s = asym_call(ASYM[gate], gate, x)
    assert o.shape == (2, 0, 2, 3)
    torch.testing.assert_close(s, x["initial_state"])
    assert s.data_ptr() != x["initial_state"].data_ptr()
    p = precond_problem(B=2, T=0, H=2, K=4, dtype=torch.float32)
    kt, d = osdn_ops.precond_scan(p["k"], p["beta"], p["d0"])
    assert kt.shape == (2, 0, 2, 4)
    torch.testing.assert_close(d, p["d0"])


@pytest.mark.parametrize("gate", list(ASYM))
def test_empty_sequences_pass_states_through(gate):
    cu = [0, 0, 5, 5, 12, 12]
    x = asym_problem(gate, B=1, T=12, H=2, K=4, V=3, cu_seqlens=cu, seed=7)
    o, s = asym_call(ASYM[gate], gate, x)
    for n in (0, 2, 4):
        torch.testing.assert_close(s[n], x["initial_state"][n])
    p = precond_problem(B=1, T=12, H=2, K=4, cu_seqlens=cu)
    _, d = osdn_ops.precond_scan(p["k"], p["beta"], p["d0"], cu_seqlens=p["cu_seqlens"])
    for n in (0, 2, 4):
        torch.testing.assert_close(d[n], p["d0"][n])


@pytest.mark.parametrize("gate", list(ASYM))
def test_int32_and_int64_cu_seqlens_agree(gate):
    x = asym_problem(gate, B=1, T=20, H=2, K=4, V=3, cu_seqlens=[0, 7, 20], seed=8)
    o1, s1 = asym_call(ASYM[gate], gate, x)
    x["cu_seqlens"] = x["cu_seqlens"].to(torch.int32)
    o2, s2 = asym_call(ASYM[gate], gate, x)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(s1, s2)


@pytest.mark.parametrize("gate", list(ASYM))
def test_osdn_composite_equals_its_parts(gate):
    x = asym_problem(gate, B=2, T=30, H=2, K=8, V=4, seed=9)
    g = x["g"]
    o, s, d = osdn_ops.osdn(x["q"], x["k"], x["v"], x["beta"], g, initial_state=x["initial_state"], eta=0.1)
    kt, d_ref = osdn_ops.precond_scan(x["k"], x["beta"], eta=0.1)
    o_ref, s_ref = asym_call(ASYM[gate], gate, dict(x, k_tilde=kt))
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(d, d_ref)


def test_kda_state_is_the_transpose_of_the_gated_state_for_a_scalar_gate():
    """A per-channel gate equal across channels is the scalar gate; KDA keeps S as K x V."""
    x = asym_problem("scalar", B=1, T=40, H=2, K=4, V=3, seed=10)
    o1, s1 = asym_call(osdn_ops.chunk_gated_delta_asym, "scalar", x)
    y = dict(x, g=x["g"][..., None].expand(-1, -1, -1, 4).contiguous(),
             initial_state=x["initial_state"].transpose(-1, -2).contiguous())
    o2, s2 = asym_call(osdn_ops.chunk_kda_asym, "channel", y)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(s1, s2.transpose(-1, -2))


@pytest.mark.parametrize("gate", list(ASYM))
def test_backward_of_a_single_token_single_head(gate):
    """B = T = H = 1: gradient slices of one buffer must not alias (custom ops forbid it)."""
    x = asym_problem(gate, B=1, T=1, H=1, K=4, V=3, requires_grad=True, seed=11)
    o, s = asym_call(ASYM[gate], gate, x)
    (o.sum() + s.sum()).backward()
    p = precond_problem(B=1, T=1, H=1, K=4, requires_grad=True, seed=11)
    kt, d = osdn_ops.precond_scan(p["k"], p["beta"], p["d0"], p["retention"])
    (kt.sum() + d.sum()).backward()
    assert all(t.grad is not None for t in (x["q"], x["v"], p["k"], p["retention"]))


def _unused_output_case(gate, device, dtype):
    """An output that takes no gradient counts as a zero seed (the ops' autograd gets None for it)."""
    x = asym_problem(gate, B=2, T=20, H=2, K=4, V=3, dtype=dtype, requires_grad=True, seed=12, device=device)
    leaves = [x[n] for n in NAMES if x[n] is not None]
    o, s = asym_call(ASYM[gate], gate, x)
    seed_o, seed_s = torch.randn_like(o), torch.randn_like(s)
    for used, seeds in (((o,), (seed_o,)), ((s,), (seed_s,))):
        got = torch.autograd.grad(used, leaves, seeds, retain_graph=True, allow_unused=True)
        want = torch.autograd.grad((o, s), leaves, (seed_o if used[0] is o else torch.zeros_like(o),
                                                   seed_s if used[0] is s else torch.zeros_like(s)),
                                   retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    p = precond_problem(B=2, T=20, H=2, K=4, dtype=dtype, requires_grad=True, seed=12, device=device)
    kt, d = osdn_ops.precond_scan(p["k"], p["beta"], p["d0"], p["retention"])
    seed_d = torch.randn_like(d)
    got = torch.autograd.grad(d, [p["k"], p["d0"]], seed_d, retain_graph=True)
    want = torch.autograd.grad((kt, d), [p["k"], p["d0"]], (torch.zeros_like(kt), seed_d))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("gate", list(ASYM))
def test_second_order_gradients_raise(gate):
    """Gradients are first order: a first backward with ``create_graph=True`` works and gives the plain
    gradients, and a backward through it raises (the backward ops have no autograd formula) instead of
    returning a silently wrong second derivative."""
    x = asym_problem(gate, T=20, requires_grad=True, seed=21)
    kt, _ = osdn_ops.precond_scan(x["k"], x["beta"], eta=0.5)
    o, _ = asym_call(ASYM[gate], gate, dict(x, k_tilde=kt))
    dq, dk = torch.autograd.grad(o.square().sum(), [x["q"], x["k"]], create_graph=True)
    want = torch.autograd.grad(o.square().sum(), [x["q"], x["k"]], retain_graph=True)
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(dk, want[1])
    for first in (dq, dk):
        with pytest.raises(RuntimeError, match="no autograd formula"):
            torch.autograd.grad(first.sum(), x["q"], retain_graph=True)
    dk_pre, = torch.autograd.grad(kt.square().sum(), x["k"], create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(dk_pre.sum(), x["k"])


@pytest.mark.parametrize("gate", list(ASYM))
def test_gradients_when_one_output_is_unused(gate):
    _unused_output_case(gate, "cpu", torch.float64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("gate", list(ASYM))
def test_gpu_gradients_when_one_output_is_unused(gate):
    """The same on the Triton kernels (fp32)."""
    _unused_output_case(gate, "cuda", torch.float32)


def test_keep_chunk_states_setting():
    """Off by default; the context manager sets it and restores the previous value, also on an error; only a
    bool is accepted. On the CPU (reference kernels, nothing kept) the results do not change."""
    from osdn_ops.memory import keeping_chunk_states
    assert keeping_chunk_states() is False
    with osdn_ops.keep_chunk_states():
        assert keeping_chunk_states() is True
        with osdn_ops.keep_chunk_states(False):
            assert keeping_chunk_states() is False
        assert keeping_chunk_states() is True
    assert keeping_chunk_states() is False
    with pytest.raises(RuntimeError), osdn_ops.keep_chunk_states():
        raise RuntimeError
    assert keeping_chunk_states() is False
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="enabled: expected a bool"):
            osdn_ops.set_keep_chunk_states(bad)
    x = asym_problem("scalar", B=2, T=20, H=2, K=4, V=3, dtype=torch.float64, requires_grad=True, seed=13)
    leaves = [x[n] for n in NAMES if x[n] is not None]
    o, s = asym_call(osdn_ops.chunk_gated_delta_asym, "scalar", x)
    want = torch.autograd.grad(o.sum() + s.sum(), leaves)
    with osdn_ops.keep_chunk_states():
        o2, s2 = asym_call(osdn_ops.chunk_gated_delta_asym, "scalar", x)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    for a, b in zip(torch.autograd.grad(o2.sum() + s2.sum(), leaves), want):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("gate", list(ASYM))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_keep_chunk_states(gate, dtype):
    """With ``keep_chunk_states`` the Triton forward holds its ``W``, ``v_new`` and chunk states until the backward
    (the memory held after the forward grows by exactly their bytes) and the backward, which then recomputes neither,
    gives bitwise the same gradients (packed sequences, an initial state)."""
    from osdn_ops.triton.asym import kept_states_shape
    x = asym_problem(gate, B=1, T=300, H=3, K=64, V=32, dtype=dtype, cu_seqlens=[0, 100, 100, 300],
                     requires_grad=True, seed=14, device="cuda")
    leaves = [x[n] for n in NAMES if x[n] is not None]
    do = torch.randn(1, 300, 3, 32, device="cuda", dtype=dtype)
    held, grads = [], []
    for keep in (False, True):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with osdn_ops.keep_chunk_states(keep):
            o, s = asym_call(ASYM[gate], gate, x)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before)
        grads.append(torch.autograd.grad((o, s), leaves, (do, torch.ones_like(s))))
        del o, s
    extra = kept_states_shape(x["q"], x["v"], x["cu_seqlens"])[0] * x["q"].element_size()
    assert held[1] - held[0] >= extra and held[1] - held[0] < extra + 2 ** 20, (held, extra)
    for name, a, b in zip([n for n in NAMES if x[n] is not None], *grads):
        assert torch.isfinite(a).all() and torch.equal(a, b), name
