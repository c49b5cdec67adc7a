"""SubnetLaplace.fit on dense (per-pixel) outputs under a memory budget: a sample whose Jacobian
rows exceed the budget is fitted from one forward pass (never re-run per slice), exactly; and
the opt-in unbiased subsampling of output positions (``max_outputs_per_sample``)."""

from __future__ import annotations

import pytest
import torch
from conftest import smallest_budget
from torch import nn

import multiscale_jac as mj
from multiscale_jac.laplace._subset_ggn import SubsetGGN

DTYPE = torch.float64
SIZES = [(6, 7), (5, 5), (8, 6)]  # ragged images


def make_model(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(4, classes, 1),
        )
        .to(DTYPE)
        .eval()
    )


def make_data(likelihood: str, classes: int = 3, sizes=SIZES):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, h, w, generator=g, dtype=DTYPE) for h, w in sizes]
    if likelihood == "classification":
        ys = [torch.randint(0, classes, (h, w), generator=g) for h, w in sizes]
        ys[0][0, :3] = -100  # ignored positions
    else:
        ys = [torch.randn(classes, h, w, generator=g, dtype=DTYPE) for h, w in sizes]
    return [(xs, ys)]


def fit(model, likelihood, subset, data, budget=None, **kw) -> mj.SubnetLaplace:
    la = mj.SubnetLaplace(model, likelihood, subset, memory_budget=budget)
    return la.fit(data, **kw)


def budget_for(model, likelihood, subset, data, rows: int) -> int:
    """A budget with room for about ``rows`` Jacobian rows beyond the smallest accepted."""
    least = smallest_budget(lambda b: fit(model, likelihood, subset, data, b))
    return least + rows * 6 * subset.numel * 8


def assert_same(a: mj.SubnetLaplace, b: mj.SubnetLaplace) -> None:
    scale = float(b.H.abs().max())
    torch.testing.assert_close(a.H, b.H, atol=1e-10 * max(scale, 1.0), rtol=0)
    assert float(a.loss) == pytest.approx(float(b.loss), rel=1e-12)
    assert a.n_outputs == b.n_outputs and a._posterior.n_entries == b._posterior.n_entries


class Counter:
    """Counts the model's forward calls (a forward hook; under vmap one per vmapped call)."""

    def __init__(self, model: nn.Module) -> None:
        self.n = 0
        model.register_forward_hook(self.hook)

    def hook(self, *_: object) -> None:
        self.n += 1


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("hessian", ["ggn", "empirical"])
def test_sliced_fit_equals_unsliced(likelihood: str, hessian: str, monkeypatch) -> None:
    seen = []
    original = SubsetGGN._whole
    monkeypatch.setattr(
        SubsetGGN, "_whole", lambda self, *a: seen.append(a[1]) or original(self, *a)
    )
    model = make_model()
    subset = mj.ParamSubset.largest_magnitude(model, 12)  # P < rows: column route
    data = make_data(likelihood)
    budget = budget_for(model, likelihood, subset, data, rows=4)
    exact = mj.SubnetLaplace(model, likelihood, subset, hessian=hessian).fit(data)
    sliced = mj.SubnetLaplace(model, likelihood, subset, hessian=hessian, memory_budget=budget)
    assert_same(sliced.fit(data), exact)
    assert seen == [0, 1, 2]  # every sample was above the budget


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_sliced_fit_reverse_route_when_rows_are_few(likelihood: str) -> None:
    """Rows no more than P: the rows are pulled back from one forward pass."""
    model = make_model()
    subset = mj.ParamSubset.all(model)  # P = 263 > rows of a 3x3 image
    data = make_data(likelihood, sizes=[(3, 3), (2, 4)])
    budget = budget_for(model, likelihood, subset, data, rows=2)
    assert_same(fit(model, likelihood, subset, data, budget), fit(model, likelihood, subset, data))


def test_forward_calls_do_not_grow_with_slices() -> None:
    model = make_model()
    subset = mj.ParamSubset.largest_magnitude(model, 12)
    data = make_data("classification", sizes=[(12, 12), (12, 12)])
    counter = Counter(model)
    calls = {}
    for rows in (2, 8, 40):  # about 430 / rows slices per image in row slices
        counter.n = 0
        fit(
            model,
            "classification",
            subset,
            data,
            budget_for(model, "classification", subset, data, rows),
        )
        calls[rows] = counter.n
    counter.n = 0
    fit(model, "classification", subset, data)
    unsliced = counter.n
    assert calls[2] == calls[8] == calls[40], calls
    # per sample: its shape, one kept forward pass, and the budget's probe
    assert calls[2] <= unsliced + 2 * 2 + 2, (calls, unsliced)


def test_subsampling_is_exact_when_it_keeps_every_position() -> None:
    model = make_model()
    subset = mj.ParamSubset.largest_magnitude(model, 10)
    data = make_data("classification")
    most = max(h * w for h, w in SIZES)
    got = fit(model, "classification", subset, data, max_outputs_per_sample=most)
    assert_same(got, fit(model, "classification", subset, data))


@pytest.mark.slow  # a statistical check: 300 sampled fits per likelihood
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_subsampling_is_unbiased(likelihood: str) -> None:
    model = make_model()
    subset = mj.ParamSubset.largest_magnitude(model, 6)
    data = make_data(likelihood, sizes=[(4, 4), (3, 5)])
    exact = fit(model, likelihood, subset, data)
    g = torch.Generator().manual_seed(0)
    most = 5 if likelihood == "classification" else 15
    draws = [
        fit(model, likelihood, subset, data, max_outputs_per_sample=most, generator=g).H
        for _ in range(300)
    ]
    mean = torch.stack(draws).mean(0)
    err = float((mean - exact.H).abs().max() / exact.H.abs().max())
    assert err < 0.1, err
    # the loss stays exact, and one draw differs from the exact curvature (it is sampled)
    sampled = fit(model, likelihood, subset, data, max_outputs_per_sample=most, generator=g)
    assert float(sampled.loss) == pytest.approx(float(exact.loss), rel=1e-12)
    assert not torch.allclose(sampled.H, exact.H)


def test_subsampling_rescales_by_positions_over_sampled() -> None:
    """One position of a sample whose positions all contribute the same GGN: the estimate is
    M times that position's GGN, i.e. exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1)).to(DTYPE).eval()  # 1x1: position-wise
    subset = mj.ParamSubset.all(model)
    x = torch.randn(1, 2, 1, 1, dtype=DTYPE).expand(1, 2, 4, 5).contiguous()  # equal pixels
    data = [(x, torch.zeros(1, 4, 5, dtype=torch.long))]
    exact = fit(model, "classification", subset, data)
    g = torch.Generator().manual_seed(3)
    one = fit(model, "classification", subset, data, max_outputs_per_sample=1, generator=g)
    torch.testing.assert_close(one.H, exact.H, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "4"])
def test_bad_max_outputs_per_sample(bad: object) -> None:
    model = make_model()
    subset = mj.ParamSubset.largest_magnitude(model, 4)
    with pytest.raises(ValueError, match="max_outputs_per_sample"):
        fit(
            model, "classification", subset, make_data("classification"), max_outputs_per_sample=bad
        )


def test_max_outputs_per_sample_refuses_the_empirical_fisher() -> None:
    model = make_model()
    subset = mj.ParamSubset.largest_magnitude(model, 4)
    la = mj.SubnetLaplace(model, "classification", subset, hessian="empirical")
    with pytest.raises(ValueError, match="max_outputs_per_sample"):
        la.fit(make_data("classification"), max_outputs_per_sample=3)
