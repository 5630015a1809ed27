"""Hypothesis strategies that draw valid osdn_ops problems, for fuzzing the ops or a model built on them.

Every strategy draws a few sizes and a seed, then builds its tensors in one go from a
``torch.Generator`` seeded with it (never element by element), so examples are cheap and
reproducible. Sizes are small by default; widen them with the parameters.

- :func:`shapes` -> :class:`Shape` ``(B, T, H, K, V)`` with ``T = 1`` and ``T`` not a multiple of 64.
- :func:`seqlens` -> packed sequence lengths, empty and length-1 sequences included.
- :func:`precond_hparams` -> ``dict(eta, d_min, d_max, eps, beta_aware)``.
- :func:`precond_problems` -> :class:`PrecondProblem` (arguments of :func:`osdn_ops.precond_scan`).
- :func:`problems` -> :class:`Problem` (arguments of the asym ops; ``gate`` picks the op).

Example::

    from hypothesis import given
    import osdn_ops
    from osdn_ops.testing import problems

    @given(problems(gate="scalar"))
    def test_finite(p):
        o, state = p.run()
        assert o.isfinite().all()

Importing this module needs ``hypothesis``; importing ``osdn_ops`` does not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from hypothesis import strategies as st
from torch import Tensor

__all__ = [
    "Shape", "Problem", "PrecondProblem", "shapes", "seqlens", "dtypes", "precond_hparams",
    "precond_problems", "problems", "GATES", "DEFAULT_DTYPES",
]

GATES = ("none", "scalar", "channel")
DEFAULT_DTYPES = (torch.float32, torch.bfloat16)
_SEEDS = st.integers(min_value=0, max_value=2**63 - 1)


@dataclass(frozen=True)
class Shape:
    """Problem sizes: batch ``B``, tokens ``T``, heads ``H``, key dim ``K``, value dim ``V``.

    ``lengths`` (packed sequences, ``sum(lengths) == T``, then ``B == 1``) or None.
    """

    B: int
    T: int
    H: int
    K: int
    V: int
    lengths: Optional[tuple[int, ...]] = None

    @property
    def N(self) -> int:
        """Number of sequences (states)."""
        return self.B if self.lengths is None else len(self.lengths)


@dataclass
class PrecondProblem:
    """Arguments of :func:`osdn_ops.precond_scan`.

    ``k [B,T,H,K]``, ``beta [B,T,H]``, ``d0 [N,H,K]`` fp32 (fp64 for fp64 keys) or None,
    ``retention [B,T,H]`` or None, ``cu_seqlens [N+1]`` int or None, and the hyperparameters.
    """

    k: Tensor
    beta: Tensor
    d0: Optional[Tensor]
    retention: Optional[Tensor]
    cu_seqlens: Optional[Tensor]
    eta: float
    d_min: float
    d_max: float
    eps: float
    beta_aware: bool
    shape: Shape = field(repr=False, default=None)

    def hparams(self) -> dict:
        """``dict(eta, d_min, d_max, eps, beta_aware)``."""
        return dict(eta=self.eta, d_min=self.d_min, d_max=self.d_max, eps=self.eps, beta_aware=self.beta_aware)

    def kwargs(self) -> dict:
        """Keyword arguments of ``precond_scan`` after ``(k, beta, d0, retention)``."""
        return dict(self.hparams(), cu_seqlens=self.cu_seqlens)

    def tensors(self) -> dict:
        """The differentiable tensor inputs (None ones left out)."""
        named = dict(k=self.k, beta=self.beta, d0=self.d0, retention=self.retention)
        return {n: t for n, t in named.items() if t is not None}

    def run(self, fn=None):
        """``fn(k, beta, d0, retention, **kwargs())`` with ``fn`` defaulting to ``osdn_ops.precond_scan``."""
        if fn is None:
            import osdn_ops

            fn = osdn_ops.precond_scan
        return fn(self.k, self.beta, self.d0, self.retention, **self.kwargs())


@dataclass
class Problem:
    """Arguments of an asym op; ``gate`` picks it ("none" delta, "scalar" gated, "channel" KDA).

    ``q, k, k_tilde [B,T,H,K]``, ``v [B,T,H,V]`` (one dtype), ``g`` None / ``[B,T,H]`` /
    ``[B,T,H,K]`` fp32, ``beta [B,T,H]``, ``initial_state`` None or the op's public state
    (``[N,H,V,K]``, KDA ``[N,H,K,V]``; fp32, fp64 for fp64 inputs), ``cu_seqlens`` or None.
    """

    q: Tensor
    k: Tensor
    k_tilde: Tensor
    v: Tensor
    g: Optional[Tensor]
    beta: Tensor
    initial_state: Optional[Tensor]
    cu_seqlens: Optional[Tensor]
    scale: float
    gate: str
    shape: Shape = field(repr=False, default=None)

    def __repr__(self) -> str:
        """Sizes, not values: what Hypothesis prints for an example (e.g. with ``--hypothesis-verbosity=verbose``,
        before each one runs)."""
        B, T, H, K = self.q.shape
        cu = None if self.cu_seqlens is None else self.cu_seqlens.tolist()
        return (f"Problem(gate={self.gate!r}, B={B}, T={T}, H={H}, K={K}, V={self.v.shape[-1]}, dtype={self.q.dtype}, "
                f"cu_seqlens={cu}, initial_state={self.initial_state is not None}, scale={self.scale:.4g}, "
                f"device={self.q.device})")

    def _repr_pretty_(self, printer, cycle) -> None:
        """Hypothesis's printer: the same sizes (it would otherwise print every field's values)."""
        printer.text(repr(self))

    def tensors(self) -> dict:
        """The differentiable tensor inputs in the op's argument order (None ones left out)."""
        named = dict(q=self.q, k=self.k, k_tilde=self.k_tilde, v=self.v, g=self.g, beta=self.beta,
                     initial_state=self.initial_state)
        return {n: t for n, t in named.items() if t is not None}

    def args(self) -> tuple:
        """Positional arguments of the public op (``g`` only for gated/KDA)."""
        if self.gate == "none":
            return self.q, self.k, self.k_tilde, self.v, self.beta
        return self.q, self.k, self.k_tilde, self.v, self.g, self.beta

    def kwargs(self) -> dict:
        return dict(scale=self.scale, initial_state=self.initial_state, cu_seqlens=self.cu_seqlens)

    def run(self, module: Any = None):
        """Call the op this problem is for from ``module`` (default ``osdn_ops``; e.g. ``osdn_ops.triton``)."""
        if module is None:
            import osdn_ops as module
        fn = {"none": module.chunk_delta_asym, "scalar": module.chunk_gated_delta_asym,
              "channel": module.chunk_kda_asym}[self.gate]
        return fn(*self.args(), **self.kwargs())


