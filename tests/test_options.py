"""One option vocabulary: every entry point takes the shared options under the same names, with
the same defaults, and they mean the same thing (checked through behaviour)."""

from __future__ import annotations

import inspect
from collections import OrderedDict

import pytest
import torch
from torch import nn

import multiscale_jac as mj

DTYPE = torch.float64
SHARED = ("randomness", "batch_norm", "strict", "memory_budget", "chunk_size", "output_fn")


def _model(dropout: float = 0.0, bn: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = {"conv": nn.Conv2d(2, 3, 3, padding=1)}
    if bn:
        layers["bn"] = nn.BatchNorm2d(3)
    layers.update(act=nn.Tanh(), drop=nn.Dropout(dropout), flat=nn.Flatten())
    layers["head"] = nn.Linear(3 * 5 * 5, 3)
    return nn.Sequential(OrderedDict(layers)).to(DTYPE).eval()


X = torch.randn(4, 2, 5, 5, dtype=DTYPE)
Y = torch.tensor([0, 2, 1, 0])


def _jacobian(model, **kw):
    return mj.per_sample_jacobian(model, X, params="head.*", **kw)


def _fisher(model, **kw):
    return mj.diag_fisher(model, [(X, Y)], params="head.*", **kw)


def _sq_norm(model, **kw):
    return mj.jacobian_sq_norm(model, X, params="head.*", **kw)


def _laplace(model, **kw):
    return mj.SubnetLaplace(model, "classification", "head.*", **kw).fit([(X, Y)])


def _variance(model, **kw):
    return mj.largest_variance(model, [(X, Y)], 3, params="head.*", **kw)


ENTRY_POINTS = {
    "per_sample_jacobian": _jacobian,
    "diag_fisher": _fisher,
    "jacobian_sq_norm": _sq_norm,
    "SubnetLaplace": _laplace,
    "largest_variance": _variance,
}
FUNCTIONS = {
    "per_sample_jacobian": mj.per_sample_jacobian,
    "diag_fisher": mj.diag_fisher,
    "jacobian_sq_norm": mj.jacobian_sq_norm,
    "SubnetLaplace": mj.SubnetLaplace,
    "largest_variance": mj.largest_variance,
}


def test_shared_options_have_one_name_and_default() -> None:
    defaults: dict[str, set] = {name: set() for name in (*SHARED, "progress")}
    for fname, fn in FUNCTIONS.items():
        params = inspect.signature(fn).parameters
        for name in SHARED:
            assert name in params, f"{fname} lacks {name}"
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (fname, name)
            defaults[name].add(params[name].default)
        if "progress" in params:
            defaults["progress"].add(params["progress"].default)
    defaults["progress"].add(inspect.signature(mj.SubnetLaplace.fit).parameters["progress"].default)
    for name, values in defaults.items():
        assert len(values) == 1, f"{name} has the defaults {values}"
    assert inspect.signature(mj.map_levels).parameters["strict"].default is False


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_too_small_budget_is_one_error(entry: str) -> None:
    with pytest.raises(mj.MemoryBudgetError) as err:
        ENTRY_POINTS[entry](_model(), memory_budget=1000)
    message = str(err.value)
    assert message.startswith("memory_budget=1000 bytes is below the estimated minimum of ")
    assert f"at least {err.value.minimum}" in message
    assert err.value.minimum > 1000 and isinstance(err.value, ValueError)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_the_stated_minimum_is_enough(entry: str) -> None:
    call = ENTRY_POINTS[entry]
    with pytest.raises(mj.MemoryBudgetError) as err:
        call(_model(), memory_budget=1000)
    call(_model(), memory_budget=err.value.minimum)  # runs


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_train_mode_batch_norm_follows_batch_norm(entry: str) -> None:
    model = _model(bn=True).train()
    with pytest.raises(ValueError, match=r"module 'bn' \(BatchNorm2d\) is in train mode"):
        ENTRY_POINTS[entry](model)
    ENTRY_POINTS[entry](model, batch_norm="eval")  # runs with the running statistics
    assert model.training


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_dropout_follows_randomness(entry: str) -> None:
    model = _model(dropout=0.5).train()
    with pytest.raises(ValueError, match=r"randomness='different'"):
        ENTRY_POINTS[entry](model)
    ENTRY_POINTS[entry](model, randomness="different")  # runs, each sample its own masks


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    "option, value, err",
    [
        ("strict", "yes", TypeError),
        ("memory_budget", -5, ValueError),
        ("chunk_size", 0, ValueError),
        ("randomness", "sometimes", ValueError),
        ("batch_norm", "train", ValueError),
    ],
)
def test_bad_shared_option_names_itself(entry: str, option: str, value, err) -> None:
    with pytest.raises(err, match=option):
        ENTRY_POINTS[entry](_model(), **{option: value})
