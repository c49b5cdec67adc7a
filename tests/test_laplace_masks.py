"""laplace-torch's subnetwork masks (``multiscale_jac.laplace._masks``): the indices each
selects, written out here from its rule, and the errors of bad use."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac.laplace import (
    Laplace,
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
    LargestVarianceSWAGSubnetMask,
    LastLayerSubnetMask,
    ModuleNameSubnetMask,
    ParamNameSubnetMask,
    RandomSubnetMask,
)

DTYPE = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE).eval()


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, generator=g, dtype=DTYPE)
    return DataLoader(TensorDataset(x, torch.randint(3, (12,), generator=g)), batch_size=6)


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.argsort(scores, descending=True)[:k].sort().values


def test_score_masks_pick_the_top_scores() -> None:
    model = _model()
    theta = parameters_to_vector(model.parameters()).detach()
    mask = LargestMagnitudeSubnetMask(model, n_params_subnet=7)
    assert torch.equal(mask.select(), _top(theta.abs(), 7)) and mask.n_params_subnet == 7
    torch.manual_seed(3)
    chosen = RandomSubnetMask(model, n_params_subnet=5).select()
    torch.manual_seed(3)
    assert torch.equal(chosen, _top(torch.rand_like(theta), 5))


def test_name_masks_take_whole_tensors() -> None:
    model = _model()
    sizes = [p.numel() for p in model.parameters()]  # 24, 6, 18, 3
    last = torch.arange(sum(sizes[:2]), sum(sizes))
    assert torch.equal(ParamNameSubnetMask(model, ["2.weight", "2.bias"]).select(), last)
    assert torch.equal(ModuleNameSubnetMask(model, ["2"]).select(), last)
    assert torch.equal(LastLayerSubnetMask(model).select(), last)
    assert torch.equal(LastLayerSubnetMask(model, "0").select(), torch.arange(sum(sizes[:2])))
    bias = torch.arange(sizes[0], sum(sizes[:2]))
    assert torch.equal(ParamNameSubnetMask(model, ["0.bias"]).select(), bias)


def test_the_diagonal_laplace_variance_mask_fits_and_ranks() -> None:
    model = _model()
    diag = Laplace(model, "classification", "all", "diag")
    mask = LargestVarianceDiagLaplaceSubnetMask(model, 6, diag)
    chosen = mask.select(_loader())
    assert diag.n_data > 0  # fitted by the mask
    assert torch.equal(chosen, _top(diag.posterior_variance.detach(), 6))
    la = Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=chosen)
    la.fit(_loader())
    assert la.n_params == 6


@pytest.mark.parametrize(
    ("make", "err", "match"),
    [
        (lambda m: LargestMagnitudeSubnetMask(m, 1000), ValueError, "more than the model's 51"),
        (lambda m: LargestMagnitudeSubnetMask(m, 0), ValueError, "n_params_subnet"),
        (lambda m: ParamNameSubnetMask(m, ["9.weight"]), ValueError, r"\['9.weight'\]"),
        (lambda m: ModuleNameSubnetMask(m, ["1"]), ValueError, "'1' has no parameters"),
        (lambda m: ModuleNameSubnetMask(m, "2"), ValueError, "list of names"),
        (lambda m: ParamNameSubnetMask(m, 3), ValueError, "list of names; got 3"),
        (lambda m: LargestVarianceSWAGSubnetMask(m, 3), NotImplementedError, "SWAG"),
        (lambda m: LargestVarianceDiagLaplaceSubnetMask(m, 3, None), TypeError, "DiagLaplace"),
    ],
    ids=[
        "too-many",
        "zero",
        "unknown-param",
        "module-without-params",
        "a-string",
        "a-number",
        "swag",
        "no-la",
    ],
)
def test_bad_masks_are_refused(make, err, match) -> None:
    with pytest.raises(err, match=match):
        make(_model())


def test_a_mask_is_selected_once_and_read_after() -> None:
    mask = LargestMagnitudeSubnetMask(_model(), 4)
    with pytest.raises(AttributeError, match="select"):
        _ = mask.indices
    mask.select()
    with pytest.raises(ValueError, match="already selected"):
        mask.select()
    with pytest.raises(ValueError, match="0/1 vector of the model's 51 parameters"):
        mask.convert_subnet_mask_to_indices(torch.ones(50, dtype=torch.bool))
