"""Triton precond_scan (forward, d_final, every gradient) against the float64 token-by-token oracle.

CPU tests run the kernels under the Triton interpreter on tiny shapes; GPU tests (CUDA only) use the
BENCH.md shapes, scaled down in T or heads where the Python-loop oracle would be too slow.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import osdn_ops.triton as ot
from osdn_ops.reference import precond_scan_recurrent
from osdn_ops.triton import asym_chunks
from osdn_ops.triton import precond as tp
from osdn_ops.triton import precond_segments as segments
from osdn_ops.triton.precond_fwd import forward_pass, residual_views
from osdn_ops.triton.precond_tokens import flagged_chunk

HP = dict(d_min=0.5, d_max=2.0, eps=1e-6)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"     # the tiny-shape tests run on either


def rel(x, ref):
    """Relative RMS error in float64 (NaN fails every bound)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def vocab_keys(B, T, H, K, n_keys, gen, device):
    """Keys drawn from a fixed vocabulary ``normalize(softmax(4 * N(0,1)) ** 0.5)`` (the clamp fires)."""
    vocab = F.normalize(torch.softmax(4 * torch.randn(n_keys, K, generator=gen), -1) ** 0.5, dim=-1)
    return vocab[torch.randint(0, n_keys, (B, T, H), generator=gen)].to(device)


def problem(B=1, T=70, H=1, K=16, *, dtype=torch.float32, cu=None, d0=True, retention=True, keys="unit",
            n_keys=8, seed=0, device=DEV):
    """Inputs ``k, beta, d0, retention, cu_seqlens`` (fresh random values)."""
    gen = torch.Generator().manual_seed(seed)
    N = B if cu is None else len(cu) - 1
    if keys == "vocab":
        k = vocab_keys(B, T, H, K, n_keys, gen, device)
    else:
        k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(device)
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).to(device, sd)
    x = dict(k=k.to(dtype), beta=beta,
             d0=(0.6 + 1.2 * torch.rand(N, H, K, generator=gen)).to(device, sd) if d0 else None,
             retention=(0.97 + 0.03 * torch.rand(B, T, H, generator=gen)).to(device, sd) if retention else None,
             cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))
    return x


def check(x, *, eta, beta_aware=True, tol=1e-4, gtol=None, other_form=True, box=None):
    """Forward, d_final and gradients of osdn_ops.triton.precond_scan against the float64 oracle
    (and, with ``other_form``, of the kernels in the token-loop form, which the op does not use by
    default). ``box``: ``(d_min, d_max)`` instead of HP's."""
    gtol = tol if gtol is None else gtol
    bounds = HP if box is None else dict(HP, d_min=box[0], d_max=box[1])
    hp = dict(bounds, eta=eta, beta_aware=beta_aware)
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("k", "beta", "d0", "retention") if x[n] is not None}
    kt, df = ot.precond_scan(leaves["k"], leaves["beta"], leaves.get("d0"), leaves.get("retention"),
                             cu_seqlens=x["cu_seqlens"], **hp)
    assert kt.dtype == x["k"].dtype and df.dtype == (torch.float64 if kt.dtype == torch.float64 else torch.float32)
    oracle = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    kr, dr = precond_scan_recurrent(oracle["k"], oracle["beta"], oracle.get("d0"), oracle.get("retention"),
                                    cu_seqlens=x["cu_seqlens"], **hp)
    assert rel(kt, kr) < tol and rel(df, dr) < tol
    gk, gd = torch.randn_like(kr), torch.randn_like(dr)
    torch.autograd.backward((kt, df), (gk.to(kt.dtype), gd.to(df.dtype)))
    ref = torch.autograd.grad((kr * gk).sum() + (dr * gd).sum(), list(oracle.values()), allow_unused=True,
                              materialize_grads=True)
    for (name, leaf), g_ref in zip(leaves.items(), ref):
        assert leaf.grad.dtype == leaf.dtype, name
        if g_ref.abs().max() == 0:
            assert leaf.grad.abs().max() == 0, name
        else:
            assert rel(leaf.grad, g_ref) < gtol, (name, rel(leaf.grad, g_ref))
    if other_form:                                  # the form the op does not use by default
        args = (x["k"], x["beta"], x["d0"], x["retention"], x["cu_seqlens"], eta, bounds["d_min"], bounds["d_max"],
                bounds["eps"], beta_aware)
        kt2, df2 = tp.precond_scan_fwd(*args, form="tokens")
        assert rel(kt2, kr) < tol and rel(df2, dr) < tol
        dk, dbeta, dd0, dret = tp.precond_scan_bwd(gk.to(kt.dtype), gd.to(df.dtype), *args, form="tokens")
        grads = dict(k=dk, beta=dbeta, d0=dd0, retention=dret)
        for name, g_ref in zip(leaves, ref):
            if g_ref.abs().max() > 0:
                assert rel(grads[name], g_ref) < gtol, (name, "other form")


