"""Sequence-structure properties: state chaining, varlen packing, batch-row / head independence.

Each runs for ``precond_scan`` and the asym ops, through the public functions and, when
importable, the Triton entry points (tiny shapes under the interpreter on CPU).
"""
import dataclasses

import torch
from hypothesis import given
from hypothesis import strategies as st

import osdn_ops
from osdn_ops.testing import precond_problems, problems, shapes

from .helpers import DEVICE, INTERPRETED, Errors, bound, few, kernel_shapes, require_triton

SMALL = shapes()
IMPLS = ("public", "triton")


def _module(impl):
    return osdn_ops if impl == "public" else require_triton()


def _strategies(impl, kind, **shape_kw):
    """(problem strategy, device) for an implementation; shapes tiny under the interpreter."""
    interp = impl == "triton" and INTERPRETED
    base = kernel_shapes() if impl == "triton" else SMALL
    sh = shapes(max_T=40 if interp else 80, max_dim=24 if interp else 32, **shape_kw)
    device = DEVICE if impl == "triton" else "cpu"
    if kind == "precond":
        return precond_problems(shape=sh if shape_kw else base, device=device)
    return problems(shape=sh if shape_kw else base, device=device)


def _slice(x, s, e):
    return None if x is None else x[:, s:e].contiguous()


def _rows(x, idx):
    return None if x is None else x[idx].contiguous()


def _precond(mod, p, **over):
    args = dict(k=p.k, beta=p.beta, d0=p.d0, retention=p.retention)
    args.update(over)
    return mod.precond_scan(args["k"], args["beta"], args["d0"], args["retention"], **p.hparams(),
                            cu_seqlens=args.get("cu_seqlens", p.cu_seqlens))


def _asym(mod, p, **over):
    return dataclasses.replace(p, **over).run(mod)


def _tol(x, impl):
    """Bound by the input dtype ``x.dtype``, also for fp32 states: a kernel may take bf16 operands
    for its state products, so chaining through an fp32 state differs at bf16 level."""
    return bound(x.dtype, "triton" if impl == "triton" else "ref")


# ----------------------------------------------------------------- state chaining

def _chain_case(impl):
    @given(_strategies(impl, "precond", varlen=False), st.floats(0, 1))
    def precond_case(p, frac):
        mod = _module(impl)
        T = p.k.shape[1]
        cut = int(frac * T)
        kt, d = _precond(mod, p)
        kt1, d1 = _precond(mod, p, k=_slice(p.k, 0, cut), beta=_slice(p.beta, 0, cut), retention=_slice(p.retention, 0, cut))
        kt2, d2 = _precond(mod, p, k=_slice(p.k, cut, T), beta=_slice(p.beta, cut, T),
                           retention=_slice(p.retention, cut, T), d0=d1)
        errs = Errors(f"chain_precond_{impl}")
        errs.close(f"k_tilde cut={cut}/{T}", torch.cat([kt1, kt2], 1), kt, _tol(p.k, impl))
        errs.close("d_final", d2, d, _tol(p.k, impl))
        errs.check()

    @given(_strategies(impl, "asym", varlen=False), st.floats(0, 1))
    def asym_case(p, frac):
        mod = _module(impl)
        T = p.k.shape[1]
        cut = int(frac * T)
        o, S = _asym(mod, p)
        part = {n: getattr(p, n) for n in ("q", "k", "k_tilde", "v", "g", "beta")}
        o1, S1 = _asym(mod, p, **{n: _slice(x, 0, cut) for n, x in part.items()})
        o2, S2 = _asym(mod, p, initial_state=S1, **{n: _slice(x, cut, T) for n, x in part.items()})
        errs = Errors(f"chain_asym_{impl}")
        errs.close(f"o gate={p.gate} cut={cut}/{T}", torch.cat([o1, o2], 1), o, _tol(p.v, impl))
        errs.close("state", S2, S, _tol(p.v, impl))
        errs.check()

    return precond_case, asym_case


test_chain_precond_public, test_chain_asym_public = _chain_case("public")
test_chain_precond_triton, test_chain_asym_triton = (few()(t) for t in _chain_case("triton"))


# ----------------------------------------------------------------- varlen packing

