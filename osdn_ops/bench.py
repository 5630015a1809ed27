"""Benchmark CLI: ``python -m osdn_ops.bench``.

Times every available implementation of every op on the shapes of the benchmark protocol
(scaled down on the CPU), checks each against the float64 reference on a slice of the problem
(the first sequence or two and two heads: heads and sequences are independent, so the slice is
exact), and prints one table: op, impl, shape, fwd ms, fwd+bwd ms, ratios to the best peer,
error. Implementations:

- ``osdn``: the public op on the device (Triton on CUDA, the PyTorch kernel on the CPU);
- ``osdn-kept``: the same inside ``osdn_ops.keep_chunk_states()`` (the asym ops and ``osdn``; opt-in): the forward
  keeps its chunk states and the backward recomputes none;
- ``torch``: the PyTorch reference kernels run on the device (CUDA only, opt-in: slow);
- ``fla``: flash-linear-attention's peers (symmetric keys), when ``fla`` is importable on CUDA;
  their rows name the fla function, and the ratios compare each of our ops with its best peer.

Timing: ``triton.testing.do_bench(warmup=25, rep=200, return_mode="median")`` on CUDA, after one
untimed call; the median of a few wall-clock runs on the CPU. On CUDA the table also gives the
forward+backward's kernel time (the sum of its kernels' device times, from the profiler, per call):
where it is well below the wall time, the step is bound by the host (launches, autograd), not by
the kernels; the peak extra memory of a forward+backward, and the memory the forward holds for the backward
(what a model keeps per layer: outputs and saved tensors, beyond the inputs).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import osdn_ops
from osdn_ops import reference

GPU_SHAPES = {  # name: (B, T, H, K, V, number of packed sequences or 0)
    "S1": (8, 2048, 16, 128, 128, 0),
    "S2": (4, 4096, 8, 128, 128, 0),
    "S3": (1, 32768, 8, 128, 128, 0),
    "S4": (1, 32768, 16, 128, 128, 16),
}
CPU_SHAPES = {
    "S1": (2, 256, 2, 32, 32, 0),
    "S2": (1, 512, 2, 32, 32, 0),
    "S3": (1, 2048, 1, 32, 32, 0),
    "S4": (1, 1024, 2, 32, 32, 4),
}
OPS = ("precond_scan", "chunk_delta_asym", "chunk_gated_delta_asym", "chunk_kda_asym", "osdn")
GATE = {"chunk_delta_asym": "none", "chunk_gated_delta_asym": "scalar", "chunk_kda_asym": "channel", "osdn": "none"}
PEERS = {"precond_scan": ["chunk_delta_rule"], "chunk_delta_asym": ["chunk_delta_rule"],
         "osdn": ["chunk_delta_rule"],
         "chunk_gated_delta_asym": ["chunk_gated_delta_rule", "chunk_precond_gated_delta_rule"],
         "chunk_kda_asym": ["chunk_kda"]}
# the op of ours whose symmetric case (k_tilde = k) each fla peer computes; None: another algorithm
FLA_CHECK = {"chunk_delta_rule": "chunk_delta_asym", "chunk_gated_delta_rule": "chunk_gated_delta_asym",
             "chunk_kda": "chunk_kda_asym", "chunk_precond_gated_delta_rule": None}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HP = dict(eta=0.003, d_min=0.5, d_max=2.0, eps=1e-6, beta_aware=True)


@dataclass
class Problem:
    """Benchmark inputs (BENCH.md): unit q, k; v ~ N(0,1); beta = sigmoid(N); g = logsigmoid(N)/16."""
    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    g_scalar: torch.Tensor
    g_channel: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]
    hp: dict
    k_tilde: Optional[torch.Tensor] = None


def make_problem(name, shape, device, dtype=torch.bfloat16, seed=0, clamp=False) -> Problem:
    """Fresh random inputs for one shape; ``clamp`` gives the clamp-heavy S1-clamp keys and eta."""
    B, T, H, K, V, nseq = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen).to(device)

    q = F.normalize(randn(B, T, H, K), dim=-1).to(dtype)
    if clamp:  # repeated keys from a vocabulary of 32, mass on few features
        vocab = F.normalize(torch.softmax(4 * randn(32, K), -1) ** 0.5, dim=-1)
        k = vocab[torch.randint(0, 32, (B, T, H), generator=gen).to(device)].to(dtype)
    else:
        k = F.normalize(randn(B, T, H, K), dim=-1).to(dtype)
    cu = None
    if nseq:
        cuts = torch.randperm(T - 1, generator=gen)[: nseq - 1].sort().values + 1
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to(device)
    return Problem(name + ("-clamp" if clamp else ""), q, k, randn(B, T, H, V).to(dtype),
                   torch.sigmoid(randn(B, T, H)).to(dtype), F.logsigmoid(randn(B, T, H)) / 16,
                   F.logsigmoid(randn(B, T, H, K)) / 16, cu, dict(HP, eta=0.5) if clamp else dict(HP))


def _slice(p: Problem, x: Optional[torch.Tensor], heads=2):
    """The checked slice of a token tensor [B,T,H,...]: first sequence(s), first heads."""
    if x is None:
        return None
    if p.cu_seqlens is None:
        return x[:1, :, :heads]
    return x[:, : int(p.cu_seqlens[min(2, len(p.cu_seqlens) - 1)]), :heads]


def _slice_cu(p: Problem):
    return None if p.cu_seqlens is None else p.cu_seqlens[: min(3, len(p.cu_seqlens))]


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# ---------------------------------------------------------------- implementations
# Each returns (inputs requiring grad: dict name -> tensor, run: inputs -> (outputs tuple)).

def _asym_inputs(p: Problem, gate, kt):
    x = dict(q=p.q, k=p.k, k_tilde=kt, v=p.v, beta=p.beta)
    if gate != "none":
        x["g"] = p.g_scalar if gate == "scalar" else p.g_channel
    return x


def _osdn_impl(op: str, p: Problem, torch_kernels: bool):
    """Our op (or, with ``torch_kernels``, the reference kernels on the same device)."""
    if op == "precond_scan":
        x = dict(k=p.k, beta=p.beta)

        def run(x):
            if torch_kernels:
                return reference.precond_scan_recurrent(x["k"], x["beta"], cu_seqlens=p.cu_seqlens, **p.hp)
            return osdn_ops.precond_scan(x["k"], x["beta"], cu_seqlens=p.cu_seqlens, **p.hp)
        return x, run
    if op == "osdn":
        x = dict(q=p.q, k=p.k, v=p.v, beta=p.beta)

        def run(x):
            o, s, d = osdn_ops.osdn(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=p.cu_seqlens, **p.hp)
            return o, s
        return x, run
    gate = GATE[op]
    x = _asym_inputs(p, gate, p.k_tilde)
    fn = getattr(osdn_ops, op)

    def run(x):
        if torch_kernels:
            return reference.asym_chunked(x["q"], x["k"], x["k_tilde"], x["v"], x.get("g"), x["beta"],
                                          scale=x["q"].shape[-1] ** -0.5, gate=gate, cu_seqlens=p.cu_seqlens)
        args = [x["q"], x["k"], x["k_tilde"], x["v"]] + ([x["g"]] if gate != "none" else []) + [x["beta"]]
        return fn(*args, cu_seqlens=p.cu_seqlens)
    return x, run


def fwd_bwd_step(run, x):
    """``(step, leaves)``: ``step()`` runs a forward+backward of ``run`` on ``leaves`` (fresh leaves of ``x``; their
    gradients reset first) with a fixed random seed on the first output."""
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    do = torch.randn_like(run(leaves)[0])

    def step():
        for t in leaves.values():
            t.grad = None
        run(leaves)[0].backward(do)
    return step, leaves


def held_gib(run, leaves) -> float:
    """GiB of GPU memory that a forward of ``run`` on ``leaves`` holds for its backward (its outputs and saved
    tensors)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    outs = run(leaves)
    held = (torch.cuda.memory_allocated() - base) / 2**30
    del outs
    return held


