"""Forward of the Triton asymmetric delta engine (osdn_ops.triton.asym_fwd / asym.chunk_asym_fwd).

CPU: the Triton interpreter on tiny shapes: each stage against a PyTorch computation of the same
chunk quantity, and the composed forward against the fp64 token-by-token oracle.
GPU (skipped without CUDA): real shapes against the fp64 chunked reference on the GPU.
"""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from osdn_ops.reference import GATES, asym_chunked, asym_recurrent, state_shape  # noqa: E402
from osdn_ops.triton.asym import chunk_asym_fwd  # noqa: E402
from osdn_ops.triton.asym_fwd import chunk_output, chunk_states, gate_cumsum, wy_repr  # noqa: E402

from .inputs import asym_problem, rel_rms  # noqa: E402

C = 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NAMES = ["q", "k", "k_tilde", "v", "g", "beta", "initial_state"]


def _fwd(x, gate, scale=0.5):
    return chunk_asym_fwd(*(x[n] for n in NAMES[:6]), x["initial_state"], x["cu_seqlens"], scale, gate)


def _oracle(x, gate, fn=asym_recurrent, scale=0.5):
    args = [None if x[n] is None else x[n].double() for n in NAMES]
    return fn(*args, scale=scale, gate=gate, cu_seqlens=x["cu_seqlens"])


def _spans(T, cu):
    """(start, end) of every chunk: 64-token pieces of each sequence."""
    bounds = [0, T] if cu is None else cu
    return [(s, min(s + C, e)) for a, e in zip(bounds[:-1], bounds[1:]) for s in range(a, e, C)]


# ---------------------------------------------------------------- stages (CPU and GPU)

@pytest.mark.parametrize("channel", [False, True])
@pytest.mark.parametrize("cu", [None, [0, 0, 1, 70, 130]])
def test_gate_cumsum(channel, cu):
    T = 130
    g = F.logsigmoid(torch.randn(1, T, 2, *((16,) if channel else ()))).to(DEV)
    cut = None if cu is None else torch.tensor(cu, device=DEV)
    G = gate_cumsum(g, cut)
    ref = torch.cat([g[:, s:e].double().cumsum(1) for s, e in _spans(T, cu)], 1)
    assert G.dtype == torch.float32 and G.shape == g.shape
    assert rel_rms(G, ref) < 1e-6


def _chunk_ref(x, gate, G, T, cu):
    """fp64 per-chunk A^{-1}, W, U from the DESIGN §4 formulas (b = 0, h = 0)."""
    k, kt, v, beta = (x[n][0, :, 0].double() for n in ("k", "k_tilde", "v", "beta"))
    Gc = None if G is None else G[0, :, 0].double()
    f64 = dict(dtype=torch.float64, device=k.device)
    Ainv, W, U = [], [], []
    for s, e in _spans(T, cu):
        n = e - s
        if gate == "none":
            dec = torch.ones(n, n, k.shape[-1], **f64)
            eg = torch.ones(n, k.shape[-1], **f64)
        else:
            g_ = Gc[s:e] if gate == "channel" else Gc[s:e, None].expand(n, k.shape[-1])
            dec = torch.exp((g_[:, None] - g_[None]).clamp(max=0))
            eg = torch.exp(g_)
        A = torch.einsum("tc,jc,tjc->tj", k[s:e], kt[s:e], dec).tril(-1) * beta[s:e, None]
        Ti = torch.linalg.inv(torch.eye(n, **f64) + A)
        Ainv.append(F.pad(Ti, (0, C - n)))
        W.append(Ti @ (beta[s:e, None] * k[s:e] * eg))
        U.append(Ti @ (beta[s:e, None] * v[s:e]))
    return torch.cat(Ainv), torch.cat(W), torch.cat(U)


