"""Gradients of the Triton asymmetric delta ops (osdn_ops.triton.asym_bwd) against fp64 autograd.

Tiny shapes (the Triton interpreter on a CPU-only machine, the GPU where there is one): every
gradient vs autograd of the token-by-token oracle. GPU (skipped without CUDA): real shapes vs
fp64 autograd of the chunked reference.
"""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import osdn_ops.triton as ot
from osdn_ops.reference import GATES, asym_chunked, asym_recurrent, state_shape
from osdn_ops.reference import asym as reference
from osdn_ops.triton import asym_bwd, asym_chunks, asym_states
from osdn_ops.triton.asym import chunk_asym_fwd, kept_states_shape, saved_shape
from osdn_ops.triton.asym_kept import kept_views
from osdn_ops.triton.asym_bwd import chunk_asym_bwd
from osdn_ops.triton.channel_refs import REF_SPAN

from .inputs import asym_problem, rel_rms, strong_decay

NAMES = ["q", "k", "k_tilde", "v", "g", "beta", "initial_state"]
OPS = {"none": ot.chunk_delta_asym, "scalar": ot.chunk_gated_delta_asym, "channel": ot.chunk_kda_asym}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"     # the tiny-shape tests run on either


def _triton(gate, x, scale):
    args = [x["q"], x["k"], x["k_tilde"], x["v"]] + ([] if gate == "none" else [x["g"]]) + [x["beta"]]
    return OPS[gate](*args, scale=scale, initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])


def _oracle(fn, gate, x, scale):
    x64 = {n: None if x[n] is None else x[n].detach().double().requires_grad_() for n in NAMES}
    o, s = fn(*(x64[n] for n in NAMES), scale=scale, gate=gate, cu_seqlens=x["cu_seqlens"])
    return x64, o, s


def _check(gate, x, fn=asym_recurrent, tol=1e-4, scale=0.37, seed=0, forward=False):
    """Every gradient of the Triton op vs fp64 autograd of ``fn``, seeds on o and the final state (``forward``: also
    o and the final state themselves, to the same bound)."""
    o, s = _triton(gate, x, scale)
    x64, o64, s64 = _oracle(fn, gate, x, scale)
    if forward:
        assert rel_rms(o, o64) < tol and rel_rms(s, s64) < tol, (rel_rms(o, o64), rel_rms(s, s64))
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    ds = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(o.device)
    names = [n for n in NAMES if x[n] is not None]
    got = torch.autograd.grad((o, s), [x[n] for n in names], (do.to(o.dtype), ds.to(s.dtype)))
    want = torch.autograd.grad((o64, s64), [x64[n] for n in names], (do, ds))
    largest = max(b.norm().item() for b in want)
    for name, a, b, leaf in zip(names, got, want, (x[n] for n in names)):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape, name
        # a gradient that is exactly zero in float64 (dg of one-token chunks without an initial state: the gate
        # enters only through differences G_t - G_j = 0 there, and the kernel's terms cancel to rounding) is held
        # to the same bound relative to the largest gradient
        err = rel_rms(a, b) if b.norm() > 0 else a.double().norm().item() / largest
        assert err < tol, f"d{name}: rel rms {err:.2e} >= {tol:.0e}"


def _problem(gate, T, dtype=torch.float32, B=2, H=2, K=16, V=16, device=DEV, **kw):
    return asym_problem(gate, B=B, T=T, H=H, K=K, V=V, dtype=dtype, requires_grad=True, device=device, **kw)


# ---------------------------------------------------------------- tiny shapes (interpreter or GPU)

@pytest.mark.parametrize("gate", GATES)
def test_grads_fp32_three_chunks(gate):
    _check(gate, _problem(gate, 130, B=1, V=32, initial_state=False, seed=130))


@pytest.mark.parametrize("gate", GATES)
def test_grads_bf16_single_token(gate):
    _check(gate, _problem(gate, 1, dtype=torch.bfloat16, seed=1), tol=2e-2)


@pytest.mark.parametrize("gate", GATES)
def test_grads_varlen_empty_and_single(gate):
    x = _problem(gate, 80, B=1, cu_seqlens=[0, 0, 1, 1, 71, 80], seed=2)
    _check(gate, x)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_grads_strong_decay(gate):
    x = strong_decay(_problem(gate, 50, B=2, seed=3), gate)
    _check(gate, x)


