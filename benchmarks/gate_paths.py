"""KDA forward+backward time per kernel under gate patterns that choose its forward's and backward's paths, on a GPU.

    PYTHONPATH=. python benchmarks/gate_paths.py [OUT_FILE] [DTYPE]      # DTYPE: bfloat16 (default), float32, ...

The channel gate's forward and backward form a chunk's decayed sums from its first row (span at most ``REF_SPAN``:
"one ref"), else from the first row of each 16-token block (each block within ``REF_SPAN``: "four refs"), else in
the exact block form ("blocks": one product for each of six levels of a binary hierarchy of row groups, against the
groups' middle rows), which the backward also takes where every token decays every channel by more than e^-4. On the
S1 problem of :func:`osdn_ops.bench.make_problem`, prints the profiler's kernel ms per call (total and ``_dqkv``)
for: the bench gates, the bench gates with one token per chunk at -6 in every channel, every gate lowered by 6 or by
20 (blocks), the gates of an eighth of the channels lowered by 4 (fast-forgetting channels: their 16-token blocks
span more than 60, so every chunk takes the blocks), ``logsigmoid(N)`` without the bench's /16 (most chunks span
more than ``REF_SPAN``), the bench gates again; with the share of chunks of each backward path, and fla's
``chunk_kda`` forward+backward kernel ms on the same gates (keys k for both of its keys) where fla is installed.
"""
import sys

import torch
import torch.nn.functional as F

import osdn_ops
from osdn_ops.bench import GPU_SHAPES, kernel_times, make_problem
from osdn_ops.triton.asym_bwd import STEP_SPAN
from osdn_ops.triton.asym_chunks import CHUNK
from osdn_ops.triton.channel_refs import REF_SPAN


def backward_paths(g):
    """Shares of the chunks of ``g`` [B, T, H, K] (T a multiple of CHUNK, gates <= 0) whose backward takes one
    reference row, four, or the exact block form (``osdn_ops.triton.channel_refs.channel_refs`` and
    ``asym_bwd._any_mild_step``)."""
    g = g.float().unflatten(1, (-1, CHUNK))                       # [B, NT, C, H, K]
    G = g.cumsum(2)
    one = (G - G[:, :, :1]).abs().amax(dim=(2, 4)) <= REF_SPAN.value
    blocks = G.unflatten(2, (4, CHUNK // 4))                     # [B, NT, 4, 16, H, K]
    four = (blocks[:, :, :, :1] - blocks).amax(dim=(2, 3, 5)) <= REF_SPAN.value
    mild = g.amax(dim=(2, 4)) >= -STEP_SPAN.value
    one, four = one & mild, four & ~one & mild
    return one.float().mean().item(), four.float().mean().item(), 1 - (one | four).float().mean().item()


def main(path=None, dtype="bfloat16"):
    out = open(path, "w") if path else None

    def log(s):
        print(s, flush=True)
        if out:
            out.write(s + "\n")
            out.flush()

    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  inputs {dtype}")
    p = make_problem("S1", GPU_SHAPES["S1"], torch.device("cuda"), dtype=getattr(torch, dtype))
    kt = osdn_ops.precond_scan(p.k, p.beta, **p.hp)[0]
    one = p.g_channel.clone()
    one[:, ::CHUNK] = -6.0
    fast = p.g_channel.clone()
    fast[..., : fast.shape[-1] // 8] -= 4.0
    torch.manual_seed(1)
    cases = [("bench", p.g_channel), ("one token per chunk at -6", one), ("every gate - 6", p.g_channel - 6.0),
             ("every gate - 20", p.g_channel - 20.0),
             ("an eighth of the channels - 4", fast),
             ("logsigmoid(N)", F.logsigmoid(torch.randn_like(p.g_channel))),
             ("bench again", p.g_channel)]
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        chunk_kda = None
    for name, g in cases:
        leaves = [t.detach().requires_grad_() for t in (p.q, p.k, kt, p.v, g, p.beta)]
        do = torch.randn_like(p.v)

        def fwd_bwd():
            o, _ = osdn_ops.chunk_kda_asym(*leaves)
            torch.autograd.grad(o, leaves, do)
        times = kernel_times(fwd_bwd)
        dqkv = sum(t for k, t in times.items() if "_dqkv" in k)
        one, four, blocks = backward_paths(g)
        line = (f"{name:29s} one ref {one:5.1%} four refs {four:5.1%} blocks {blocks:5.1%}  "
                f"osdn total {sum(times.values()):.3f} ms  _dqkv {dqkv:.3f} ms  "
                + "  ".join(f"{k[:20]} {t:.3f}" for k, t in list(times.items())[:6]))
        if chunk_kda is not None:
            fl = [t.detach().requires_grad_() for t in (p.q, p.k, p.v, g, p.beta)]

            def fla_fwd_bwd():
                o, _ = chunk_kda(*fl)
                torch.autograd.grad(o, fl, do)
            try:
                line += f"  | fla chunk_kda total {sum(kernel_times(fla_fwd_bwd).values()):.3f} ms"
            except Exception as e:  # fla may refuse some gates; the osdn time still counts
                line += f"  | fla chunk_kda failed: {type(e).__name__}: {str(e)[:120]}"
        log(line)


if __name__ == "__main__":
    main(*sys.argv[1:3])
