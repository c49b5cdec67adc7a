"""laplace-torch's options with its meaning, on every Laplace class: ``backend=``,
``enable_backprop``, ``joint``, ``n_outputs``, ``state_dict``, ``bridge_norm``,
``functional_samples(pred_type=)``, BatchNorm in train mode and ``likelihood`` assigned by name;
values against dense float64 references written out here."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_laplace_torch_usage import DTYPE, TOL, jacobians, mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multiscale_jac as mj
from multiscale_jac.enums import FallbackWarning
from multiscale_jac.laplace import Laplace

STRUCTURES = ["full", "kron", "diag"]


def regression_data(n: int = 7, outputs: int = 2, seed: int = 3) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=DTYPE)
    y = torch.randn(n, outputs, generator=g, dtype=DTYPE)
    return DataLoader(TensorDataset(x, y), batch_size=3)


def fitted(structure: str, *, seed: int = 0, **kwargs: object):
    model = mlp(2, seed=seed)
    la = Laplace(model, "regression", "all", structure, sigma_noise=0.7, **kwargs)
    return la.fit(regression_data())


def covariance(la) -> torch.Tensor:
    """``Sigma`` ``(P, P)`` of any of the three classes, densely."""
    if isinstance(la, mj.KronLaplace):
        return la.posterior_precision.to_matrix(exponent=-1)
    if isinstance(la, mj.DiagLaplace):
        return torch.diag(la.posterior_variance)
    return la.posterior_covariance


# ---------------------------------------------------------------------- backend=
@pytest.mark.parametrize("structure", STRUCTURES)
def test_backend_is_accepted_by_every_class_with_its_meaning(structure: str) -> None:
    cls = {"full": mj.SubnetLaplace, "kron": mj.KronLaplace, "diag": mj.DiagLaplace}[structure]
    model = mlp(2)
    subset = mj.ParamSubset.all(model)

    class MyEF:  # a user's subclass of laplace-torch's backend: its MRO names the kind
        pass

    ef_sub = type("MyCurvlinopsEF", (type("CurvlinopsEF", (MyEF,), {}),), {})
    for backend, kind in [
        ("CurvlinopsGGN", "ggn"),
        ("GGNInterface", "ggn"),
        ("BackPackEF", "empirical"),
        (ef_sub, "empirical"),
    ]:
        la = cls(model, "regression", subset, backend=backend, backend_kwargs={})
        assert la.hessian.value == kind, backend
        assert la.backend.name == getattr(backend, "__name__", backend)
    ef = cls(model, "regression", subset, backend="AsdlEF").fit(regression_data())
    ref = cls(model, "regression", subset, hessian="empirical").fit(regression_data())
    h = ef.H.to_matrix() if structure == "kron" else ef.H
    h_ref = ref.H.to_matrix() if structure == "kron" else ref.H
    torch.testing.assert_close(h, h_ref, atol=0, rtol=0)
    with pytest.raises(ValueError, match="means hessian='ggn', but hessian='empirical'"):
        cls(model, "regression", subset, backend="BackPackGGN", hessian="empirical")
    with pytest.raises(ValueError, match="only stochastic=False"):
        cls(model, "regression", subset, backend="BackPackGGN", backend_kwargs={"x": 1})
    with pytest.raises(ValueError, match="exact Hessian has no counterpart"):
        cls(model, "regression", subset, backend="CurvlinopsHessian")
    with pytest.raises(TypeError, match="backend must be a backend class or its name"):
        cls(model, "regression", subset, backend=3)


# ---------------------------------------------------------------------- enable_backprop
@pytest.mark.parametrize("structure", STRUCTURES)
def test_enable_backprop_differentiates_the_predictive_wrt_the_inputs(structure: str) -> None:
    la = fitted(structure, enable_backprop=True)
    plain = fitted(structure)
    sigma = covariance(la)
    x = torch.randn(3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(9))

    def reference(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outs, jacs = jacobians(la.model, [xi[None] for xi in xs])
        var = torch.stack([torch.diagonal(j @ sigma @ j.T) for j in jacs])
        return torch.stack(outs), var

    xg = x.clone().requires_grad_(True)
    mean, cov = la(xg)
    torch.testing.assert_close(cov, plain(x)[1], atol=TOL, rtol=0)
    var = torch.diagonal(cov, dim1=1, dim2=2)
    grad = torch.autograd.grad(var.sum() + mean.sum(), xg)[0]
    # central differences of the dense reference
    eps, fd = 1e-6, torch.zeros_like(x)
    for i in range(x.shape[0]):
        for k in range(x.shape[1]):
            d = torch.zeros_like(x)
            d[i, k] = eps
            (mp, vp), (mm, vm) = reference(x + d), reference(x - d)
            fd[i, k] = ((mp.sum() + vp.sum()) - (mm.sum() + vm.sum())) / (2 * eps)
    torch.testing.assert_close(grad, fd, atol=1e-6, rtol=1e-6)
    nn_mean, nn_var = la(xg, pred_type="nn", link_approx="mc", n_samples=4)
    assert torch.autograd.grad(nn_var.sum() + nn_mean.sum(), xg)[0].abs().sum() > 0
    assert not plain(xg)[1].requires_grad  # without the option nothing is kept


class _Branchy(nn.Module):
    """A conv net on images of any size with a data-dependent branch: it runs under
    ``jacrev`` one sample at a time but not under ``vmap``."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.conv, self.head, self.branch = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(3, 2), branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if self.branch and bool(h.sum() > -1e9):
            h = h * 1.0
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("branch", [False, True])
def test_enable_backprop_rows_are_batched_per_shape_bucket(branch: bool) -> None:
    """``enable_backprop``'s rows come from ``jacrev`` vmapped over each shape bucket's samples,
    in sample order across buckets (the joint predictive's order): the mean, the covariance,
    the joint covariance and their gradients w.r.t. ragged inputs equal those of one sample
    at a time (``chunk_size=1``). A model that does not run under ``vmap`` falls back to one
    sample at a time, with a ``FallbackWarning``."""
    torch.manual_seed(0)
    model = _Branchy(branch).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    sizes = [(4, 4), (5, 3), (4, 4), (5, 3), (4, 4)]  # two buckets, interleaved
    xs = [torch.randn(2, *s, generator=g, dtype=DTYPE) for s in sizes]
    ys = torch.randn(len(xs), 2, generator=g, dtype=DTYPE)
    results = []
    for chunk in (None, 1):
        la = Laplace(model, "regression", "all", "full", enable_backprop=True, chunk_size=chunk)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)  # the fit's own route
            la.fit([(xs, ys)])
        xg = [x.clone().requires_grad_(True) for x in xs]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mean, cov = la(xg)
            f_mu, f_cov = la(xg, joint=True)
        fell_back = any("one sample at a time" in str(w.message) for w in seen)
        assert fell_back == (branch and chunk is None)
        total = mean.sum() + cov.sum() + f_mu.sum() + f_cov.sum()
        grads = torch.autograd.grad(total, xg)
        results.append([mean, cov, f_mu, f_cov, *grads])
    for batched, one in zip(*results):
        torch.testing.assert_close(batched, one, atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------------- joint
@pytest.mark.parametrize("structure", STRUCTURES)
def test_joint_predictive_covariance_across_samples(structure: str) -> None:
    la = fitted(structure)
    x = torch.randn(3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(4))
    outs, jacs = jacobians(la.model, [xi[None] for xi in x])
    j = torch.cat(jacs)  # (N O, P), sample-major
    mean, cov = la(x, joint=True)
    torch.testing.assert_close(mean, torch.cat(outs), atol=TOL, rtol=0)
    torch.testing.assert_close(cov, j @ covariance(la) @ j.T, atol=TOL, rtol=0)
    cls = Laplace(mlp(3), "classification", "all", structure)
    cls.fit([(x, torch.tensor([0, 2, 1]))])
    torch.testing.assert_close(cls(x, joint=True), cls(x), atol=0, rtol=0)  # ignored, as there


# ---------------------------------------------------------------------- n_outputs
@pytest.mark.parametrize("structure", STRUCTURES)
def test_n_outputs_is_the_output_dim(structure: str) -> None:
    model = mlp(2)
    la = Laplace(model, "regression", "all", structure)
    assert la.n_outputs is None
    la.fit(regression_data(n=5))
    assert la.n_outputs == 2 and la.n_data == 5
    assert la._posterior.n_entries == 10  # the marginal likelihood's constant counts every entry
    clf = Laplace(mlp(3), "classification", "all", structure)
    clf.fit([(torch.zeros(2, 4, dtype=DTYPE), torch.tensor([0, 2]))])
    assert clf.n_outputs == 3


# ---------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("structure", STRUCTURES)
def test_state_dict_round_trip_and_refusals(structure: str, tmp_path) -> None:
    la = fitted(structure)
    la.prior_precision = 0.4
    la.sigma_noise = torch.tensor(0.9, dtype=DTYPE)
    path = tmp_path / "la.pt"
    torch.save(la.state_dict(), path)
    state = torch.load(path)
    for key, value in state.items():
        assert value is None or isinstance(
            value, (list, tuple, int, float, str, bool, torch.Tensor)
        ), key
    again = Laplace(la.model, "regression", "all", structure)
    again.load_state_dict(state)
    x = torch.randn(2, 4, dtype=DTYPE)
    for a, b in zip(la(x), again(x)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    assert float(again.sigma_noise) == 0.9
    torch.testing.assert_close(again.log_marginal_likelihood(), la.log_marginal_likelihood())
    h0 = la.H.to_matrix() if structure == "kron" else la.H
    again.fit(regression_data(), override=False)  # continual learning from a saved posterior
    h1 = again.H.to_matrix() if structure == "kron" else again.H
    torch.testing.assert_close(h1, 2 * h0, atol=TOL, rtol=0)
    cases = [
        (Laplace(la.model, "classification", "all", structure), "different likelihood"),
        (Laplace(mlp(2, seed=1), "regression", "all", structure), "differ from the saved MAP"),
        (Laplace(mlp(2), "regression", "last_layer", structure), "different subset"),
        (
            Laplace(
                nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 2)).to(DTYPE),
                "regression",
                "all",
                structure,
            ),
            "different model parameters",
        ),
        (
            Laplace(la.model, "regression", "all", "diag" if structure != "diag" else "full"),
            "different class",
        ),
        (
            Laplace(la.model, "regression", "all", structure, hessian="empirical"),
            "different hessian",
        ),
    ]
    for other, match in cases:
        with pytest.raises(ValueError, match=match):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"lacks \['H'\]"):
        again.load_state_dict({k: v for k, v in state.items() if k != "H"})
    with pytest.raises(RuntimeError, match="not fitted"):
        Laplace(la.model, "regression", "all", structure).state_dict()