def keeping(run, keep=True):
    """``run`` with its forwards inside ``osdn_ops.keep_chunk_states(keep)``."""
    def kept(x):
        with osdn_ops.keep_chunk_states(keep):
            return run(x)
    return kept


def _fla_impl(name: str, p: Problem):
    """An fla peer on the symmetric problem (k_tilde = k); its state is K x V."""
    import fla.ops  # noqa: F401  (raises ImportError when fla is not installed)
    cu = p.cu_seqlens
    if name == "chunk_delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule as f
        x = dict(q=p.q, k=p.k, v=p.v, beta=p.beta)
        return x, lambda x: f(x["q"], x["k"], x["v"], x["beta"], output_final_state=True, cu_seqlens=cu)
    if name == "chunk_gated_delta_rule":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
        x = dict(q=p.q, k=p.k, v=p.v, g=p.g_scalar, beta=p.beta)
        return x, lambda x: f(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, cu_seqlens=cu)
    if name == "chunk_kda":
        from fla.ops.kda import chunk_kda as f
        x = dict(q=p.q, k=p.k, v=p.v, g=p.g_channel, beta=p.beta)
        return x, lambda x: f(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, cu_seqlens=cu)
    if name == "chunk_precond_gated_delta_rule":
        from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule as f
        x = dict(q=p.q, k=p.k, v=p.v, g=p.g_scalar, beta=p.beta)
        return x, lambda x: f(x["q"], x["k"], x["v"], x["g"], x["g"], x["beta"], x["beta"],
                              output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu)
    raise ValueError(name)


