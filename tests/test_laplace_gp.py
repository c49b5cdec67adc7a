"""The function-space (GP) Laplace, ``Laplace(..., hessian_structure="gp")``: with every
training sample as context it is the full GGN Laplace's GLM predictive (Woodbury), in float64
to round-off; streamed context Jacobians give the kept ones' numbers; its state round-trips;
bad options are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multiscale_jac.laplace as mjl

TOL = 1e-10


def _data(
    likelihood: str, outputs: int, n: int = 23, hidden: int = 6
) -> tuple[nn.Module, DataLoader, torch.Tensor]:
    torch.manual_seed(3)
    x = torch.randn(n, 4, dtype=torch.float64)
    y = (
        torch.randn(n, outputs, dtype=torch.float64)
        if likelihood == "regression"
        else torch.randint(outputs, (n,))
    )
    model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, outputs)).double()
    return model, DataLoader(TensorDataset(x, y), batch_size=5), torch.randn(3, 4).double()


@pytest.mark.parametrize("outputs", [1, 3])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_gp_with_every_sample_is_the_full_laplace(outputs: int, subset: str) -> None:
    """Regression, M = N: the GP's mean, covariance and joint covariance equal the full GGN
    Laplace's (independent outputs too where the kernel is block-diagonal in the outputs: one
    output, or the last layer)."""
    model, data, query = _data("regression", outputs)
    opts = {"subset_of_weights": subset, "sigma_noise": 0.4, "prior_precision": 2.0}
    full = mjl.Laplace(model, "regression", hessian_structure="full", **opts).fit(data)
    for independent in (False, True):
        gp = mjl.Laplace(model, "regression", hessian_structure="gp", n_subset=23,
                         independent_outputs=independent, **opts).fit(data)  # fmt: skip
        (m1, v1), (m2, v2) = full(query), gp(query)
        torch.testing.assert_close(m2, m1, atol=TOL, rtol=0)
        if independent and outputs > 1 and subset == "all":
            assert (v2 - v1).abs().max() > 1e-6  # an approximation there: the test can fail
            continue
        torch.testing.assert_close(v2, v1, atol=TOL, rtol=0)
        torch.testing.assert_close(gp(query, joint=True)[1], full(query, joint=True)[1],
                                   atol=TOL, rtol=0)  # fmt: skip


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_streamed_context_jacobians_give_the_kept_ones_numbers(likelihood: str) -> None:
    """A memory budget that keeps two samples' Jacobians (groups streamed past each other) and
    a data list instead of a DataLoader: the same draw, kernel, evidence and predictive."""
    model, data, query = _data(likelihood, 3, hidden=30)  # 5,832 bytes of rows a sample
    kept = mjl.Laplace(model, likelihood, "all", "gp", n_subset=17).fit(data)
    streamed = mjl.Laplace(model, likelihood, "all", "gp", n_subset=17, chunk_size=1,
                           memory_budget=60_000).fit(list(data))  # fmt: skip
    assert len(streamed._context._groups()) > 3
    torch.testing.assert_close(streamed.K_MM, kept.K_MM, atol=TOL, rtol=0)
    torch.testing.assert_close(
        streamed.log_marginal_likelihood(), kept.log_marginal_likelihood(), atol=TOL, rtol=0
    )
    a, b = kept(query), streamed(query)
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(y, x, atol=TOL, rtol=0)


def test_state_round_trip_and_prior_tuning() -> None:
    model, data, query = _data("regression", 2)
    la = mjl.Laplace(model, "regression", "all", "gp", n_subset=9, seed=4).fit(data)
    before = la.log_marginal_likelihood().item()
    la.optimize_prior_precision(n_steps=20)
    assert la.log_marginal_likelihood().item() > before
    la.sigma_noise = 0.7
    state = la.state_dict()
    assert all(isinstance(v, (list, int, float, str, bool, torch.Tensor)) for v in state.values())
    again = mjl.Laplace(model, "regression", "all", "gp", n_subset=9)
    again.load_state_dict(state)
    for x, y in zip(la(query), again(query)):
        torch.testing.assert_close(y, x, atol=0, rtol=0)
    assert again.sigma_noise.item() == pytest.approx(0.7)


def test_gp_refuses_bad_options_by_name() -> None:
    model, data, _ = _data("classification", 3)
    with pytest.raises(TypeError, match="n_subset"):
        mjl.Laplace(model, "classification", "all", "gp")
    with pytest.raises(ValueError, match="exceeds the 23 training samples"):
        mjl.Laplace(model, "classification", "all", "gp", n_subset=24).fit(data)
    with pytest.raises(ValueError, match="isotropic"):
        mjl.Laplace(model, "classification", "all", "gp", n_subset=5,
                    prior_precision=torch.ones(2))  # fmt: skip
    with pytest.raises(ValueError, match=r"does not take \['method'\]"):
        mjl.Laplace(model, "classification", "all", "gp", n_subset=5, method="vmap")
    with pytest.raises(ValueError, match="options of hessian_structure='gp'"):
        mjl.Laplace(model, "classification", "all", "diag", n_subset=5)
    with pytest.raises(ValueError, match="pred_type='gp'"):
        mjl.Laplace(model, "classification", "all", "gp", n_subset=5).fit(data)(
            torch.randn(2, 4).double(), pred_type="nn"
        )
    dense = nn.Conv2d(2, 3, 3, padding=1).double()  # per-pixel logits (3, 4, 4) per sample
    images = [(torch.randn(4, 2, 4, 4).double(), torch.randint(3, (4, 4, 4)))]
    with pytest.raises(ValueError, match=r"one vector \(O,\) per sample.*\(3, 4, 4\)"):
        mjl.Laplace(dense, "classification", "all", "gp", n_subset=3).fit(images)
    assert isinstance(mjl.Laplace(model, "classification", "all", "gp", n_subset=5),
                      mjl.BaseLaplace)  # fmt: skip


@pytest.mark.slow
def test_gp_agrees_with_laplace_torch(laplace_torch) -> None:
    """laplace-torch's FunctionalLaplace on the same data (float64, 12 context samples of 30,
    a prior mean off zero; regression with one and three outputs, dependent and independent,
    and classification): the predictive, the evidence, its scatter and log-determinant and the
    prior after 30 Adam steps agree to round-off (2e-15 measured)."""
    from test_laplace_torch_differences import ROUND_OFF, run

    worst = run(laplace_torch, "gp_agrees")
    assert set(worst) == {"predictive", "log_marginal_likelihood", "scatter", "log_det_ratio",
                          "tuned prior"}  # fmt: skip
    assert all(v < ROUND_OFF for v in worst.values()), worst


def test_gp_last_layer_without_a_name_is_checked_by_the_fit() -> None:
    """A head registered before its body: the last nn.Linear registered does not run last, so
    the GP over "the last layer" is refused at fit, as the parametric posteriors."""
    from test_laplace import _HeadFirst

    x, y = torch.randn(6, 3), torch.randint(2, (6,))
    la = mjl.Laplace(_HeadFirst(), "classification", "last_layer", "gp", n_subset=4)
    with pytest.raises(ValueError, match=r"took 'body.0'.*ran before 'head'"):
        la.fit([(x, y)])
    named = mjl.Laplace(_HeadFirst(), "classification", "last_layer", "gp", n_subset=4,
                        last_layer_name="head")  # fmt: skip
    assert named.fit([(x, y)]).K_MM.shape == (8, 8)


def test_unfitted_last_layer_gp_takes_a_prior_and_a_state() -> None:
    """A last-layer GP found without a name (its twin's mean is None until the fit, as
    laplace-torch's) still takes a prior precision and a saved state before any fit."""
    model, data, query = _data("regression", 2)
    la = mjl.Laplace(model, "regression", "last_layer", "gp", n_subset=9).fit(data)
    again = mjl.Laplace(model, "regression", "last_layer", "gp", n_subset=9)
    again.prior_precision = 3.0
    assert again.prior_precision.tolist() == [3.0]
    again.load_state_dict(la.state_dict())
    for x, y in zip(la(query), again(query)):
        torch.testing.assert_close(y, x, atol=0, rtol=0)
