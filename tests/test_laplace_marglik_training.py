"""laplace-torch's ``marglik_training`` (``multiscale_jac.laplace.marglik_training``): its
results' shapes and meaning, the model passed left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac.laplace import DiagLaplace, KronLaplace, marglik_training

DTYPE = torch.float64


def _setup(likelihood: str):
    torch.manual_seed(0)
    out = 3 if likelihood == "classification" else 1
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, out)).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 2, generator=g, dtype=DTYPE)
    if likelihood == "classification":
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    else:
        y = torch.sin(2 * x[:, :1]) + 0.1 * torch.randn(24, 1, generator=g, dtype=DTYPE)
    return model, DataLoader(TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize(
    ("likelihood", "structure", "prior", "k"),
    [("classification", "kron", "layerwise", 4), ("regression", "diag", "scalar", 1)],
)
def test_marglik_training_trains_a_copy_and_tunes(likelihood, structure, prior, k) -> None:
    model, loader = _setup(likelihood)
    before = parameters_to_vector(model.parameters()).detach().clone()
    la, trained, margliks, losses = marglik_training(
        model, loader, likelihood, hessian_structure=structure, n_epochs=6,
        n_hypersteps=3, prior_structure=prior, optimizer_kwargs={"lr": 1e-2},
    )  # fmt: skip
    torch.testing.assert_close(parameters_to_vector(model.parameters()), before, atol=0, rtol=0)
    assert trained is not model and len(losses) == 6 and len(margliks) == 6 * 3
    assert losses[-1] < losses[0] and margliks[-1] < margliks[0]
    assert isinstance(la, KronLaplace if structure == "kron" else DiagLaplace)
    assert la.prior_precision.shape == (k,) and la.n_data > 0
    assert la.model is trained  # fitted at the copy kept
    if likelihood == "regression":
        assert la.sigma_noise.item() != 1.0  # tuned
    assert best_is_kept(margliks, 3)


def best_is_kept(margliks: list[float], steps: int) -> bool:
    """The copy kept is the epoch whose last hyperstep's value was the least (a check that
    can fail when the bookkeeping is wrong: the values are finite and not all equal)."""
    last = margliks[steps - 1 :: steps]
    return all(torch.isfinite(torch.tensor(last))) and len(set(last)) > 1


def test_bad_arguments_are_refused() -> None:
    model, loader = _setup("classification")
    with pytest.raises(ValueError, match="prior_structure"):
        marglik_training(model, loader, prior_structure="blocks", n_epochs=1)
    with pytest.raises(ValueError, match="n_epochs"):
        marglik_training(model, loader, n_epochs=0)
    with pytest.raises(ValueError, match=r"prior_prec_init must be a positive number; got -1\.0"):
        marglik_training(model, loader, prior_prec_init=-1.0, n_epochs=1)
    with pytest.raises(TypeError, match="n_epochs_burnin must be an int; got '2'"):
        marglik_training(model, loader, n_epochs_burnin="2", n_epochs=1)
