"""The WY chunk form equals the token recurrence, forward and gradients (fp64, any chunk size)."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from osdn_ops.reference import asym_chunked, asym_recurrent
from osdn_ops.testing import problems

from .helpers import Errors, cotangents, leaves, vjp

NAMES = ("q", "k", "k_tilde", "v", "g", "beta", "initial_state")


def _call(fn, p, **extra):
    def run(q, k, k_tilde, v, g, beta, initial_state):
        return fn(q, k, k_tilde, v, g, beta, initial_state, scale=p.scale, gate=p.gate, cu_seqlens=p.cu_seqlens, **extra)
    return run


@given(problems(dtype=st.just(torch.float64)), st.sampled_from((8, 16, 64)))
def test_chunked_equals_recurrent(p, chunk_size):
    named = {n: getattr(p, n) for n in NAMES}
    o, st_ = asym_recurrent(**{n: named[n] for n in NAMES}, scale=p.scale, gate=p.gate, cu_seqlens=p.cu_seqlens)
    cots = cotangents((o, st_), seed=1)
    ref_out, ref_grads = vjp(_call(asym_recurrent, p), leaves(named), cots)
    out, grads = vjp(_call(asym_chunked, p, chunk_size=chunk_size), leaves(named), cots)
    errs = Errors("chunk_vs_recurrent")
    errs.close(f"o gate={p.gate} C={chunk_size}", out[0], ref_out[0], 1e-9)
    errs.close("state", out[1], ref_out[1], 1e-9)
    for n, g in ref_grads.items():
        errs.close(f"d{n}", grads[n], g, 1e-9)
    errs.check()