@pytest.mark.parametrize("decay", [-20.0, -8.0, "0 or -20"])
@pytest.mark.parametrize("gate,T,cu", [("scalar", 2, [0, 2, 2]), ("scalar", 70, None), ("channel", 70, None),
                                       ("channel", 2, [0, 2, 2]), ("channel", 7, None)])
def test_grads_every_token_strong(gate, T, cu, decay):
    """Every token decaying by e^-20 or e^-8 (or half of them by e^-20, the rest not at all): dg is ~1e-9 against
    O(1) terms of ``q dq + k dk - kt dkt``, so it is held to 1e-4 only when formed from decayed terms
    (``_scalar_dg``; for the channel gate, fp32 here, the exact block form, ``channel_blocks``, which takes every
    chunk spanning more than ``REF_SPAN`` (70 tokens) or whose every one-token step is below ``-STEP_SPAN`` (2 and 7
    tokens))."""
    x = _problem(gate, T, B=1, K=24, V=20, cu_seqlens=cu, seed=T)
    u = torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(T + 1))
    g = torch.where(u < 0.5, 0.0, -20.0) if decay == "0 or -20" else torch.full_like(u, decay)
    x["g"] = g.to(x["g"].device).requires_grad_()
    _check(gate, x)


@pytest.mark.parametrize("K, pattern", [(40, "every token -8"), (40, "0 or -20"), (40, "strong decay"),
                                        (40, "an eighth of the channels -4"), (136, "0 or -20"), (136, "strong decay")])
def test_grads_channel_exact_blocks_half(K, pattern):
    """The exact block form (``channel_blocks``) where no reference row serves a chunk or no token decays mildly,
    with half inputs: bf16 keys, K 40 and K 136 (256-wide tiles, eight groups of 32 channels), a 22-token tail,
    every gradient within 2e-2."""
    x = _problem("channel", 150, dtype=torch.bfloat16, B=1, K=K, V=24, seed=31)
    u = torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(32))
    g = {"every token -8": torch.full_like(u, -8.0), "0 or -20": torch.where(u < 0.5, 0.0, -20.0),
         "strong decay": -20 * u ** 2,
         "an eighth of the channels -4": -u / 16 - 4.0 * (torch.arange(K) < K // 8)}[pattern]
    x["g"] = g.to(x["g"].device, x["g"].dtype).requires_grad_()
    _check("channel", x, tol=2e-2, forward=True)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_grads_mild_and_strong_chunks(gate):
    """A mild chunk (in-chunk gate span about 3) between strong ones (about 600) in one call: the
    channel gate (fp32 here) finishes the mild chunk with one reference row and the strong ones in the exact block
    form."""
    x = _problem(gate, 192, B=1, seed=4)
    strong = strong_decay(_problem(gate, 192, B=1, seed=4), gate)["g"].detach()
    g = torch.cat([strong[:, :64], x["g"].detach()[:, 64:128] / 16, strong[:, 128:]], 1)
    x["g"] = g.requires_grad_()
    _check(gate, x)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_grads_channel_references(dtype, tol):
    """The channel gate's three ways of forming a chunk's decayed sums, forward and backward, in one call: a chunk
    spanning more than ``REF_SPAN`` whose 16-token blocks each span less (four reference rows), a mild chunk (one),
    a chunk whose blocks span more (the exact block form, ``channel_blocks``) and a 6-token tail."""
    T = 3 * 64 + 6
    x = _problem("channel", T, dtype=dtype, B=1, seed=21)
    u = torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(22))
    g = torch.cat([-3 * u[:, :64], -0.1 * u[:, 64:128], -20 * u[:, 128:] ** 2], 1)

    def decay(a, b):      # the largest decay over tokens a..b of any channel
        return -g[:, a:b].sum(1).min().item()

    assert decay(0, 64) > REF_SPAN.value and decay(128, 144) > REF_SPAN.value
    assert max(decay(a, a + 16) for a in range(0, 64, 16)) < REF_SPAN.value
    x["g"] = g.to(x["g"].device).requires_grad_()
    _check("channel", x, tol=tol, forward=True)


@pytest.mark.parametrize("gate", GATES)
def test_dense_backward_equals_packed(gate):
    """Dense rows index their chunks arithmetically, packed sequences through the chunk table: the same
    rows given either way get the same gradients (T not a multiple of 64, an initial state)."""
    x = _problem(gate, 70, B=2, seed=7)
    gen = torch.Generator().manual_seed(8)
    do = torch.randn(x["v"].shape, generator=gen).to(DEV)
    dht = torch.randn(state_shape(gate, 2, 2, 16, 16), generator=gen).to(DEV)
    flat = {n: None if x[n] is None else x[n].detach() for n in NAMES}
    dense = chunk_asym_bwd(do, dht, flat["q"], flat["k"], flat["k_tilde"], flat["v"], flat["g"], flat["beta"],
                           flat["initial_state"], None, 0.37, gate)
    pk = {n: None if flat[n] is None or n == "initial_state" else flat[n].reshape(1, 140, *flat[n].shape[2:])
          for n in NAMES}
    packed = chunk_asym_bwd(do.reshape(1, 140, 2, 16), dht, pk["q"], pk["k"], pk["k_tilde"], pk["v"], pk["g"],
                            pk["beta"], flat["initial_state"], torch.tensor([0, 70, 140], device=DEV), 0.37, gate)
    for name, a, b in zip(["q", "k", "k_tilde", "v", "g", "beta", "initial_state"], dense, packed):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-6, atol=1e-6, msg=f"d{name}")


