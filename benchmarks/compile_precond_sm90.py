"""Compile every precond_scan kernel variant for sm_90 without a GPU; prints shared memory per variant.

Usage: ``python benchmarks/compile_precond_sm90.py [pre] [fwd] [bwd]`` (default all; not under the interpreter).
"""
import pathlib
import sys
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from osdn_ops.triton import precond_fwd as F, precond_bwd as Bw, precond_parallel as P
tgt = GPUTarget("cuda", 90, 32)

def comp(fn, types, consts, nw, tag):
    names = fn.arg_names
    s = {n: ("constexpr" if n in consts else types(n)) for n in names}
    src = ASTSource(fn, s, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=tgt, options={"num_warps": nw})
    print(fn.__name__, tag, "nw", nw, "shared", k.metadata.shared, "regs", getattr(k, "n_regs", None), "spills", getattr(k, "n_spills", None), flush=True)

def types_for(kdt, idt):
    def t(n):
        if n in ("T", "NT", "H", "K"): return "i32"
        if n in ("eta", "eps", "d_min", "d_max"): return "fp32"
        if n in ("cu_ptr",): return idt
        if n in ("table_ptr", "flag_ptr"): return "*i32"
        if n in ("k_ptr", "kt_ptr", "dkt_ptr", "dk_ptr"): return kdt
        return "*fp32"
    return t

which = sys.argv[1:] or ["pre", "fwd", "bwd"]
for BK, kdt, idt in [(16, "*bf16", "*i32"), (64, "*fp16", "*i64"), (128, "*bf16", "*i32"), (128, "*fp32", "*i64"), (256, "*bf16", "*i32")]:
    t = types_for(kdt, idt)
    for HAS_R, VARLEN, BA in [(True, True, True), (False, False, False)]:
        tag = f"BK{BK} {kdt} R{int(HAS_R)} V{int(VARLEN)} BA{int(BA)}"
        if "pre" in which and BK <= 128:
            comp(P._precompute_kernel, t, dict(HAS_R=HAS_R, VARLEN=VARLEN, BETA_AWARE=BA, C=64, BK=BK), 4, tag)
        for par in ([True, False] if BK <= 128 else [False]):
            nw = P.num_warps(BK, par)
            if "fwd" in which:
                for kt, st, ck in [(True, False, False), (False, True, False), (False, False, True)]:
                    comp(F._precond_fwd_kernel, t, dict(HAS_D0=True, HAS_R=HAS_R, VARLEN=VARLEN, BETA_AWARE=BA,
                         PARALLEL=par, STORE_KT=kt, STATS=st, STORE_CKPT=ck, C=64, BK=BK), nw, tag + f" par{int(par)} kt{int(kt)} st{int(st)} ck{int(ck)}")
            if "bwd" in which:
                comp(Bw._precond_bwd_kernel, t, dict(HAS_R=HAS_R, VARLEN=VARLEN, BETA_AWARE=BA, PARALLEL=par, C=64, BK=BK), nw, tag + f" par{int(par)}")
