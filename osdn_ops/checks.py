"""Argument validation shared by the public functions and the direct Triton entry points.

Every rule raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, device
or value) naming the argument, what was expected and what was given, before any kernel runs.
Inputs may have any strides: the callers pass them through :func:`contiguous` (which copies
only tensors that are not contiguous), because the kernels index dense row-major tensors. Rules that need tensor *values* (``cu_seqlens`` monotone and ending at T,
``retention`` in (0, 1], ``g <= 0``) read them back to the host, so they run only where that is
free of side effects: on CPU tensors, and outside ``torch.compile`` tracing. Set the
environment variable ``OSDN_OPS_CHECK_VALUES=1`` to run them on GPU tensors too (one host
sync per call), or ``=0`` to skip them everywhere.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def state_dtype(t: Tensor) -> torch.dtype:
    """States are float32, or float64 when the inputs are float64."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def tensor(name: str, t, ndim: int, dtypes: Sequence[torch.dtype] = FLOATS) -> Tensor:
    """``t`` is a tensor of ``ndim`` dimensions and one of ``dtypes`` (any strides)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {_shape(t)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    return t


def contiguous(*ts):
    """The tensors made contiguous (a copy only where they are not); None stays None."""
    return tuple(t if t is None else t.contiguous() for t in ts)


def shape(name: str, t: Tensor, expected: tuple, meaning: str) -> None:
    if _shape(t) != tuple(expected):
        raise ValueError(f"{name}: expected shape {meaning} = {tuple(expected)}, got {_shape(t)}")


def same_device(named: dict) -> None:
    tensors = {n: t for n, t in named.items() if t is not None}
    first_name, first = next(iter(tensors.items()))
    for n, t in tensors.items():
        if t.device != first.device:
            raise ValueError(f"{n}: expected device {first.device} (the device of {first_name}), got {t.device}")


def same_dtype(named: dict) -> None:
    first_name, first = next(iter(named.items()))
    for n, t in named.items():
        if t.dtype != first.dtype:
            raise TypeError(f"{n}: expected dtype {first.dtype} (the dtype of {first_name}), got {t.dtype}")


def number(name: str, x, *, low: Optional[float] = None, low_open: bool = False) -> float:
    """A finite real number (not a bool, not a tensor), optionally bounded below."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__}")
    x = float(x)
    if x != x or abs(x) == math.inf:  # not math.isfinite, which torch.compile cannot trace
        raise ValueError(f"{name}: expected a finite number, got {x}")
    if low is not None and (x <= low if low_open else x < low):
        raise ValueError(f"{name}: expected {'>' if low_open else '>='} {low}, got {x}")
    return x


def _values_checked(t: Tensor) -> bool:
    mode = os.environ.get("OSDN_OPS_CHECK_VALUES", "")
    if mode == "0" or torch.compiler.is_compiling():
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return mode == "1" or t.device.type == "cpu"


def sequences(cu_seqlens, B: int, T: int, device: torch.device) -> int:
    """Validate ``cu_seqlens`` (or None) against ``[B, T, ...]`` inputs; returns N."""
    if cu_seqlens is None:
        return B
    tensor("cu_seqlens", cu_seqlens, 1, (torch.int32, torch.int64))
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected device {device} (the device of the inputs), got {cu_seqlens.device}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected [N+1] offsets with N >= 1, got shape {_shape(cu_seqlens)}")
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size B == 1, got B = {B}")
    if _values_checked(cu_seqlens):
        cu = cu_seqlens.tolist()
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {cu[0]}")
        bad = [i for i in range(1, len(cu)) if cu[i] < cu[i - 1]]
        if bad:
            i = bad[0]
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{i}] = {cu[i]} "
                             f"< cu_seqlens[{i - 1}] = {cu[i - 1]}")
        if cu[-1] != T:
            raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] == T = {T}, got {cu[-1]}")
    return cu_seqlens.shape[0] - 1


