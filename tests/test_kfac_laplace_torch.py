"""K-FAC factors against laplace-torch 0.3's ``KronLaplace`` (``H_facs.kfacs`` after ``fit``).

Optional: skipped without laplace-torch. Self-contained (no conftest, no Hypothesis), so that
it runs in an environment that has laplace-torch but not the test extra::

    PYTHONPATH=$PWD /path/to/venv/bin/python -m pytest --noconftest tests/test_kfac_laplace_torch.py

What the backends do (measured here, float64, three uneven batches 4 + 4 + 2):

* CurvlinopsGGN (laplace-torch's default) and CurvlinopsEF: every factor equal to
  :meth:`KronResult.laplace_torch_kfacs` (relative ``< 1e-12``; ``~1e-16`` measured), Linear
  and Conv2d, classification and regression, a conv shared by two resolutions, grouped convs.
* AsdlGGN / AsdlEF: the same numbers, except AsdlGGN for regression, whose weights' Kronecker
  products are the same but whose factors split the scale differently (``G`` relative 0.41).
* BackPackGGN: the same for Linear layers on ``(n, in)``; for convolutions it sums the output
  gradient over positions before the outer product and does not average ``A`` over positions
  (products relative 0.6-0.97 apart on the CNN here). BackPackEF has no Kronecker factors.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

laplace = pytest.importorskip("laplace")
curvature = pytest.importorskip("laplace.curvature")

from multiscale_jac._kfac import kron_factors  # noqa: E402

DTYPE = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Shared(nn.Module):
    """A conv applied to the map and to its subsampled copy (called twice per forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2)
        self.c2 = nn.Conv2d(4, 3, 3, dilation=2, padding=2)
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.c1(x))
        return self.fc(self.c2(h).mean((2, 3)) + self.c2(h[:, :, ::2, ::2]).mean((2, 3)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(64, 3),
    )


class _Pairs(nn.Module):
    """laplace-torch's reward-modelling example: every item of a sample through one net, the
    items folded into the batch, ``(B, 3, d) -> (3B, d)``, a score each."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))

    def forward(self, x: Tensor) -> Tensor:
        b, k, d = x.shape
        return self.net(x.reshape(-1, d)).reshape(b, k)


class _Minor(_Pairs):
    """The same fold taken sample-minor: ``x.transpose(0, 1).reshape(-1, d)``."""

    def forward(self, x: Tensor) -> Tensor:
        b, k, d = x.shape
        return self.net(x.transpose(0, 1).reshape(-1, d)).reshape(k, b).t()


class _Frames(nn.Module):
    """Video frames through a conv, folded into the batch: ``(B, T, C, H, W) -> (B T, ...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        b, t = x.shape[:2]
        h = torch.tanh(self.conv(x.flatten(0, 1))).mean((2, 3))
        return self.fc(h.reshape(b, t, -1).mean(1))


MODELS = {
    "mlp": (_mlp, (5,)),
    "cnn": (_cnn, (2, 8, 8)),
    "shared": (_Shared, (2, 8, 8)),
    # folding the batch (issue 38): each sample's rows count as calls of their own, as
    # curvlinops counts them
    "pairs": (_Pairs, (3, 5)),
    "minor": (_Minor, (3, 5)),
    "frames": (_Frames, (3, 2, 6, 6)),
}


def _setup(name: str, likelihood: str) -> tuple[nn.Module, DataLoader]:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build().to(DTYPE).eval()
    x = torch.randn(10, *shape, generator=_gen(1), dtype=DTYPE)
    if likelihood == "classification":
        y = torch.randint(0, 3, (10,), generator=_gen(2))
    else:
        y = torch.randn(10, 3, generator=_gen(2), dtype=DTYPE)
    return model, DataLoader(TensorDataset(x, y), batch_size=4)


def _fit(model: nn.Module, loader: DataLoader, likelihood: str, backend: type, **kw) -> object:
    la = laplace.KronLaplace(model, likelihood, backend=backend, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader)
    return la


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _product(block: list[Tensor]) -> Tensor:
    return block[0] if len(block) == 1 else torch.kron(block[0], block[1])


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize(
    ("kind", "backend"), [("ggn", "CurvlinopsGGN"), ("empirical", "CurvlinopsEF")]
)
def test_curvlinops_backends(name: str, likelihood: str, kind: str, backend: str) -> None:
    model, loader = _setup(name, likelihood)
    ours = kron_factors(model, loader, likelihood=likelihood, kind=kind)
    la = _fit(model, loader, likelihood, getattr(curvature, backend))
    theirs = la.H_facs.kfacs
    mine = ours.laplace_torch_kfacs()
    assert [len(b) for b in mine] == [len(b) for b in theirs]
    for a, b in zip(mine, theirs):
        for fa, fb in zip(a, b):
            assert fa.shape == fb.shape and _rel(fa, fb) < 1e-12
    assert abs(float(la.loss) - float(ours.loss)) < 1e-10 * max(1.0, float(ours.loss))


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_backpack_ggn_agrees_for_linear_and_not_for_conv(likelihood: str) -> None:
    model, loader = _setup("mlp", likelihood)
    mine = kron_factors(model, loader, likelihood=likelihood).laplace_torch_kfacs()
    theirs = _fit(model, loader, likelihood, curvature.BackPackGGN).H_facs.kfacs
    assert max(_rel(fa, fb) for a, b in zip(mine, theirs) for fa, fb in zip(a, b)) < 1e-12
    model, loader = _setup("cnn", likelihood)
    mine = kron_factors(model, loader, likelihood=likelihood).laplace_torch_kfacs()
    theirs = _fit(model, loader, likelihood, curvature.BackPackGGN).H_facs.kfacs
    gaps = [_rel(_product(a), _product(b)) for a, b in zip(mine, theirs)]
    assert min(gaps[:4]) > 0.3  # both convs' weights and biases: a different approximation
    assert max(gaps[4:]) < 1e-12  # the Linear layer on (n, in)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_asdl_ggn(likelihood: str) -> None:
    model, loader = _setup("cnn", likelihood)
    mine = kron_factors(model, loader, likelihood=likelihood).laplace_torch_kfacs()
    theirs = _fit(model, loader, likelihood, curvature.AsdlGGN).H_facs.kfacs
    assert max(_rel(_product(a), _product(b)) for a, b in zip(mine, theirs)) < 1e-12
    factors = max(_rel(fa, fb) for a, b in zip(mine, theirs) for fa, fb in zip(a, b))
    if likelihood == "classification":
        assert factors < 1e-12
    else:  # ASDL splits the regression scale between G and A its own way
        assert abs(factors - (math.sqrt(2) - 1)) < 1e-9


@pytest.mark.slow
def test_mc_matches_in_expectation() -> None:
    """curvlinops draws its own labels: both MC estimates near the GGN."""
    model, loader = _setup("mlp", "classification")
    ggn = kron_factors(model, loader).laplace_torch_kfacs()
    ours = kron_factors(model, loader, kind="mc", mc_samples=2000, generator=_gen(3))
    la = _fit(
        model,
        loader,
        "classification",
        curvature.CurvlinopsGGN,
        backend_kwargs={"stochastic": True},
        asdl_fisher_kwargs={"mc_samples": 2000},
    )
    for mc in (ours.laplace_torch_kfacs(), la.H_facs.kfacs):
        for a, b in zip(mc, ggn):
            assert _rel(_product(a), _product(b)) < 0.1


def test_what_laplace_torch_refuses() -> None:
    """Norm layers: curvlinops raises, we raise naming the parameter (and take the rest with
    params=); Conv3d: laplace-torch's Kron refuses 5-d weights, we compute it."""
    x = torch.randn(4, 5, dtype=DTYPE)
    y = torch.tensor([0, 1, 2, 0])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3)).to(DTYPE)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    with pytest.raises(NotImplementedError, match="un-supported layers"):
        _fit(model, loader, "classification", curvature.CurvlinopsGGN)
    with pytest.raises(ValueError, match=r"'1.weight' belongs to module '1' \(LayerNorm\)"):
        kron_factors(model, loader)
    assert len(kron_factors(model, loader, params=["0.*", "2.*"]).layers) == 2
    conv3d = nn.Sequential(nn.Conv3d(1, 2, 2), nn.Flatten(), nn.Linear(2, 3)).to(DTYPE)
    loader = DataLoader(TensorDataset(torch.randn(4, 1, 2, 2, 2, dtype=DTYPE), y), batch_size=2)
    with pytest.raises(ValueError, match="Invalid parameter shape"):
        _fit(conv3d, loader, "classification", curvature.CurvlinopsGGN)
    assert kron_factors(conv3d, loader)["0.weight"].A.shape == (9, 9)


