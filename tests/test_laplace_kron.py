"""KronLaplace (K-FAC posterior) against dense float64 computations built from the same factors
and the loop reference, on ragged multi-level inputs too; laplace-torch's front door
(``hessian_structure``, ``backend=``)."""

from __future__ import annotations

import math

import pytest
import torch
from cases import DTYPE, ragged_samples
from torch import nn

import multiscale_jac as mj
from multiscale_jac._kfac import kron_factors
from multiscale_jac.models import SharedHeadFPN
from multiscale_jac.reference import per_sample_jacobian_loop

TOL = 1e-10


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(DTYPE)


def _data(likelihood: str, n: int = 9) -> list:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g, dtype=DTYPE)
    if likelihood == "classification":
        y = torch.randint(2, (n,), generator=g)
    else:
        y = torch.randn(n, 2, generator=g, dtype=DTYPE)
    return [(x[:4], y[:4]), (x[4:], y[4:])]


def _dense_h(model: nn.Module, data: list, likelihood: str, kind: str = "ggn") -> torch.Tensor:
    """Block-diagonal ``G (x) A_w`` and ``G`` per tensor, from :func:`kron_factors`."""
    res = kron_factors(model, data, likelihood=likelihood, kind=kind)
    blocks = []
    for f in res.layers:
        blocks.append(torch.kron(f.G, f.weight_A))
        blocks.append(f.G)
    return torch.block_diag(*blocks)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("hessian", ["ggn", "empirical"])
def test_posterior_is_the_dense_kron_posterior(likelihood: str, hessian: str) -> None:
    model, data = _mlp(), _data(likelihood)
    sigma, prior, temperature = (1.0 if likelihood == "classification" else 0.4), 0.7, 1.3
    la = mj.KronLaplace(
        model,
        likelihood,
        sigma_noise=sigma,
        prior_precision=prior,
        temperature=temperature,
        hessian=hessian,
    ).fit(data)
    s = 4 if (hessian == "empirical" and likelihood == "regression") else 2
    h = _dense_h(model, data, likelihood, "ggn" if hessian == "ggn" else "empirical")
    p_post = h / (sigma**s * temperature) + prior * torch.eye(h.shape[0], dtype=DTYPE)
    torch.testing.assert_close(la.posterior_precision.to_matrix(), p_post, atol=TOL, rtol=0)
    torch.testing.assert_close(la.H.to_matrix(), h, atol=TOL, rtol=0)
    sigma_post = torch.linalg.inv(p_post)
    torch.testing.assert_close(la.posterior_covariance, sigma_post, atol=TOL, rtol=0)
    torch.testing.assert_close(la.posterior_variance, sigma_post.diagonal(), atol=TOL, rtol=0)
    logdet = torch.logdet(p_post)
    assert abs(float(la.posterior_precision.logdet() - logdet)) < TOL
    # the marginal likelihood from the same terms, dense
    theta = la.mean
    lml = -la.loss / (sigma**2 * temperature) - 0.5 * (
        float(logdet) - la.n_params * math.log(prior) + prior * float(theta @ theta)
    )
    if likelihood == "regression":
        lml -= la._posterior.n_entries * math.log(sigma * math.sqrt(2 * math.pi))
    assert abs(float(la.log_marginal_likelihood()) - lml) < 1e-9 * max(1.0, abs(lml))


def test_glm_predictive_variance_is_j_sigma_jt() -> None:
    model, data = _mlp(), _data("regression")
    la = mj.KronLaplace(model, "regression", sigma_noise=0.5, prior_precision=2.0).fit(data)
    x = data[0][0]
    f_mu, f_var = la(x)
    jac = per_sample_jacobian_loop(model, x).jacobian  # (N, 2, P), parameters in model order
    want = torch.einsum("nop,pq,nrq->nor", jac, la.posterior_covariance, jac)
    torch.testing.assert_close(f_var, want, atol=TOL, rtol=0)
    torch.testing.assert_close(f_mu, model(x), atol=TOL, rtol=0)


