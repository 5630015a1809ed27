"""Shared pieces of the property tests: error measure and bounds, gradients, Triton availability."""
from __future__ import annotations

import importlib
import math
from typing import Callable, Optional

import torch
from hypothesis import settings, target

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"

# Relative-RMS bounds (forward, gradient) by input dtype and kernel kind: the CPU reference
# kernels compute in fp32, Triton on a GPU may use tf32-ish dots.
_BOUNDS = {
    ("ref", torch.float64): (1e-9, 1e-9), ("ref", torch.float32): (1e-4, 1e-4),
    ("ref", torch.bfloat16): (2e-2, 2e-2), ("ref", torch.float16): (5e-3, 5e-3),
    ("gpu", torch.float64): (1e-9, 1e-9), ("gpu", torch.float32): (1e-3, 2e-3),
    ("gpu", torch.bfloat16): (2e-2, 3e-2), ("gpu", torch.float16): (5e-3, 1e-2),
}

def kernel_shapes():
    """Shapes for the Triton entry points: tiny under the interpreter, real ones on a GPU."""
    from osdn_ops.testing import shapes

    if INTERPRETED:
        return shapes(max_T=40, max_dim=24, max_seqs=3)
    return shapes(max_T=300, max_heads=4, max_dim=128, max_seqs=4)


# test name -> (worst error / bound, description, examples run); printed by conftest.
WORST: dict[str, tuple[float, str, int]] = {}


def bound(dtype: torch.dtype, kind: str = "ref", grad: bool = False) -> float:
    """Relative-RMS bound for outputs (``grad`` False) or gradients of a ``kind`` kernel."""
    if kind == "triton" and INTERPRETED:
        kind = "ref"  # the interpreter evaluates in numpy fp32, no tf32
    return _BOUNDS[("gpu" if kind == "triton" else kind, dtype)][int(grad)]


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64; ``inf`` for any NaN/inf in ``x``; absolute when ``ref`` is ~0."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if x.shape != ref.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference shape {tuple(ref.shape)}")
    if not torch.isfinite(x).all():
        return math.inf
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 1e-30 else num


class Errors:
    """Collects named error/bound ratios of one example; ``check()`` targets the worst and asserts."""

    def __init__(self, test: str):
        self.test = test
        self.items: list[tuple[float, str]] = []

    def add(self, name: str, err: float, tol: float) -> None:
        self.items.append((err / tol if tol > 0 else (0.0 if err == 0 else math.inf), f"{name}: {err:.3e} (bound {tol:.1e})"))

    def close(self, name: str, x: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
        self.add(name, rel_rms(x, ref), tol)

    def check(self) -> None:
        if not self.items:
            return
        ratio, detail = max(self.items, key=lambda it: it[0])
        target(ratio if math.isfinite(ratio) else 1e30, label="worst error / bound")
        prev = WORST.get(self.test, (-1.0, "", 0))
        WORST[self.test] = (max(prev[0], ratio), detail if ratio > prev[0] else prev[1], prev[2] + 1)
        bad = [d for r, d in self.items if not r <= 1.0]
        assert not bad, "; ".join(bad)


def few(divisor: int = 2) -> settings:
    """Settings for expensive tests (Triton interpreter, long loops): a fraction of the profile's examples."""
    return settings(max_examples=max(2, settings.default.max_examples // divisor))


def triton_module(name: str):
    """``osdn_ops.triton.<name>`` (``"precond"``, ``"asym"`` kernels or ``"functions"``), or None when
    it does not exist yet or Triton is missing. Other import errors propagate."""
    full = f"osdn_ops.triton.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name in (full, "triton", "osdn_ops.triton.precond", "osdn_ops.triton.asym"):
            return None
        raise


def require_triton(name: str = "functions"):
    """The Triton module, or skip the test when it is not importable yet."""
    mod = triton_module(name)
    if mod is None:
        import pytest

        pytest.skip(f"osdn_ops.triton.{name} not importable")
    return mod


def to_device(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.to(DEVICE)


def leaves(named: dict, dtype: Optional[torch.dtype] = None) -> dict:
    """Detached copies (optionally cast; integer/None left alone) that require grad."""
    out = {}
    for n, t in named.items():
        if t is None:
            out[n] = None
            continue
        t = t.detach().clone()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[n] = t.requires_grad_(t.is_floating_point())
    return out


def cotangents(outputs, seed: int = 0) -> list[torch.Tensor]:
    """Fresh random fp64 cotangents (CPU) for the outputs."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outputs]


def vjp(fn: Callable, named: dict, cots: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    """Run ``fn(**named)`` (tuple of outputs) and back-propagate ``cots``; returns (outputs, grads)."""
    outs = fn(**named)
    pairs = [(o, c.to(o.device, o.dtype)) for o, c in zip(outs, cots) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
    grads = {n: (t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in named.items()
             if t is not None and t.is_floating_point()}
    return [o.detach() for o in outs], grads