# ---------------------------------------------------------------------- bridge_norm
def test_bridge_norm_is_laplace_torchs_formula() -> None:
    model = mlp(3, seed=5)
    x = torch.randn(4, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(6))
    la = Laplace(model, "classification", "all", "full", prior_precision=0.5)
    la.fit([(x, torch.tensor([0, 1, 2, 1]))])
    outs, jacs = jacobians(model, [xi[None] for xi in x])
    f_mu = torch.stack(outs)
    f_var = torch.stack([j @ la.posterior_covariance @ j.T for j in jacs])
    # laplace-torch 0.3's code for link_approx="bridge_norm", written out
    f_mu = f_mu - f_var.sum(-1) * f_mu.sum(-1).reshape(-1, 1) / f_var.sum(dim=(1, 2)).reshape(-1, 1)
    f_var = f_var - torch.einsum("bi,bj->bij", f_var.sum(-1), f_var.sum(-2)) / f_var.sum(
        dim=(1, 2)
    ).reshape(-1, 1, 1)
    k = f_mu.shape[-1]
    diag = torch.diagonal(f_var, dim1=1, dim2=2)
    mean = diag.mean(dim=1) / math.sqrt(k / 2)
    f_mu = f_mu / mean.sqrt().unsqueeze(-1)
    diag = diag / mean.unsqueeze(-1)
    sum_exp = torch.exp(-f_mu).sum(dim=1).unsqueeze(-1)
    alpha = (1 - 2 / k + f_mu.exp() / k**2 * sum_exp) / diag
    ref = alpha / alpha.sum(dim=1).unsqueeze(-1)
    torch.testing.assert_close(la(x, link_approx="bridge_norm"), ref, atol=TOL, rtol=0)
    assert not torch.allclose(la(x, link_approx="bridge"), ref)