def share(x, *, eta, beta_aware=True, box=None):
    """Share of chunks the parallel form ran token by token."""
    bounds = HP if box is None else dict(HP, d_min=box[0], d_max=box[1])
    return tp.precond_fallback_share(x["k"], x["beta"], x["d0"], x["retention"], x["cu_seqlens"], eta=eta,
                                     beta_aware=beta_aware, **bounds)


# ------------------------------------------------------------------ tiny shapes (the interpreter on CPU)

def test_d0_retention_batch():
    check(problem(B=2, T=70, H=2), eta=0.05)


@pytest.mark.parametrize("beta_aware", [True, False])
def test_defaults_t_not_multiple_of_chunk(beta_aware):
    x = problem(T=130, K=32, d0=False, retention=False)
    check(x, eta=0.02, beta_aware=beta_aware)
    assert share(x, eta=0.02, beta_aware=beta_aware) == 0.0     # no clamp: every chunk in parallel form


def test_clamp_heavy_repeated_keys():
    x = problem(T=130, keys="vocab", retention=False)
    check(x, eta=2.0, gtol=1e-3)
    assert share(x, eta=2.0) > 0.0                               # the token-by-token fallback ran


def test_pinned_coordinates_fall_back():
    """d0 on d_max with beta < 1/2: the pre-clamp value points outward, so the clamp fires in every
    chunk and the parallel form hands each one to the token loop."""
    x = problem(T=130, retention=False)
    x["d0"] = torch.full_like(x["d0"], 2.0)
    x["d0"][..., :4] = 1.0
    x["beta"] = 0.3 * x["beta"]
    check(x, eta=0.05)
    assert share(x, eta=0.05) == 1.0


def test_retention_drives_to_bound():
    x = problem(T=130)
    x["retention"] = torch.full_like(x["retention"], 0.97)
    x["d0"] = torch.full_like(x["d0"], 0.5)
    x["d0"][..., :4] = 1.0
    check(x, eta=0.01)
    assert share(x, eta=0.01) > 0.0


def test_pinned_groups_on_both_bounds():
    """Half the coordinates on d_max, pushed up by keys concentrated there, the other half on d_min, drawn down by
    the retention, so the clamp fires at both bounds at most tokens; tokens with a large beta pull the upper half
    inside the box for a while (no torch.clamp gradient on the bound-pinned steps, the full one inside). T = 150
    leaves a partial last group and chunk."""
    x = problem(B=2, T=150, H=2, K=16)
    k = torch.rand(2, 150, 2, 16, generator=torch.Generator().manual_seed(3)) + 0.5
    k[..., 8:] *= 1e-2
    x["k"] = F.normalize(k, dim=-1).to(DEV)
    x["beta"] = torch.full_like(x["beta"], 0.3)
    x["beta"][:, [40, 41, 97]] = 0.95
    x["retention"] = torch.full_like(x["retention"], 0.9998)
    x["d0"] = torch.cat([torch.full_like(x["d0"][..., :8], 2.0), torch.full_like(x["d0"][..., 8:], 0.5)], -1)
    check(x, eta=0.5)
    assert share(x, eta=0.5) == 1.0


@pytest.mark.parametrize("beta_aware", [True, False])
def test_parallel_form_retention_near_zero(beta_aware):
    """Retention in (0.9, 1) and 1e-3 at two tokens, in a box that never clamps: every chunk in the
    parallel form."""
    x = problem(T=130, K=16)
    x["retention"] = 0.9 + 0.1 * torch.rand_like(x["retention"])
    x["retention"][:, [5, 100]] = 1e-3
    x["d0"] = 0.5 + 0.4 * torch.rand_like(x["d0"])          # <d, s> < 1 for unit keys: w > 0, d stays > 0
    box = (1e-7, 10.0)
    check(x, eta=0.05, beta_aware=beta_aware, box=box)
    assert share(x, eta=0.05, beta_aware=beta_aware, box=box) == 0.0