@pytest.mark.parametrize("gate", GATES)
def test_backward_from_kept_inverse(gate):
    """The backward from the forward's WY inverse (no scores, no inversion) gives bitwise the gradients
    of the one that recomputes it; a wrong inverse changes them (so it is the one used)."""
    x = _problem(gate, 150, B=1, cu_seqlens=[0, 70, 70, 150], seed=11)
    args = [None if x[n] is None else x[n].detach() for n in NAMES] + [x["cu_seqlens"], 0.37, gate]
    o, final, inverse, states = chunk_asym_fwd(*args, save=True)
    assert inverse.shape == saved_shape(x["q"], x["v"]) and inverse.dtype == torch.float32 and states.numel() == 0
    gen = torch.Generator().manual_seed(12)
    do, dht = torch.randn(o.shape, generator=gen).to(DEV), torch.randn(final.shape, generator=gen).to(DEV)
    kept = chunk_asym_bwd(do, dht, *args, inverse=inverse)
    rerun = chunk_asym_bwd(do, dht, *args)
    for name, a, b in zip(["q", "k", "k_tilde", "v", "g", "beta", "initial_state"], kept, rerun):
        assert torch.equal(a, b), f"d{name}"
    wrong = chunk_asym_bwd(do, dht, *args, inverse=inverse * 1.5)
    assert not torch.equal(wrong[0], kept[0])


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_from_kept_states(gate, dtype):
    """With the forward's chunk states kept (``keep_states``: ``W``, ``v_new``, ``h``) the backward runs neither its
    WY pass nor its state recurrence and gives the gradients of the one that recomputes them: bitwise for fp32
    inputs (and on a GPU), within rounding for half inputs in the interpreter (which keeps ``h`` in the inputs' dtype
    in the forward and in fp32 in the backward). Corrupted states change the gradients (so they are the ones read)."""
    x = _problem(gate, 150, dtype=dtype, B=1, cu_seqlens=[0, 70, 70, 150], seed=15)
    args = [None if x[n] is None else x[n].detach() for n in NAMES] + [x["cu_seqlens"], 0.37, gate]
    o, final, inverse, states = chunk_asym_fwd(*args, save=True, keep_states=True)
    assert states.shape == kept_states_shape(args[0], args[3], x["cu_seqlens"]) and states.dtype == dtype
    assert torch.equal(o, chunk_asym_fwd(*args)[0])
    gen = torch.Generator().manual_seed(16)
    do, dht = torch.randn(o.shape, generator=gen).to(DEV, dtype), torch.randn(final.shape, generator=gen).to(DEV)
    kept = chunk_asym_bwd(do, dht, *args, inverse=inverse, states=states)
    rerun = chunk_asym_bwd(do, dht, *args, inverse=inverse)
    exact = dtype == torch.float32 or DEV == "cuda"
    for name, a, b in zip(["q", "k", "k_tilde", "v", "g", "beta", "initial_state"], kept, rerun):
        assert torch.isfinite(a).all(), f"d{name}"
        if exact:
            assert torch.equal(a, b), f"d{name}"
        elif b.numel():
            assert rel_rms(a, b) < 1e-2, (f"d{name}", rel_rms(a, b))
    W, vn, h = kept_views(states, args[0], args[3], x["cu_seqlens"])
    h.mul_(1.5)
    wrong = chunk_asym_bwd(do, dht, *args, inverse=inverse, states=states)
    assert not torch.equal(wrong[0], kept[0])


