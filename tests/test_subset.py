"""ParamSubset: constructors, flat order, mapping values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import TiedLinear
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parameters_to_vector

import multiscale_jac as mj


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(3, 2, 1), nn.Linear(4, 2)),
    )


def test_all_and_names_follow_named_parameters_order() -> None:
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    assert mj.ParamSubset.all(model).names == tuple(names)
    sub = mj.ParamSubset.from_names(model, ["2.1.weight", "0.bias", "2.*"])
    assert sub.names == ("0.bias", "2.0.weight", "2.0.bias", "2.1.weight", "2.1.bias")
    assert sub.numel == 3 + 6 + 2 + 8 + 2
    assert all(sub.is_whole(n) for n in sub.names)


def test_glob_star_matches_dots() -> None:
    model = _model()
    assert mj.ParamSubset.from_names(model, "2.*").names == (
        "2.0.weight",
        "2.0.bias",
        "2.1.weight",
        "2.1.bias",
    )
    assert mj.ParamSubset.from_names(model, "*.bias").names == ("0.bias", "2.0.bias", "2.1.bias")
    assert mj.ParamSubset.from_names(model, "2.?.weight").names == ("2.0.weight", "2.1.weight")


def test_from_indices_sorts_and_orders() -> None:
    model = _model()
    sub = mj.ParamSubset.from_indices(
        model, {"2.1.weight": [5, 0, 3], "0.weight": np.array([7, 2])}
    )
    assert sub.names == ("0.weight", "2.1.weight")
    assert sub.indices["0.weight"].tolist() == [2, 7]
    assert sub.indices["2.1.weight"].tolist() == [0, 3, 5]
    assert sub.selected_shape("0.weight") == (2,)
    assert sub.offsets == {"0.weight": (0, 2), "2.1.weight": (2, 5)}


@given(data=st.data())
def test_flat_indices_round_trip(data) -> None:
    model = _model()
    vec = parameters_to_vector(model.parameters())
    total = vec.numel()
    idx = data.draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=30, unique=True))
    sub = mj.ParamSubset.from_flat_indices(model, torch.tensor(idx))
    assert sub.numel == len(idx)
    assert sub.flat_indices().tolist() == sorted(idx)
    values = sub.flatten(dict(model.named_parameters()))
    assert torch.equal(values, vec[sorted(idx)])
    # split / embed / gather agree with each other
    parts = sub.split(values)
    full = sub.embed(values)
    for name, part in parts.items():
        p = dict(model.named_parameters())[name]
        assert full[name].shape == p.shape
        sel = sub.indices[name]
        assert torch.equal(full[name].reshape(-1)[sel], part)
        mask = torch.ones(p.numel(), dtype=torch.bool)
        mask[sel] = False
        assert torch.all(full[name].reshape(-1)[mask] == 0)
    # the same entries through from_mask and from_indices give the same subset
    masks = {}
    for name in sub.names:
        m = torch.zeros(dict(model.named_parameters())[name].shape, dtype=torch.bool)
        m.view(-1)[sub.indices[name]] = True
        masks[name] = m
    assert mj.ParamSubset.from_mask(model, masks) == sub
    assert mj.ParamSubset.from_indices(model, sub.indices) == sub


def test_flatten_with_batch_dims_and_values() -> None:
    model = _model()
    sub = mj.ParamSubset.from_indices(model, {"0.bias": [2, 0]})
    grads = {"0.bias": torch.arange(12.0).reshape(4, 3)}  # (N=4, *shape)
    assert sub.flatten(grads).tolist() == [[0, 2], [3, 5], [6, 8], [9, 11]]
    torch.testing.assert_close(sub.values(model)["0.bias"], model[0].bias.detach()[[0, 2]])
    whole = mj.ParamSubset.from_names(model, "2.1.weight")
    assert whole.split(torch.zeros(5, 8))["2.1.weight"].shape == (5, 2, 4)


def test_tied_weights_are_one_parameter() -> None:
    model = TiedLinear()
    sub = mj.ParamSubset.all(model)
    assert sub.names == ("a.weight", "a.bias", "b.bias")
    assert mj.ParamSubset.from_names(model, "b.weight").names == ("a.weight",)  # alias resolves
    assert mj.ParamSubset.from_names(model, "b.*").names == ("a.weight", "b.bias")


def test_trainable_only() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in mj.ParamSubset.all(model, trainable_only=True).names
    assert "0.weight" in mj.ParamSubset.all(model).names


def test_subset_checked_against_model() -> None:
    sub = mj.ParamSubset.from_names(_model(), "2.1.weight")
    other = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'2\.1\.weight', which the model does not have"):
        mj.per_sample_jacobian(other, torch.randn(2, 2), params=sub)
    wrong_shape = _model()
    wrong_shape[2][1] = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"shape \(2, 4\); the model's has shape \(3, 4\)"):
        sub.check_model(wrong_shape)


def test_repr_names_counts() -> None:
    sub = mj.ParamSubset.from_indices(_model(), {"0.weight": [1, 2]})
    assert repr(sub) == "ParamSubset(numel=2, {0.weight: 2 of 54})"
