"""Launch settings of the asym engine's Triton kernels, timed on a GPU (the constants in the code come from these).

    PYTHONPATH=. python benchmarks/launch_sweep.py --shapes S2 --gates none,scalar,channel --parts fwd,bwd
    PYTHONPATH=. python benchmarks/launch_sweep.py --shapes S2 --gates none --parts fwd --fwd-stages states

``fwd``: each forward stage alone (``WY_CONFIG``, ``STATES_CONFIG``, ``OUTPUT_CONFIG``) over block width,
warps and stages. ``bwd``: the whole backward (``chunk_asym_bwd``) over the reverse recurrence's warps,
stages and V block (``DH_WARPS, DH_STAGES, DH_BV``) and ``_dqkv``'s warps and stages (``DQKV_WARPS, DQKV_STAGES``); its outputs are
checked against the shipped setting's (they must agree to rounding). Prints, per shape, gate and stage, the
shipped setting's median ms and the four best (``triton.testing.do_bench(warmup=25, rep=200)``). The
precompute of precond_scan is swept by ``benchmarks/bench_precond.py``.
"""
import argparse
import itertools

import torch
import triton

from osdn_ops.triton import asym_bwd, asym_output, asym_states, asym_wy
from osdn_ops.reference import state_shape
from osdn_ops.triton.asym_bwd import chunk_asym_bwd

from asym_stages import cases, stages  # noqa: E402  (this script's folder is on sys.path)

FWD = {
    "wy": (asym_wy.WY_CONFIG, dict(block_out=(64, 128), num_warps=(4, 8), num_stages=(1, 2))),
    # num_stages applies where an SM runs more than one program (S1, S4), deep_stages where it runs one (S2, S3)
    "states": (asym_states.STATES_CONFIG, dict(block_v=(32, 64), num_warps=(4, 8), num_stages=(2, 3, 4),
                                               deep_stages=(2, 3, 4))),
    "output": (asym_output.OUTPUT_CONFIG, dict(block_v=(64, 128), num_warps=(4, 8), num_stages=(1, 2, 3))),
}
#: (DH_WARPS, DH_STAGES, DH_BV, DQKV_WARPS, DQKV_STAGES) tried for the backward (``_dh`` at 4 warps with 32- and
#: 64-wide blocks left out: wrong on the H200 for a property-test shape)
BWD = [(8, 3, 64, 8, 2), (8, 3, 64, 8, 1), (8, 3, 32, 8, 2), (8, 2, 64, 8, 2), (8, 4, 32, 8, 2), (8, 3, 64, 4, 2),
       (8, 3, 64, 16, 2)]


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def report(shape, gate, stage, shipped, results):
    results = sorted(results, key=lambda r: r[0])
    best = "; ".join(f"{t:.4f} {cfg}" for t, cfg in results[:4])
    mine = next((t for t, cfg in results if cfg == shipped), float("nan"))
    print(f"{shape} {gate:8s} {stage:7s} shipped {mine:.4f} {shipped} | best: {best}", flush=True)


def sweep_fwd(shape, gate, p, kt, g, scale, only=tuple(FWD)):
    fns = stages(p.q, p.k, kt, p.v, g, p.beta, gate, scale)
    for stage, (cfg, grid) in ((st, FWD[st]) for st in only):
        shipped = dict(cfg)
        results = []
        for values in itertools.product(*grid.values()):
            cfg.update(zip(grid, values))
            try:
                results.append((ms(fns[stage]), dict(cfg)))
            except Exception as e:  # e.g. out of shared memory: report and go on
                print(f"  {stage} {dict(cfg)}: {type(e).__name__}", flush=True)
        cfg.update(shipped)
        report(shape, gate, stage, shipped, results)


def sweep_bwd(shape, gate, p, kt, g, scale):
    B, T, H, K = p.q.shape
    N = B if p.cu_seqlens is None else p.cu_seqlens.numel() - 1
    do = torch.randn_like(p.v)
    dht = torch.randn(state_shape(gate, N, H, K, p.v.shape[-1]), device=p.q.device)
    names = ("DH_WARPS", "DH_STAGES", "DH_BV", "DQKV_WARPS", "DQKV_STAGES")
    shipped = tuple(getattr(asym_bwd, n) for n in names)

    def run():
        return chunk_asym_bwd(do, dht, p.q, p.k, kt, p.v, g, p.beta, None, p.cu_seqlens, scale, gate)
    ref = run()
    results = []
    for setting in [shipped] + [s for s in BWD if s != shipped]:
        for n, v in zip(names, setting):
            setattr(asym_bwd, n, v)
        try:
            diff = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                       for a, b in zip(run(), ref) if b.numel())
            if diff > 1e-2:
                print(f"  bwd {setting}: outputs differ from the shipped setting's by {diff:.1e}", flush=True)
                continue
            results.append((ms(run), setting))
        except Exception as e:
            print(f"  bwd {setting}: {type(e).__name__}", flush=True)
    for n, v in zip(names, shipped):
        setattr(asym_bwd, n, v)
    report(shape, gate, "bwd", shipped, results)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S2")
    ap.add_argument("--gates", default="none,scalar,channel")
    ap.add_argument("--parts", default="fwd,bwd")
    ap.add_argument("--fwd-stages", default=",".join(FWD), help="forward stages to sweep (default: all)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    for shape, gate, p, kt, g, scale in cases(args.shapes, args.gates):
        if "fwd" in args.parts:
            sweep_fwd(shape, gate, p, kt, g, scale, args.fwd_stages.split(","))
        if "bwd" in args.parts:
            sweep_bwd(shape, gate, p, kt, g, scale)


if __name__ == "__main__":
    main()