def test_precision_operations_agree_with_the_dense_matrix() -> None:
    model, data = _mlp(), _data("classification")
    la = mj.KronLaplace(model, "classification", prior_precision=[0.5, 1.0, 2.0, 3.0]).fit(data)
    prec = la.posterior_precision
    dense = prec.to_matrix()
    g = torch.Generator().manual_seed(3)
    v = torch.randn(dense.shape[0], 4, generator=g, dtype=DTYPE)
    torch.testing.assert_close(prec.matmul(v), dense @ v, atol=TOL, rtol=0)
    inv_sqrt = prec.to_matrix(-0.5)
    torch.testing.assert_close(prec.matmul(v, -0.5), inv_sqrt @ v, atol=TOL, rtol=0)
    torch.testing.assert_close(inv_sqrt @ inv_sqrt, torch.linalg.inv(dense), atol=TOL, rtol=0)
    js = torch.randn(3, 2, dense.shape[0], generator=g, dtype=DTYPE)
    want = torch.einsum("bkp,pq,bcq->bkc", js, torch.linalg.inv(dense), js)
    torch.testing.assert_close(prec.inv_square_form(js), want, atol=TOL, rtol=0)
    torch.testing.assert_close(prec.diag(), dense.diagonal(), atol=TOL, rtol=0)


def test_ragged_pyramids_equal_the_samples_one_at_a_time() -> None:
    """K-FAC Laplace of a conv head shared over FPN-like levels: the ragged batch's posterior
    equals the one accumulated sample by sample (each unpadded)."""
    torch.manual_seed(0)
    model = SharedHeadFPN((3, 4), width=4, num_outputs=2).to(DTYPE).eval()
    sizes = [[(5, 6), (3, 3)], [(4, 4), (2, 2)], [(6, 3), (3, 2)], [(4, 4), (2, 2)]]
    samples = ragged_samples(sizes, [3, 4], seed=2)
    with torch.no_grad():
        targets = [torch.randn_like(model([t[None] for t in s])[0]) for s in samples]
    subset = mj.ParamSubset.from_names(model, ["lateral.*", "head.0.*", "head.6.*"])
    whole = mj.KronLaplace(model, "regression", subset, prior_precision=0.3)
    whole.fit([(samples, targets)])
    one = mj.KronLaplace(model, "regression", subset, prior_precision=0.3)
    for k, (s, y) in enumerate(zip(samples, targets)):
        one.fit([([s], [y])], override=k == 0)
    torch.testing.assert_close(whole.H.to_matrix(), one.H.to_matrix(), atol=TOL, rtol=0)
    assert abs(float(whole.log_marginal_likelihood() - one.log_marginal_likelihood())) < 1e-9
    assert (
        whole.n_data == one.n_data == 4 and whole._posterior.n_entries == one._posterior.n_entries
    )


def test_bias_block_of_a_head_called_per_level_is_g() -> None:
    """A head called once per pyramid level (two calls): the bias block is ``G`` (curvlinops'
    separate bias, laplace-torch's), with or without a backend named; for the output conv,
    whose calls give separate outputs, that is the exact GGN of its bias (the dense float64
    subset GGN, ``SubnetLaplace``), where ``c G`` (the bias row of the augmented ``A``)
    would be twice it."""
    torch.manual_seed(0)
    model = SharedHeadFPN((3, 4), width=4, num_outputs=2).to(DTYPE).eval()
    samples = ragged_samples([[(5, 6), (3, 3)], [(4, 4), (2, 2)]], [3, 4], seed=2)
    with torch.no_grad():
        targets = [torch.randn_like(model([t[None] for t in s])[0]) for s in samples]
    data = [(samples, targets)]
    subset = mj.ParamSubset.from_names(model, ["head.6.*"])
    f = kron_factors(model, data, params=subset, likelihood="regression")["head.6.bias"]
    assert float(f.A[-1, -1]) == pytest.approx(2.0)  # the head runs on both levels
    own = mj.KronLaplace(model, "regression", subset).fit(data)
    named = mj.KronLaplace(model, "regression", subset, backend="CurvlinopsGGN").fit(data)
    torch.testing.assert_close(own.H.blocks[1].factors[0], f.G, atol=TOL, rtol=0)
    torch.testing.assert_close(own.H.to_matrix(), named.H.to_matrix(), atol=0, rtol=0)
    exact = mj.SubnetLaplace(model, "regression", "head.6.bias").fit(data).H
    torch.testing.assert_close(f.G, exact, atol=TOL, rtol=0)


