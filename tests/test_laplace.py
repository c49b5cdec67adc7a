"""SubnetLaplace against dense computations from the loop oracle (float64, 1e-10)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from cases import DTYPE
from conftest import CASE_BY_ID, smallest_budget, zoo_model, zoo_reference
from test_fisher import CASES, as_model_input, batches, make_targets, samples_of

import multiscale_jac as mj

TOL = 1e-10


def setup(case_id: str, likelihood: str, subset_kind: str = "elements"):
    """Model, subset, batched data, per-sample outputs/targets and the oracle's Jacobians."""
    case = CASE_BY_ID[case_id]
    model = zoo_model(case_id)
    samples, kind_in = samples_of(case_id)
    outs = [model(as_model_input(x, kind_in)).detach() for x in samples]
    targets = make_targets(outs, likelihood)
    subset, ref = zoo_reference(case_id, subset_kind)
    jacs = [ref.jacobian[i, : ref.output_sizes[i]] for i in range(len(samples))]
    data = batches(samples, targets, kind_in, 2)
    return model, subset, data, outs, targets, jacs, case.inputs()


def few_rows(model, likelihood: str, subset: mj.ParamSubset, data) -> int:
    """A memory budget with room for a few Jacobian rows: the smallest budget the fit accepts
    (the rows of one output position) plus 3 rows (the library counts about 6 copies of
    each, its own and the engine's)."""

    def fit(batch, budget: int) -> None:
        mj.SubnetLaplace(model, likelihood, subset, memory_budget=budget).fit([batch])

    smallest = max(smallest_budget(lambda b, batch=batch: fit(batch, b)) for batch in data)
    return smallest + 3 * (6 * subset.numel + 3) * 8


def dense_curvature(outs, targets, jacs, likelihood: str, hessian: str = "ggn") -> torch.Tensor:
    """``sum_i J_i^T Lambda_i J_i`` (or ``sum_i g_i g_i^T``), position by position."""
    p = jacs[0].shape[-1]
    h = torch.zeros(p, p, dtype=DTYPE)
    for out, y, j in zip(outs, targets, jacs):
        if likelihood == "regression":
            r = out[0].reshape(-1) - y.reshape(-1)
            if hessian == "ggn":
                h += j.T @ j
            else:
                g = j.T @ r
                h += torch.outer(g, g)
            continue
        c = out.shape[1]
        logits = out[0].reshape(c, -1)
        jc = j.view(c, -1, p)
        yv = y.reshape(-1)
        g = torch.zeros(p, dtype=DTYPE)
        for pos in range(logits.shape[1]):
            if yv[pos] == -100:
                continue
            prob = torch.softmax(logits[:, pos], 0)
            if hessian == "ggn":
                lam = torch.diag(prob) - torch.outer(prob, prob)
                h += jc[:, pos].T @ lam @ jc[:, pos]
            else:
                g += jc[:, pos].T @ (prob - torch.nn.functional.one_hot(yv[pos], c).to(DTYPE))
        if hessian != "ggn":
            h += torch.outer(g, g)
    return h


def dense_loss(outs, targets, likelihood: str) -> float:
    total = 0.0
    for out, y in zip(outs, targets):
        if likelihood == "regression":
            total += 0.5 * float(((out[0].reshape(-1) - y.reshape(-1)) ** 2).sum())
            continue
        c = out.shape[1]
        logits, yv = out[0].reshape(c, -1).T, y.reshape(-1)
        keep = yv != -100
        total += float(torch.nn.functional.cross_entropy(logits[keep], yv[keep], reduction="sum"))
    return total


