"""Forward and backward of the asym engine on small grids, a workload for compute-sanitizer.

    compute-sanitizer --tool memcheck python benchmarks/memcheck_asym.py [GATE ...]    # none scalar channel

Each case (bf16, B 1, T 200, H 2, an initial state; K, V and packing below) runs ``chunk_asym_fwd`` and
``chunk_asym_bwd`` and prints whether every output is finite. With two sequence-heads every grid leaves SMs
idle, so the chunk recurrences take their narrowest V blocks (``fill_block_v``): 16-wide where K and V are
multiples of 16, 32-wide elsewhere. An out-of-bounds access shows in the sanitizer's report, not here.
Without a GPU it runs on the CPU (Triton interpreter, ``TRITON_INTERPRET=1``), where the grids are not narrowed.
"""
import sys

import torch

from osdn_ops.reference import state_shape
from osdn_ops.triton.asym import chunk_asym_bwd, chunk_asym_fwd

DEV = "cuda" if torch.cuda.is_available() else "cpu"
#: (K, V, cu_seqlens)
CASES = [(128, 128, None), (64, 48, [0, 70, 200]), (32, 96, None), (100, 40, None), (100, 128, [0, 70, 200])]


def run(gate: str, K: int, V: int, cu, gen: torch.Generator, B=1, T=200, H=2) -> list[int]:
    """Indices of the non-finite outputs among ``(o, final state, *gradients)``."""
    def rnd(*shape):
        return torch.randn(*shape, device=DEV, generator=gen)
    q, k = (torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).bfloat16() for _ in range(2))
    k_tilde = (k.float() * (0.5 + torch.rand(k.shape, device=DEV, generator=gen))).bfloat16()
    v = rnd(B, T, H, V).bfloat16()
    beta = torch.rand(B, T, H, device=DEV, generator=gen).bfloat16()
    g = None if gate == "none" else -0.1 * torch.rand((B, T, H) if gate == "scalar" else (B, T, H, K),
                                                      device=DEV, generator=gen)
    cu_seqlens = None if cu is None else torch.tensor(cu, device=DEV, dtype=torch.int64)
    h0 = rnd(*state_shape(gate, B if cu is None else len(cu) - 1, H, K, V))
    o, final, inverse = chunk_asym_fwd(q, k, k_tilde, v, g, beta, h0, cu_seqlens, K ** -0.5, gate, save=True)
    grads = chunk_asym_bwd(torch.randn_like(o), torch.randn_like(final), q, k, k_tilde, v, g, beta, h0, cu_seqlens,
                           K ** -0.5, gate, inverse)
    if DEV == "cuda":
        torch.cuda.synchronize()
    return [i for i, x in enumerate((o, final, *grads)) if x is not None and not torch.isfinite(x).all()]


def main(gates):
    gen = torch.Generator(device=DEV).manual_seed(5)
    for gate in gates:
        for K, V, cu in CASES:
            print(f"gate {gate} K {K} V {V} cu_seqlens {cu}: non-finite outputs {run(gate, K, V, cu, gen)}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["none", "scalar", "channel"])
