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
from multiscale_jac.testing import param_subsets


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(3, 2, 1), nn.Linear(4, 2)),
    )


def test_names_follow_the_order_given() -> None:
    """``all`` follows named_parameters(); names keep the order given, a glob expands in
    named_parameters() order, a tensor named twice counts where it is first named."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    assert mj.ParamSubset.all(model).names == tuple(names)
    sub = mj.ParamSubset.from_names(model, ["2.1.weight", "0.bias", "2.*"])
    assert sub.names == ("2.1.weight", "0.bias", "2.0.weight", "2.0.bias", "2.1.bias")
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


def test_from_indices_keeps_the_order_given() -> None:
    model = _model()
    sub = mj.ParamSubset.from_indices(
        model, {"2.1.weight": [5, 0, 3], "0.weight": np.array([7, 2])}
    )
    assert sub.names == ("2.1.weight", "0.weight")
    assert sub.indices["0.weight"].tolist() == [7, 2]
    assert sub.indices["2.1.weight"].tolist() == [5, 0, 3]
    assert sub.selected_shape("0.weight") == (2,)
    assert sub.offsets == {"2.1.weight": (0, 3), "0.weight": (3, 5)}
    vec = parameters_to_vector(model.parameters())
    assert sub.flat_indices().tolist() == [65 + 5, 65, 65 + 3, 7, 2]  # 2.1.weight starts at 65
    assert torch.equal(sub.flatten(dict(model.named_parameters())), vec[sub.flat_indices()])


def test_from_flat_indices_is_full_jacobian_indexing() -> None:
    """Columns in the order of the flat indices, also when it interleaves tensors:
    ``J[..., k]`` is the derivative w.r.t. ``parameters_to_vector(...)[idx[k]]``."""
    model = _model()
    vec = parameters_to_vector(model.parameters())
    idx = torch.tensor([70, 3, 55, 71, 0, 60])  # 2.1.weight, 0.weight, 0.bias, ... interleaved
    sub = mj.ParamSubset.from_flat_indices(model, idx)
    assert sub.flat_indices().tolist() == idx.tolist()
    assert sub.columns is not None
    values = sub.flatten(dict(model.named_parameters()))
    assert torch.equal(values, vec[idx])
    # split / embed invert flatten
    full = sub.embed(values)
    for name, part in sub.split(values).items():
        p = dict(model.named_parameters())[name]
        assert torch.equal(part, p.detach().reshape(-1)[sub.indices[name]])
        assert torch.equal(full[name].reshape(-1)[sub.indices[name]], part)
    with pytest.raises(ValueError, match="index 3 is given more than once"):
        mj.ParamSubset.from_flat_indices(model, [3, 5, 3])


@given(data=st.data())
def test_flat_indices_round_trip(data) -> None:
    model = _model()
    vec = parameters_to_vector(model.parameters())
    # up to 30 unique flat indices in any order (interleaving tensors), by from_flat_indices
    sub = data.draw(param_subsets(model, kinds=("flat",), max_entries=30))
    idx = sub.flat_indices().tolist()
    assert sub.numel == len(idx) == len(set(idx))
    assert mj.ParamSubset.from_flat_indices(model, torch.tensor(idx)) == sub
    values = sub.flatten(dict(model.named_parameters()))
    assert torch.equal(values, vec[idx])
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
    # the same entries through from_mask (ascending order) and from_indices (the order given)
    masks = {}
    for name, p in model.named_parameters():
        if name in sub.names:
            masks[name] = torch.zeros(p.shape, dtype=torch.bool)
            masks[name].view(-1)[sub.indices[name]] = True
    assert mj.ParamSubset.from_mask(model, masks) == mj.ParamSubset.from_flat_indices(
        model, sorted(idx)
    )
    by_indices = mj.ParamSubset.from_indices(model, sub.indices)
    assert sorted(by_indices.flat_indices().tolist()) == sorted(idx)
    if sub.columns is None:
        assert by_indices == sub


def test_flatten_with_batch_dims_and_values() -> None:
    model = _model()
    sub = mj.ParamSubset.from_indices(model, {"0.bias": [2, 0]})
    grads = {"0.bias": torch.arange(12.0).reshape(4, 3)}  # (N=4, *shape)
    assert sub.flatten(grads).tolist() == [[2, 0], [5, 3], [8, 6], [11, 9]]
    torch.testing.assert_close(sub.values(model)["0.bias"], model[0].bias.detach()[[2, 0]])
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
