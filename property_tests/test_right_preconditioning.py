"""Right preconditioning: one asym step is S - beta grad f_t(S) D (f_t(S) = 1/2 ||S k - v||^2, D = diag(d))."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from osdn_ops.testing import problems, shapes

from .helpers import DEVICE, Errors, INTERPRETED, few, require_triton

ONE_TOKEN = problems(dtype=st.just(torch.float64), shape=shapes(varlen=False, max_T=1), initial_state=True)


def _expected(p):
    """Autograd gradient of f_t at the gated state, preconditioned on the key side (fp64, public layout)."""
    S = p.initial_state.clone()
    if p.gate == "scalar":
        S = torch.exp(p.g[:, 0])[..., None, None] * S
    elif p.gate == "channel":
        S = torch.exp(p.g[:, 0])[..., :, None] * S
    S = S.detach().requires_grad_(True)
    k, v, beta = p.k[:, 0], p.v[:, 0], p.beta[:, 0]
    read = torch.einsum("nhkv,nhk->nhv", S, k) if p.gate == "channel" else torch.einsum("nhvk,nhk->nhv", S, k)
    (grad,) = torch.autograd.grad(0.5 * ((read - v) ** 2).sum(), S)
    d = p.k_tilde[:, 0] / p.k[:, 0]  # the diagonal the strategy drew (k != 0 almost surely)
    precond = d[..., :, None] * grad if p.gate == "channel" else grad * d[..., None, :]
    step = S.detach() - beta[..., None, None] * precond
    u = v - read.detach()
    outer = (torch.einsum("nhk,nhv->nhkv", p.k_tilde[:, 0], u) if p.gate == "channel"
             else torch.einsum("nhv,nhk->nhvk", u, p.k_tilde[:, 0]))
    return step, S.detach() + beta[..., None, None] * outer


@given(ONE_TOKEN)
def test_gradient_form_equals_rank_one_form(p):
    """S - beta grad f(S) D == S + beta u (d*k)^T, and the public op's one-token state equals it."""
    step, rank_one = _expected(p)
    _, state = p.run()
    errs = Errors("right_preconditioning")
    errs.close("rank-one form", rank_one, step, 1e-12)
    errs.close(f"op state gate={p.gate}", state, step, 1e-12)
    errs.check()


@few()
@given(problems(dtype=st.just(torch.float32), shape=shapes(varlen=False, max_T=1, max_dim=24 if INTERPRETED else 64),
                initial_state=True, device=DEVICE))
def test_triton_step_is_preconditioned_gradient(p):
    mod = require_triton()
    _, state = p.run(mod)
    cpu = {n: (t.double().cpu() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in vars(p).items()}
    step, _ = _expected(type(p)(**cpu))
    errs = Errors("right_preconditioning_triton")
    errs.close(f"triton state gate={p.gate}", state, step, 1e-5)
    errs.check()
