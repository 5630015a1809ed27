"""Compile every Triton kernel variant the ops launch for sm_90 (H100/H200), without a GPU.

    PYTHONPATH=. python benchmarks/compile_sm90.py [--largest] [KERNEL ...]     # e.g. _dqkv _dv_local

A child process runs the ops under the Triton interpreter with kernel execution switched off
and records each launch (kernel, argument types, constexprs, warps, stages) as the GPU path
would make it (half-precision operand types included; twice, for grids larger than the GPU and as on a 132-SM H200,
where the launch settings that depend on the SM count differ); this process then compiles every
distinct one with Triton's own toolchain for ``GPUTarget("cuda", 90, 32)`` and prints its
shared memory, registers per thread, spilled bytes (``ptxas -v``) and its asynchronous copies (``cp.async``: the
loads a software-pipelined loop issues ahead; zero where Triton did not pipeline).
A variant that does not compile (or needs more than the 227 KiB of shared memory a Hopper
block gets) is listed and makes the exit status 1. Catches what the interpreter cannot:
register/shared-memory limits and compile errors of the GPU backend. ``--largest`` compiles only the
variants of the shapes with the biggest tiles and of the benchmark shapes (what ``tests/test_sm90_compile.py`` runs
in CI).
"""
import importlib
import json
import os
import subprocess
import sys

import torch

SMEM_LIMIT = 227 * 1024
def _const(v):
    import triton.language as tl
    return {"tl": str(v)} if isinstance(v, tl.dtype) else v


def _unconst(v):
    import triton.language as tl
    return getattr(tl, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(v["tl"], v["tl"])) \
        if isinstance(v, dict) else v