def test_online_fit_adds_as_laplace_torch() -> None:
    model, data = _mlp(), _data("regression")
    la = mj.KronLaplace(model, "regression", sigma_noise=0.3).fit(data)
    h, loss, n = la.H.to_matrix(), la.loss, la.n_data
    la.fit(data, override=False)
    la.fit(data, override=False)
    torch.testing.assert_close(la.H.to_matrix(), 3 * h, atol=TOL, rtol=0)
    assert la.n_data == 3 * n and abs(la.loss - 3 * loss) < 1e-10


def test_prior_precision_per_tensor_or_refused() -> None:
    model = _mlp()
    mj.KronLaplace(model, "classification", prior_precision=torch.ones(4))
    with pytest.raises(ValueError, match="one per selected tensor"):
        mj.KronLaplace(model, "classification", prior_precision=torch.ones(32))
    la = mj.KronLaplace(model, "classification")
    with pytest.raises(ValueError, match="one per selected tensor"):
        la.prior_precision = torch.ones(32)
    with pytest.raises(ValueError, match="whole tensors"):
        mj.KronLaplace(model, "classification", mj.ParamSubset.from_flat_indices(model, [0, 5]))
    norm = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).to(DTYPE)
    with pytest.raises(ValueError, match=r"1\.weight"):
        mj.KronLaplace(norm, "classification").fit(_data("classification"))


# ---------------------------------------------------------------------- the front door
def test_front_door_defaults_to_kron_over_the_last_layer() -> None:
    model = _mlp()
    la = mj.Laplace(model, "classification")
    assert isinstance(la, mj.KronLaplace)
    assert la.subset.names == ("2.weight", "2.bias")
    assert isinstance(mj.Laplace(model, "classification", "all", "full"), mj.SubnetLaplace)
    assert isinstance(mj.Laplace(model, "classification", "all", "diag"), mj.DiagLaplace)
    with pytest.raises(ValueError, match="'kron'"):
        mj.Laplace(model, "classification", "subnetwork", subnetwork_indices=torch.tensor([0]))


class BackPackGGN:  # stand-ins for laplace-torch's classes (matched by name)
    pass


class CurvlinopsEF:
    pass


@pytest.mark.parametrize(
    ("backend", "hessian"),
    [
        (BackPackGGN, "ggn"),
        ("CurvlinopsGGN", "ggn"),
        ("AsdlGGN", "ggn"),
        (CurvlinopsEF, "empirical"),
        ("BackPackEF", "empirical"),
        ("AsdlEF", "empirical"),
    ],
)
@pytest.mark.parametrize("structure", ["kron", "full", "diag"])
def test_backend_maps_to_the_hessian(backend, hessian: str, structure: str) -> None:
    la = mj.Laplace(_mlp(), "regression", "all", structure, backend=backend, backend_kwargs={})
    assert la.hessian.value == hessian


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "CurvlinopsHessian"}, "exact Hessian"),
        ({"backend": "NoSuchGGN"}, "unknown backend 'NoSuchGGN'"),
        ({"backend": "BackPackGGN", "backend_kwargs": {"stochastic": True}}, "stochastic"),
        ({"backend_kwargs": {"stochastic": False}}, "without a backend"),
        ({"asdl_fisher_kwargs": {"n_mc_samples": 2}}, "asdl_fisher_kwargs"),
        ({"backend": "CurvlinopsEF", "hessian": "ggn"}, "hessian='empirical'"),
    ],
)
def test_backend_options_without_a_meaning_here_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mj.Laplace(_mlp(), "classification", **kwargs)