# ---------------------------------------------------------------- timing and checking

def _time(fn: Callable[[], object], device) -> float:
    fn()
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def kernel_times(fn, calls=10):
    """``{kernel name: ms per call}`` of ``fn`` on the GPU, largest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    acc = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name] = acc.get(ev.name, 0.0) + ev.device_time / 1e3 / calls
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


def _fwd_bwd(run, x, seeds=None):
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    outs = run(leaves)
    o = outs[0]
    do = seeds if seeds is not None else torch.randn_like(o)
    o.backward(do)
    return outs, {n: t.grad for n, t in leaves.items()}, do


def _oracle(op: str, p: Problem, x: dict, do_slice, symmetric=False):
    """float64 reference on the checked slice: outputs and gradients (w.r.t. the sliced x)."""
    leaves = {n: _slice(p, t).double().detach().requires_grad_() for n, t in x.items()}
    cu = _slice_cu(p)
    if op == "precond_scan":
        outs = reference.precond_scan_recurrent(leaves["k"], leaves["beta"], cu_seqlens=cu, **p.hp)
    else:
        if op == "osdn":
            kt, _ = reference.precond_scan_recurrent(leaves["k"], leaves["beta"], cu_seqlens=cu, **p.hp)
        else:
            kt = leaves["k"] if symmetric else leaves["k_tilde"]
        gate = GATE[op]
        outs = reference.asym_chunked(leaves["q"], leaves["k"], kt, leaves["v"], leaves.get("g"), leaves["beta"],
                                      scale=leaves["q"].shape[-1] ** -0.5, gate=gate, cu_seqlens=cu)
    if do_slice is None:
        return outs, None
    outs[0].backward(do_slice.double())
    return outs, {n: t.grad for n, t in leaves.items()}


def _error(op, p, x, run, with_grad, symmetric=False) -> float:
    """Worst relative RMS error over the outputs (and gradients) on the checked slice."""
    if with_grad:
        outs, grads, do = _fwd_bwd(run, x)
        ref_outs, ref_grads = _oracle(op, p, x, _slice(p, do), symmetric)
    else:
        with torch.no_grad():
            outs = run(x)
        ref_outs, ref_grads = _oracle(op, p, x, None, symmetric)
    errs = [_rel(_slice(p, outs[0]), ref_outs[0])]
    if not symmetric:  # final states (same layout): the states of the checked sequences and heads
        n = 1 if p.cu_seqlens is None else len(_slice_cu(p)) - 1
        errs.append(_rel(outs[1][:n, :2], ref_outs[1]))
    if with_grad:
        errs += [_rel(_slice(p, grads[n]), ref_grads[n]) for n in ref_grads if grads[n] is not None]
    return max(errs)


@dataclass
class Row:
    op: str
    impl: str
    shape: str
    fwd: float = float("nan")
    fwd_bwd: float = float("nan")
    gpu_fwd_bwd: float = float("nan")
    err: float = float("nan")
    peak_gib: float = float("nan")
    held_gib: float = float("nan")
    note: str = ""


def bench_one(op, impl, p: Problem, device, check: bool) -> Row:
    """One row; for ``impl == "fla"``, ``op`` names the fla function."""
    row = Row(op, impl, p.name)
    symmetric = impl == "fla"
    if symmetric:
        x, run = _fla_impl(op, p)
        check = check and FLA_CHECK[op] is not None
    else:
        x, run = _osdn_impl(op, p, torch_kernels=impl == "torch")
        if impl == "osdn-kept":
            run = keeping(run)
    with torch.no_grad():
        row.fwd = _time(lambda: run(x), device)
    try:
        step, leaves = fwd_bwd_step(run, x)
        row.fwd_bwd = _time(step, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row.peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
            row.held_gib = held_gib(run, leaves)
            row.gpu_fwd_bwd = sum(kernel_times(step).values())
    except Exception as e:  # fla refuses some backward passes on some GPUs: report, don't hide
        row.note = f"bwd refused: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    if check:
        row.err = _error(FLA_CHECK[op] if symmetric else op, p, x, run, with_grad=row.note == "",
                         symmetric=symmetric)
    if op == "precond_scan" and impl == "osdn" and device.type == "cuda":
        from osdn_ops.triton.precond import precond_fallback_share
        share = precond_fallback_share(p.k, p.beta, cu_seqlens=p.cu_seqlens, **p.hp)
        row.note = f"fallback {100 * share:.1f}% of chunks"
    return row


def _ratio(row: Row, rows: list[Row], attr: str) -> str:
    if row.impl == "fla":
        return ""
    peers = [getattr(r, attr) for r in rows if r.shape == row.shape and r.impl == "fla" and r.op in PEERS[row.op]
             and getattr(r, attr) == getattr(r, attr)]
    mine = getattr(row, attr)
    return f"{mine / min(peers):.2f}" if peers and mine == mine else ""


def table(rows: list[Row]) -> str:
    head = ("| op | impl | shape | fwd ms | fwd+bwd ms | fwd / best peer | fwd+bwd / best peer | fwd+bwd kernel ms | "
            "kernel ms / best peer | max rel err | peak GiB | held GiB | note |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        fmt = lambda v, f: "" if v != v else format(v, f)  # noqa: E731  (NaN -> empty)
        lines.append(f"| {r.op} | {r.impl} | {r.shape} | {fmt(r.fwd, '.3f')} | {fmt(r.fwd_bwd, '.3f')} | "
                     f"{_ratio(r, rows, 'fwd')} | {_ratio(r, rows, 'fwd_bwd')} | {fmt(r.gpu_fwd_bwd, '.3f')} | "
                     f"{_ratio(r, rows, 'gpu_fwd_bwd')} | {fmt(r.err, '.1e')} | "
                     f"{fmt(r.peak_gib, '.2f')} | {fmt(r.held_gib, '.2f')} | {r.note} |")
    return "\n".join(lines)


def _fla_available(device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import fla.ops  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> list[Row]:
    ap = argparse.ArgumentParser(prog="python -m osdn_ops.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help="comma list of ops (default: all)")
    ap.add_argument("--shapes", default="S1,S2,S3,S4,S1-clamp",
                    help="comma list of S1..S4 and S1-clamp (precond_scan only); default: all")
    ap.add_argument("--impls", default=None,
                    help="comma list of osdn, osdn-kept, torch, fla (default: osdn, and fla when present)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-check", action="store_true", help="skip the float64 error check")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES),
                    help="dtype of q, k, v, beta (the protocol's bf16 by default; states stay fp32)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    impls = args.impls.split(",") if args.impls else ["osdn"] + (["fla"] if _fla_available(device) else [])
    rows: list[Row] = []
    for sname in args.shapes.split(","):
        clamp = sname.endswith("-clamp")
        p = make_problem(sname.removesuffix("-clamp"), shapes[sname.removesuffix("-clamp")], device,
                         dtype=DTYPES[args.dtype], clamp=clamp)
        p.k_tilde = osdn_ops.precond_scan(p.k, p.beta, cu_seqlens=p.cu_seqlens, **p.hp)[0]
        for op in args.ops.split(","):
            if clamp and op != "precond_scan":
                continue
            runs = [(op, i) for i in impls if i != "fla" and not (i == "osdn-kept" and op == "precond_scan")]
            if "fla" in impls and not clamp:
                runs += [(peer, "fla") for peer in PEERS[op]
                         if not any(r.op == peer and r.shape == p.name for r in rows)]  # one row per peer
            for name, impl in runs:
                try:
                    row = bench_one(name, impl, p, device, check=not args.no_check)
                except Exception as e:
                    row = Row(name, impl, p.name, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                rows.append(row)
                if args.markdown:  # rewritten after every row, so a run cut short keeps its rows
                    with open(args.markdown, "w") as f:
                        f.write(table(rows) + "\n")
                print(f"{row.op:24s} {row.impl:38s} {row.shape:9s} fwd {row.fwd:8.3f} ms  fwd+bwd {row.fwd_bwd:8.3f} ms"
                      f"  err {row.err:.1e}  {row.note}", flush=True)
    print()
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{args.dtype} inputs; "
          "shapes (B, T, H, K, V, packed sequences): "
          + ", ".join(f"{n} {shapes[n]}" for n in dict.fromkeys(s.removesuffix("-clamp") for s in args.shapes.split(","))))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