def record(workload):
    """Distinct launches of ``workload()`` as (module, kernel, signature, constexprs, options, specialization).

    The specialization of each argument is the runtime's own (``native_specialize_impl``): ``"D"``
    for a tensor whose address or an integer that is a multiple of 16, ``"1"`` for an integer equal
    to 1. It matters: with aligned pointers the compiler pipelines loads through shared memory."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime import interpreter as interp
    # the specializer's first call imports Triton modules that must load while the interpreter is on
    native_specialize_impl(BaseBackend, torch.empty(1), False, True, True)
    seen = {}
    call = interp.GridExecutor.__call__

    def recording_call(self, *args, **kwargs):
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        sig, consts, spec = {}, {}, {}
        for name in self.arg_names:
            val = bound.get(name)
            if name in self.constexprs or val is None:
                sig[name], consts[name] = "constexpr", val
                continue
            ty, key = native_specialize_impl(BaseBackend, val, False, True, True)
            if ty == "constexpr":                   # an integer equal to 1
                sig[name], spec[name] = "i32", "1"
            else:
                sig[name], spec[name] = ty, key or ""
        key = (self.fn.__name__, tuple(sig.items()), tuple((k, str(v)) for k, v in consts.items()),
               tuple(opts.items()), tuple(spec.items()))
        seen.setdefault(key, (self.fn.__module__, self.fn.__name__, sig,
                              {k: _const(v) for k, v in consts.items()}, opts, spec))
        # no execution: only the launch's types and constants matter here

    interp.GridExecutor.__call__ = recording_call
    try:
        workload()
    finally:
        interp.GridExecutor.__call__ = call
    return list(seen.values())


def workload(largest=False):
    """Every op forward and backward, per (K, V), dtype, gate and layout (precond_scan also as the benchmarks call
    it: dense, without d0 and retention, the backward from the forward's residuals, and on one 2048-token sequence,
    which runs its two-level chains where the SM count allows); ``largest``: only the biggest
    half-precision tiles (K = V = 256, bf16, dense layout), where shared memory runs out first, those of the
    benchmark shapes (K = V = 128, bf16, dense layout), whose variants take other paths and launch settings, and
    those of the two-level chains (K = 128)."""
    import osdn_ops.triton as ot
    from osdn_ops.triton import asym_chunks
    os.environ.pop("TRITON_INTERPRET")  # kernels are defined: now pick operand types as on a GPU
    # launch settings that depend on the SM count: as for grids larger than the GPU (no SM count), then as on an
    # H200 (132 SMs), where these small problems fill less than one wave (halved V blocks, deep pipelines)
    for sms in (0, 132):
        asym_chunks._sm_count = lambda device, sms=sms: sms
        _ops(ot, largest)


def _ops(ot, largest):
    from tests.inputs import asym_call, asym_problem, precond_problem
    fns = {"none": ot.chunk_delta_asym, "scalar": ot.chunk_gated_delta_asym, "channel": ot.chunk_kda_asym}
    cases = ([((256, 256), torch.bfloat16), ((128, 128), torch.bfloat16)] if largest else
             [(kv, dtype) for kv in ((128, 128), (64, 16), (256, 256), (48, 96), (128, 256))
              for dtype in (torch.bfloat16, torch.float16, torch.float32)])
    for (K, V), dtype in cases:
        for gate, fn in fns.items():
            for cu in (None,) if largest else (None, [0, 0, 70, 130]):
                x = asym_problem(gate, B=2 if cu is None else 1, T=130, H=2, K=K, V=V, dtype=dtype,
                                 cu_seqlens=cu, requires_grad=True)
                o, s = asym_call(fn, gate, x)
                torch.autograd.backward((o, s), (torch.ones_like(o), torch.ones_like(s)))
        for form in ("parallel",) if largest else ("tokens", "parallel"):
            p = precond_problem(B=1, T=130, H=2, K=K, dtype=dtype, cu_seqlens=[0, 0, 70, 130])
            args = (p["k"], p["beta"].float(), p["d0"].float(), p["retention"].float(), p["cu_seqlens"],
                    0.5, 0.5, 2.0, 1e-6, True)
            kt, d = ot.kernels.precond_scan_fwd(*args, form=form)
            ot.kernels.precond_scan_bwd(torch.ones_like(kt), torch.ones_like(d), *args, form=form)
        if not largest:     # as the benchmarks call it: dense, no d0 or retention, the backward from the residuals
            p = precond_problem(B=2, T=130, H=2, K=K, dtype=dtype, d0=False, retention=False, requires_grad=True)
            kt, d = ot.precond_scan(p["k"], p["beta"])
            torch.autograd.backward((kt, d), (torch.ones_like(kt), torch.ones_like(d)))
            _two_level(ot, K, dtype)
    if largest:     # the two-level chains' biggest tiles: K = 128 (wider keys run one level)
        _two_level(ot, 128, torch.bfloat16)


def _two_level(ot, K, dtype):
    """precond_scan on one long sequence: the two-level chains (precond_segments) where the SM count allows them."""
    from tests.inputs import precond_problem
    p = precond_problem(B=1, T=2048, H=1, K=K, dtype=dtype, requires_grad=True)
    kt, d = ot.precond_scan(p["k"], p["beta"], d0=p["d0"], retention=p["retention"])
    torch.autograd.backward((kt, d), (torch.ones_like(kt), torch.ones_like(d)))


def _ptxas_usage(ptx: str) -> str:
    """``registers, spill stores`` of a kernel's PTX, from ``ptxas -v`` for sm_90a."""
    import re
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    res = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return f"regs {regs.group(1) if regs else '?':>3s}  spill {spill.group(1) if spill else '?':>5s} B"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    largest = "--largest" in argv
    names = [a for a in argv if not a.startswith("--")]
    if "--record" in argv:
        json.dump(record(lambda: workload(largest)), sys.stdout)
        return 0
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, __file__, "--record"] + (["--largest"] if largest else []), env=env,
                         check=True, capture_output=True, text=True)
    launches = [x for x in json.loads(out.stdout) if not names or x[1] in names]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    failures = 0
    target = GPUTarget("cuda", 90, 32)
    for module, name, sig, consts, opts, spec in launches:
        fn = getattr(importlib.import_module(module), name)
        consts = {k: _unconst(v) for k, v in consts.items()}
        attrs = {}
        for p in fn.params:                 # the kernel's own do_not_specialize settings
            if p.do_not_specialize or p.name not in spec:
                continue
            if spec[p.name] == "1":
                sig[p.name], consts[p.name] = "constexpr", 1
            elif spec[p.name] == "D" and not p.do_not_specialize_on_alignment:
                attrs[(p.num,)] = [["tt.divisibility", 16]]
        names = list(sig)
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
        tag = ", ".join(f"{k}={v}" for k, v in consts.items() if k.isupper() and v is not None)
        try:
            compiled = triton.compile(src, target=target, options=opts)
            smem = compiled.metadata.shared
            bad = smem > SMEM_LIMIT
            failures += bad
            usage = _ptxas_usage(compiled.asm["ptx"])
            copies = compiled.asm["ptx"].count("cp.async")
            print(f"{'FAIL' if bad else 'ok  '} {name:24s} smem {smem / 1024:6.1f} KiB  {usage}  async copies "
                  f"{copies:3d}  {opts}  {tag}", flush=True)
        except Exception as e:
            failures += 1
            print(f"FAIL {name:24s} {type(e).__name__}: {str(e).splitlines()[0][:120]}  {tag}", flush=True)
    print(f"{len(launches)} kernel variants, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