@pytest.mark.parametrize("gate,strong_tail", [(g, False) for g in GATES] + [("channel", True), ("scalar", True)])
def test_stages(gate, strong_tail):
    """wy_repr, chunk_states, chunk_output on one head vs fp64 PyTorch (varlen, h0 given).

    ``strong_tail``: the last sequence decays 20x faster, so its chunk takes the block-by-block
    channel-gate path while the first chunk takes the single-product one."""
    cu = [0, 0, 1, 70, 90]
    T = cu[-1]
    x = asym_problem(gate, B=1, T=T, H=1, K=16, V=16, dtype=torch.float32, cu_seqlens=cu, device=DEV, seed=3)
    if strong_tail:
        x["g"][:, 70:] *= 20
    cut = x["cu_seqlens"]
    G = None if gate == "none" else gate_cumsum(x["g"], cut)
    Ainv, W, U = wy_repr(x["k"], x["k_tilde"], x["v"], x["beta"], G, cut, gate)
    rA, rW, rU = _chunk_ref(x, gate, G, T, cu)
    assert Ainv.shape == (1, T, 1, C) and W.dtype == x["k"].dtype and U.dtype == x["v"].dtype
    for got, ref in ((Ainv[0, :, 0], rA), (W[0, :, 0], rW), (U[0, :, 0], rU)):
        assert rel_rms(got, ref) < 1e-5

    h, vn, final = chunk_states(x["k_tilde"], W, U, G, x["initial_state"], cut, gate)
    kt = x["k_tilde"][0, :, 0].double()
    kv = (lambda s: s) if gate == "channel" else (lambda s: s.transpose(-1, -2))
    from osdn_ops.triton.varlen import chunk_table
    rows = {tuple(r): i for i, r in enumerate(chunk_table(cut, T, C).tolist())}
    for n in range(len(cu) - 1):
        S = kv(x["initial_state"][n, 0].double())
        for s, e in _spans(T, cu[n:n + 2]):
            assert rel_rms(h[0, rows[(n, s)], 0], S) < 1e-5
            vref = U[0, s:e, 0].double() - W[0, s:e, 0].double() @ S
            assert rel_rms(vn[0, s:e, 0], vref) < 1e-5
            if gate == "none":
                S = S + kt[s:e].T @ vref
            else:
                g_ = G[0, s:e, 0].double()
                g_ = g_ if gate == "channel" else g_[:, None].expand(e - s, kt.shape[-1])
                S = torch.exp(g_[-1])[:, None] * S + (kt[s:e] * torch.exp(g_[-1] - g_)).T @ vref
        assert rel_rms(kv(final[n, 0]), S) < 1e-5

    o = chunk_output(x["q"], x["k_tilde"], vn, h, G, 0.5, cut, gate)
    q = x["q"][0, :, 0].double()
    for n in range(len(cu) - 1):
        for s, e in _spans(T, cu[n:n + 2]):
            S = h[0, rows[(n, s)], 0].double()
            if gate == "none":
                qg, P = q[s:e], (q[s:e] @ kt[s:e].T).tril()
            else:
                g_ = G[0, s:e, 0].double()
                g_ = g_ if gate == "channel" else g_[:, None].expand(e - s, kt.shape[-1])
                dec = torch.exp((g_[:, None] - g_[None]).clamp(max=0))
                qg = q[s:e] * torch.exp(g_)
                P = torch.einsum("tc,jc,tjc->tj", q[s:e], kt[s:e], dec).tril()
            ref = 0.5 * (qg @ S + P @ vn[0, s:e, 0].double())
            assert rel_rms(o[0, s:e, 0], ref) < 1e-5


# ---------------------------------------------------------------- composed forward vs the oracle