@pytest.mark.parametrize("gate", GATES)
def test_wide_fp32_keys_run_the_reference(gate):
    """fp32 inputs with K above 128 run the PyTorch reference, forward and backward (their 256-wide fp32 tiles do not
    fit in a Hopper block's shared memory): the outputs and gradients are the reference's, bitwise, and no WY inverse
    is kept. Half-precision inputs of the same width keep the Triton kernels."""
    x = _problem(gate, 70, K=160, V=16, seed=13)
    args = [None if x[n] is None else x[n].detach() for n in NAMES] + [None, 0.37, gate]
    o, final, inverse, states = chunk_asym_fwd(*args, save=True, keep_states=True)
    assert inverse.numel() == 0 and states.numel() == 0 and saved_shape(x["q"], x["v"]) == (0,)
    want = reference.chunk_asym_fwd(*args)
    assert torch.equal(o, want[0]) and torch.equal(final, want[1])
    gen = torch.Generator().manual_seed(14)
    do, dht = torch.randn(o.shape, generator=gen).to(DEV), torch.randn(final.shape, generator=gen).to(DEV)
    for name, a, b in zip(NAMES, chunk_asym_bwd(do, dht, *args), reference.chunk_asym_bwd(do, dht, *args)):
        assert torch.equal(a, b), f"d{name}"
    assert saved_shape(x["q"].bfloat16(), x["v"].bfloat16()) == (2, 70, 2, 64)


@pytest.mark.parametrize("gate", GATES)
def test_narrow_recurrence_blocks(gate, monkeypatch):
    """Where few (sequence, head) pairs would leave SMs idle, the state recurrences run narrower V blocks
    (``fill_block_v``): forced here by a GPU of many SMs, every gradient still matches the oracle."""
    fill = functools.partial(asym_chunks.fill_block_v, device=torch.device("cpu"))
    monkeypatch.setattr(asym_chunks, "_sm_count", lambda device: 12)
    assert fill(16, 96, 4, 64, 16) == 32        # 16-wide: 24 programs on 12 SMs
    assert fill(256, 96, 4, 64, 16) == 64       # K 256: never narrowed
    monkeypatch.setattr(asym_chunks, "_sm_count", lambda device: 10 ** 6)
    assert fill(16, 96, 4, 64, 16) == 16
    assert fill(16, 96, 4, 64, 32) == 32        # the caller's narrowest
    assert fill(16, 96, 4, 64, 64) == 64
    assert fill(16, 16, 4, 64, 16) == 64        # one block covers V at any width
    assert fill(16, 40, 4, 64, 16) == 64        # V not a multiple of 16: never narrowed
    assert fill(100, 96, 4, 64, 16) == 64       # K not a multiple of 16: never narrowed
    widths = {}
    for mod in (asym_states, asym_bwd):
        def record(*a, name=mod.__name__):
            w = asym_chunks.fill_block_v(*a)
            widths.setdefault(name, set()).add(w)
            return w
        monkeypatch.setattr(mod, "fill_block_v", record)
    _check(gate, _problem(gate, 70, dtype=torch.bfloat16, K=16, V=96, seed=3), tol=2e-2)
    # the state kernel runs 16-wide, _dh too except with the channel gate (slower there)
    assert widths == {asym_states.__name__: {16}, asym_bwd.__name__: {32 if gate == "channel" else 16}}, widths


# ---------------------------------------------------------------- GPU

def _gpu(gate, B, T, H, K, V, dtype=torch.bfloat16, cu=None, seed=0, h0=True):
    return _problem(gate, T, dtype=dtype, B=B, H=H, K=K, V=V, device="cuda", cu_seqlens=cu, seed=seed,
                    initial_state=h0)


def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 2e-2


@cuda
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("shape", [(2, 2048, 4, 128, 128), (1, 4096, 2, 128, 128)])
def test_gpu_bench_shapes(gate, shape):
    _check(gate, _gpu(gate, *shape), fn=asym_chunked, tol=_tol(torch.bfloat16))


@cuda
@pytest.mark.parametrize("gate", GATES)
def test_gpu_long_sequence(gate):
    _check(gate, _gpu(gate, 1, 65536, 1, 64, 64, seed=4), fn=asym_chunked, tol=_tol(torch.bfloat16))


@cuda
@pytest.mark.parametrize("gate", GATES)
def test_gpu_varlen(gate):
    gen = torch.Generator().manual_seed(5)
    cuts = torch.randint(0, 32768, (15,), generator=gen).sort().values.tolist()
    cu = [0] + cuts + [32768]
    _check(gate, _gpu(gate, 1, 32768, 2, 128, 128, cu=cu, seed=5), fn=asym_chunked, tol=_tol(torch.bfloat16))


