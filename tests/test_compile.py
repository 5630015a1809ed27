"""The ops inside torch.compile(fullgraph=True): equal to eager, forward and backward, no recompiles."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import osdn_ops

from .inputs import asym_problem

GATES = ["none", "scalar", "channel"]


def _loss(q, k, v, beta, g, h0, d0):
    o, s, d = osdn_ops.osdn(q, k, v, beta, g, initial_state=h0, d0=d0, eta=0.05)
    return (o * o).sum() + s.sum() + d.sum()


def _inputs(gate, T, seed):
    x = asym_problem(gate, B=2, T=T, H=2, K=8, V=4, dtype=torch.float32, seed=seed)
    d0 = torch.ones(2, 2, 8) + 0.1 * torch.rand(2, 2, 8)
    leaves = [x["q"], x["k"], x["v"], x["beta"], x["g"], x["initial_state"], d0]
    return [None if t is None else t.requires_grad_() for t in leaves]


@pytest.mark.parametrize("gate", GATES)
def test_compiled_composite_matches_eager(gate):
    torch._dynamo.reset()
    xs = _inputs(gate, 21, seed=1)
    live = [t for t in xs if t is not None]
    eager = _loss(*xs)
    g_eager = torch.autograd.grad(eager, live)
    compiled = torch.compile(_loss, fullgraph=True)(*xs)
    g_comp = torch.autograd.grad(compiled, live)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b)


def test_dynamic_shapes_compile_once():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_loss, fullgraph=True, dynamic=True, backend=counter)
    counts = []
    for T in (9, 17, 30):
        xs = _inputs("scalar", T, seed=T)
        loss = fn(*xs)
        loss.backward()
        torch.testing.assert_close(loss, _loss(*xs))
        counts.append(counter.frame_count)
    # the first call compiles (one frame; Dynamo may restart its analysis once, which counts
    # again), the next two T values reuse that graph
    assert counts[0] >= 1 and counts[1] == counts[0] and counts[2] == counts[0]


def test_compiled_varlen():
    torch._dynamo.reset()
    x = asym_problem("channel", B=1, T=25, H=2, K=8, V=4, dtype=torch.float32, cu_seqlens=[0, 10, 10, 25], seed=3)

    def f(q, k, v, beta, g, cu):
        o, s, d = osdn_ops.osdn(q, k, v, beta, g, cu_seqlens=cu)
        return o, s, d

    args = (x["q"], x["k"], x["v"], x["beta"], x["g"], x["cu_seqlens"])
    for a, b in zip(torch.compile(f, fullgraph=True)(*args), f(*args)):
        torch.testing.assert_close(a, b)


def test_keep_chunk_states_is_guarded():
    """A compiled function keeps what it was traced with: switching ``keep_chunk_states`` retraces it (Dynamo
    guards on the setting), and the results are the same either way."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_loss, fullgraph=True, backend=counter)
    xs = _inputs("none", 13, seed=5)
    live = [t for t in xs if t is not None]
    want = torch.autograd.grad(fn(*xs), live)
    frames = counter.frame_count
    with osdn_ops.keep_chunk_states():
        got = torch.autograd.grad(fn(*xs), live)
        assert counter.frame_count > frames
        frames = counter.frame_count
        fn(*xs)
        assert counter.frame_count == frames
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("keep", [False, True], ids=["recomputed", "kept_states"])
def test_gpu_compiled_dynamic_matches_eager(keep):
    """On the Triton kernels, with dynamic shapes (the fake impls' residual shapes are symbolic, the kept chunk states
    included): compiled forward and backward equal eager for two lengths."""
    torch._dynamo.reset()
    fn = torch.compile(_loss, fullgraph=True, dynamic=True)
    with osdn_ops.keep_chunk_states(keep):
        for T in (70, 131):
            xs = [None if t is None else t.detach().cuda().requires_grad_() for t in _inputs("scalar", T, seed=T)]
            live = [t for t in xs if t is not None]
            got = torch.autograd.grad(fn(*xs), live)
            want = torch.autograd.grad(_loss(*xs), live)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