def test_unclamped_chain_diverges_after_first_clamp():
    """The chain runs without the clamp, so past the first chunk where a clamp fires its checkpoints are
    wrong and, with a large step, overflow to inf/NaN; the fixup must replace all of them. The first
    chunk stays inside the box (d starts in its middle, small eta), the later ones do not (eta jumps)."""
    x = problem(T=200, H=2, keys="vocab", n_keys=4, d0=False, retention=False)
    x["beta"][:, 64:] = 1.0
    x["k"][:, 64:] = x["k"][:, 64:] * 40.0                        # |k|^2 = 1600 past the first chunk
    d = torch.ones(2, 16, dtype=torch.float64)                   # the unclamped recurrence overflows fp32
    for t in range(200):
        kk = x["k"][0, t].double().cpu()
        b = x["beta"][0, t].double().cpu()
        s = kk * kk
        d = d + (0.02 * b / s.sum(-1))[:, None] * (1 - b * (d * s).sum(-1))[:, None] * s
    assert not torch.isfinite(d.float()).all()
    _, _, flags, _ = forward_pass(x["k"], x["beta"], None, None, None, 0.02, 0.5, 2.0, 1e-6, True, True)
    assert flags[0].eq(0).all() and flags[1].eq(1).all()           # chunk 0 exact, chunk 1 clamps
    check(x, eta=0.02, gtol=1e-3)


def test_parallel_form_varlen_empty_sequences_fp16():
    x = problem(T=150, K=16, cu=[0, 0, 70, 70, 71, 150, 150], dtype=torch.float16, retention=False)
    x["d0"] = 0.9 + 0.2 * torch.rand_like(x["d0"])
    check(x, eta=0.02, tol=2e-3, gtol=5e-3)
    assert share(x, eta=0.02) == 0.0


def test_zero_and_tiny_keys_eps_floor():
    x = problem(T=40, retention=False)
    x["k"][:, 3] = 0.0
    x["k"][:, 10] = 1e-4 * x["k"][:, 10]                          # ||k||^2 = 1e-8 < eps
    check(x, eta=1e-7)


def test_varlen_empty_and_single_token_bf16():
    x = problem(T=100, K=24, cu=[0, 0, 1, 40, 40, 100], dtype=torch.bfloat16)
    check(x, eta=0.05, tol=1e-2, gtol=2e-2)


def test_token_and_parallel_forms_agree():
    x = problem(T=80, H=2, retention=False)
    args = (x["k"], x["beta"], x["d0"], None, None, 0.05, 0.5, 2.0, 1e-6, True)
    for a, b in zip(tp.precond_scan_fwd(*args, form="parallel"), tp.precond_scan_fwd(*args, form="tokens")):
        assert rel(a, b) < 1e-5
    g = (torch.randn_like(x["k"]), torch.randn(1, 2, 16, device=DEV))
    for a, b in zip(tp.precond_scan_bwd(*g, *args, form="parallel"), tp.precond_scan_bwd(*g, *args, form="tokens")):
        assert rel(a, b) < 1e-5 if a.numel() else b.numel() == 0


@pytest.mark.parametrize("form", ["parallel", "tokens"])
def test_backward_from_saved_residuals(form):
    """The backward from the forward's residuals (checkpoints, flags) is bitwise the one that reruns the
    forward, with chunks that fell back (vocabulary keys, large eta) among those that did not."""
    x = problem(B=2, T=150, H=2, keys="vocab", cu=None, retention=False)
    x["d0"] = 1.0 + 0.2 * torch.rand(x["d0"].shape, generator=torch.Generator().manual_seed(1)).to(x["d0"])
    args = (x["k"], x["beta"], x["d0"], x["retention"], None, 0.7, 0.5, 2.0, 1e-6, True)
    kt, df, ckpt, flags = tp.precond_scan_fwd(*args, form=form, save=True)
    assert (ckpt.shape, flags.shape) == tuple(torch.Size(s) for s in tp.saved_shapes(x["k"], None))
    if form == "parallel":
        assert 0.0 < share(x, eta=0.7) < 1.0                                 # some chunks fell back, not all
    for a, b in zip((kt, df), tp.precond_scan_fwd(*args, form=form)):
        assert torch.equal(a, b)
    g = (torch.randn_like(kt), torch.randn_like(df))
    from_saved = tp.precond_scan_bwd(*g, *args, form=form, saved=(ckpt, flags))
    for a, b in zip(from_saved, tp.precond_scan_bwd(*g, *args, form=form)):
        assert torch.equal(a, b)
    if form == "parallel":      # the kept per-token w and Tinv^T are what the backward reads
        for part in (1, 2):
            moved = ckpt.clone()
            residual_views(moved, x["k"], None)[part].mul_(1.5)
            dk = tp.precond_scan_bwd(*g, *args, form=form, saved=(moved, flags))[0]
            assert not torch.equal(dk, from_saved[0])