def dtypes(choices: Sequence[torch.dtype] = DEFAULT_DTYPES) -> st.SearchStrategy[torch.dtype]:
    """One of ``choices`` (default float32 and bfloat16)."""
    return st.sampled_from(tuple(choices))


@st.composite
def seqlens(draw, *, max_seqs: int = 4, max_len: int = 40) -> tuple[int, ...]:
    """Lengths of 1..max_seqs packed sequences, each 0..max_len; empty and length-1 ones are favoured."""
    one = st.one_of(st.sampled_from((0, 1)), st.integers(0, max_len))
    return tuple(draw(st.lists(one, min_size=1, max_size=max_seqs)))


@st.composite
def shapes(draw, *, max_batch: int = 2, max_T: int = 80, max_heads: int = 2, min_dim: int = 16,
           max_dim: int = 32, dim_multiple: int = 1, varlen: Optional[bool] = None, max_seqs: int = 4) -> Shape:
    """Sizes of a problem. ``T`` includes 1 and values around 64; ``K`` and ``V`` are any multiple of
    ``dim_multiple`` in ``[min_dim, max_dim]`` (not only powers of two). ``varlen`` None draws it; with it
    ``B == 1`` and ``lengths`` sum to T (each at most ``max_T // max_seqs``, at least 1)."""
    if varlen is None:
        varlen = draw(st.booleans())
    H = draw(st.integers(1, max_heads))
    dims = st.integers(-(-min_dim // dim_multiple), max_dim // dim_multiple).map(lambda i: i * dim_multiple)
    K = draw(dims)
    V = draw(dims)
    if varlen:
        lengths = draw(seqlens(max_seqs=max_seqs, max_len=max(1, max_T // max_seqs)))
        return Shape(1, sum(lengths), H, K, V, lengths)
    special = [t for t in (1, 63, 64, 65) if t <= max_T]
    T = draw(st.one_of(st.sampled_from(special), st.integers(1, max_T)))
    return Shape(draw(st.integers(1, max_batch)), T, H, K, V)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _uniform(gen, shape, low: float, high: float) -> Tensor:
    """Uniform in [low, high] (float64, CPU)."""
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=torch.float64)


def _keys(gen, shape, norm: str) -> Tensor:
    """"unit": L2-normalized rows; "raw": Gaussian with E||k||^2 = 1 (norm varies by row)."""
    k = torch.randn(shape, generator=gen, dtype=torch.float64)
    if norm == "unit":
        return k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return k / math.sqrt(shape[-1])


def _cu(lengths, device) -> Optional[Tensor]:
    if lengths is None:
        return None
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@st.composite
def precond_hparams(draw, *, adversarial: bool = False) -> dict:
    """``dict(eta, d_min, d_max, eps, beta_aware)`` with ``0 < d_min <= d_max``.

    ``adversarial`` widens ``eta`` up to 1e4 and the box to ``[1e-3, 1e3]``.
    """
    etas = [0.0, 1e-3, 3e-3, 0.03, 0.3] + ([3.0, 1e2, 1e4] if adversarial else [])
    eta = draw(st.one_of(st.sampled_from(etas), st.floats(0.0, etas[-1])))
    lo_hi = (1e-3, 1e3) if adversarial else (0.05, 4.0)
    a = draw(st.floats(*lo_hi))
    b = draw(st.one_of(st.just(a), st.floats(*lo_hi)))
    d_min, d_max = min(a, b), max(a, b)
    eps = draw(st.sampled_from((1e-6, 1e-3)))
    return dict(eta=eta, d_min=d_min, d_max=d_max, eps=eps, beta_aware=draw(st.booleans()))


@st.composite
def precond_problems(draw, *, shape: Optional[st.SearchStrategy[Shape]] = None,
                     dtype: Optional[st.SearchStrategy[torch.dtype]] = None,
                     hparams: Optional[st.SearchStrategy[dict]] = None, adversarial: bool = False,
                     device: str | torch.device = "cpu") -> PrecondProblem:
    """A :class:`PrecondProblem`.

    Keys are unit or raw; ``adversarial`` adds zero keys, keys of norm up to 1e4, beta near
    0 and 1, retention near 0 and huge eta. ``d0`` (None or in the box) and ``retention``
    (None, exactly 1, or in (r_min, 1]) are drawn.
    """
    sh = draw(shape if shape is not None else shapes())
    dt = draw(dtype if dtype is not None else dtypes())
    hp = draw(hparams if hparams is not None else precond_hparams(adversarial=adversarial))
    gen = _gen(draw(_SEEDS))
    B, T, H, K = sh.B, sh.T, sh.H, sh.K
    k = _keys(gen, (B, T, H, K), draw(st.sampled_from(("unit", "raw"))))
    beta_lo, beta_hi = draw(st.sampled_from(((0.0, 1.0), (0.0, 1e-4), (1 - 1e-4, 1.0)) if adversarial
                                            else ((0.0, 1.0),)))
    beta = _uniform(gen, (B, T, H), beta_lo, beta_hi).clamp(1e-6, 1 - 1e-6)
    if adversarial:
        norms = torch.tensor([0.0, 1e-3, 1.0, 1e2, 1e4], dtype=torch.float64)
        pick = torch.randint(0, len(norms), (B, T, H, 1), generator=gen)
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12) * norms[pick]
    r_min = draw(st.sampled_from((None, 1.0, 0.9) + ((1e-6,) if adversarial else (0.2,))))
    retention = None if r_min is None else 1 - _uniform(gen, (B, T, H), 0.0, 1 - r_min)
    d0 = None
    if draw(st.booleans()):
        d0 = _uniform(gen, (sh.N, H, K), hp["d_min"], hp["d_max"]).to(_state_dtype(dt)).to(device)
    return PrecondProblem(
        k=k.to(dt).to(device), beta=beta.to(dt).to(device), d0=d0,
        retention=None if retention is None else retention.to(dt).clamp(min=1e-6, max=1.0).to(device),
        cu_seqlens=_cu(sh.lengths, device), shape=sh, **hp)


@st.composite
def _log_gates(draw, gen_seed: int, shape: tuple, device) -> Tensor:
    """fp32 log-decays ``g <= 0`` of ``shape``: zero, mild, or strong (down to -20 per token)."""
    gen = _gen(gen_seed)
    strength = draw(st.sampled_from((0.0, 0.05, 1.0, 20.0)))
    g = -_uniform(gen, shape, 0.0, strength)
    if strength > 0 and draw(st.booleans()):  # some tokens exactly 0, some at the strongest decay
        pick = torch.randint(0, 3, shape, generator=gen)
        g = torch.where(pick == 0, torch.zeros_like(g), torch.where(pick == 1, torch.full_like(g, -strength), g))
    return g.to(torch.float32).to(device)


@st.composite
def problems(draw, *, gate: Optional[str] = None, shape: Optional[st.SearchStrategy[Shape]] = None,
             dtype: Optional[st.SearchStrategy[torch.dtype]] = None, key_norm: Optional[str] = None,
             k_tilde: str = "box", initial_state: Optional[bool] = None,
             device: str | torch.device = "cpu") -> Problem:
    """A :class:`Problem` for the asym op ``gate`` (drawn when None).

    ``key_norm`` "unit" / "raw" (drawn when None) applies to ``q`` and ``k``. ``k_tilde``:
    "box" (``d_t * k_t`` with ``d_t`` in [0.5, 2] per token and channel) or "same" (``k``).
    ``initial_state`` None draws whether to pass one. ``beta`` is in (0, 1); gated ops get
    fp32 log-gates from zero to strong decay (-20 per token).
    """
    gate = draw(st.sampled_from(GATES)) if gate is None else gate
    sh = draw(shape if shape is not None else shapes())
    dt = draw(dtype if dtype is not None else dtypes())
    norm = draw(st.sampled_from(("unit", "raw"))) if key_norm is None else key_norm
    with_state = draw(st.booleans()) if initial_state is None else initial_state
    seed = draw(_SEEDS)
    gen = _gen(seed)
    B, T, H, K, V = sh.B, sh.T, sh.H, sh.K, sh.V
    q = _keys(gen, (B, T, H, K), norm)
    k = _keys(gen, (B, T, H, K), norm)
    kt = k if k_tilde == "same" else k * _uniform(gen, (B, T, H, K), 0.5, 2.0)
    v = torch.randn((B, T, H, V), generator=gen, dtype=torch.float64)
    beta = _uniform(gen, (B, T, H), 1e-3, 1 - 1e-3)
    g = None
    if gate != "none":
        g = draw(_log_gates(seed + 1, (B, T, H) if gate == "scalar" else (B, T, H, K), device))
        if dt == torch.float64:
            g = g.double()
    h0 = None
    if with_state:
        sshape = (sh.N, H, K, V) if gate == "channel" else (sh.N, H, V, K)
        h0 = (torch.randn(sshape, generator=gen, dtype=torch.float64) / math.sqrt(K)).to(_state_dtype(dt)).to(device)
    cast = [x.to(dt).to(device) for x in (q, k, v, beta)]
    kt = cast[1] if k_tilde == "same" else kt.to(dt).to(device)
    return Problem(q=cast[0], k=cast[1], k_tilde=kt, v=cast[2], g=g, beta=cast[3], initial_state=h0,
                   cu_seqlens=_cu(sh.lengths, device), scale=K ** -0.5, gate=gate, shape=sh)