@cuda
@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("dtype, K", [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 256)])
def test_gpu_strong_decay(gate, dtype, K):
    """Gates down to -20 a token: the channel gate's chunks take the exact block form (fp32 products exact; K 256:
    eight groups of 32 channels)."""
    x = strong_decay(_gpu(gate, 2, 700, 2, K, 64, dtype=dtype, seed=6), gate)
    _check(gate, x, fn=asym_chunked, tol=_tol(dtype))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_channel_paths(dtype):
    """The channel gate's ways of forming a chunk's decayed sums at K = V = 128, in one call: gates ``logsigmoid(N)``
    (chunk spans around ``REF_SPAN``: one or four reference rows), every fourth chunk at 1.5 times that (spans above
    ``REF_SPAN``, 16-token blocks below it: four), every fourth at a sixteenth (one) and every fourth at ``-20 U``
    (blocks spanning more: neither). Output, final state and every gradient."""
    x = _gpu("channel", 2, 1024, 2, 128, 128, dtype=dtype, seed=11)
    gen = torch.Generator().manual_seed(12)
    g = F.logsigmoid(torch.randn(x["g"].shape, generator=gen, dtype=torch.float64)).unflatten(1, (-1, 64))
    g[:, 0::4] /= 16
    g[:, 1::4] *= 1.5
    g[:, 3::4] = -20 * torch.rand(g[:, 3::4].shape, generator=gen, dtype=torch.float64)
    G = g.cumsum(2)
    whole = (G - G[:, :, :1]).abs().amax(dim=(2, 3, 4)) <= REF_SPAN.value
    blocks = G.unflatten(2, (4, 16))
    four = (blocks - blocks[:, :, :, :1]).abs().amax(dim=(2, 3, 4, 5)) <= REF_SPAN.value
    assert whole.any() and (four & ~whole).any() and (~four).any()
    x["g"] = g.flatten(1, 2).to(x["g"]).requires_grad_()
    _check("channel", x, fn=asym_chunked, tol=_tol(dtype), forward=True)


@cuda
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("B, H", [(1, 2), (4, 40)])
def test_gpu_fp16(gate, B, H):
    """fp16 inputs, on a grid of two sequence-heads (the recurrences' narrowest V blocks) and of 160: output, final
    state and every gradient. The channel gates' in-chunk cumulative sums reach about -50, whose factors
    ``e^{+-50}`` no fp16 holds (every output was inf/NaN on the H200 while the scores were an fp16 product); on two
    sequence-heads ``_dh``'s 32-wide V blocks gave a wrong ``dk`` without a gate (so fp16 keeps 64-wide ones)."""
    x = _gpu(gate, B, 200, H, 128, 128, dtype=torch.float16, seed=9)
    o, s = _triton(gate, x, 0.37)
    _, o64, s64 = _oracle(asym_chunked, gate, x, 0.37)
    assert o.dtype == torch.float16 and rel_rms(o, o64) < 1e-2 and rel_rms(s, s64) < 1e-2
    _check(gate, x, fn=asym_chunked, tol=_tol(torch.float16))


@cuda
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("K, V, T", [(105, 61, 65), (100, 40, 128), (128, 64, 65)])
def test_gpu_narrow_blocks(gate, dtype, K, V, T):
    """Four sequence-heads, an initial state: a grid that leaves SMs idle, where the recurrences narrow their V blocks
    (``fill_block_v``) if K and V are multiples of 16 (128 / 64). Without a gate, bf16, K 105 / V 61 and K 100 / V 40,
    ``_dh``'s 32- and 16-wide blocks gave a wrong initial-state gradient on the H200, so those keep 64-wide blocks."""
    _check(gate, _gpu(gate, 1, T, 4, K, V, dtype=dtype, seed=11), fn=asym_chunked, tol=_tol(dtype))


@cuda
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype, K, V", [(torch.float32, 256, 256), (torch.float32, 128, 256),
                                         (torch.bfloat16, 128, 128)])
@pytest.mark.parametrize("B, H", [(1, 2), (4, 40)])
def test_gpu_launch_settings(gate, dtype, K, V, B, H):
    """Where launch settings depend on the tiles and the grid: fp32 with 256-wide keys (the reference: the kernels
    asked for more shared memory than the H200 has), fp32 with the widest keys the kernels take, 16-bit 128-wide
    tiles (the state kernel's deep pipeline where a grid fills at most one wave of SMs: 2 heads; its shallow one
    where it fills more: 160 sequence-heads)."""
    _check(gate, _gpu(gate, B, 130, H, K, V, dtype=dtype, seed=8), fn=asym_chunked, tol=_tol(dtype))


