"""KDA forward+backward time per kernel under gate patterns that choose the near or the far paths, on a GPU.

    PYTHONPATH=. python benchmarks/gate_paths.py [OUT_FILE]

The channel gate's chunks take the block-by-block forward and the channel-by-channel gate gradient ("far")
when their in-chunk gate span exceeds 60 or when every token decays every channel by more than e^-4; the
others take the matrix-product forms ("near"). On the S1 problem of :func:`osdn_ops.bench.make_problem`,
prints the profiler's kernel ms per call (total and ``_dqkv``) for: the bench gates (near), the bench gates
with one token per chunk at -6 in every channel (near), every gate lowered by 6 (far), the bench gates again.
"""
import sys

import torch

import osdn_ops
from osdn_ops.bench import GPU_SHAPES, kernel_times, make_problem


def main(path=None):
    out = open(path, "w") if path else None

    def log(s):
        print(s, flush=True)
        if out:
            out.write(s + "\n")
            out.flush()

    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    p = make_problem("S1", GPU_SHAPES["S1"], torch.device("cuda"))
    kt = osdn_ops.precond_scan(p.k, p.beta, **p.hp)[0]
    one = p.g_channel.clone()
    one[:, ::64] = -6.0
    cases = [("bench", p.g_channel), ("one token per chunk at -6", one), ("every gate - 6", p.g_channel - 6.0),
             ("bench again", p.g_channel)]
    for name, g in cases:
        leaves = [t.detach().requires_grad_() for t in (p.q, p.k, kt, p.v, g, p.beta)]
        do = torch.randn_like(p.v)

        def fwd_bwd():
            o, _ = osdn_ops.chunk_kda_asym(*leaves)
            torch.autograd.grad(o, leaves, do)
        times = kernel_times(fwd_bwd)
        dqkv = sum(t for k, t in times.items() if "_dqkv" in k)
        log(f"{name:27s} total {sum(times.values()):.3f} ms  _dqkv {dqkv:.3f} ms  "
            + "  ".join(f"{k[:20]} {t:.3f}" for k, t in list(times.items())[:4]))


if __name__ == "__main__":
    main(*sys.argv[1:2])
