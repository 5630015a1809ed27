"""Reduction: eta = 0 and d0 = 1 give k_tilde == k, and an asym op with k_tilde = k is its symmetric parent."""
import dataclasses
import importlib.util

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import osdn_ops
from osdn_ops.reference import symmetric
from osdn_ops.testing import dtypes, precond_hparams, precond_problems, problems, shapes

from .helpers import DEVICE, Errors, bound, few, kernel_shapes, require_triton

ALL_DTYPES = dtypes((torch.float32, torch.bfloat16, torch.float64))


def _no_step(hp):
    """eta = 0 with a box that holds d0 = 1."""
    return dict(hp, eta=0.0, d_min=min(hp["d_min"], 1.0), d_max=max(hp["d_max"], 1.0))


def _identity_problems(**kw):
    """Any precond problem with eta = 0, d0 = 1 (None) and r = 1 (None)."""
    problem = precond_problems(hparams=precond_hparams(adversarial=True).map(_no_step), **kw)
    return problem.map(lambda p: dataclasses.replace(p, d0=None, retention=None))


def _parent(p):
    """The symmetric parent on the problem's inputs in fp64."""
    x = {n: (None if t is None else t.double().cpu()) for n, t in
         dict(q=p.q, k=p.k, v=p.v, g=p.g, beta=p.beta, h0=p.initial_state).items()}
    kw = dict(scale=p.scale, cu_seqlens=None if p.cu_seqlens is None else p.cu_seqlens.cpu())
    if p.gate == "none":
        return symmetric.delta_rule(x["q"], x["k"], x["v"], x["beta"], x["h0"], **kw)
    if p.gate == "scalar":
        return symmetric.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"], **kw)
    return symmetric.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"], **kw)


@given(_identity_problems(dtype=ALL_DTYPES))
def test_eta_zero_gives_k(p):
    k_tilde, d_final = p.run()
    assert torch.equal(k_tilde, p.k), "k_tilde != k with eta = 0, d0 = 1"
    assert (d_final == 1).all()


@few()
@given(_identity_problems(shape=kernel_shapes(), device=DEVICE))
def test_eta_zero_gives_k_triton(p):
    k_tilde, _ = p.run(require_triton().precond_scan)
    assert torch.equal(k_tilde, p.k), "k_tilde != k with eta = 0, d0 = 1"


@given(problems(k_tilde="same", dtype=ALL_DTYPES))
def test_asym_with_k_is_symmetric_parent(p):
    o, state = p.run()
    o_ref, state_ref = _parent(p)
    errs = Errors("reduction_public")
    errs.close(f"o gate={p.gate}", o, o_ref, bound(p.v.dtype))
    errs.close("state", state, state_ref, bound(p.v.dtype))
    errs.check()


@few()
@given(problems(k_tilde="same", shape=kernel_shapes(), device=DEVICE))
def test_triton_asym_with_k_is_symmetric_parent(p):
    o, state = p.run(require_triton())
    o_ref, state_ref = _parent(p)
    errs = Errors("reduction_triton")
    errs.close(f"o gate={p.gate}", o, o_ref, bound(p.v.dtype, "triton"))
    errs.close("state", state, state_ref, bound(p.v.dtype, "triton"))
    errs.check()


def _fla(p):
    """fla's chunk kernel on the problem (fla states are [N,H,K,V])."""
    h0 = p.initial_state
    kw = dict(scale=p.scale, output_final_state=True, cu_seqlens=None if p.cu_seqlens is None else p.cu_seqlens.long())
    if p.gate == "none":
        from fla.ops.delta_rule import chunk_delta_rule
        o, S = chunk_delta_rule(p.q, p.k, p.v, p.beta, initial_state=None if h0 is None else h0.transpose(-1, -2).contiguous(), **kw)
        return o, S.transpose(-1, -2)
    if p.gate == "scalar":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        o, S = chunk_gated_delta_rule(p.q, p.k, p.v, p.g, p.beta, initial_state=None if h0 is None else h0.transpose(-1, -2).contiguous(), **kw)
        return o, S.transpose(-1, -2)
    from fla.ops.kda import chunk_kda
    return chunk_kda(p.q, p.k, p.v, p.g, p.beta, initial_state=h0, **kw)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and fla")
@few()
@given(problems(k_tilde="same", key_norm="unit", dtype=st.just(torch.bfloat16),
                shape=shapes(min_dim=64, max_dim=128, dim_multiple=64, max_T=300, max_heads=2),
                device="cuda"))
def test_asym_with_k_matches_fla(p):
    """The symmetric parent as fla computes it. K, V in {64, 128} and at most two heads: fla compiles and
    tunes its kernels for each new shape (about a minute for the first few examples on the H200)."""
    o, state = p.run(osdn_ops)
    o_fla, state_fla = _fla(p)
    errs = Errors("reduction_fla")
    errs.close(f"o gate={p.gate}", o, o_fla, 3e-2)
    errs.close("state", state, state_fla, 3e-2)
    errs.check()