# ---------------------------------------------------------------------- curvature
@pytest.mark.parametrize(
    "case_id, likelihood, hessian",
    [
        # the fast tier: one curvature per case, alternating; the slow tier the other
        pytest.param(c, lk, h, marks=[pytest.mark.slow] * ((p + k) % 2))
        for p, (c, lk) in enumerate(CASES)
        for k, h in enumerate(["ggn", "empirical"])
    ],
)
def test_subset_curvature_matches_dense(case_id: str, likelihood: str, hessian: str) -> None:
    model, subset, data, outs, targets, jacs, _ = setup(case_id, likelihood)
    la = mj.SubnetLaplace(model, likelihood, subset, hessian=hessian)
    la.fit(data, progress=False)
    ref = dense_curvature(outs, targets, jacs, likelihood, hessian)
    torch.testing.assert_close(la.H, ref, atol=TOL, rtol=0)
    assert la.n_data == len(outs)
    assert float(la.loss) == pytest.approx(dense_loss(outs, targets, likelihood), abs=1e-9)
    # a budget of 4 rows: one sample at a time, its outputs in slices of a few positions
    tiny = mj.SubnetLaplace(
        model,
        likelihood,
        subset,
        hessian=hessian,
        memory_budget=few_rows(model, likelihood, subset, data),
    )
    tiny.fit(data, progress=False)
    torch.testing.assert_close(tiny.H, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_the_fit_runs_the_mode_given(mode: str, monkeypatch) -> None:
    """``mode=`` reaches the engine the fit runs (its Jacobian rows by that mode), and the
    curvature is the same either way."""
    from multiscale_jac.laplace import _jacobian_rows as _curvature

    modes: list[str] = []
    run = _curvature.run_engine

    def spy(*args, **kwargs):
        res = run(*args, **kwargs)
        modes.append(res.mode.value)
        return res

    monkeypatch.setattr(_curvature, "run_engine", spy)
    model, subset, data, outs, targets, jacs, _ = setup("dense_per_pixel", "classification")
    la = mj.SubnetLaplace(model, "classification", subset, mode=mode).fit(data, progress=False)
    assert modes and set(modes) == {mode}, modes
    ref = dense_curvature(outs, targets, jacs, "classification", "ggn")
    torch.testing.assert_close(la.H, ref, atol=TOL, rtol=0)


def test_fit_streams_and_accumulates() -> None:
    model, subset, data, *_ = setup("dense_per_pixel", "classification")
    whole = mj.SubnetLaplace(model, "classification", subset).fit(data, progress=False)
    parts = mj.SubnetLaplace(model, "classification", subset).fit(data[:1], progress=False)
    parts.fit(data[1:], progress=False, override=False)
    torch.testing.assert_close(parts.H, whole.H, atol=TOL, rtol=0)
    assert parts.n_data == whole.n_data
    again = mj.SubnetLaplace(model, "classification", subset).fit(data, progress=False)
    again.fit(data, progress=False)  # override=True starts over
    torch.testing.assert_close(again.H, whole.H, atol=0, rtol=0)


def test_model_is_unchanged() -> None:
    model, subset, data, *_ = setup("bn_cnn_multicrop", "classification")
    before = copy.deepcopy(model.state_dict())
    la = mj.SubnetLaplace(model, "classification", subset).fit(data, progress=False)
    la.predictive(data[0][0])
    la.functional_samples(data[0][0], 2, linearized=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------- curvlinops
def test_subset_ggn_equals_curvlinops_submatrix() -> None:
    curvlinops = pytest.importorskip("curvlinops")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(
        DTYPE
    )
    x = torch.randn(7, 4, dtype=DTYPE)
    y = torch.randint(3, (7,))
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    idx = torch.randperm(total, generator=torch.Generator().manual_seed(1))[:9]
    subset = mj.ParamSubset.from_flat_indices(model, idx)
    data = [(x[:4], y[:4]), (x[4:], y[4:])]
    la = mj.SubnetLaplace(model, "classification", subset).fit(data, progress=False)
    op = curvlinops.GGNLinearOperator(
        model, torch.nn.CrossEntropyLoss(reduction="sum"), params, data, check_deterministic=False
    )
    eye = torch.eye(total, dtype=DTYPE)
    dense = op @ eye
    sel = subset.flat_indices()
    torch.testing.assert_close(la.H, dense[sel][:, sel].to(DTYPE), atol=1e-10, rtol=0)


# ---------------------------------------------------------------------- marginal likelihood
@pytest.mark.parametrize("case_id, likelihood", [CASES[0], CASES[2], CASES[4]])
def test_log_marginal_likelihood_matches_dense_formula(case_id: str, likelihood: str) -> None:
    model, subset, data, outs, targets, jacs, _ = setup(case_id, likelihood)
    sigma = 0.7 if likelihood == "regression" else 1.0
    prior = torch.linspace(0.5, 2.0, len(subset.names), dtype=DTYPE)
    la = mj.SubnetLaplace(
        model,
        likelihood,
        subset,
        sigma_noise=sigma,
        prior_precision=prior.tolist(),
        prior_mean=0.1,
    ).fit(data, progress=False)
    h = dense_curvature(outs, targets, jacs, likelihood)
    sizes = [b - a for a, b in subset.offsets.values()]
    p0 = torch.repeat_interleave(prior, torch.tensor(sizes))
    post = h / sigma**2 + torch.diag(p0)
    theta = torch.cat([v.reshape(-1) for v in subset.values(model).values()])
    # log p(D | theta) + log N(theta; mu0, P0^-1) + P/2 log 2 pi - 1/2 log det P_post
    if likelihood == "regression":
        n_out = sum(o.numel() for o in outs)
        sse = 2 * dense_loss(outs, targets, likelihood)
        loglik = -n_out * math.log(sigma * math.sqrt(2 * math.pi)) - sse / (2 * sigma**2)
    else:
        loglik = -dense_loss(outs, targets, likelihood)
    p = subset.numel
    d = theta - 0.1
    logprior = (
        -p / 2 * math.log(2 * math.pi) + 0.5 * float(p0.log().sum()) - 0.5 * float(d @ (p0 * d))
    )
    expected = (
        loglik
        + logprior
        + p / 2 * math.log(2 * math.pi)
        - 0.5 * float(torch.linalg.slogdet(post)[1])
    )
    assert float(la.log_marginal_likelihood()) == pytest.approx(expected, abs=1e-9)
    # an argument is stored, as laplace-torch stores it, and evaluated at
    other = la.log_marginal_likelihood(prior_precision=3.0)
    post3 = h / sigma**2 + 3.0 * torch.eye(p, dtype=DTYPE)
    exp3 = (
        loglik
        + 0.5 * p * math.log(3.0)
        - 1.5 * float(d @ d)
        - 0.5 * float(torch.linalg.slogdet(post3)[1])
    )
    assert float(other) == pytest.approx(exp3, abs=1e-9)
    assert float(la.log_marginal_likelihood()) == pytest.approx(exp3, abs=1e-9)
    assert la.prior_precision.tolist() == [3.0]
    la.prior_precision = prior.tolist()
    assert float(la.log_marginal_likelihood()) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("structure", ["scalar", "tensor", "layerwise", "diag"])
def test_optimize_prior_precision_increases_marglik(structure: str) -> None:
    model, subset, data, *_ = setup("fpn_ragged", "regression")
    la = mj.SubnetLaplace(model, "regression", subset, prior_precision=1.0).fit(
        data, progress=False
    )
    before = float(la.log_marginal_likelihood())
    assert la.optimize_prior_precision(prior_structure=structure, n_steps=60) is None
    best = la.prior_precision  # laplace-torch's shapes: (1,), one per tensor, (P,)
    sizes = {"scalar": 1, "tensor": len(subset.names), "layerwise": len(subset.names)}
    assert best.shape == (sizes.get(structure, subset.numel),)
    after = float(la.log_marginal_likelihood())
    assert after > before
    # a local optimum: nudging the precision does not improve it
    for f in (0.8, 1.25):
        assert float(la.log_marginal_likelihood(prior_precision=best * f)) <= after + 1e-9


def test_sigma_noise_enters_like_a_gaussian() -> None:
    model, subset, data, _outs, _targets, _jacs, _ = setup("mlp_vectors", "regression")
    la = mj.SubnetLaplace(model, "regression", subset).fit(data, progress=False)
    sig = torch.tensor(0.5, dtype=DTYPE, requires_grad=True)
    lml = la.log_marginal_likelihood(sigma_noise=sig)
    lml.backward()
    eps = 1e-6
    fd = (
        float(la.log_marginal_likelihood(sigma_noise=0.5 + eps))
        - float(la.log_marginal_likelihood(sigma_noise=0.5 - eps))
    ) / (2 * eps)
    assert float(sig.grad) == pytest.approx(fd, rel=1e-5)


# ---------------------------------------------------------------------- predictive
@pytest.mark.parametrize("case_id, likelihood", CASES)
def test_glm_variance_matches_dense(case_id: str, likelihood: str) -> None:
    model, subset, data, outs, _targets, jacs, inputs = setup(case_id, likelihood)
    la = mj.SubnetLaplace(model, likelihood, subset, prior_precision=0.5).fit(data, progress=False)
    sigma = torch.linalg.inv(la.posterior_precision)
    pred = la.predictive(inputs)
    tiny = copy.copy(la)
    tiny.memory_budget = few_rows(model, likelihood, subset, data)  # slices of a few positions
    pred_tiny = tiny.predictive(inputs)
    for i, (out, j) in enumerate(zip(outs, jacs)):
        cov = j @ sigma @ j.T
        torch.testing.assert_close(pred.variance[i].reshape(-1), cov.diagonal(), atol=TOL, rtol=0)
        torch.testing.assert_close(pred_tiny.variance[i], pred.variance[i], atol=TOL, rtol=0)
        torch.testing.assert_close(pred.mean[i], out[0], atol=TOL, rtol=0)
        if pred.covariance is not None:
            torch.testing.assert_close(pred.covariance[i], cov, atol=TOL, rtol=0)
        if likelihood == "classification":
            c = out.shape[1]
            kappa = 1 / torch.sqrt(1 + math.pi / 8 * cov.diagonal().view(c, -1))
            probit = torch.softmax(kappa * out[0].reshape(c, -1), dim=0)
            torch.testing.assert_close(pred.probs[i].reshape(c, -1), probit, atol=TOL, rtol=0)
            torch.testing.assert_close(pred_tiny.probs[i], pred.probs[i], atol=TOL, rtol=0)
    assert (pred.covariance is not None) == all(o.dim() == 2 for o in outs)  # vector outputs


def test_mc_and_bridge_agree_with_a_dense_monte_carlo() -> None:
    model, subset, data, outs, _targets, jacs, inputs = setup("dense_per_pixel", "classification")
    la = mj.SubnetLaplace(model, "classification", subset, prior_precision=2.0).fit(
        data, progress=False
    )
    sigma = torch.linalg.inv(la.posterior_precision)
    mc = la.predictive(
        inputs, link_approx="mc", n_samples=20000, generator=torch.Generator().manual_seed(0)
    )
    probit = la.predictive(inputs, link_approx="probit")
    bridge = la.predictive(inputs, link_approx="bridge")
    g = torch.Generator().manual_seed(1)
    chol = torch.linalg.cholesky(sigma)
    for i, (out, j) in enumerate(zip(outs, jacs)):
        c = out.shape[1]
        z = torch.randn(40000, subset.numel, generator=g, dtype=DTYPE)
        f = out[0].reshape(-1) + (z @ chol.T) @ j.T  # (S, O) joint samples
        ref = torch.softmax(f.view(-1, c, f.shape[1] // c), dim=1).mean(0)
        # Monte Carlo error of a probability with 20000 draws is below 0.004 (3 sigma)
        assert float((mc.probs[i].reshape(c, -1) - ref).abs().max()) < 0.01
        assert float((probit.probs[i].reshape(c, -1) - ref).abs().max()) < 0.05
        for pred in (mc, probit, bridge):
            torch.testing.assert_close(
                pred.probs[i].sum(0), torch.ones_like(pred.probs[i].sum(0)), atol=1e-9, rtol=0
            )


def test_samples_and_functional_samples() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model = model.to(DTYPE)
    x, y = torch.randn(9, 3, dtype=DTYPE), torch.randn(9, 2, dtype=DTYPE)
    subset = mj.ParamSubset.last_layer(model)  # the output is linear in it
    la = mj.SubnetLaplace(model, "regression", subset, prior_precision=0.3).fit(
        [(x, y)], progress=False
    )
    s = la.sample(50000, generator=torch.Generator().manual_seed(0))
    assert s.shape == (50000, subset.numel)
    cov = la.posterior_covariance
    torch.testing.assert_close(
        s.mean(0), la.mean, atol=4 * float(cov.diagonal().max()) ** 0.5 / 200, rtol=0
    )
    torch.testing.assert_close(torch.cov(s.T), cov, atol=0.03 * float(cov.abs().max()), rtol=0)
    lin = la.functional_samples(x, 5, generator=torch.Generator().manual_seed(3))
    full = la.functional_samples(x, 5, generator=torch.Generator().manual_seed(3), linearized=False)
    assert lin.shape == (5, 9, 2)
    torch.testing.assert_close(lin, full, atol=1e-10, rtol=0)


def test_functional_samples_ragged_dense() -> None:
    model, subset, data, outs, _targets, jacs, inputs = setup("dense_per_pixel", "classification")
    la = mj.SubnetLaplace(model, "classification", subset).fit(data, progress=False)
    got = la.functional_samples(inputs, 4, generator=torch.Generator().manual_seed(0))
    assert isinstance(got, list) and len(got) == len(outs)
    thetas = la.sample(4, generator=torch.Generator().manual_seed(0))
    for g, out, j in zip(got, outs, jacs):
        assert g.shape == (4, *out.shape[1:])
        ref = out[0].reshape(-1) + (thetas - la.mean) @ j.T
        torch.testing.assert_close(g.reshape(4, -1), ref, atol=TOL, rtol=0)


# ---------------------------------------------------------------------- subset selection
def test_selection_helpers() -> None:
    model, _subset, data, outs, targets, jacs, _ = setup("mlp_vectors", "classification", "all")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    top = mj.ParamSubset.largest_magnitude(model, 5)
    assert set(top.flat_indices().tolist()) == set(flat.abs().topk(5).indices.tolist())
    r1 = mj.ParamSubset.random(model, 6, generator=torch.Generator().manual_seed(0))
    r2 = mj.ParamSubset.random(model, 6, generator=torch.Generator().manual_seed(0))
    assert r1 == r2 and r1.numel == 6
    last = mj.ParamSubset.last_layer(model)
    assert last.names == ("net.2.weight", "net.2.bias")
    # largest variance under a diagonal Laplace: 1 / (sum_i diag GGN_i + prior)
    ggn = dense_curvature(outs, targets, jacs, "classification").diagonal()
    var = 1 / (ggn + 2.0)
    chosen = mj.largest_variance(model, data, 7, prior_precision=2.0)
    assert set(chosen.flat_indices().tolist()) == set(var.topk(7).indices.tolist())
    sub = mj.ParamSubset.largest_magnitude(model, 3, params="net.2.*")
    assert set(sub.names) <= {"net.2.weight", "net.2.bias"}


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda m: mj.ParamSubset.largest_magnitude(m, 0), ValueError, "k must be in 1"),
        (lambda m: mj.ParamSubset.random(m, 10**6), ValueError, "k must be in 1"),
        (lambda m: mj.ParamSubset.random(m, 2.5), TypeError, "k must be an int"),
        (lambda m: mj.ParamSubset.last_layer(torch.nn.ReLU()), ValueError, "no parameters"),
    ],
)
def test_selection_errors(call, err, match) -> None:
    with pytest.raises(err, match=match):
        call(zoo_model("mlp_vectors"))


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"likelihood": "poisson"}, ValueError, "likelihood"),
        ({"sigma_noise": 2.0}, ValueError, "sigma_noise must be 1 for classification"),
        ({"prior_precision": -1.0}, ValueError, "prior_precision must be positive"),
        ({"prior_precision": [1.0, 2.0, 3.0, 4.0]}, ValueError, "one per selected tensor"),
        ({"prior_precision": {"nope": 1.0}}, ValueError, "unknown \\['nope'\\]"),
        ({"prior_precision": "big"}, TypeError, "prior_precision"),
        ({"temperature": 0}, ValueError, "temperature"),
        ({"hessian": "kfac"}, ValueError, "hessian"),
        ({"subset": "nope.*"}, ValueError, "nope"),
        ({"mode": "sideways"}, ValueError, "mode"),
    ],
)
def test_bad_arguments(kwargs, err, match) -> None:
    model = zoo_model("mlp_vectors")
    args = {"likelihood": "classification", "subset": "net.2.*", **kwargs}
    with pytest.raises(err, match=match):
        mj.SubnetLaplace(model, args.pop("likelihood"), args.pop("subset"), **args)


