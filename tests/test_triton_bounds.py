"""Every Triton kernel stays inside its tensors: interpreter runs with bounds checking.

Awkward shapes on purpose: a partial single chunk (T = 63), feature sizes that are not powers
of two, packed sequences with empty and one-token ones, and gradients that arrive as broadcast
views (the gradient of a sum), which once made the backward read past a one-element buffer.
"""
import os

import pytest
import torch

from .inputs import asym_call, asym_problem, precond_problem

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="bounds checking needs the Triton interpreter")

CASES = [  # (B, T, H, K, V, dtype, cu_seqlens, initial state)
    (2, 63, 3, 64, 16, torch.bfloat16, None, False),
    (1, 70, 2, 48, 24, torch.float32, [0, 0, 1, 65, 65, 70], True),
]


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_asym_kernels_stay_in_bounds(gate, case):
    from osdn_ops import triton as ot

    from .memcheck import bounds_checked
    B, T, H, K, V, dtype, cu, h0 = CASES[case]
    fn = {"none": ot.chunk_delta_asym, "scalar": ot.chunk_gated_delta_asym, "channel": ot.chunk_kda_asym}[gate]
    x = asym_problem(gate, B=B, T=T, H=H, K=K, V=V, dtype=dtype, cu_seqlens=cu, initial_state=h0,
                     requires_grad=True, seed=case)
    with bounds_checked():
        o, s = asym_call(fn, gate, x)
        (o.float().sum() + s.sum()).backward()  # both gradients arrive as expanded views
    assert torch.isfinite(x["q"].grad).all()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_channel_exact_blocks_stay_in_bounds(case):
    """Every chunk of neither reference form (each token decays every channel by e^-8): the exact block form, whose
    levels read the rows of G at their groups' reference rows, on partial chunks and packed sequences (bf16 and fp32
    cases)."""
    from osdn_ops import triton as ot

    from .memcheck import bounds_checked
    B, T, H, K, V, dtype, cu, h0 = CASES[case]
    x = asym_problem("channel", B=B, T=T, H=H, K=K, V=V, dtype=dtype, cu_seqlens=cu, initial_state=h0,
                     requires_grad=True, seed=case)
    x["g"] = torch.full_like(x["g"], -8.0).requires_grad_()
    with bounds_checked():
        o, s = asym_call(ot.chunk_kda_asym, "channel", x)
        (o.float().sum() + s.sum()).backward()
    assert torch.isfinite(x["g"].grad).all() and torch.isfinite(x["q"].grad).all()


@pytest.mark.parametrize("form", ["tokens", "parallel"])
def test_precond_kernels_stay_in_bounds(form):
    from osdn_ops.triton import precond

    from .memcheck import bounds_checked
    x = precond_problem(B=1, T=70, H=2, K=24, dtype=torch.bfloat16, cu_seqlens=[0, 0, 1, 65, 65, 70], seed=3)
    args = (x["k"], x["beta"].float(), x["d0"].float(), x["retention"].float(), x["cu_seqlens"],
            0.5, 0.5, 2.0, 1e-6, True)
    with bounds_checked():
        kt, d = precond.precond_scan_fwd(*args, form=form)
        grads = precond.precond_scan_bwd(torch.ones(1, 1, 1, 1).expand_as(kt).contiguous(), torch.ones_like(d),
                                         *args, form=form)
    assert all(torch.isfinite(g).all() for g in grads)


def test_memcheck_catches_an_out_of_bounds_read():
    import triton
    import triton.language as tl

    from .memcheck import bounds_checked

    @triton.jit
    def read_past(x, y, n):
        i = tl.arange(0, 16)
        tl.store(y + i, tl.load(x + i + n))

    x, y = torch.randn(16), torch.empty(16)
    with bounds_checked(), pytest.raises(Exception, match="outside every tensor argument of read_past"):
        read_past[(1,)](x, y, 8)
