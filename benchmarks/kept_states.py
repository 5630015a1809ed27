"""Kept chunk states (``osdn_ops.keep_chunk_states``) against the default recomputation, on a GPU.

    PYTHONPATH=. python benchmarks/kept_states.py --shapes S1,S3,S2 --gates none,scalar,channel [--markdown FILE]

Per shape and gate: forward+backward kernel time (the profiler's sum per call, two measurements each) of the public
asym op with the chunk states recomputed by the backward (default) and kept by the forward, whether the two give
bitwise the same gradients, and the memory each forward holds for its backward (outputs and saved tensors). For the
ungated op also ``osdn`` end to end (precond_scan's forward+backward kernels plus the asym op's) and, where fla is
importable, its ratio to fla's ``chunk_delta_rule`` forward+backward kernels on the same inputs. Inputs follow the
benchmark protocol (:func:`osdn_ops.bench.make_problem`); rows are printed (and written) as they come.
"""
import argparse

import torch
import triton

import osdn_ops
from osdn_ops.bench import (GPU_SHAPES, _fla_impl, _osdn_impl, fwd_bwd_step, held_gib, keeping, kernel_times,
                            make_problem)

OPS = {"none": "chunk_delta_asym", "scalar": "chunk_gated_delta_asym", "channel": "chunk_kda_asym"}


def kernel_ms(step, reps=2):
    return [sum(kernel_times(step).values()) for _ in range(reps)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S2,S3")
    ap.add_argument("--gates", default="none,scalar,channel")
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", "",
             "| shape | op | recompute ms | kept ms | kept / recompute | held GiB recompute / kept | gradients |",
             "|---|---|---|---|---|---|---|"]

    def emit(line):
        lines.append(line)
        print(line, flush=True)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write("\n".join(lines) + "\n")

    for name in args.shapes.split(","):
        p = make_problem(name, GPU_SHAPES[name], torch.device("cuda"))
        p.k_tilde = osdn_ops.precond_scan(p.k, p.beta, cu_seqlens=p.cu_seqlens, **p.hp)[0]
        x, run = _osdn_impl("precond_scan", p, torch_kernels=False)
        precond = min(kernel_ms(fwd_bwd_step(run, x)[0]))
        emit(f"| {name} | precond_scan | {precond:.3f} | | | | |")
        try:
            x, run = _fla_impl("chunk_delta_rule", p)
            fla = min(kernel_ms(fwd_bwd_step(run, x)[0]))
            emit(f"| {name} | fla chunk_delta_rule | {fla:.3f} | | | | |")
        except ImportError:
            fla = None
        for gate in args.gates.split(","):
            x, run = _osdn_impl(OPS[gate], p, torch_kernels=False)
            ms, grads, held = {}, {}, {}
            for keep in (False, True):
                run_k = keeping(run, keep)
                step, leaves = fwd_bwd_step(run_k, x)
                step()
                grads[keep] = [t.grad.clone() for t in leaves.values()]
                ms[keep] = kernel_ms(step)
                held[keep] = held_gib(run_k, leaves)
            same = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
            finite = all(torch.isfinite(a).all().item() for a in grads[True])
            del grads
            r, k = min(ms[False]), min(ms[True])
            emit(f"| {name} | {OPS[gate]} | {ms[False][0]:.3f} / {ms[False][1]:.3f} | {ms[True][0]:.3f} / "
                 f"{ms[True][1]:.3f} | {k / r:.3f} | {held[False]:.2f} / {held[True]:.2f} | "
                 f"{'bitwise equal' if same else 'DIFFER'}{'' if finite else ', NOT FINITE'} |")
            if gate == "none":
                vs = f"{(precond + r) / fla:.2f}x / {(precond + k) / fla:.2f}x of fla" if fla else ""
                emit(f"| {name} | osdn (precond_scan + chunk_delta_asym) | {precond + r:.3f} | {precond + k:.3f} | "
                     f"{(precond + k) / (precond + r):.3f} | | {vs} |")


if __name__ == "__main__":
    main()