def test_setting_prior_precision_refreshes_the_posterior() -> None:
    model, subset, data, *_ = setup("mlp_vectors", "classification")
    la = mj.SubnetLaplace(model, "classification", subset).fit(data, progress=False)
    x = data[0][0]
    before = la.predictive(x).variance
    la.prior_precision = 50.0
    fresh = mj.SubnetLaplace(model, "classification", subset, prior_precision=50.0)
    fresh.fit(data, progress=False)
    torch.testing.assert_close(la.predictive(x).variance, fresh.predictive(x).variance)
    assert not torch.allclose(before, fresh.predictive(x).variance)
    with pytest.raises(ValueError, match="prior_precision must be positive"):
        la.prior_precision = 0.0


def test_bad_use() -> None:
    model = zoo_model("mlp_vectors")
    la = mj.SubnetLaplace(model, "classification", "net.2.*")
    x = torch.randn(3, 5, dtype=DTYPE)
    with pytest.raises(RuntimeError, match="not fitted"):
        la.predictive(x)
    with pytest.raises(ValueError, match="no samples"):
        la.fit([], progress=False)
    with pytest.raises(TypeError, match="class indices"):
        la.fit([(x, torch.zeros(3, dtype=DTYPE))], progress=False)
    with pytest.raises(ValueError, match="2 positions, the logits 1"):
        la.fit([(x, torch.zeros(3, 2, dtype=torch.long))], progress=False)
    la.fit([(x, torch.tensor([0, 1, 2]))], progress=False)
    with pytest.raises(ValueError, match="link_approx"):
        la.predictive(x, link_approx="sigmoid")
    with pytest.raises(ValueError, match="sigma_noise can only be changed for regression"):
        la.log_marginal_likelihood(sigma_noise=0.5)
    with pytest.raises(ValueError, match="unknown method 'cv'; expected one of 'marglik'"):
        la.optimize_prior_precision("cv")
    with pytest.raises(ValueError, match="gridsearch' needs val_loader"):
        la.optimize_prior_precision("gridsearch")
    with pytest.raises(ValueError, match="unknown prior_structure 'block'"):
        la.optimize_prior_precision(prior_structure="block")
    reg = mj.SubnetLaplace(model, "regression", "net.2.*")
    with pytest.raises(ValueError, match="regression target has 2 entries, the output 3"):
        reg.fit([(x, torch.zeros(3, 2, dtype=DTYPE))], progress=False)