@pytest.mark.parametrize("keys, eta, retention, fallback", [
    ("unit", 0.05, None, "none"), ("unit", 0.05, 0.99, "none"), ("vocab", 1.0, 0.99, "some"),
    ("vocab", 2.0, None, "all")])
def test_parallel_backward(keys, eta, retention, fallback):
    """The adjoint group by group (chunks that passed the check), token by token elsewhere, with and
    without retention; ``fallback``: which share of the chunks the inputs send to the token loop."""
    x = problem(T=150, H=2, keys=keys, retention=retention is not None)
    gen = torch.Generator().manual_seed(1)
    x["d0"] = 1.0 + 0.2 * torch.rand(x["d0"].shape, generator=gen).to(x["d0"])
    if retention is not None:
        x["retention"] = retention + (1 - retention) * torch.rand(x["retention"].shape, generator=gen).to(x["d0"])
    got = share(x, eta=eta)
    assert {"none": got == 0.0, "some": 0.0 < got < 1.0, "all": got == 1.0}[fallback], got
    check(x, eta=eta, tol=1e-5, other_form=False)


@pytest.mark.parametrize("case", ["dense", "varlen", "fallback"])
def test_two_level_chains(case, monkeypatch):
    """The chains in two levels (segment maps, a carry over segments, the chain per segment), forced on with
    64-token segments: outputs and every gradient match the oracle, and the one-level chains to 1e-5.
    ``dense``/``varlen`` (empty and partial segments): a large step in a wide box, so that no chunk falls back
    and the maps are far from the identity; ``fallback``: chunks that ran token by token, so the adjoint's
    carry runs some segments serially. The backward from the saved residuals (the forward's maps among them) is
    bitwise the one that runs the forward again."""
    x = {"dense": lambda: problem(B=2, T=300, H=2),
         "varlen": lambda: problem(T=300, H=2, cu=[0, 0, 70, 80, 80, 300], retention=False),
         "fallback": lambda: problem(T=350, H=2, keys="vocab", retention=False)}[case]()
    box = (0.5, 2.0) if case == "fallback" else (1e-3, 1e3)
    args = (x["k"], x["beta"], x["d0"], x["retention"], x["cu_seqlens"], 1.0, *box, 1e-6, True)
    one = tp.precond_scan_fwd(*args, save=True)
    g = (torch.randn_like(one[0]), torch.randn_like(one[1]))
    one_bwd = tp.precond_scan_bwd(*g, *args, saved=one[2:])
    monkeypatch.setattr(segments, "segment_tokens", lambda k, cu: 64)
    fell_back = share(x, eta=1.0, box=box)
    assert 0.0 < fell_back < 1.0 if case == "fallback" else fell_back == 0.0
    check(x, eta=1.0, tol=1e-5, other_form=False, box=box)
    two = tp.precond_scan_fwd(*args, save=True)
    assert torch.equal(two[3], one[3])                      # the same chunks fell back
    two_bwd = tp.precond_scan_bwd(*g, *args, saved=two[2:])
    for a, b in zip(two[:2] + two_bwd, one[:2] + one_bwd):
        assert rel(a, b) < 1e-5 if b.numel() else a.numel() == 0
    for a, b in zip(tp.precond_scan_bwd(*g, *args), two_bwd):     # the backward that runs the forward again
        assert torch.equal(a, b)
    if case == "dense":                                     # the adjoint applies the forward's maps
        moved = two[2].clone()
        residual_views(moved, x["k"], None)[3].mul_(1.5)
        assert not torch.equal(tp.precond_scan_bwd(*g, *args, saved=(moved, two[3]))[0], two_bwd[0])


