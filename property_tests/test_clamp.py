"""Clamp invariant: every d_t, d_final and k_tilde / k stay in [d_min, d_max], for any inputs."""
import torch
from hypothesis import given

from osdn_ops import precond_scan
from osdn_ops.reference import precond_scan_recurrent
from osdn_ops.testing import dtypes, precond_problems

from .helpers import DEVICE, few, kernel_shapes, require_triton

ADVERSARIAL = precond_problems(adversarial=True, dtype=dtypes((torch.float32, torch.bfloat16, torch.float64)))


def _first_tokens(p) -> torch.Tensor:
    """[B, T] mask of each sequence's first token (where d_t = d0, which may lie outside the box)."""
    B, T = p.k.shape[:2]
    mask = torch.zeros(B, T, dtype=torch.bool)
    starts = [0] if p.cu_seqlens is None else [int(s) for s in p.cu_seqlens[:-1]]
    for s in starts:
        if s < T:
            mask[:, s] = True
    return mask


def _bounds(p, dtype):
    """The box in ``dtype`` (the clamp's bounds are rounded to the compute dtype)."""
    lo = torch.tensor(p.d_min, dtype=dtype).item()
    hi = torch.tensor(p.d_max, dtype=dtype).item()
    return min(lo, p.d_min), max(hi, p.d_max)


def _d0_in_box(p) -> bool:
    return p.d0 is not None or p.d_min <= 1.0 <= p.d_max


def _assert_d_final(p, d_final):
    lo, hi = _bounds(p, d_final.dtype)
    d = d_final.detach().cpu().double()
    assert not d.isnan().any(), "NaN in d_final"
    lengths = [p.k.shape[1]] * p.k.shape[0] if p.cu_seqlens is None else p.cu_seqlens.diff().tolist()
    active = torch.tensor([n > 0 or _d0_in_box(p) for n in lengths])
    d = d[active]
    assert ((d >= lo) & (d <= hi)).all(), f"d_final outside [{p.d_min}, {p.d_max}]: [{d.min()}, {d.max()}]"


def _assert_ratio(p, k_tilde):
    """k_tilde / k in the box (widened by one rounding of k_tilde's dtype) wherever k != 0."""
    ulp = torch.finfo(k_tilde.dtype).eps
    k, kt = p.k.detach().cpu().double(), k_tilde.detach().cpu().double()
    assert not kt.isnan().any(), "NaN in k_tilde"
    keep = k != 0
    if not _d0_in_box(p):
        keep &= ~_first_tokens(p)[:, :, None, None]
    ratio = kt[keep] / k[keep]
    lo, hi = _bounds(p, torch.float32)
    assert ((ratio >= lo * (1 - ulp)) & (ratio <= hi * (1 + ulp))).all(), \
        f"k_tilde / k outside [{p.d_min}, {p.d_max}]: [{ratio.min()}, {ratio.max()}]"


@given(ADVERSARIAL)
def test_trajectory_in_box(p):
    """Oracle: d_t for every token (but a default d0 = 1 outside the box) and d_final are in the box."""
    d, d_final = precond_scan_recurrent(p.k, p.beta, p.d0, p.retention, **p.kwargs(), trajectory=True)
    lo, hi = _bounds(p, d.dtype)
    keep = torch.ones(d.shape[:2], dtype=torch.bool) if _d0_in_box(p) else ~_first_tokens(p)
    dt = d[keep]
    assert not dt.isnan().any()
    assert ((dt >= lo) & (dt <= hi)).all(), f"d_t outside [{p.d_min}, {p.d_max}]: [{dt.min()}, {dt.max()}]"
    _assert_d_final(p, d_final)


@given(ADVERSARIAL)
def test_public_op_in_box(p):
    """osdn_ops.precond_scan: d_final in the box and k_tilde / k in the box where k != 0."""
    k_tilde, d_final = p.run(precond_scan)
    _assert_d_final(p, d_final)
    _assert_ratio(p, k_tilde)


@few()
@given(precond_problems(adversarial=True, shape=kernel_shapes(), device=DEVICE))
def test_triton_in_box(p):
    """osdn_ops.triton.precond_scan (interpreted on CPU): the same invariant."""
    k_tilde, d_final = p.run(require_triton().precond_scan)
    _assert_d_final(p, d_final)
    _assert_ratio(p, k_tilde)