def values_in(name: str, t: Tensor, *, low: float, high: float, low_open: bool) -> None:
    """``t``'s values lie in the interval (or [low, high]); checked where values may be read."""
    if t is None or not _values_checked(t) or t.numel() == 0:
        return
    lo, hi = t.min().item(), t.max().item()
    below = lo <= low if low_open else lo < low
    if below or hi > high or math.isnan(lo) or math.isnan(hi):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name}: expected values in {interval}, got values in [{lo}, {hi}]")


def state(name: str, t, expected: tuple, meaning: str, dtype: torch.dtype) -> None:
    """An optional fp32 (fp64 for fp64 inputs) state tensor of exactly ``expected`` shape."""
    if t is None:
        return
    tensor(name, t, len(expected), FLOATS)
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (states are float32, float64 for float64 "
                        f"inputs), got {t.dtype}")
    shape(name, t, expected, meaning)


def precond_args(k, beta, d0, retention, *, eta, d_min, d_max, eps, beta_aware, cu_seqlens) -> dict:
    """Validate precond_scan's arguments; returns the hyperparameters as plain floats."""
    tensor("k", k, 4)
    B, T, H, K = k.shape
    tensor("beta", beta, 3)
    shape("beta", beta, (B, T, H), "[B, T, H] of k")
    if retention is not None:
        tensor("retention", retention, 3)
        shape("retention", retention, (B, T, H), "[B, T, H] of k")
    same_device({"k": k, "beta": beta, "d0": d0, "retention": retention})
    N = sequences(cu_seqlens, B, T, k.device)
    state("d0", d0, (N, H, K), "[N, H, K]", state_dtype(k))
    if not isinstance(beta_aware, bool):
        raise TypeError(f"beta_aware: expected a bool, got {type(beta_aware).__name__}")
    hp = dict(eta=number("eta", eta, low=0.0), d_min=number("d_min", d_min, low=0.0, low_open=True),
              d_max=number("d_max", d_max), eps=number("eps", eps, low=0.0, low_open=True))
    if hp["d_min"] > hp["d_max"]:
        raise ValueError(f"d_min, d_max: expected d_min <= d_max, got d_min = {d_min} > d_max = {d_max}")
    values_in("retention", retention, low=0.0, high=1.0, low_open=True)
    return hp


def asym_args(q, k, k_tilde, v, g, beta, *, scale, initial_state, cu_seqlens, gate) -> float:
    """Validate an asym op's arguments (``gate`` in none/scalar/channel); returns the scale."""
    for name, t in (("q", q), ("k", k), ("k_tilde", k_tilde), ("v", v)):
        tensor(name, t, 4)
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, t in (("k", k), ("k_tilde", k_tilde)):
        shape(name, t, (B, T, H, K), "[B, T, H, K] of q")
    shape("v", v, (B, T, H, V), "[B, T, H, V] with q's B, T, H")
    same_dtype({"q": q, "k": k, "k_tilde": k_tilde, "v": v})
    tensor("beta", beta, 3)
    shape("beta", beta, (B, T, H), "[B, T, H] of q")
    if gate == "scalar":
        tensor("g", g, 3)
        shape("g", g, (B, T, H), "[B, T, H] of q")
    elif gate == "channel":
        tensor("g", g, 4)
        shape("g", g, (B, T, H, K), "[B, T, H, K] of q")
    same_device({"q": q, "k": k, "k_tilde": k_tilde, "v": v, "g": g, "beta": beta,
                 "initial_state": initial_state})
    N = sequences(cu_seqlens, B, T, q.device)
    if gate == "channel":
        state("initial_state", initial_state, (N, H, K, V), "[N, H, K, V]", state_dtype(v))
    else:
        state("initial_state", initial_state, (N, H, V, K), "[N, H, V, K]", state_dtype(v))
    values_in("g", g, low=float("-inf"), high=0.0, low_open=True)
    return K ** -0.5 if scale is None else number("scale", scale)
