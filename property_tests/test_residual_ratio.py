"""Residual-ratio identity ||S_t k_t - v_t||^2 / ||S_bar k_t - v_t||^2 = (1 - beta_t <kt_t, k_t>)^2 (DESIGN §3)."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from osdn_ops.reference import precond_scan_recurrent
from osdn_ops.reference.asym import asym_recurrent
from osdn_ops.testing import precond_hparams, problems, shapes

from .helpers import Errors

F64 = st.just(torch.float64)
SHAPES = shapes(varlen=False, max_T=24, max_dim=24)


def _read(S, k, gate):
    """S k (after any gate), public layout: [N,H,V,K] (S k) or KDA [N,H,K,V] (S^T k) -> [N,H,V]."""
    return torch.einsum("nhkv,nhk->nhv", S, k) if gate == "channel" else torch.einsum("nhvk,nhk->nhv", S, k)


def _gated(S, g_t, gate):
    if gate == "scalar":
        return torch.exp(g_t)[..., None, None] * S
    if gate == "channel":
        return torch.exp(g_t)[..., :, None] * S
    return S


def _ratios(p, k_tilde):
    """Step the fp64 oracle token by token; yields (measured ratio, (1 - beta <kt,k>)^2, ||r_before||^2)."""
    S = p.initial_state
    if S is None:
        B, _, H, K = p.k.shape
        V = p.v.shape[-1]
        S = torch.zeros((B, H, K, V) if p.gate == "channel" else (B, H, V, K), dtype=torch.float64)
    for t in range(p.k.shape[1]):
        sl = slice(t, t + 1)
        g = None if p.g is None else p.g[:, sl]
        _, S_next = asym_recurrent(p.q[:, sl], p.k[:, sl], k_tilde[:, sl], p.v[:, sl], g, p.beta[:, sl], S,
                                   scale=p.scale, gate=p.gate)
        k_t, v_t = p.k[:, t], p.v[:, t]
        before = ((_read(_gated(S, None if g is None else g[:, 0], p.gate), k_t, p.gate) - v_t) ** 2).sum(-1)
        after = ((_read(S_next, k_t, p.gate) - v_t) ** 2).sum(-1)
        factor = (1 - p.beta[:, t] * (k_tilde[:, t] * k_t).sum(-1)) ** 2
        yield after, factor, before
        S = S_next


@given(problems(dtype=F64, shape=SHAPES))
def test_residual_ratio_identity(p):
    """For all three variants and any write key: after = factor * before (fp64, relative 1e-9)."""
    errs = Errors("residual_ratio_identity")
    for after, factor, before in _ratios(p, p.k_tilde):
        scale = before * (1 + factor.sqrt()) ** 2 + 1e-300
        errs.add(f"gate={p.gate}", ((after - factor * before).abs() / scale).max().item(), 1e-9)
    errs.check()


@given(problems(dtype=F64, shape=SHAPES, key_norm="unit"), precond_hparams(), st.booleans())
def test_residual_contracts(p, hp, with_d0):
    """Unit keys, 0 < beta < 1 and 0 < d_min <= d_max <= 2 (k_tilde from precond_scan): ratio < 1."""
    hp = dict(hp, d_min=min(hp["d_min"], 2.0), d_max=min(hp["d_max"], 2.0))
    B, _, H, K = p.k.shape
    d0 = torch.full((B, H, K), (hp["d_min"] + hp["d_max"]) / 2, dtype=torch.float64) if with_d0 else None
    k_tilde, _ = precond_scan_recurrent(p.k, p.beta, d0, None, **hp)
    for after, factor, before in _ratios(p, k_tilde):
        assert (factor < 1).all(), f"(1 - beta <kt, k>)^2 = {factor.max().item()} >= 1"
        live = before > 1e-200
        measured = after[live] / before[live]
        assert (measured < 1).all(), f"residual ratio {measured.max().item()} >= 1"