def test_two_level_choice(monkeypatch):
    """Two levels only where there are few (sequence, head) chains for the SMs and sequences are long."""
    monkeypatch.setattr(asym_chunks, "_sm_count", lambda device: 132)
    k = lambda B, T, H: torch.empty(B, T, H, 128, device="meta")
    assert segments.segment_tokens(k(1, 32768, 8), None) == 1024       # S3
    assert segments.segment_tokens(k(2, 16384, 8), None) == 1024
    assert segments.segment_tokens(k(4, 4096, 8), None) == 512         # S2: 32 chains
    assert segments.segment_tokens(k(4, 2048, 8), None) == 256
    assert segments.segment_tokens(k(5, 4096, 8), None) == 0           # 40 chains
    assert segments.segment_tokens(k(8, 2048, 16), None) == 0          # S1: 128 chains
    assert segments.segment_tokens(k(2, 1024, 4), None) == 0           # short sequences
    assert segments.segment_tokens(torch.empty(1, 32768, 8, 256, device="meta"), None) == 0     # K = 256


@triton.jit
def _flag_search_kernel(flag_ptr, lo_ptr, hi_ptr, out_ptr, H, LAST: tl.constexpr, FB: tl.constexpr):
    """Program i: ``flagged_chunk`` over chunks ``[lo[i], hi[i])`` of head ``i % H`` (flag rows from slot 3)."""
    i = tl.program_id(0)
    j = flagged_chunk(flag_ptr, 3, tl.load(lo_ptr + i), tl.load(hi_ptr + i), i % H, H, LAST, FB)
    tl.store(out_ptr + i, j)


@pytest.mark.parametrize("last", [False, True])
def test_flag_search_blocks(last):
    """The flag search reads blocks of FB flags from the end it searches from and stops at the first hit: with
    FB = 4 over 40 chunks (sparse and dense flags, empty ranges) it returns what a Python search does."""
    gen = torch.Generator().manual_seed(3)
    H, n = 2, 40
    flags = (torch.rand(3 + n, H, generator=gen) < 0.08).to(torch.int32)
    flags[3 + 30:3 + 33, 1] = 1
    lo = torch.randint(0, n, (64,), generator=gen)
    hi = torch.minimum(lo + torch.randint(0, 30, (64,), generator=gen), torch.tensor(n))
    out = torch.empty(64, dtype=torch.int64, device=DEV)
    _flag_search_kernel[(64,)](flags.to(DEV), lo.to(DEV), hi.to(DEV), out, H, LAST=last, FB=4)
    for i in range(64):
        hits = [j for j in range(int(lo[i]), int(hi[i])) if flags[3 + j, i % H]]
        want = (max(hits) if hits else int(lo[i]) - 1) if last else (min(hits) if hits else int(hi[i]))
        assert int(out[i]) == want, (i, int(lo[i]), int(hi[i]), hits)


def test_empty_time_and_float64_reference():
    x = problem(B=2, T=0)
    kt, df = ot.precond_scan(x["k"], x["beta"], x["d0"], x["retention"], eta=0.1, beta_aware=True, **HP)
    assert kt.shape == x["k"].shape and torch.equal(df, x["d0"])
    check(problem(T=20, dtype=torch.float64), eta=0.05, tol=1e-10)


@pytest.mark.parametrize("cu", [None, [0, 0]], ids=["dense", "varlen"])
def test_empty_time_backward(cu):
    """T = 0 through autograd (the backward from the saved residuals): empty gradients of k and beta, and
    d0's gradient is d_final's."""
    x = problem(B=1, T=0, cu=cu, retention=False)
    k, beta, d0 = (x[n].clone().requires_grad_() for n in ("k", "beta", "d0"))
    kt, df = ot.precond_scan(k, beta, d0, None, cu_seqlens=x["cu_seqlens"], eta=0.1, beta_aware=False, **HP)
    gd = torch.randn_like(df)
    torch.autograd.backward((kt, df), (torch.randn_like(kt), gd))
    assert k.grad.shape == k.shape and beta.grad.shape == beta.shape and torch.equal(d0.grad, gd)


# ------------------------------------------------------------------ GPU, BENCH.md shapes (scaled)

