"""Kernels vs the fp64 token-by-token oracle, forward and every gradient, relative RMS by dtype.

The public ``osdn_ops`` functions run the CPU reference kernels on CPU and the Triton kernels on
CUDA; the ``osdn_ops.triton`` entry points run Triton (interpreted on CPU, tiny shapes). NaN
never passes (its error is infinite).
"""
import torch
from hypothesis import given

import osdn_ops
from osdn_ops.reference import asym_recurrent, precond_scan_recurrent
from osdn_ops.testing import dtypes, precond_hparams, precond_problems, problems

from .helpers import DEVICE, INTERPRETED, Errors, bound, cotangents, few, kernel_shapes, leaves, require_triton, vjp

ALL_DTYPES = dtypes((torch.float32, torch.bfloat16, torch.float64))
ASYM = ("q", "k", "k_tilde", "v", "g", "beta", "initial_state")
PRECOND = ("k", "beta", "d0", "retention")


def _no_ties(hp):
    """A box whose bounds are away from 1 (the default d0) and apart: a pre-clamp value then does not
    sit on a bound, where fp32 and fp64 could take different sides of the clamp's gradient."""
    return hp["d_max"] > 1.05 * hp["d_min"] and all(abs(b - 1) > 1e-2 for b in (hp["d_min"], hp["d_max"]))


HPARAMS = precond_hparams().filter(_no_ties)


def _precond_fn(fn, p):
    def run(k, beta, d0, retention):
        return fn(k, beta, d0, retention, **p.kwargs())
    return run


def _asym_fn(p, module=None):
    def run(q, k, k_tilde, v, g, beta, initial_state):
        if module is None:
            return asym_recurrent(q, k, k_tilde, v, g, beta, initial_state, scale=p.scale, gate=p.gate,
                                  cu_seqlens=p.cu_seqlens)
        return type(p)(q=q, k=k, k_tilde=k_tilde, v=v, g=g, beta=beta, initial_state=initial_state,
                       cu_seqlens=p.cu_seqlens, scale=p.scale, gate=p.gate).run(module)
    return run


def _oracle_inputs(named):
    """fp64 CPU leaves of the same values."""
    return leaves({n: (None if t is None else t.detach().cpu()) for n, t in named.items()}, torch.float64)


def _compare(test, kind, p, fn, oracle, named, label, same_precision_grads=False):
    """Op and oracle see the same values and the same cotangents (rounded to the op's output dtypes).

    ``same_precision_grads``: take the oracle's gradients at the op's own compute precision (fp32
    for fp32/bf16 inputs). For precond_scan a coordinate pinned at a clamp bound whose pre-clamp
    value overshoots by less than one fp32 ulp lands on the bound in fp32 (gradient passes, as
    torch.clamp) but outside it in fp64 (gradient blocked), so fp32 and fp64 gradients differ there
    legitimately. Outputs are still compared with the fp64 oracle.
    """
    with torch.no_grad():
        shapes_ = [o.shape for o in oracle(**_oracle_inputs(named))]
    cots = cotangents([torch.empty(s) for s in shapes_], seed=7)
    out, grads = vjp(fn, leaves(named), cots)
    rounded = [c.to(o.dtype).double() for c, o in zip(cots, out)]
    out_ref, grads_ref = vjp(oracle, _oracle_inputs(named), rounded)
    if same_precision_grads:
        cpu = leaves({n: (None if t is None else t.detach().cpu()) for n, t in named.items()})
        _, grads_ref = vjp(oracle, cpu, rounded)
    errs = Errors(test)
    for i, (x, ref) in enumerate(zip(out, out_ref)):
        errs.close(f"{label} out{i}", x, ref, bound(named[next(iter(named))].dtype, kind))
    for n, ref in grads_ref.items():
        errs.close(f"d{n}", grads[n], ref, bound(named[n].dtype if n not in ("d0", "initial_state", "g")
                                                  else named["k"].dtype, kind, grad=True))
    errs.check()


@given(precond_problems(dtype=ALL_DTYPES, hparams=HPARAMS))
def test_precond_public_vs_oracle(p):
    named = {n: getattr(p, n) for n in PRECOND}
    _compare("precond_public", "ref", p, _precond_fn(osdn_ops.precond_scan, p),
             _precond_fn(precond_scan_recurrent, p), named, "precond", same_precision_grads=True)


@given(problems(dtype=ALL_DTYPES))
def test_asym_public_vs_oracle(p):
    named = {n: getattr(p, n) for n in ASYM}
    _compare("asym_public", "ref", p, _asym_fn(p, osdn_ops), _asym_fn(p), named, f"gate={p.gate}")


@few()
@given(precond_problems(shape=kernel_shapes(), hparams=HPARAMS, device=DEVICE))
def test_precond_triton_vs_oracle(p):
    mod = require_triton()
    named = {n: getattr(p, n) for n in PRECOND}
    _compare("precond_triton", "triton", p, _precond_fn(mod.precond_scan, p),
             _precond_fn(precond_scan_recurrent, p), named, "precond", same_precision_grads=True)


@few()
@given(problems(shape=kernel_shapes(), device=DEVICE))
def test_asym_triton_vs_oracle(p):
    mod = require_triton()
    named = {n: getattr(p, n) for n in ASYM}
    _compare("asym_triton", "triton", p, _asym_fn(p, mod), _asym_fn(p), named, f"gate={p.gate}")


@few()
@given(problems(shape=kernel_shapes(), device=DEVICE,
                dtype=dtypes((torch.float32,) if INTERPRETED else (torch.float32, torch.bfloat16))))
def test_asym_triton_kept_states_change_no_bit(p):
    """``keep_chunk_states`` changes what the forward holds for the backward, not the results: outputs, final
    state and every gradient are bitwise those of the backward that recomputes the chunk states. fp32 under the
    interpreter, whose recomputing backward holds a bf16 input's chunk states in fp32; bf16 too on a GPU."""
    mod = require_triton()
    named = {n: getattr(p, n) for n in ASYM}
    fn = _asym_fn(p, mod)
    with torch.no_grad():
        cots = cotangents(fn(**named), seed=9)
    runs = []
    for keep in (False, True):
        with osdn_ops.keep_chunk_states(keep):
            runs.append(vjp(fn, leaves(named), cots))
    (out, grads), (out_kept, grads_kept) = runs
    for i, (a, b) in enumerate(zip(out, out_kept)):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"out{i}"
    for n, a in grads.items():
        assert torch.isfinite(a).all() and torch.equal(a, grads_kept[n]), f"d{n}"