# ---------------------------------------------------------------------- last layer by default
class _HeadFirst(torch.nn.Module):
    """Registers its head before its body: the last nn.Linear registered runs first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 2)
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_last_layer_without_a_name_is_checked_by_the_first_batch(structure: str) -> None:
    """Without ``last_layer_name`` the last nn.Linear registered is taken; ``fit`` checks on
    its first batch that it runs last (a head registered first is refused, naming both
    modules) and leaves no hook; ``mean`` and ``H`` are ``None`` until then (laplace-torch)."""
    from multiscale_jac.laplace import Laplace

    torch.manual_seed(0)
    x, y = torch.randn(6, 3), torch.randint(2, (6,))
    plain = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    la = Laplace(plain, "classification", subset_of_weights="last_layer",
                 hessian_structure=structure)  # fmt: skip
    assert la.mean is None and la.H is None
    la.fit([(x[:4], y[:4]), (x[4:], y[4:])])
    assert la.mean.shape == (18,) and la.H is not None
    named = Laplace(plain, "classification", subset_of_weights="last_layer",
                    hessian_structure=structure, last_layer_name="2")  # fmt: skip
    assert la.log_marginal_likelihood().item() == pytest.approx(
        named.fit([(x[:4], y[:4]), (x[4:], y[4:])]).log_marginal_likelihood().item()
    )
    model = _HeadFirst()
    wrong = Laplace(model, "classification", subset_of_weights="last_layer",
                    hessian_structure=structure)  # fmt: skip
    with pytest.raises(ValueError, match=r"took 'body.0'.*ran before 'head'.*last_layer_name"):
        wrong.fit([(x, y)])
    assert all(not m._forward_hooks for m in model.modules())
    right = Laplace(model, "classification", subset_of_weights="last_layer",
                    hessian_structure=structure, last_layer_name="head")  # fmt: skip
    assert right.fit([(x, y)]).mean.shape == (18,)