@cuda
@pytest.mark.parametrize("shape", [(2, 2048, 2, 128), (1, 4096, 2, 128), (1, 8192, 1, 128)],
                         ids=["S1-like", "S2-like", "S3-like"])
@pytest.mark.parametrize("opts", [dict(d0=False, retention=False), dict(d0=True, retention=True)],
                         ids=["defaults", "d0-retention"])
def test_gpu_bench_shapes(shape, opts):
    B, T, H, K = shape
    x = problem(B, T, H, K, dtype=torch.bfloat16, device="cuda", **opts)
    check(x, eta=0.003, tol=1e-2, gtol=2e-2)
    if not opts["d0"]:                      # d starts at 1, far from the box: the parallel form throughout
        assert share(x, eta=0.003) == 0.0


@cuda
def test_gpu_clamp_heavy():
    x = problem(1, 2048, 2, 128, dtype=torch.bfloat16, keys="vocab", n_keys=32, d0=False, retention=False,
                device="cuda")
    check(x, eta=0.5, tol=1e-2, gtol=3e-2)
    assert share(x, eta=0.5) > 0.0


@cuda
def test_gpu_deterministic():
    x = problem(1, 1024, 4, 128, dtype=torch.bfloat16, keys="vocab", n_keys=32, device="cuda")
    args = (x["k"], x["beta"], x["d0"], x["retention"], None, 0.3, 0.5, 2.0, 1e-6, True)
    a, b = tp.precond_scan_fwd(*args), tp.precond_scan_fwd(*args)
    g = (torch.randn_like(a[0]), torch.randn_like(a[1]))
    c, e = tp.precond_scan_bwd(*g, *args), tp.precond_scan_bwd(*g, *args)
    assert all(torch.equal(u, v) for u, v in zip(a + c, b + e))


@cuda
def test_gpu_fp32_beta_unaware():
    check(problem(2, 1024, 2, 64, device="cuda"), eta=0.01, beta_aware=False)


@cuda
def test_gpu_varlen_empty_sequences():
    x = problem(1, 2048, 2, 128, cu=[0, 0, 700, 700, 701, 2048, 2048], dtype=torch.bfloat16, device="cuda")
    check(x, eta=0.003, tol=1e-2, gtol=2e-2)


@cuda
def test_gpu_k256_and_fallback_reference_sizes():
    check(problem(1, 512, 2, 256, dtype=torch.bfloat16, device="cuda"), eta=0.01, tol=1e-2, gtol=2e-2)
    check(problem(1, 64, 1, 320, device="cuda"), eta=0.01)     # K > 256: reference kernel


@cuda
def test_gpu_more_than_2_31_elements():
    """k has > 2^31 elements; the sequences at both ends (the last past 2^31) match the oracle."""
    H, K = 4, 128
    T = 2**31 // (H * K) + 4096
    k = torch.randn(1, T, H, K, dtype=torch.bfloat16, device="cuda") * K ** -0.5
    beta = torch.rand(1, T, H, device="cuda")
    cu = torch.tensor([0, 1000, T - 2000, T - 1000, T], dtype=torch.int64, device="cuda")
    hp = dict(HP, eta=0.05, beta_aware=True)
    kt, df = tp.precond_scan_fwd(k, beta, None, None, cu, 0.05, 0.5, 2.0, 1e-6, True)
    dkt = torch.randn_like(kt)
    ddf = torch.randn_like(df)
    dk, dbeta, _, _ = tp.precond_scan_bwd(dkt, ddf, k, beta, None, None, cu, 0.05, 0.5, 2.0, 1e-6, True)
    for n, (s, e) in ((0, (0, 1000)), (3, (T - 1000, T))):
        ks = k[:, s:e].double().requires_grad_()
        bs = beta[:, s:e].double().requires_grad_()
        kr, dr = precond_scan_recurrent(ks, bs, **hp)
        assert rel(kt[:, s:e], kr) < 1e-2 and rel(df[n], dr[0]) < 1e-4
        gk, gb = torch.autograd.grad((kr * dkt[:, s:e].double()).sum() + (dr * ddf[n].double()).sum(), [ks, bs])
        assert rel(dk[:, s:e], gk) < 2e-2 and rel(dbeta[:, s:e], gb) < 1e-4
    assert torch.isfinite(df).all()