@pytest.mark.parametrize("name", ["mlp", "cnn", "shared", "pairs", "frames"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_kron_laplace_posterior_matches(name: str, likelihood: str) -> None:
    """``multiscale_jac.KronLaplace`` against laplace-torch's ``KronLaplace`` (CurvlinopsGGN):
    the posterior precision, its log-determinant, the marginal likelihood and the GLM
    predictive's variance (GGN: the two place the regression scales differently in the factors,
    the products agree)."""
    import multiscale_jac as mj

    model, loader = _setup(name, likelihood)
    sigma = 1.0 if likelihood == "classification" else 0.6
    theirs = laplace.KronLaplace(
        model, likelihood, sigma_noise=sigma, prior_precision=0.7, backend=curvature.CurvlinopsGGN
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.fit(loader)
    ours = mj.KronLaplace(model, likelihood, sigma_noise=sigma, prior_precision=0.7)
    ours.fit(loader)
    p_ours, p_theirs = ours.posterior_precision.to_matrix(), theirs.posterior_precision.to_matrix()
    assert _rel(p_ours, p_theirs) < 1e-10
    assert abs(float(ours.posterior_precision.logdet() - theirs.log_det_posterior_precision)) < 1e-8
    lml_ours, lml_theirs = ours.log_marginal_likelihood(), theirs.log_marginal_likelihood()
    assert abs(float(lml_ours - lml_theirs)) < 1e-8 * max(1.0, abs(float(lml_theirs)))
    x = loader.dataset.tensors[0][:3]
    if likelihood == "regression":
        (m_ours, v_ours), (m_theirs, v_theirs) = ours(x), theirs(x, pred_type="glm")
        assert _rel(v_ours, v_theirs) < 1e-8 and _rel(m_ours, m_theirs) < 1e-12
    else:
        p1 = ours(x, link_approx="probit")
        p2 = theirs(x, pred_type="glm", link_approx="probit")
        assert _rel(p1, p2) < 1e-8


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_regression_ef_backend_posterior_matches(structure: str) -> None:
    """``backend=CurvlinopsEF`` on a regression: the posterior precision and the marginal
    likelihood are laplace-torch's (its convention: twice the textbook EF, over sigma^2)."""
    from multiscale_jac.laplace import Laplace

    model, loader = _setup("mlp", "regression")
    kw = dict(sigma_noise=0.6, prior_precision=0.7, backend=curvature.CurvlinopsEF)
    theirs = laplace.Laplace(model, "regression", "all", structure, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.fit(loader)
    ours = Laplace(model, "regression", "all", structure, **kw).fit(loader)
    p_ours, p_theirs = ours.posterior_precision, theirs.posterior_precision
    if structure == "kron":
        p_ours, p_theirs = p_ours.to_matrix(), p_theirs.to_matrix()
    # full: 1.8e-8 apart, diag and kron < 1e-10 (measured): laplace-torch's full EF sums
    assert _rel(p_ours, p_theirs) < 1e-7
    lml_ours, lml_theirs = ours.log_marginal_likelihood(), theirs.log_marginal_likelihood()
    assert abs(float(lml_ours - lml_theirs)) < 1e-7 * max(1.0, abs(float(lml_theirs)))