CASES = {  # name: (B, T, H, cu_seqlens, initial_state, K, V)
    "dense": (2, 50, 2, None, True, 16, 32),
    "one_token": (1, 1, 2, None, False, 16, 16),
    "varlen": (1, 100, 1, [0, 0, 1, 70, 70, 100], True, 32, 16),
    "odd_dims": (1, 70, 1, None, True, 8, 6),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gate", GATES)
def test_forward_fp32(gate, case):
    B, T, H, cu, h0, K, V = CASES[case]
    x = asym_problem(gate, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, cu_seqlens=cu, initial_state=h0,
                     device=DEV, seed=1)
    o, s = _fwd(x, gate)
    ro, rs = _oracle(x, gate)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    N = B if cu is None else len(cu) - 1
    assert s.shape == state_shape(gate, N, H, K, V) and o.shape == x["v"].shape
    assert rel_rms(o, ro) < 1e-5 and rel_rms(s, rs) < 1e-5


@pytest.mark.parametrize("case", ["dense", "varlen"])
@pytest.mark.parametrize("gate", GATES)
def test_forward_bf16(gate, case):
    B, T, H, cu, h0, K, V = CASES[case]
    x = asym_problem(gate, B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, cu_seqlens=cu, initial_state=h0,
                     device=DEV, seed=2)
    o, s = _fwd(x, gate)
    ro, rs = _oracle(x, gate)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_rms(o, ro) < 2e-2 and rel_rms(s, rs) < 2e-2


@pytest.mark.parametrize("strength", [2.0, 20.0])
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_strong_decay(gate, strength):
    """g down to -20 per token (G to -1280 in a chunk), or to -2 (chunk spans around the channel
    gate's single-product limit): finite and exact."""
    x = asym_problem(gate, B=1, T=70, H=1, K=16, V=16, dtype=torch.float32, device=DEV, seed=4)
    x["g"] = -strength * torch.rand_like(x["g"])
    o, s = _fwd(x, gate)
    ro, rs = _oracle(x, gate)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rms(o, ro) < 1e-5 and rel_rms(s, rs) < 1e-5


@pytest.mark.parametrize("gate", GATES)
def test_empty(gate):
    """T == 0: empty output, final state = initial state (or zeros)."""
    x = asym_problem(gate, B=2, T=0, H=2, K=16, V=16, dtype=torch.float32, device=DEV)
    o, s = _fwd(x, gate)
    assert o.shape == (2, 0, 2, 16) and torch.equal(s, x["initial_state"])
    x["initial_state"] = None
    assert torch.equal(_fwd(x, gate)[1], torch.zeros(state_shape(gate, 2, 2, 16, 16), device=DEV))


def test_public_ops():
    """osdn_ops.triton.chunk_*_asym forward uses this engine."""
    ot = pytest.importorskip("osdn_ops.triton")
    ops = {"none": ot.chunk_delta_asym, "scalar": ot.chunk_gated_delta_asym, "channel": ot.chunk_kda_asym}
    for gate, fn in ops.items():
        x = asym_problem(gate, B=1, T=40, H=1, K=16, V=16, dtype=torch.float32, device=DEV, seed=5)
        args = [x["q"], x["k"], x["k_tilde"], x["v"]] + ([] if gate == "none" else [x["g"]]) + [x["beta"]]
        o, s = fn(*args, scale=0.5, initial_state=x["initial_state"])
        ro, rs = _oracle(x, gate)
        assert rel_rms(o, ro) < 1e-5 and rel_rms(s, rs) < 1e-5


# ---------------------------------------------------------------- GPU: real shapes

def _bench_inputs(gate, B, T, H, K=128, V=128, dtype=torch.bfloat16, seed=0, g_scale=16.0, N=None):
    """BENCH.md inputs: unit-norm q, k; kt = k (1 + 0.01 noise); v ~ N(0,1); beta = sigmoid(N);
    g = logsigmoid(N) / g_scale (fp32); initial state N(0,1) over N sequences (default B)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    q, k = (F.normalize(rnd(B, T, H, K), dim=-1) for _ in range(2))
    kt = k * (1 + 0.01 * rnd(B, T, H, K))
    gshape = (B, T, H, K) if gate == "channel" else (B, T, H)
    return dict(q=q.to(dtype), k=k.to(dtype), k_tilde=kt.to(dtype), v=rnd(B, T, H, V).to(dtype),
                g=None if gate == "none" else F.logsigmoid(rnd(*gshape)) / g_scale,
                beta=torch.sigmoid(rnd(B, T, H)),
                initial_state=rnd(*state_shape(gate, N or B, H, K, V)), cu_seqlens=None)


TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("shape", [(2, 2048, 4), (1, 4096, 2)])
def test_gpu_shapes(gate, dtype, shape):
    x = _bench_inputs(gate, *shape, dtype=dtype)
    o, s = _fwd(x, gate, scale=128 ** -0.5)
    ro, rs = _oracle(x, gate, asym_chunked, scale=128 ** -0.5)
    assert rel_rms(o, ro) < TOL[dtype] and rel_rms(s, rs) < TOL[dtype]


@cuda
@pytest.mark.parametrize("gate", GATES)
def test_gpu_long(gate):
    x = _bench_inputs(gate, 1, 65536, 1)
    o, s = _fwd(x, gate, scale=128 ** -0.5)
    ro, rs = _oracle(x, gate, asym_chunked, scale=128 ** -0.5)
    assert rel_rms(o, ro) < 2e-2 and rel_rms(s, rs) < 2e-2


@cuda
@pytest.mark.parametrize("gate", GATES)
def test_gpu_varlen(gate):
    """S4-like packing (16 random lengths summing to 32768) plus an empty and a 1-token sequence."""
    gen = torch.Generator().manual_seed(7)
    cut = torch.sort(torch.randint(1, 32768, (15,), generator=gen)).values
    cu = [0, 0, 1] + [1 + int(c) for c in cut] + [32769]
    x = _bench_inputs(gate, 1, cu[-1], 4, N=len(cu) - 1)
    x["cu_seqlens"] = torch.tensor(cu, device="cuda", dtype=torch.int32)
    o, s = _fwd(x, gate, scale=128 ** -0.5)
    ro, rs = _oracle(x, gate, asym_chunked, scale=128 ** -0.5)
    assert rel_rms(o, ro) < 2e-2 and rel_rms(s, rs) < 2e-2


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_gpu_strong_decay(gate, dtype):
    x = _bench_inputs(gate, 2, 1024, 4, dtype=dtype)
    x["g"] = -20 * torch.rand_like(x["g"])
    o, s = _fwd(x, gate, scale=128 ** -0.5)
    ro, rs = _oracle(x, gate, asym_chunked, scale=128 ** -0.5)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rms(o, ro) < TOL[dtype] and rel_rms(s, rs) < TOL[dtype]


@cuda
@pytest.mark.parametrize("gate", GATES)
def test_gpu_deterministic(gate):
    x = _bench_inputs(gate, 2, 4096, 8)
    o1, s1 = _fwd(x, gate)
    o2, s2 = _fwd(x, gate)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


@cuda
def test_gpu_int64_offsets():
    """Packed tensors of more than 2^31 elements: the sequences past the 2^31-th element are exact."""
    H, K = 16, 128
    L0 = (2 ** 31) // (H * K) + 64
    cu = [0, L0, L0 + 100, L0 + 230]
    x = _bench_inputs("scalar", 1, cu[-1], H, N=3)
    assert x["q"].numel() > 2 ** 31
    x["cu_seqlens"] = torch.tensor(cu, device="cuda")
    o, s = _fwd(x, "scalar", scale=K ** -0.5)
    assert torch.isfinite(o[:, L0 - 64:]).all() and torch.isfinite(s).all()
    tail = {n: (x[n][:, L0:] if n not in ("initial_state", "cu_seqlens") else None) for n in x}
    tail["initial_state"] = x["initial_state"][1:]
    tail["cu_seqlens"] = torch.tensor([0, 100, 230], device="cuda")
    ro, rs = _oracle(tail, "scalar", asym_chunked, scale=K ** -0.5)
    assert rel_rms(o[:, L0:], ro) < 2e-2 and rel_rms(s[1:], rs) < 2e-2
