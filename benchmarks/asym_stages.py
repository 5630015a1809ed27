"""Where the time of the Triton asymmetric engine goes: each forward stage alone, on a GPU.

    PYTHONPATH=. python benchmarks/asym_stages.py --shapes S1,S2 --gates none,scalar,channel

Prints, per shape and gate, the median ms (``triton.testing.do_bench(warmup=25, rep=200)``,
each timed twice) of the whole forward, of each forward stage (gate cumsum, WY, chunk states,
output) and of the whole forward+backward, then the forward+backward's time per kernel (from the
profiler, averaged over 10 calls). Inputs follow the benchmark protocol
(:func:`osdn_ops.bench.make_problem`); the comparison with fla is ``python -m osdn_ops.bench``.
"""
import argparse

import torch
import triton

import osdn_ops
from osdn_ops.bench import GPU_SHAPES, kernel_times, make_problem
from osdn_ops.triton.asym import chunk_asym_fwd
from osdn_ops.triton.asym_fwd import chunk_layout, chunk_output, chunk_states, gate_cumsum, wy_repr


def bench(fn):
    fn()
    return [triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") for _ in range(2)]


def stages(q, k, kt, v, g, beta, gate, scale):
    """Each forward stage as a thunk, fed with the real outputs of the stage before it."""
    lay = chunk_layout(None, *q.shape[:2])
    G = None if gate == "none" else gate_cumsum(g, None, layout=lay)
    _, W, U = wy_repr(k, kt, v, beta, G, None, gate, layout=lay)
    h_dtype = torch.float32 if k.dtype == torch.float32 else k.dtype
    h, vn, _ = chunk_states(kt, W, U, G, None, None, gate, layout=lay, h_dtype=h_dtype)
    fns = {"wy": lambda: wy_repr(k, kt, v, beta, G, None, gate, layout=lay),
           "states": lambda: chunk_states(kt, W, U, G, None, None, gate, layout=lay, h_dtype=h_dtype),
           "output": lambda: chunk_output(q, kt, vn, h, G, scale, None, gate, layout=lay, out_dtype=v.dtype)}
    if G is not None:
        fns = {"cumsum": lambda: gate_cumsum(g, None, layout=lay), **fns}
    return fns


def cases(shapes: str, gates: str, device="cuda"):
    """``(shape, gate, problem, k_tilde, g, scale)`` for each comma-listed BENCH.md shape and gate; k_tilde
    from precond_scan on the shape's keys, g the gate's log decay (None for "none")."""
    for name in shapes.split(","):
        p = make_problem(name, GPU_SHAPES[name], torch.device(device))
        kt = osdn_ops.precond_scan(p.k, p.beta, **p.hp)[0]
        for gate in gates.split(","):
            g = {"none": None, "scalar": p.g_scalar, "channel": p.g_channel}[gate]
            yield name, gate, p, kt, g, p.q.shape[-1] ** -0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S2")
    ap.add_argument("--gates", default="none,scalar,channel")
    args = ap.parse_args()
    ops = {"none": osdn_ops.chunk_delta_asym, "scalar": osdn_ops.chunk_gated_delta_asym,
           "channel": osdn_ops.chunk_kda_asym}
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    for name, gate, p, kt, g, scale in cases(args.shapes, args.gates):
        row = {"fwd": bench(lambda: chunk_asym_fwd(p.q, p.k, kt, p.v, g, p.beta, None, None, scale, gate))}
        row.update({st: bench(fn) for st, fn in stages(p.q, p.k, kt, p.v, g, p.beta, gate, scale).items()})
        leaves = [t.detach().requires_grad_() for t in (p.q, p.k, kt, p.v) + ((g,) if g is not None else ()) + (p.beta,)]
        do = torch.randn_like(p.v)

        def fwd_bwd():
            o, _ = ops[gate](*leaves)
            torch.autograd.grad(o, leaves, do)
        row["fwd+bwd"] = bench(fwd_bwd)
        print(f"{name} {gate:8s} " + "  ".join(f"{k} {a:.3f}/{b:.3f}" for k, (a, b) in row.items()), flush=True)
        print("   per kernel (fwd+bwd): " + "  ".join(f"{k[:28]} {t:.3f}" for k, t in kernel_times(fwd_bwd).items()
                                                 if t >= 0.005), flush=True)


if __name__ == "__main__":
    main()
