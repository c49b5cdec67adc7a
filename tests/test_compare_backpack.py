"""diag_fisher against BackPACK's SumGradSquared and DiagGGNExact (float64, the ``compare`` extra).

Conventions, checked here rather than assumed:

* BackPACK differentiates the loss it is given. With ``reduction="sum"`` the per-sample gradient
  is ``grad l_i`` with ``l_i = -log p(y_i | x_i)``, so ``sum_grad_squared = sum_i g_i^2`` and
  ``diag_ggn_exact = sum_i diag(J_i^T H_i J_i)``; both equal ``N *`` our mean.
* With ``reduction="mean"`` the loss is ``1/N sum_i l_i``: each per-sample gradient carries
  ``1/N`` (so ``sum_grad_squared = 1/N^2 sum_i g_i^2``) and the GGN carries ``1/N``.
* ``MSELoss(reduction="sum")`` is ``sum (f - y)^2``: gradient ``2 (f - y)``, output Hessian
  ``2 I``. Our Gaussian NLL with ``sigma_noise=1`` is ``0.5 sum (f - y)^2``: gradient ``f - y``,
  Hessian ``I``. So BackPACK's squared gradients are 4x ours and its GGN 2x ours.

Each library sees an unmodified model: BackPACK's ``extend`` registers hooks on the module in
place, so it gets a deep copy; the original goes to ``diag_fisher`` and is checked hook-free.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import multiscale_jac as mj

backpack = pytest.importorskip("backpack")
from backpack.context import CTX  # noqa: E402
from backpack.extensions import DiagGGNExact, SumGradSquared  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # BackPACK's hook on the first layer fires for an input that does not require grad
    "ignore:Full backward hook is firing when gradients are computed:UserWarning"
)

DTYPE = torch.float64
N = 8
CLASSES = 5
RTOL, ATOL = 1e-10, 1e-12


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2),  # 8x8 -> 3x3
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, CLASSES),
    )


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 8 * 8, 6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.Sigmoid(),
        nn.Linear(6, CLASSES),
    )


def dense() -> nn.Module:
    """Per-pixel logits ``(N, C, 4, 4)``: one categorical per position."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, CLASSES, 3, stride=2, padding=1)
    )


MODELS = {"cnn": cnn, "mlp": mlp, "dense": dense}


def make_case(name: str, likelihood: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[name]().to(DTYPE).eval()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(N, 3, 8, 8, generator=g, dtype=DTYPE)
    with torch.no_grad():
        out = model(x)
    if likelihood == "regression":
        y = torch.randn(out.shape, generator=g, dtype=DTYPE)
    else:
        y = torch.randint(CLASSES, (N, *out.shape[2:]), generator=g)
    return model, x, y


def assert_hook_free(model: nn.Module, *, pristine: bool = True) -> None:
    """No module hooks; ``pristine``: nor BackPACK's extend flag or stored inputs/outputs."""
    for name, m in model.named_modules():
        hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
        assert not any(hooks), f"hooks left on {name or 'the model'}"
        if pristine:
            assert not getattr(m, "_backpack_extend", False), name
            assert not hasattr(m, "input0") and not hasattr(m, "output"), name


def run_backpack(model: nn.Module, x, y, loss_fn: nn.Module, extension) -> dict[str, torch.Tensor]:
    """``extension``'s per-parameter quantity on an extended deep copy of ``model``."""
    bp_model = backpack.extend(copy.deepcopy(model))
    bp_loss = backpack.extend(loss_fn)
    try:
        with backpack.backpack(extension):
            loss = bp_loss(bp_model(x), y)
            loss.backward()
        attr = extension.savefield
        out = {n: getattr(p, attr).detach().clone() for n, p in bp_model.named_parameters()}
    finally:
        CTX.remove_hooks()  # BackPACK keeps the handles globally; drop ours
    assert_hook_free(bp_model, pristine=False)
    return out


def ours(model: nn.Module, x, y, **kw) -> dict[str, torch.Tensor]:
    assert_hook_free(model)
    res = mj.diag_fisher(model, [(x, y)], progress=False, **kw)
    assert res.num_samples == N
    return res.as_dict()


def assert_match(got: dict, want: dict, scale: float) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        assert w.abs().max() > 0, name  # the comparison says something
        torch.testing.assert_close(got[name], w * scale, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(
    ("kind", "extension"), [("empirical", SumGradSquared), ("exact", DiagGGNExact)]
)
def test_classification(name, kind, extension) -> None:
    model, x, y = make_case(name, "classification")
    before = copy.deepcopy(model.state_dict())
    got = ours(model, x, y, kind=kind, likelihood="classification")
    want = run_backpack(model, x, y, nn.CrossEntropyLoss(reduction="sum"), extension())
    assert_match(got, want, 1.0 / N)
    # the original is untouched by either library
    assert_hook_free(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    ("kind", "extension", "scale"),
    [("empirical", SumGradSquared, float(N)), ("exact", DiagGGNExact, 1.0)],
)
def test_classification_mean_reduction_convention(kind, extension, scale) -> None:
    """With reduction="mean": sum_grad_squared = 1/N^2 sum g_i^2 (ours is 1/N sum g_i^2, so
    N x BackPACK); diag_ggn_exact = 1/N sum diag(J^T H J), the same as ours."""
    model, x, y = make_case("cnn", "classification", seed=3)
    got = ours(model, x, y, kind=kind, likelihood="classification")
    want = run_backpack(model, x, y, nn.CrossEntropyLoss(reduction="mean"), extension())
    assert_match(got, want, scale)


@pytest.mark.parametrize("name", ["cnn", "mlp"])
@pytest.mark.parametrize(
    ("kind", "extension", "scale"),
    # MSELoss(sum) = sum (f-y)^2 vs our 0.5 sum (f-y)^2: gradients 2x (squares 4x), Hessian 2x
    [("empirical", SumGradSquared, 1.0 / (4 * N)), ("exact", DiagGGNExact, 1.0 / (2 * N))],
)
def test_regression(name, kind, extension, scale) -> None:
    model, x, y = make_case(name, "regression", seed=5)
    got = ours(model, x, y, kind=kind, likelihood="regression", sigma_noise=1.0)
    want = run_backpack(model, x, y, nn.MSELoss(reduction="sum"), extension())
    assert_match(got, want, scale)
    assert_hook_free(model)


def test_regression_sigma_noise() -> None:
    """sigma_noise scales the Gaussian NLL by 1/sigma^2: the GGN by 1/sigma^2, squares by 1/sigma^4."""
    sigma = 0.5
    model, x, y = make_case("mlp", "regression", seed=7)
    want_ggn = run_backpack(model, x, y, nn.MSELoss(reduction="sum"), DiagGGNExact())
    got = ours(model, x, y, kind="exact", likelihood="regression", sigma_noise=sigma)
    assert_match(got, want_ggn, 1.0 / (2 * N * sigma**2))
    want_sq = run_backpack(model, x, y, nn.MSELoss(reduction="sum"), SumGradSquared())
    got = ours(model, x, y, kind="empirical", likelihood="regression", sigma_noise=sigma)
    assert_match(got, want_sq, 1.0 / (4 * N * sigma**4))
