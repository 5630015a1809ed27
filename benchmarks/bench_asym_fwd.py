"""Forward timing of the Triton asymmetric delta engine next to fla (BENCH.md protocol).

Prints, per shape (S1, S2) and gate: chunk_asym_fwd, each stage alone, and the fla peer
forward (chunk_delta_rule / chunk_gated_delta_rule / chunk_kda), median ms of
``triton.testing.do_bench(warmup=25, rep=200)``, each timed twice.
``--sweep`` first times stage launch settings on S1 and keeps the best for the table.
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F
import triton

from osdn_ops.triton import asym_output, asym_states, asym_wy
from osdn_ops.triton.asym import chunk_asym_fwd
from osdn_ops.triton.asym_fwd import chunk_layout, chunk_output, chunk_states, gate_cumsum, wy_repr

SHAPES = {"S1": (8, 2048, 16, 128, 128), "S2": (4, 4096, 8, 128, 128)}


def inputs(gate, B, T, H, K, V):
    torch.manual_seed(0)
    q, k = (F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1) for _ in range(2))
    kt = k * (1 + 0.01 * torch.randn_like(k))
    g = F.logsigmoid(torch.randn(B, T, H, *((K,) if gate == "channel" else ()), device="cuda")) / 16
    return dict(q=q.bfloat16(), k=k.bfloat16(), kt=kt.bfloat16(), v=torch.randn(B, T, H, V, device="cuda").bfloat16(),
                g=None if gate == "none" else g, beta=torch.sigmoid(torch.randn(B, T, H, device="cuda")))


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return [triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") for _ in range(2)]


def stage_fns(x, gate, scale):
    lay = chunk_layout(None, *x["q"].shape[:2])
    G = None if gate == "none" else gate_cumsum(x["g"], None, layout=lay)
    _, W, U = wy_repr(x["k"], x["kt"], x["v"], x["beta"], G, None, gate, layout=lay)
    h, vn, _ = chunk_states(x["kt"], W, U, G, None, None, gate, layout=lay, h_dtype=torch.bfloat16)
    fns = {
        "wy": lambda: wy_repr(x["k"], x["kt"], x["v"], x["beta"], G, None, gate, layout=lay),
        "states": lambda: chunk_states(x["kt"], W, U, G, None, None, gate, layout=lay, h_dtype=torch.bfloat16),
        "output": lambda: chunk_output(x["q"], x["kt"], vn, h, G, scale, None, gate, layout=lay),
    }
    if G is not None:
        fns = {"cumsum": lambda: gate_cumsum(x["g"], None, layout=lay), **fns}
    return fns


def fla_fn(gate, x, scale):
    try:
        if gate == "none":
            from fla.ops.delta_rule import chunk_delta_rule
            return lambda: chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"].bfloat16(), scale=scale,
                                            output_final_state=True)
        if gate == "scalar":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            return lambda: chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"].bfloat16(), scale=scale,
                                                  output_final_state=True)
        from fla.ops.kda import chunk_kda
        return lambda: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"].bfloat16(), scale=scale,
                                 output_final_state=True)
    except Exception as e:  # fla is optional
        print(f"  fla unavailable: {type(e).__name__}: {e}")
        return None


SWEEP = {
    "states": (asym_states.STATES_CONFIG, [dict(block_v=16, num_warps=4), dict(block_v=32, num_warps=4),
                                           dict(block_v=64, num_warps=4), dict(block_v=32, num_warps=8)]),
    "output": (asym_output.OUTPUT_CONFIG, [dict(block_v=64, num_warps=4), dict(block_v=128, num_warps=4),
                                           dict(block_v=64, num_warps=8)]),
    "wy": (asym_wy.WY_CONFIG, [dict(block_out=64, num_warps=4), dict(block_out=128, num_warps=4)]),
}


def sweep(gates):
    """Time each stage's launch options on S1 for every gate; keep the option with the least total."""
    B, T, H, K, V = SHAPES["S1"]
    xs = {gate: inputs(gate, B, T, H, K, V) for gate in gates}
    for stage, (cfg, options) in SWEEP.items():
        totals = []
        for opt in options:
            cfg.update(opt)
            times = []
            for gate in gates:
                fn = stage_fns(xs[gate], gate, K ** -0.5)[stage]
                fn()
                times.append(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
            totals.append((sum(times), times, dict(opt)))
            print(f"sweep S1 {stage:7s} {opt} " + " ".join(f"{g}:{t:.3f}" for g, t in zip(gates, times)), flush=True)
        best = min(totals, key=lambda r: r[0])
        cfg.update(best[2])
        print(f"sweep S1 {stage:7s} chosen {best[2]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default="S1,S2")
    ap.add_argument("--gates", default="none,scalar,channel")
    ap.add_argument("--no-fla", action="store_true")
    a = ap.parse_args()
    gates = a.gates.split(",")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), time.strftime("%Y-%m-%d"), flush=True)
    if a.sweep:
        try:
            sweep(gates)
        except Exception as e:
            print(f"sweep failed: {type(e).__name__}: {e}", flush=True)
    for name in a.shapes.split(","):
        B, T, H, K, V = SHAPES[name]
        for gate in gates:
            try:
                table_row(name, gate, a.no_fla, B, T, H, K, V)
            except Exception as e:
                print(f"{name} {gate} failed: {type(e).__name__}: {e}", flush=True)
    sys.stdout.flush()


def table_row(name, gate, no_fla, B, T, H, K, V):
    x = inputs(gate, B, T, H, K, V)
    scale = K ** -0.5
    row = {"fwd": bench(lambda: chunk_asym_fwd(x["q"], x["k"], x["kt"], x["v"], x["g"], x["beta"], None, None,
                                                scale, gate))}
    for st, fn in stage_fns(x, gate, scale).items():
        row[st] = bench(fn)
    peer = None if no_fla else fla_fn(gate, x, scale)
    if peer is not None:
        try:
            row["fla"] = bench(peer)
        except Exception as e:
            print(f"  fla failed: {type(e).__name__}: {e}")
    cells = "  ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in row.items())
    ratio = f"  fwd/fla {row['fwd'][0] / row['fla'][0]:.2f}" if "fla" in row else ""
    print(f"{name} {gate:8s} {cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
