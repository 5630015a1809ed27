"""precond_scan on the GPU: token loop vs chunk-parallel form, forward and forward+backward.

Usage: ``PYTHONPATH=. python benchmarks/bench_precond.py OUT.md`` (CUDA). Shapes S1, S2, S3 and
S1-clamp of BENCH.md (bf16 keys, default hyperparameters; S1-clamp: vocabulary keys, eta 0.5).
Times are medians of ``triton.testing.do_bench(warmup=25, rep=200)`` in ms, kernels called directly
(the backward from the forward's residuals); the fallback share is the share of (chunk, head) pairs
the parallel form ran token by token.
Prints the markdown table and writes it to OUT.md, followed by S1's time per kernel of the parallel form
and its forward and backward at each launch setting.
"""
from __future__ import annotations

import sys

import torch
import triton

from osdn_ops.bench import GPU_SHAPES, kernel_times, make_problem
from osdn_ops.triton import precond as tp
from osdn_ops.triton import precond_fwd as pf
from osdn_ops.triton import precond_parallel as pp

SHAPES = ("S1", "S2", "S3", "S1-clamp")
FORMS = ("tokens", "parallel")


def _args(p):
    hp = p.hp
    return (p.k, p.beta, None, None, p.cu_seqlens, hp["eta"], hp["d_min"], hp["d_max"], hp["eps"], hp["beta_aware"])


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def measure(name: str) -> list[str]:
    """One table row: shape, fwd and fwd+bwd ms per form, speedups, fallback share."""
    base = name.removesuffix("-clamp")
    p = make_problem(base, GPU_SHAPES[base], "cuda", clamp=name.endswith("-clamp"))
    args = _args(p)
    kt, df = tp.precond_scan_fwd(*args)
    gk, gd = torch.randn_like(kt), torch.randn_like(df)
    res = {}
    for form in FORMS:
        fwd = _ms(lambda: tp.precond_scan_fwd(*args, form=form, save=True))
        both = _ms(lambda: tp.precond_scan_bwd(gk, gd, *args, form=form,
                                               saved=tp.precond_scan_fwd(*args, form=form, save=True)[2:]))
        res[form] = (fwd, both)
    share = tp.precond_fallback_share(p.k, p.beta, None, None, p.cu_seqlens, **p.hp)
    (tf, tb), (pf, pb) = res["tokens"], res["parallel"]
    return [name, f"{tf:.3f}", f"{pf:.3f}", f"{tf / pf:.1f}x", f"{tb:.3f}", f"{pb:.3f}", f"{tb / pb:.1f}x",
            f"{share:.3f}"]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _knobs():
    """Launch settings of the parallel form: name -> (setter, choices, shipped value)."""
    def attr(mod, name):
        return lambda v: setattr(mod, name, v)

    def warps(adjoint):
        return lambda v: pp.PRECOMPUTE_WARPS.__setitem__(adjoint, v)
    return {"chain warps": (attr(pf, "CHAIN_WARPS"), (1, 2, 4), pf.CHAIN_WARPS),
            "output pass warps": (attr(pf, "OUT_WARPS"), (1, 2, 4), pf.OUT_WARPS),
            "adjoint pass warps": (attr(pf, "ADJOINT_OUT_WARPS"), (1, 2, 4), pf.ADJOINT_OUT_WARPS),
            "precompute warps": (warps(False), (1, 2, 4), pp.PRECOMPUTE_WARPS[False]),
            "adjoint precompute warps": (warps(True), (1, 2, 4), pp.PRECOMPUTE_WARPS[True])}


def parts(name: str = "S1") -> list[str]:
    """Where the parallel form's time goes on one shape: each kernel's ms per forward and per backward
    (profiler), then forward and backward ms at each launch setting (one changed at a time; every setting's outputs
    and gradients are compared with the shipped one's)."""
    p = make_problem(name, GPU_SHAPES[name], "cuda")
    args = _args(p)
    kt0, df0, *saved = tp.precond_scan_fwd(*args, form="parallel", save=True)
    gk, gd = torch.randn_like(kt0), torch.randn_like(df0)
    g0 = tp.precond_scan_bwd(gk, gd, *args, form="parallel", saved=saved)

    lines = []
    for part, fn in (("forward", lambda: tp.precond_scan_fwd(*args, form="parallel", save=True)),
                     ("backward", lambda: tp.precond_scan_bwd(gk, gd, *args, form="parallel", saved=saved))):
        per_kernel = "  ".join(f"{k[:32]} {t:.3f}" for k, t in kernel_times(fn).items())
        lines.append(f"{name} parallel form, ms per {part}: {per_kernel}")
    for knob, (set_to, choices, shipped) in _knobs().items():
        res = []
        for v in choices:
            set_to(v)
            kt, df, *sv = tp.precond_scan_fwd(*args, save=True)
            g = tp.precond_scan_bwd(gk, gd, *args, saved=sv)
            same = max([_rel(kt, kt0), _rel(df, df0)] + [_rel(a, b) for a, b in zip(g[:3], g0[:3])])
            fwd = _ms(lambda: tp.precond_scan_fwd(*args, save=True))
            bwd = _ms(lambda: tp.precond_scan_bwd(gk, gd, *args, saved=sv))
            res.append(f"{v}: fwd {fwd:.3f} bwd {bwd:.3f}" + ("" if same < 1e-4 else f" (differs: {same:.1e})"))
        set_to(shipped)
        lines.append(f"{name} {knob} (shipped {shipped}): " + "; ".join(res))
    return lines


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    head = ["shape", "tokens fwd", "parallel fwd", "speedup", "tokens fwd+bwd", "parallel fwd+bwd", "speedup",
            "fallback share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in SHAPES:
        lines.append("| " + " | ".join(measure(name)) + " |")
        print(lines[-1], flush=True)
    text = "precond_scan, median ms (" + torch.cuda.get_device_name() + ")\n\n" + "\n".join(lines) + "\n"
    extra = parts()
    print("\n".join(extra), flush=True)
    text += "\n" + "\n\n".join(extra) + "\n"
    print(text)
    if argv:
        with open(argv[0], "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