# ---------------------------------------------------------------------- functional_samples
def test_functional_samples_takes_pred_type() -> None:
    la = fitted("full")
    x = torch.randn(3, 4, dtype=DTYPE)
    for pred_type, linearized in [("glm", True), ("nn", False)]:
        a = la.functional_samples(
            x, pred_type=pred_type, n_samples=5, generator=torch.Generator().manual_seed(1)
        )
        b = la.functional_samples(
            x, 5, linearized=linearized, generator=torch.Generator().manual_seed(1)
        )
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="disagree"):
        la.functional_samples(x, 5, pred_type="nn", linearized=True)
    la.likelihood = "classification"  # assigned by name, as laplace-torch's tests do
    assert la.likelihood is mj.enums.Likelihood.CLASSIFICATION
    with pytest.raises(ValueError, match="likelihood"):
        la.likelihood = "poisson"


# ---------------------------------------------------------------------- BatchNorm in train mode
@pytest.mark.parametrize("structure", STRUCTURES)
def test_batch_norm_in_train_mode_fits_in_eval_mode_and_keeps_the_models_mode(
    structure: str,
) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.BatchNorm1d(5, affine=False), nn.Tanh(), nn.Linear(5, 2)
    ).to(DTYPE)
    model[1].running_mean.uniform_(-0.5, 0.5)
    model[1].running_var.uniform_(0.5, 2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trained = Laplace(model, "regression", "all", structure).fit(regression_data())
    assert model.training and model[1].training  # the model's mode is kept
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # running statistics untouched
    evaluated = Laplace(model.eval(), "regression", "all", structure).fit(regression_data())
    h0 = trained.H.to_matrix() if structure == "kron" else trained.H
    h1 = evaluated.H.to_matrix() if structure == "kron" else evaluated.H
    torch.testing.assert_close(h0, h1, atol=TOL, rtol=0)
    model.train()
    with pytest.raises(ValueError, match="BatchNorm"):
        Laplace(model, "regression", "all", structure, batch_norm="error")


# ---------------------------------------------------------------------- dict batches
class DictModel(nn.Module):
    """A model called with a dict batch (Hugging Face style); the labels never reach it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)

    def forward(self, batch: dict) -> torch.Tensor:
        assert "y" not in batch
        return self.net(batch["x"])


@pytest.mark.parametrize("structure", STRUCTURES)
def test_dict_batches_with_dict_keys(structure: str) -> None:
    from collections import UserDict

    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 4, generator=g, dtype=DTYPE) for _ in range(2)]
    ys = [torch.randint(3, (3,), generator=g) for _ in range(2)]
    model = DictModel()
    dicts = [UserDict({"x": x, "y": y}) for x, y in zip(xs, ys)]
    la = Laplace(model, "classification", "all", structure, dict_key_x="x", dict_key_y="y")
    la.fit(dicts)
    plain = Laplace(model.net, "classification", "all", structure).fit(list(zip(xs, ys)))
    h0 = la.H.to_matrix() if structure == "kron" else la.H
    h1 = plain.H.to_matrix() if structure == "kron" else plain.H
    torch.testing.assert_close(h0, h1, atol=TOL, rtol=0)
    torch.testing.assert_close(la(dicts[0]), plain(xs[0]), atol=TOL, rtol=0)
    with pytest.raises(KeyError, match=r"lacks \['input_ids', 'labels'\]"):
        Laplace(model, "classification", "all", structure).fit(dicts)
    with pytest.raises(TypeError, match="dict_key_x must be a str"):
        Laplace(model, "classification", "all", structure, dict_key_x=1)


# ---------------------------------------------------------------------- reward modelling
@pytest.mark.parametrize("structure", STRUCTURES)
def test_reward_modeling_fits_pairs_and_predicts_one_reward(structure: str) -> None:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).to(DTYPE)

    class Pairs(nn.Module):  # (N, 2, 3) -> the two rewards (N, 2); (N, 3) -> (N, 1)
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 3:
                return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], 2)
            return self.net(x)

    model = Pairs()
    g = torch.Generator().manual_seed(4)
    pairs, prefs = (
        torch.randn(5, 2, 3, generator=g, dtype=DTYPE),
        torch.randint(2, (5,), generator=g),
    )
    la = Laplace(model, "reward_modeling", "all", structure).fit([(pairs, prefs)])
    ref = Laplace(model, "classification", "all", structure).fit([(pairs, prefs)])
    h0 = la.H.to_matrix() if structure == "kron" else la.H
    h1 = ref.H.to_matrix() if structure == "kron" else ref.H
    torch.testing.assert_close(h0, h1, atol=TOL, rtol=0)
    assert la.likelihood is mj.enums.Likelihood.REGRESSION  # the predictive is a regression
    x = torch.randn(4, 3, generator=g, dtype=DTYPE)
    mean, var = la(x)
    outs, jacs = jacobians(model, [xi[None] for xi in x])
    torch.testing.assert_close(mean, torch.stack(outs), atol=TOL, rtol=0)
    sigma = covariance(la)
    torch.testing.assert_close(var, torch.stack([j @ sigma @ j.T for j in jacs]), atol=TOL, rtol=0)
    assert la.state_dict()["likelihood"] == "reward_modeling"


def test_regression_ef_backend_takes_laplace_torchs_convention() -> None:
    """An EF backend named on a regression: laplace-torch's posterior ``2 EF / sigma^2``; the
    library's own ``hessian="empirical"``: the textbook ``EF / sigma^4``."""
    model = mlp(2)
    named = Laplace(model, "regression", "all", "full", sigma_noise=0.7, backend="CurvlinopsEF")
    own = Laplace(model, "regression", "all", "full", sigma_noise=0.7, hessian="empirical")
    named.fit(regression_data())
    own.fit(regression_data())
    torch.testing.assert_close(named.H, own.H, atol=0, rtol=0)  # H: the EF at sigma = 1
    prior = torch.eye(named.n_params, dtype=DTYPE)
    torch.testing.assert_close(named.posterior_precision, 2 * own.H / 0.49 + prior)
    torch.testing.assert_close(own.posterior_precision, own.H / 0.7**4 + prior)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_functional_variance_and_covariance_of_given_jacobians(structure: str) -> None:
    la = fitted(structure)
    x = torch.randn(3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(5))
    _, jacs = jacobians(la.model, [xi[None] for xi in x])
    js, sigma = torch.stack(jacs), covariance(la)
    ref = torch.einsum("nop,pq,nkq->nok", js, sigma, js)
    torch.testing.assert_close(la.functional_variance(js), ref, atol=TOL, rtol=0)
    flat = js.reshape(-1, js.shape[-1])
    torch.testing.assert_close(
        la.functional_covariance(js), flat @ sigma @ flat.T, atol=TOL, rtol=0
    )
    with pytest.raises(ValueError, match=r"Js must be \(N, O, P="):
        la.functional_variance(js[0])


@pytest.mark.parametrize("structure", STRUCTURES)
def test_backend_jacobians(structure: str) -> None:
    model = mlp(2)
    x = torch.randn(3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(5))
    outs, jacs = jacobians(model, [xi[None] for xi in x])
    la = Laplace(model, "regression", "all", structure).fit(regression_data())
    js, f = la.backend.jacobians(x)
    torch.testing.assert_close(js, torch.stack(jacs), atol=TOL, rtol=0)
    torch.testing.assert_close(f, torch.stack(outs), atol=TOL, rtol=0)
    xg = x.clone().requires_grad_(True)
    assert la.backend.jacobians(xg, enable_backprop=True)[0].requires_grad
    assert not la.enable_backprop  # the posterior's own setting is kept
    with pytest.raises(ValueError, match="not over the last layer"):
        la.backend.last_layer_jacobians(x)
    last = Laplace(model, "regression", "last_layer", structure)
    js, _ = last.backend.last_layer_jacobians(x)
    torch.testing.assert_close(js, torch.stack(jacs)[..., -14:], atol=TOL, rtol=0)  # 6*2 + 2


@pytest.mark.parametrize("structure", STRUCTURES)
def test_log_prob_is_the_gaussians(structure: str) -> None:
    model = mlp(2)
    la = Laplace(model, "regression", "all", structure, prior_precision=0.7)
    theta = torch.randn(la.n_params, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    zero = torch.zeros(la.n_params, dtype=DTYPE)
    torch.testing.assert_close(la.mean, zero, atol=0, rtol=0)  # unfitted: the prior's mean
    prior = torch.distributions.Normal(zero, math.sqrt(1 / 0.7))
    torch.testing.assert_close(la.log_prob(theta), prior.log_prob(theta).sum())
    la.fit(regression_data())
    map_ = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(la.mean, map_, atol=0, rtol=0)  # fitted: the MAP
    post = torch.distributions.MultivariateNormal(la.mean, covariance_matrix=covariance(la))
    torch.testing.assert_close(la.log_prob(theta), post.log_prob(theta))
    d = theta - la.mean
    torch.testing.assert_close(
        la.log_prob(theta, normalized=False), -0.5 * d @ torch.linalg.solve(covariance(la), d)
    )
    with pytest.raises(ValueError, match=r"value must be \(P="):
        la.log_prob(theta[:3])


@pytest.mark.parametrize("structure", STRUCTURES)
def test_functional_variance_fast_is_the_marginal_glm_variance(structure: str) -> None:
    la = fitted(structure)
    x = torch.randn(3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(7))
    outs, jacs = jacobians(la.model, [xi[None] for xi in x])
    mean, var = la.functional_variance_fast(x)
    sigma = covariance(la)
    torch.testing.assert_close(mean, torch.stack(outs), atol=TOL, rtol=0)
    ref = torch.stack([torch.diagonal(j @ sigma @ j.T) for j in jacs])
    torch.testing.assert_close(var, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_tune_reaches_the_fit(structure: str) -> None:
    """``tune=True`` measures (the engine's routes, the Fisher's choice), ``False`` never; the
    curvature is the same."""
    from multiscale_jac._planning import COUNTS

    model = mlp(3)
    data = [(torch.randn(6, 4, dtype=DTYPE), torch.tensor([0, 1, 2, 0, 1, 2]))]
    hs = []
    for tune in (True, False):
        mj.clear_plan_cache()
        before = COUNTS["probe"]
        la = Laplace(model, "classification", "all", structure, tune=tune).fit(data)
        assert (COUNTS["probe"] > before) is tune
        hs.append(la.H)
    torch.testing.assert_close(hs[0], hs[1], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="unknown tune"):
        Laplace(model, "classification", "all", structure, tune="always")


@pytest.mark.parametrize("structure", STRUCTURES)
def test_h_is_zeros_before_the_fit_and_init_h_forgets_it(structure: str) -> None:
    """laplace-torch's ``H`` before ``fit``: zeros in the form's layout (the posterior is the
    prior); ``_init_H()`` forgets a fit."""
    model = mlp(2)
    la = Laplace(model, "regression", "all", structure, sigma_noise=0.7)
    p = la.n_params
    h = la.H
    if structure == "kron":
        dense = h.to_matrix()
        assert [len(b.factors) for b in h.blocks] == [2, 1] * (len(h.blocks) // 2)
    else:
        dense = h
    assert dense.shape == ((p, p) if structure != "diag" else (p,))
    assert not dense.any() and la.n_data == 0
    la.fit(regression_data())
    fitted = la.H.to_matrix() if structure == "kron" else la.H
    assert fitted.any() and la.n_data == 7
    la._init_H()
    again = la.H.to_matrix() if structure == "kron" else la.H
    assert not again.any() and la.n_data == 0
    torch.testing.assert_close(la.mean, la.prior_mean)
    with pytest.raises(RuntimeError, match="not fitted"):
        la(torch.zeros(1, 4, dtype=DTYPE))


def test_subnetwork_indices_must_be_int64() -> None:
    model = mlp(2)
    with pytest.raises(ValueError, match=r"LongTensor \(int64\).*torch.int32.*\.long\(\)"):
        Laplace(
            model, "regression", "subnetwork", "full", subnetwork_indices=torch.IntTensor([0, 3])
        )
    la = Laplace(model, "regression", "subnetwork", "full", subnetwork_indices=torch.tensor([0, 3]))
    assert la.n_params == 2
