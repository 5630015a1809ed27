"""pytest-benchmark suite: forward and forward+backward of every op.

``python -m pytest benchmarks --benchmark-enable`` times them (BENCH.md's S1 on a GPU, a
scaled-down S1 on the CPU). With the default ``--benchmark-disable`` each case runs once, as a
smoke test. GPU timings synchronize the device inside the timed function. For the comparison
table with fla and the float64 error check, use ``python -m osdn_ops.bench``.
"""
import pytest
import torch

import osdn_ops
from osdn_ops.bench import CPU_SHAPES, GPU_SHAPES, OPS, _osdn_impl, fwd_bwd_step, keeping, make_problem

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def problem():
    shape = (GPU_SHAPES if DEVICE.type == "cuda" else CPU_SHAPES)["S1"]
    p = make_problem("S1", shape, DEVICE, seed=1)
    p.k_tilde = osdn_ops.precond_scan(p.k, p.beta, **p.hp)[0]
    return p


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("op", OPS)
def test_forward(benchmark, problem, op):
    x, run = _osdn_impl(op, problem, torch_kernels=False)

    def fwd():
        with torch.no_grad():
            out = run(x)
        _sync()
        return out

    o = benchmark(fwd)[0]
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("op,keep", [(op, False) for op in OPS] + [(op, True) for op in OPS if op != "precond_scan"])
def test_forward_backward(benchmark, problem, op, keep):
    """``keep``: inside ``osdn_ops.keep_chunk_states()`` (the asym ops' backward then recomputes no states)."""
    x, run = _osdn_impl(op, problem, torch_kernels=False)
    step, leaves = fwd_bwd_step(keeping(run, keep), x)

    def fwd_bwd():
        step()
        _sync()

    benchmark(fwd_bwd)
    assert all(torch.isfinite(t.grad).all() for t in leaves.values())
