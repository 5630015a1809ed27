"""The ops inside a CUDA graph (GPU only): OSDN forward and backward (precond_scan, then each asym op),
captured once and replayed on new inputs, equals an eager run on those inputs bitwise (the kernels are
deterministic). Capture fails on any host read or host-to-device copy, so this also checks that the GPU
path has none, varlen chunk bookkeeping included."""
import pytest
import torch

import osdn_ops

from .inputs import asym_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CU = [0, 70, 70, 150]      # packed: a 70-token sequence, an empty one, an 80-token one


def _leaves(gate, cu, seed):
    """Inputs of osdn() that take gradients (bf16 q, k, v; fp32 beta, g, states, d0), on the GPU."""
    B = 2 if cu is None else 1
    x = asym_problem(gate, B=B, T=150, H=2, K=64, V=64, dtype=torch.bfloat16, cu_seqlens=cu, seed=seed,
                     device="cuda")
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(seed)
    leaves = {n: x[n] for n in ("q", "k", "v", "beta", "g", "initial_state") if x[n] is not None}
    leaves["d0"] = (0.8 + 0.4 * torch.rand(N, 2, 64, generator=gen)).cuda()
    return {n: t.detach().requires_grad_() for n, t in leaves.items()}, x["cu_seqlens"]


def _step(leaves, cu, seeds):
    """``(o, state, d_final, *gradients of a random linear loss)``."""
    o, s, d = osdn_ops.osdn(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves.get("g"),
                            initial_state=leaves["initial_state"], d0=leaves["d0"], eta=0.05, cu_seqlens=cu)
    loss = (o.float() * seeds[0]).sum() + (s * seeds[1]).sum() + (d * seeds[2]).sum()
    return (o, s, d) + torch.autograd.grad(loss, list(leaves.values()))


@pytest.mark.parametrize("keep", [False, True], ids=["recomputed", "kept_states"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_graph_replay_equals_eager(gate, varlen, keep):
    """``kept_states``: inside ``keep_chunk_states()`` (capture, replay and the eager run)."""
    with osdn_ops.keep_chunk_states(keep):
        _replay_equals_eager(gate, varlen)


def _replay_equals_eager(gate, varlen):
    cu_list = CU if varlen else None
    leaves, cu = _leaves(gate, cu_list, seed=0)
    with torch.no_grad():                   # shapes only: no autograd graph may outlive this call
        o, s, d = osdn_ops.osdn(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves.get("g"),
                                initial_state=leaves["initial_state"], d0=leaves["d0"], cu_seqlens=cu)
    seeds = [torch.randn(t.shape, device="cuda") for t in (o, s, d)]

    side = torch.cuda.Stream()              # warm-up (kernel compilation) off the capturing stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(leaves, cu, seeds)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(leaves, cu, seeds)

    fresh, _ = _leaves(gate, cu_list, seed=1)
    with torch.no_grad():
        for n, t in leaves.items():
            t.copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    eager = _step(leaves, cu, seeds)
    for a, b in zip(captured, eager):
        assert torch.isfinite(b).all()
        assert torch.equal(a, b)
