"""Forward and backward of the asym ops on small grids, a workload for compute-sanitizer.

    PYTHONPATH=. compute-sanitizer --tool memcheck python benchmarks/memcheck_asym.py [GATE ...] [--dtypes D,...]

GATE: none, scalar, channel (default all three); D: bfloat16 (default), float16, float32.
Each case (each dtype, B 1, T 200, H 2, an initial state; K, V and packing below) runs the Triton op forward and
backward, under its usual gates and (gated ops) under gates ``-20 u^2`` (every chunk of the channel gate's
backward in the exact block form), and prints whether every output and gradient is finite. With two
sequence-heads every grid leaves SMs idle, so the chunk recurrences take the narrowest V blocks they allow for
the input (``fill_block_v``; narrowed only where K and V are multiples of 16). An out-of-bounds access shows in the
sanitizer's report, not here. Without a GPU it runs on the CPU (Triton interpreter, ``TRITON_INTERPRET=1``), where
the grids are not narrowed.
"""
import argparse

import torch

import osdn_ops.triton as ot
from tests.inputs import asym_call, asym_problem, strong_decay

DEV = "cuda" if torch.cuda.is_available() else "cpu"
T = 200
#: (K, V, cu_seqlens)
CASES = [(128, 128, None), (64, 48, [0, 70, 200]), (32, 96, None), (100, 40, None), (100, 128, [0, 70, 200])]
OPS = {"none": ot.chunk_delta_asym, "scalar": ot.chunk_gated_delta_asym, "channel": ot.chunk_kda_asym}


def run(gate: str, K: int, V: int, cu, dtype: torch.dtype, seed: int, strong: bool = False) -> list[str]:
    """Names of the non-finite ones among the output, the final state and the inputs' gradients. ``strong``: gates
    ``-20 u^2`` (u uniform in [0, 1)), which put every chunk of the channel gate's backward in the exact block form."""
    x = asym_problem(gate, B=1, T=T, H=2, K=K, V=V, dtype=dtype, cu_seqlens=cu, requires_grad=True,
                     seed=seed, device=DEV)
    if strong:
        strong_decay(x, gate, seed)
    o, final = asym_call(OPS[gate], gate, x)
    torch.autograd.backward((o, final), (torch.randn_like(o), torch.randn_like(final)))
    named = {"o": o, "final_state": final, **{f"d{n}": t.grad for n, t in x.items()
                                              if isinstance(t, torch.Tensor) and t.grad is not None}}
    return [n for n, t in named.items() if not torch.isfinite(t).all()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gates", nargs="*", choices=list(OPS), default=list(OPS))
    ap.add_argument("--dtypes", default="bfloat16", help="comma list of bfloat16, float16, float32")
    args = ap.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    for gate in args.gates:
        for dtype in dtypes:
            for seed, (K, V, cu) in enumerate(CASES):
                for strong in (False, True) if gate != "none" else (False,):
                    bad = run(gate, K, V, cu, dtype, seed, strong)
                    print(f"gate {gate} {dtype} K {K} V {V} cu_seqlens {cu} strong gates {strong}: non-finite {bad}",
                          flush=True)


if __name__ == "__main__":
    main()
