"""torch.library.opcheck (schema, autograd registration, fake tensor, AOT dispatch) on every op."""
import pytest
import torch
from torch.library import opcheck

from osdn_ops import library

from .inputs import asym_problem, precond_problem

HP = dict(eta=0.1, d_min=0.5, d_max=2.0, eps=1e-6, beta_aware=True)
OPS = {"none": torch.ops.osdn.chunk_delta_asym.default, "scalar": torch.ops.osdn.chunk_gated_delta_asym.default,
       "channel": torch.ops.osdn.chunk_kda_asym.default}
CASES = [  # (optional inputs given, cu_seqlens, requires_grad, dtype)
    (False, None, False, torch.float32),
    (True, None, True, torch.float64),
    (True, [0, 4, 4, 11], True, torch.float32),
    (False, [0, 11], False, torch.bfloat16),
]


@pytest.mark.parametrize("optional,cu,grad,dtype", CASES)
def test_opcheck_precond_scan(optional, cu, grad, dtype):
    x = precond_problem(B=1 if cu else 2, T=11, H=2, K=4, dtype=dtype, cu_seqlens=cu, d0=optional,
                        retention=optional, requires_grad=grad, seed=7)
    opcheck(torch.ops.osdn.precond_scan.default, (x["k"], x["beta"], x["d0"], x["retention"], x["cu_seqlens"]), HP)


@pytest.mark.parametrize("gate", list(OPS))
@pytest.mark.parametrize("optional,cu,grad,dtype", CASES)
def test_opcheck_asym(gate, optional, cu, grad, dtype):
    x = asym_problem(gate, B=1 if cu else 2, T=11, H=2, K=4, V=3, dtype=dtype, cu_seqlens=cu,
                     initial_state=optional, requires_grad=grad, seed=8)
    args = [x["q"], x["k"], x["k_tilde"], x["v"]] + ([] if gate == "none" else [x["g"]])
    for keep in (False, True):
        opcheck(OPS[gate], (*args, x["beta"], x["initial_state"], x["cu_seqlens"]), {"scale": 0.5, "keep_states": keep})


@pytest.mark.parametrize("gate", list(OPS))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck_asym_backward(gate, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = asym_problem(gate, B=1, T=11, H=2, K=16, V=16, dtype=torch.float32, cu_seqlens=[0, 6, 11], seed=9,
                     device=device)
    o, s, inverse, states = library.ASYM_OPS[gate](*([x["q"], x["k"], x["k_tilde"], x["v"]]
                                                     + ([] if gate == "none" else [x["g"]])),
                                                   x["beta"], x["initial_state"], x["cu_seqlens"], scale=0.5,
                                                   keep_states=True)
    assert (states.numel() > 0) == (device == "cuda")
    args = (torch.randn_like(o), torch.randn_like(s), x["q"], x["k"], x["k_tilde"], x["v"], x["g"], x["beta"],
            x["initial_state"], x["cu_seqlens"])
    # the forward's WY inverse and chunk states, its inverse alone, or nothing (recomputed)
    for kept in ((inverse, states), (inverse, None), (None, None)):
        opcheck(torch.ops.osdn.chunk_asym_backward.default, args + kept, {"scale": 0.5, "gate": gate})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck_precond_scan_backward(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = precond_problem(B=2, T=11, H=2, K=16, dtype=torch.float32, seed=10, device=device)
    kt, d, ckpt, flags = library.precond_scan(x["k"], x["beta"], x["d0"], x["retention"], None, **HP)
    args = (torch.randn_like(kt), torch.randn_like(d), x["k"], x["beta"], x["d0"], x["retention"], None)
    for saved in ((ckpt, flags), (None, None)):        # the forward's residuals, or none (recomputed)
        opcheck(torch.ops.osdn.precond_scan_backward.default, args + saved, HP)