@cuda
@pytest.mark.parametrize("case", range(9))
def test_gpu_random_shapes(case):
    """Many shapes vs the fp64 reference (guards against miscompiles on this Triton/GPU pair)."""
    gen = torch.Generator().manual_seed(100 + case)

    def pick(xs):
        return xs[torch.randint(len(xs), (1,), generator=gen).item()]

    gate = GATES[case % 3]
    dtype = pick([torch.float32, torch.bfloat16, torch.float16])
    K, V = pick([16, 48, 64, 128, 256]), pick([16, 64, 96, 128, 256])
    H = pick([1, 2, 3])
    if case % 4 == 3:
        lens = torch.randint(0, 300, (pick([1, 2, 5]),), generator=gen)
        cu = [0] + torch.cumsum(lens, 0).tolist()
        B, T = 1, cu[-1]
    else:
        cu, B, T = None, pick([1, 2, 3]), pick([1, 63, 64, 65, 129, 500])
    x = _gpu(gate, B, T, H, K, V, dtype=dtype, cu=cu, seed=case, h0=bool(case % 2))
    _check(gate, x, fn=asym_chunked, tol=_tol(dtype), scale=K ** -0.5)


@cuda
@pytest.mark.parametrize("gate", GATES)
def test_gpu_deterministic(gate):
    x = _gpu(gate, 2, 1000, 4, 128, 128, cu=None, seed=7)
    args = [x[n].detach() if x[n] is not None else None for n in NAMES]
    do = torch.randn(x["v"].shape, device="cuda").to(x["v"].dtype)
    dht = torch.randn(state_shape(gate, 2, 4, 128, 128), device="cuda")
    a = chunk_asym_bwd(do, dht, *args, None, 0.1, gate)
    b = chunk_asym_bwd(do, dht, *args, None, 0.1, gate)
    for u, w in zip(a, b):
        assert torch.equal(u, w)


@cuda
@pytest.mark.parametrize("gate", GATES)
def test_gpu_over_2_31_elements(gate):
    """Tensors of more than 2^31 elements: the last (short) sequence's gradients vs the reference."""
    H, K, V = 1, 64, 64
    T = (1 << 31) // (H * V) + 256
    need = {"none": 75, "scalar": 75, "channel": 100}[gate]
    torch.cuda.empty_cache()
    if torch.cuda.mem_get_info()[0] < need * 2 ** 30:
        pytest.skip(f"needs ~{need} GiB of free GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(8)
    q = F.normalize(torch.randn(1, T, H, K, device="cuda", generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, T, H, K, device="cuda", generator=gen), dim=-1).bfloat16()
    kt = (k.float() * 1.2).bfloat16()
    v = torch.randn(1, T, H, V, device="cuda", generator=gen).bfloat16()
    beta = torch.rand(1, T, H, device="cuda", generator=gen)
    g = None if gate == "none" else F.logsigmoid(torch.randn((1, T, H) + ((K,) if gate == "channel" else ()),
                                                             device="cuda", generator=gen)) / 8
    do = torch.randn(1, T, H, V, device="cuda", generator=gen).bfloat16()
    cu = torch.cat([torch.arange(0, T - 300, 4096, device="cuda"), torch.tensor([T - 300, T], device="cuda")])
    N = cu.numel() - 1
    dht = torch.randn(state_shape(gate, N, H, K, V), device="cuda", generator=gen)
    grads = chunk_asym_bwd(do, dht, q, k, kt, v, g, beta, None, cu, K ** -0.5, gate)
    s = T - 300
    part = [t[:, s:].double().requires_grad_() if t is not None else None for t in (q, k, kt, v, g, beta)]
    o64, s64 = asym_chunked(*part, None, scale=K ** -0.5, gate=gate)
    want = torch.autograd.grad((o64, s64), [p for p in part if p is not None], (do[:, s:].double(), dht[-1:].double()))
    names = [n for n, t in zip(("q", "k", "k_tilde", "v", "g", "beta"), part) if t is not None]
    got = [grads[i][:, s:] for i in range(6) if part[i] is not None]
    for name, a, b in zip(names, got, want):
        assert rel_rms(a, b) < 2e-2, name
    assert math.isfinite(grads[0].float().abs().max().item())