def _bounds(p):
    cu = p.cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _varlen_case(impl):
    @given(_strategies(impl, "precond", varlen=True))
    def precond_case(p):
        mod = _module(impl)
        kt, d = _precond(mod, p)
        pieces, finals = [], []
        for n, (s, e) in enumerate(_bounds(p)):
            a, b = _precond(mod, p, k=_slice(p.k, s, e), beta=_slice(p.beta, s, e), retention=_slice(p.retention, s, e),
                            d0=None if p.d0 is None else p.d0[n:n + 1].contiguous(), cu_seqlens=None)
            pieces.append(a)
            finals.append(b)
        errs = Errors(f"varlen_precond_{impl}")
        errs.close(f"k_tilde lengths={p.shape.lengths}", torch.cat(pieces, 1), kt, _tol(p.k, impl))
        errs.close("d_final", torch.cat(finals, 0), d, _tol(p.k, impl))
        errs.check()

    @given(_strategies(impl, "asym", varlen=True))
    def asym_case(p):
        mod = _module(impl)
        o, S = _asym(mod, p)
        outs, finals = [], []
        for n, (s, e) in enumerate(_bounds(p)):
            part = {x: _slice(getattr(p, x), s, e) for x in ("q", "k", "k_tilde", "v", "g", "beta")}
            h0 = None if p.initial_state is None else p.initial_state[n:n + 1].contiguous()
            a, b = _asym(mod, p, initial_state=h0, cu_seqlens=None, **part)
            outs.append(a)
            finals.append(b)
        errs = Errors(f"varlen_asym_{impl}")
        errs.close(f"o gate={p.gate} lengths={p.shape.lengths}", torch.cat(outs, 1), o, _tol(p.v, impl))
        errs.close("state", torch.cat(finals, 0), S, _tol(p.v, impl))
        errs.check()

    return precond_case, asym_case


test_varlen_precond_public, test_varlen_asym_public = _varlen_case("public")
test_varlen_precond_triton, test_varlen_asym_triton = (few()(t) for t in _varlen_case("triton"))


# ----------------------------------------------------------------- position independence

def _perm(gen_seed, n):
    return torch.randperm(n, generator=torch.Generator().manual_seed(gen_seed))


def _permute(x, rows, heads, head_dim=2):
    """Permute batch rows (dim 0) and heads (``head_dim``)."""
    if x is None:
        return None
    return x[rows.to(x.device)].index_select(head_dim, heads.to(x.device)).contiguous()


def _position_case(impl):
    @given(_strategies(impl, "precond", varlen=False, max_batch=3, max_heads=3), st.integers(0, 2**32))
    def precond_case(p, seed):
        mod = _module(impl)
        rows, heads = _perm(seed, p.k.shape[0]), _perm(seed + 1, p.k.shape[2])
        kt, d = _precond(mod, p)
        kt2, d2 = _precond(mod, p, k=_permute(p.k, rows, heads), beta=_permute(p.beta, rows, heads),
                           retention=_permute(p.retention, rows, heads), d0=_permute(p.d0, rows, heads, 1))
        errs = Errors(f"position_precond_{impl}")
        errs.close("k_tilde", kt2, _permute(kt, rows, heads), _tol(p.k, impl))
        errs.close("d_final", d2, _permute(d, rows, heads, 1), _tol(p.k, impl))
        errs.check()

    @given(_strategies(impl, "asym", varlen=False, max_batch=3, max_heads=3), st.integers(0, 2**32))
    def asym_case(p, seed):
        mod = _module(impl)
        rows, heads = _perm(seed, p.k.shape[0]), _perm(seed + 1, p.k.shape[2])
        o, S = _asym(mod, p)
        moved = {x: _permute(getattr(p, x), rows, heads) for x in ("q", "k", "k_tilde", "v", "g", "beta")}
        o2, S2 = _asym(mod, p, initial_state=_permute(p.initial_state, rows, heads, 1), **moved)
        errs = Errors(f"position_asym_{impl}")
        errs.close(f"o gate={p.gate}", o2, _permute(o, rows, heads), _tol(p.v, impl))
        errs.close("state", S2, _permute(S, rows, heads, 1), _tol(p.v, impl))
        errs.check()

    return precond_case, asym_case


test_position_precond_public, test_position_asym_public = _position_case("public")
test_position_precond_triton, test_position_asym_triton = (few()(t) for t in _position_case("triton"))
