"""laplace-torch's documented usage, line by line with only the import changed, against dense
float64 computations written out here (full Jacobians by ``torch.func.jacrev``, the GGN, the
posterior, the marginal likelihood and the predictive), to 1e-8.

The laplace-torch lines are marked ``# laplace-torch``; everything else is the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, TensorDataset

import multiscale_jac as mj
from multiscale_jac.laplace import Laplace  # the one changed line: was `from laplace import`

TOL = 1e-8
DTYPE = torch.float64


# ---------------------------------------------------------------------- models and data
def mlp(outputs: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, outputs)).to(DTYPE).eval()


class TwoLevelNet(nn.Module):
    """Two pyramid levels ``(1, 2, H0, W0)`` and ``(1, 3, H1, W1)``; vector logits ``(1, C)`` or
    dense logits ``(1, C, H0, W0)`` (a 1x1 convolution head)."""

    def __init__(self, classes: int = 3, dense: bool = False) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 1)
        self.dense = dense
        self.head = nn.Conv2d(4, classes, 1) if dense else nn.Linear(4, classes)

    def forward(self, levels: list[torch.Tensor]) -> torch.Tensor:
        a = torch.tanh(self.a(levels[0]))
        b = torch.tanh(self.b(levels[1])).mean((2, 3), keepdim=True)
        if self.dense:
            return self.head(a + b)
        return self.head((a.mean((2, 3), keepdim=True) + b).flatten(1))


def classification_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=DTYPE), torch.randint(3, (n,), generator=g)


def ragged_levels(sizes: list[tuple[int, int]], seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(2, h, w, generator=g, dtype=DTYPE),
            torch.randn(3, (h + 1) // 2, (w + 1) // 2, generator=g, dtype=DTYPE),
        ]
        for h, w in sizes
    ]


# ---------------------------------------------------------------------- the dense reference
def jacobians(model: nn.Module, inputs: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample: the flat output ``(O,)`` and the full Jacobian ``(O, P_all)`` in
    ``parameters_to_vector(model.parameters())`` order, by ``jacrev``."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = parameters_to_vector(model.parameters()).detach()

    def f(vec: torch.Tensor, x: object) -> torch.Tensor:
        parts, k = {}, 0
        for name, shape in zip(names, shapes):
            parts[name] = vec[k : k + shape.numel()].view(shape)
            k += shape.numel()
        return functional_call(model, parts, (x,)).reshape(-1)

    outs = [f(theta, x).detach() for x in inputs]
    jacs = [jacrev(f)(theta, x).detach() for x in inputs]
    return outs, jacs


def columns(model: nn.Module, names: list[str]) -> torch.Tensor:
    """Flat indices of whole tensors ``names`` in ``parameters_to_vector`` order."""
    idx, k = [], 0
    for name, p in model.named_parameters():
        if name in names:
            idx.append(torch.arange(k, k + p.numel()))
        k += p.numel()
    return torch.cat(idx)


def lambdas(out: torch.Tensor, classes: int) -> torch.Tensor:
    """The output Hessian of the cross-entropy, block diagonal over positions, ``(O, O)`` for a
    class-major flat output ``(C * m,)``."""
    logits = out.view(classes, -1)
    lam = torch.zeros(out.numel(), out.numel(), dtype=DTYPE)
    for pos in range(logits.shape[1]):
        p = torch.softmax(logits[:, pos], 0)
        rows = torch.arange(classes) * logits.shape[1] + pos
        lam[rows[:, None], rows[None, :]] = torch.diag(p) - torch.outer(p, p)
    return lam


def ggn(jacs: list[torch.Tensor], outs: list[torch.Tensor], classes: int | None) -> torch.Tensor:
    """``sum_i J_i^T Lambda_i J_i`` (``classes=None``: regression, ``Lambda = I``)."""
    return sum(
        (j.T @ j if classes is None else j.T @ lambdas(o, classes) @ j for j, o in zip(jacs, outs)),
        torch.zeros(jacs[0].shape[1], jacs[0].shape[1], dtype=DTYPE),
    )


def nll(outs: list[torch.Tensor], ys: list[torch.Tensor], classes: int | None) -> float:
    """Cross-entropy sum, or ``0.5 * SSE`` (regression)."""
    if classes is None:
        return sum(0.5 * float(((o - y.reshape(-1)) ** 2).sum()) for o, y in zip(outs, ys))
    return sum(
        float(nn.functional.cross_entropy(o.view(classes, -1).T, y.reshape(-1), reduction="sum"))
        for o, y in zip(outs, ys)
    )


def log_marglik(loss, n_out, h, prior, theta, sigma=1.0, diag=False) -> torch.Tensor:
    """``log p(D | theta) - 0.5 (log det P_post - log det P_0 + theta^T P_0 theta)``."""
    p0 = prior.expand(theta.numel()) if prior.numel() == 1 else prior
    post = h / sigma**2 + (p0 if diag else torch.diag(p0))
    logdet = post.log().sum() if diag else torch.logdet(post)
    ll = -loss / sigma**2 - (n_out * math.log(sigma * math.sqrt(2 * math.pi)) if n_out else 0)
    return ll - 0.5 * (logdet - p0.log().sum() + theta @ (p0 * theta))


def probit(out: torch.Tensor, var: torch.Tensor, classes: int) -> torch.Tensor:
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * var.view(classes, -1))
    return torch.softmax(kappa * out.view(classes, -1), dim=0)


# ---------------------------------------------------------------------- (a) subnetwork
def test_subnetwork_classification_usage() -> None:
    model = mlp(3)
    x_train, y_train = classification_data(24, seed=1)
    x, _ = classification_data(5, seed=2)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=8)

    subnetwork_indices = torch.LongTensor([0, 4, 11, 42, 23, 37, 50, 31])  # laplace-torch
    la = Laplace(  # laplace-torch
        model,
        "classification",
        subset_of_weights="subnetwork",
        hessian_structure="full",
        subnetwork_indices=subnetwork_indices,
    )
    la.fit(train_loader)  # laplace-torch
    la.optimize_prior_precision(method="marglik")  # laplace-torch
    pred = la(x, link_approx="probit")  # laplace-torch

    assert isinstance(la, mj.SubnetLaplace)
    outs, jacs = jacobians(model, [xi[None] for xi in x_train])
    jacs = [j[:, subnetwork_indices] for j in jacs]
    h = ggn(jacs, outs, 3)
    torch.testing.assert_close(la.H, h, atol=TOL, rtol=0)
    loss = nll(outs, list(y_train), 3)
    assert float(la.loss) == pytest.approx(loss, abs=TOL)
    theta = parameters_to_vector(model.parameters()).detach()[subnetwork_indices]
    # the marginal-likelihood optimisation, replayed on the dense formula: Adam on log prec
    log_prec = torch.zeros(1, dtype=DTYPE, requires_grad=True)
    opt = torch.optim.Adam([log_prec], lr=0.1)
    for _ in range(100):
        opt.zero_grad()
        (-log_marglik(loss, 0, h, log_prec.exp(), theta)).backward()
        opt.step()
    prec = log_prec.detach().exp()
    assert la.prior_precision.shape == (1,)  # laplace-torch's one-element tensor
    torch.testing.assert_close(la.prior_precision, prec, atol=TOL, rtol=0)
    lml = log_marglik(loss, 0, h, prec, theta)
    assert float(la.log_marginal_likelihood()) == pytest.approx(float(lml), abs=TOL)
    sigma = torch.linalg.inv(h + prec * torch.eye(len(theta), dtype=DTYPE))
    test_outs, test_jacs = jacobians(model, [xi[None] for xi in x])
    assert pred.shape == (5, 3)
    for i, (o, j) in enumerate(zip(test_outs, test_jacs)):
        j = j[:, subnetwork_indices]
        ref = probit(o, (j @ sigma @ j.T).diagonal(), 3).reshape(-1)
        torch.testing.assert_close(pred[i], ref, atol=TOL, rtol=0)


# ---------------------------------------------------------------------- (b) last layer
@pytest.mark.slow  # two 100-step Adam runs through a log-determinant, MC with 4000 draws
def test_last_layer_classification_usage() -> None:
    model = mlp(3, seed=3)
    x_train, y_train = classification_data(20, seed=4)
    x, _ = classification_data(4, seed=5)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=6)

    la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure="full")
    la.fit(train_loader)
    la.optimize_prior_precision(method="marglik", prior_structure="layerwise")
    pred = la(x, pred_type="glm", link_approx="probit")

    cols = columns(model, ["2.weight", "2.bias"])
    assert la.subset.names == ("2.weight", "2.bias")
    outs, jacs = jacobians(model, [xi[None] for xi in x_train])
    h = ggn([j[:, cols] for j in jacs], outs, 3)
    torch.testing.assert_close(la.H, h, atol=TOL, rtol=0)
    assert la.prior_precision.shape == (2,)  # one per layer (weight, bias), as laplace-torch
    p0 = torch.repeat_interleave(la.prior_precision, torch.tensor([18, 3]))
    theta = parameters_to_vector(model.parameters()).detach()[cols]
    lml = log_marglik(nll(outs, list(y_train), 3), 0, h, p0, theta)
    assert float(la.log_marginal_likelihood()) == pytest.approx(float(lml), abs=TOL)
    # Adam on each layer's log precision, replayed on the dense formula
    log_p = torch.zeros(2, dtype=DTYPE, requires_grad=True)
    opt = torch.optim.Adam([log_p], lr=0.1)
    for _ in range(100):
        opt.zero_grad()
        p0g = torch.repeat_interleave(log_p.exp(), torch.tensor([18, 3]))
        (-log_marglik(nll(outs, list(y_train), 3), 0, h, p0g, theta)).backward()
        opt.step()
    torch.testing.assert_close(la.prior_precision, log_p.detach().exp(), atol=TOL, rtol=0)
    sigma = torch.linalg.inv(h + torch.diag(p0))
    for i, (o, j) in enumerate(zip(*jacobians(model, [xi[None] for xi in x]))):
        j = j[:, cols]
        torch.testing.assert_close(
            pred[i], probit(o, (j @ sigma @ j.T).diagonal(), 3).reshape(-1), atol=TOL, rtol=0
        )
    # MC and the Laplace bridge: probabilities of the same Gaussian over the logits
    mc = la(x, link_approx="mc", n_samples=4000, generator=torch.Generator().manual_seed(0))
    assert mc.shape == (4, 3) and float((mc - pred).abs().max()) < 0.05
    bridge = la(x, link_approx="bridge")
    torch.testing.assert_close(bridge.sum(-1), torch.ones(4, dtype=DTYPE), atol=1e-12, rtol=0)
    samples = la.predictive_samples(x, pred_type="glm", n_samples=7)
    assert samples.shape == (7, 4, 3)
    assert la.sample(5).shape == (5, 21)
    nn_probs = la(x, pred_type="nn", link_approx="mc", n_samples=8)
    assert nn_probs.shape == (4, 3)
    with pytest.raises(ValueError, match="pred_type='nn' supports only link_approx='mc'"):
        la(x, pred_type="nn")


# ---------------------------------------------------------------------- (c) regression, diag
@pytest.mark.parametrize("hessian", ["ggn", "empirical"])
def test_all_weights_diag_regression_usage(hessian: str) -> None:
    model = mlp(2, seed=6)
    g = torch.Generator().manual_seed(7)
    x_train = torch.randn(18, 4, generator=g, dtype=DTYPE)
    y_train = torch.randn(18, 2, generator=g, dtype=DTYPE)
    x = torch.randn(3, 4, generator=g, dtype=DTYPE)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=5)
    sigma_noise, prior = 0.6, 2.5

    la = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="diag",
        sigma_noise=sigma_noise,
        prior_precision=prior,
        hessian=hessian,  # a library option: the empirical Fisher instead of the GGN
    )
    la.fit(train_loader)
    f_mu, f_var = la(x)

    assert isinstance(la, mj.DiagLaplace)
    outs, jacs = jacobians(model, [xi[None] for xi in x_train])
    if hessian == "ggn":
        h = sum((j**2).sum(0) for j in jacs)
        factor = sigma_noise**2
    else:  # squared gradients of 0.5 |f - y|^2, divided by sigma^4 as SubnetLaplace does
        h = sum((j.T @ (o - y)) ** 2 for j, o, y in zip(jacs, outs, y_train))
        factor = sigma_noise**4
    torch.testing.assert_close(la.H, h, atol=TOL, rtol=0)
    theta = parameters_to_vector(model.parameters()).detach()
    p_post = h / factor + prior
    torch.testing.assert_close(la.posterior_precision, p_post, atol=TOL, rtol=0)
    loss = nll(outs, list(y_train), None)
    n_out = y_train.numel()
    ll = -loss / sigma_noise**2 - n_out * math.log(sigma_noise * math.sqrt(2 * math.pi))
    lml = ll - 0.5 * (p_post.log().sum() - theta.numel() * math.log(prior) + prior * theta @ theta)
    assert float(la.log_marginal_likelihood()) == pytest.approx(float(lml), abs=TOL)
    # differentiable in both hyperparameters, stored as laplace-torch stores them
    prec = torch.tensor(1.5, dtype=DTYPE, requires_grad=True)
    sig = torch.tensor(0.8, dtype=DTYPE, requires_grad=True)
    ml = la.log_marginal_likelihood(prec, sig)
    ml.backward()
    post = h / (sig**2 if hessian == "ggn" else sig**4) + prec
    ref = -loss / sig**2 - n_out * torch.log(sig * math.sqrt(2 * math.pi))
    ref = ref - 0.5 * (post.log().sum() - theta.numel() * prec.log() + prec * theta @ theta)
    assert float(ml.detach()) == pytest.approx(float(ref.detach()), abs=TOL)
    grads = torch.autograd.grad(ref, [prec, sig])
    assert float(prec.grad) == pytest.approx(float(grads[0]), abs=TOL)
    assert float(sig.grad) == pytest.approx(float(grads[1]), abs=TOL)
    assert la.prior_precision.shape == (1,) and float(la.prior_precision) == 1.5
    assert float(la.sigma_noise) == 0.8
    la.prior_precision, la.sigma_noise = prior, sigma_noise  # back to the predictive's values
    # the GLM predictive: f_var = J diag(Sigma) J^T per sample
    assert f_mu.shape == (3, 2) and f_var.shape == (3, 2, 2)
    for i, (o, j) in enumerate(zip(*jacobians(model, [xi[None] for xi in x]))):
        torch.testing.assert_close(f_mu[i], o, atol=TOL, rtol=0)
        torch.testing.assert_close(f_var[i], (j / p_post) @ j.T, atol=TOL, rtol=0)
    _, diag_var = la(x, diagonal_output=True)
    torch.testing.assert_close(diag_var, f_var.diagonal(dim1=1, dim2=2), atol=TOL, rtol=0)
    assert la.predictive_samples(x, n_samples=6).shape == (6, 3, 2)
    nn_mean, nn_var = la(x, pred_type="nn", link_approx="mc", n_samples=5)
    assert nn_mean.shape == (3, 2) and nn_var.shape == (3, 2)


def test_gridsearch_usage() -> None:
    model = mlp(3, seed=8)
    x_train, y_train = classification_data(16, seed=9)
    x_val, y_val = classification_data(10, seed=10)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=8)
    val_loader = DataLoader(TensorDataset(x_val, y_val), batch_size=4)

    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(train_loader)
    la.optimize_prior_precision(
        method="gridsearch",
        pred_type="glm",
        link_approx="probit",
        val_loader=val_loader,
    )
    pred = la(x_val, pred_type="glm", link_approx="probit")

    outs, jacs = jacobians(model, [xi[None] for xi in x_train])
    h = sum(torch.einsum("op,oq,qp->p", j, lambdas(o, 3), j) for j, o in zip(jacs, outs))
    torch.testing.assert_close(la.H, h, atol=TOL, rtol=0)
    val_outs, val_jacs = jacobians(model, [xi[None] for xi in x_val])

    def probs_at(prec: torch.Tensor) -> torch.Tensor:
        var = 1 / (h + prec)
        return torch.stack(
            [probit(o, (j * j * var).sum(1), 3).reshape(-1) for o, j in zip(val_outs, val_jacs)]
        )

    grid = torch.logspace(-4, 4, 100, dtype=DTYPE)
    losses = [float(-probs_at(p)[torch.arange(10), y_val].log().mean()) for p in grid]
    best = grid[min(range(100), key=losses.__getitem__)]
    assert la.prior_precision.shape == (1,)
    torch.testing.assert_close(la.prior_precision, best.reshape(1), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(pred, probs_at(best), atol=TOL, rtol=0)


def test_the_hyperparameter_loop_of_laplace_torchs_regression_example() -> None:
    """laplace-torch's regression example tunes ``log_prior`` and ``log_sigma`` with Adam on
    ``la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())``, then reads
    ``la.sigma_noise.item()``: the call stores both values (the last step's), ``sigma_noise``
    is a tensor, and the state saved holds the tuned values."""
    model = mlp(1, seed=13)
    g = torch.Generator().manual_seed(14)
    x = torch.randn(20, 4, generator=g, dtype=DTYPE)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.3 * torch.randn(20, 1, generator=g, dtype=DTYPE)
    la = Laplace(
        model, "regression", subset_of_weights="all", hessian_structure="full"
    )  # laplace-torch
    la.fit(DataLoader(TensorDataset(x, y), batch_size=5))  # laplace-torch
    assert isinstance(la.sigma_noise, torch.Tensor) and la.sigma_noise.item() == 1.0
    log_prior = torch.ones(1, requires_grad=True, dtype=DTYPE)  # laplace-torch
    log_sigma = torch.ones(1, requires_grad=True, dtype=DTYPE)  # laplace-torch
    hyper_optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)  # laplace-torch
    for _ in range(20):  # laplace-torch
        hyper_optimizer.zero_grad()  # laplace-torch
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())  # laplace-torch
        neg_marglik.backward()  # laplace-torch
        hyper_optimizer.step()  # laplace-torch
    sigma, prior = la.sigma_noise.item(), la.prior_precision  # laplace-torch reads them
    assert sigma != 1.0 and float(prior) != 1.0  # the last evaluation's (one Adam step back)
    state = la.state_dict()
    assert float(state["sigma_noise"]) == sigma
    torch.testing.assert_close(
        torch.as_tensor(state["prior_precision"]).reshape(-1), prior.detach().reshape(-1)
    )


def test_optimize_prior_precision_takes_laplace_torchs_positional_pred_type() -> None:
    """``la.optimize_prior_precision(PredType.GLM)`` (laplace-torch's first parameter is
    ``pred_type``): read as the predictive type, the method ``marglik``; ``pred_type`` given
    twice differently is refused with both values."""
    model = mlp(3, seed=15)
    x, y = classification_data(12, seed=16)
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(loader)
    la.optimize_prior_precision("glm", n_steps=20)  # laplace-torch's order
    ref = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    ref.fit(loader)
    ref.optimize_prior_precision(method="marglik", pred_type="glm", n_steps=20)
    torch.testing.assert_close(la.prior_precision, ref.prior_precision, atol=0, rtol=0)
    with pytest.raises(ValueError, match="pred_type given twice"):
        la.optimize_prior_precision("nn", pred_type="glm")


def test_gridsearch_with_a_callable_loss_on_regression() -> None:
    """``loss(f_mu, f_var, targets)`` on the concatenated predictions, as laplace-torch."""
    model = mlp(2, seed=11)
    g = torch.Generator().manual_seed(12)
    x_train, y_train = torch.randn(12, 4, generator=g, dtype=DTYPE), torch.randn(12, 2, dtype=DTYPE)
    x_val, y_val = torch.randn(6, 4, generator=g, dtype=DTYPE), torch.randn(6, 2, dtype=DTYPE)
    la = Laplace(model, "regression", subset_of_weights="last_layer", hessian_structure="diag")
    la.fit(DataLoader(TensorDataset(x_train, y_train), batch_size=4))

    def gaussian_nll(mean, var, y):  # the predictive of y: variance + sigma^2
        v = var.diagonal(dim1=1, dim2=2) + 1.0
        return (0.5 * ((mean - y) ** 2 / v + v.log())).mean()

    val_loader = DataLoader(TensorDataset(x_val, y_val), batch_size=3)
    la.optimize_prior_precision(
        method="gridsearch", val_loader=val_loader, loss=gaussian_nll, grid_size=21
    )
    cols = columns(model, ["2.weight", "2.bias"])
    _, jacs = jacobians(model, [xi[None] for xi in x_train])
    h = sum((j[:, cols] ** 2).sum(0) for j in jacs)
    vo, vj = jacobians(model, [xi[None] for xi in x_val])
    grid = torch.logspace(-4, 4, 21, dtype=DTYPE)
    scores = []
    for p in grid:
        var = torch.stack([(j[:, cols] / (h + p)) @ j[:, cols].T for j in vj])
        scores.append(float(gaussian_nll(torch.stack(vo), var, y_val)))
    best = grid[min(range(21), key=scores.__getitem__)]
    torch.testing.assert_close(la.prior_precision, best.reshape(1), atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------- beyond laplace-torch
@pytest.mark.parametrize("structure", ["full", "diag"])
def test_ragged_multilevel_samples(structure: str) -> None:
    """``la(x)`` on a list of multi-level samples of different sizes: vector logits (one
    probability vector per sample) and dense logits (probabilities per pixel, one map per
    sample)."""
    torch.manual_seed(13)
    sizes = [(4, 4), (3, 5), (2, 3), (5, 2)]
    train = ragged_levels(sizes, seed=14)
    test = ragged_levels([(3, 3), (4, 2), (2, 2)], seed=15)
    g = torch.Generator().manual_seed(16)
    for dense in (False, True):
        model = TwoLevelNet(dense=dense).to(DTYPE).eval()
        ys = [torch.randint(3, (h, w) if dense else (), generator=g) for h, w in sizes]
        train_loader = [(train[:2], ys[:2]), (train[2:], ys[2:])]
        la = Laplace(model, "classification", "last_layer", structure, prior_precision=0.7)
        la.fit(train_loader)
        probs = la(test)

        cols = columns(model, ["head.weight", "head.bias"])
        as_input = [[t[None] for t in s] for s in train]
        outs, jacs = jacobians(model, as_input)
        jacs = [j[:, cols] for j in jacs]
        full = ggn(jacs, outs, 3)
        h = full if structure == "full" else full.diagonal()
        torch.testing.assert_close(la.H, h, atol=TOL, rtol=0)
        p_post = h + (0.7 * torch.eye(len(cols), dtype=DTYPE) if structure == "full" else 0.7)
        sigma = torch.linalg.inv(p_post) if structure == "full" else torch.diag(1 / p_post)
        t_outs, t_jacs = jacobians(model, [[t[None] for t in s] for s in test])
        if dense:
            assert isinstance(probs, list) and [p.shape for p in probs] == [
                (3, 3, 3),
                (3, 4, 2),
                (3, 2, 2),
            ]
        else:
            assert probs.shape == (3, 3)
        for i, (o, j) in enumerate(zip(t_outs, t_jacs)):
            j = j[:, cols]
            ref = probit(o, (j @ sigma @ j.T).diagonal(), 3)
            torch.testing.assert_close(probs[i].reshape(3, -1), ref, atol=TOL, rtol=0)
        lml = log_marglik(
            nll(outs, ys, 3),
            0,
            h,
            torch.tensor([0.7], dtype=DTYPE),
            parameters_to_vector(model.parameters()).detach()[cols],
            diag=structure == "diag",
        )
        assert float(la.log_marginal_likelihood()) == pytest.approx(float(lml), abs=TOL)
        samples = la.predictive_samples(test, n_samples=3)
        if dense:
            assert [s.shape for s in samples] == [(3, 3, 3, 3), (3, 3, 4, 2), (3, 3, 2, 2)]
        else:
            assert samples.shape == (3, 3, 3)


# ---------------------------------------------------------------------- the front door itself
def test_factory_choices_and_errors() -> None:
    model = mlp(3)
    # laplace-torch's defaults: the last layer, Kronecker-factored
    default = Laplace(model, "classification")
    assert type(default) is mj.KronLaplace and default.subset.names == ("2.weight", "2.bias")
    full = Laplace(model, "classification", subset_of_weights="all", hessian_structure="full")
    assert type(full) is mj.SubnetLaplace and full.n_params == 51
    sub_diag = Laplace(
        model, "regression", "subnetwork", "diag", subnetwork_indices=torch.tensor([3, 1])
    )
    assert isinstance(sub_diag, mj.DiagLaplace) and sub_diag.n_params == 2
    frozen = mlp(3)
    frozen[0].weight.requires_grad_(False)
    assert Laplace(frozen, "regression", "all", "diag").n_params == 51 - 24
    cases = [
        ({"subset_of_weights": "everything"}, ValueError, "unknown subset_of_weights 'everything'"),
        ({"hessian_structure": "lowrank"}, ValueError, "'lowrank' has no counterpart"),
        ({"subset_of_weights": "subnetwork"}, TypeError, "needs subnetwork_indices"),
        (
            {"subnetwork_indices": torch.tensor([1])},
            ValueError,
            "only with subset_of_weights='subnetwork'",
        ),
        (
            {"subset_of_weights": "subnetwork", "subnetwork_indices": torch.tensor([1, 1])},
            ValueError,
            "subnetwork_indices: .*index 1 is given more than once",
        ),
        (
            {"subset_of_weights": "subnetwork", "subnetwork_indices": torch.tensor([99])},
            ValueError,
            "subnetwork_indices: .*out of range for 51",
        ),
        (
            {"subset_of_weights": "subnetwork", "subnetwork_indices": [1, 2]},
            ValueError,  # and a TypeError (ArgumentTypeError)
            "1-d LongTensor; got list",
        ),
        ({"backend": object}, ValueError, "unknown backend 'object'"),
        ({"likelihood": "poisson"}, ValueError, "likelihood"),
    ]
    for kwargs, err, match in cases:
        args = {"likelihood": "classification", **kwargs}
        with pytest.raises(err, match=match):
            Laplace(model, args.pop("likelihood"), **args)
    la = Laplace(model, "classification", "all", "diag")
    with pytest.raises(RuntimeError, match="DiagLaplace is not fitted"):
        la(torch.zeros(2, 4, dtype=DTYPE))
    la.fit([(torch.zeros(2, 4, dtype=DTYPE), torch.tensor([0, 1]))])
    with pytest.raises(ValueError, match="unknown pred_type 'gp'"):
        la(torch.zeros(2, 4, dtype=DTYPE), pred_type="gp")


def test_diag_fit_streams_and_keeps_the_model() -> None:
    model = mlp(3, seed=17)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = classification_data(12, seed=18)
    whole = Laplace(model, "classification", "all", "diag").fit([(x, y)])
    parts = Laplace(model, "classification", "all", "diag").fit([(x[:5], y[:5])])
    parts.fit(iter([(x[5:], y[5:])]), override=False)  # a one-shot iterator is fine
    torch.testing.assert_close(parts.H, whole.H, atol=1e-12, rtol=0)
    assert float(parts.loss) == pytest.approx(float(whole.loss), abs=1e-12)
    assert parts.n_data == whole.n_data == 12
    whole(x[:3])
    whole.optimize_prior_precision(method="marglik", prior_structure="diag", n_steps=5)
    assert whole.prior_precision.shape == (51,)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("method", ["layerwise", "vmap", "auto"])
@pytest.mark.parametrize("hessian", ["empirical", "ggn"])
def test_diag_fit_takes_the_loss_from_the_fishers_own_forward_passes(
    method: str, hessian: str
) -> None:
    """Layer-wise, the fit runs one batched forward per batch (the loss at the MAP comes from
    it); by vmap, a batch's loss takes one more batched forward. The loss is the same."""
    model = mlp(3, seed=21)
    x, y = classification_data(20, seed=22)
    batched: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: batched.append(a[0].shape[0]))
    try:
        la = Laplace(model, "classification", "all", "diag", hessian=hessian, method=method)
        la.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    finally:
        handle.remove()
    with torch.no_grad():
        ref = nn.functional.cross_entropy(model(x), y, reduction="sum")
    assert float(la.loss) == pytest.approx(float(ref), abs=1e-10)
    assert la.n_data == 20
    big = [b for b in batched if b > 1]  # batch-of-one calls: shape and separability checks
    if method == "layerwise":
        assert big == [8, 8, 4]
    if method == "vmap":
        assert big == [8, 8, 4]  # the loss's own passes: vmap(grad) calls see single samples


def test_diag_on_a_cnn_with_batch_norm() -> None:
    """Every weight of a small VGG-style block (conv, batch norm in eval, pooling, linear)."""
    torch.manual_seed(19)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3 * 2 * 2, 3),
    ).to(DTYPE)
    model[1].running_mean.uniform_(-0.5, 0.5)
    model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    g = torch.Generator().manual_seed(20)
    x = torch.randn(6, 2, 4, 4, generator=g, dtype=DTYPE)
    y = torch.randint(3, (6,), generator=g)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=4))
    outs, jacs = jacobians(model, [xi[None] for xi in x])
    h = sum(torch.einsum("op,oq,qp->p", j, lambdas(o, 3), j) for j, o in zip(jacs, outs))
    torch.testing.assert_close(la.H, h, atol=TOL, rtol=0)
    probs = la(x[:2])
    for i, (o, j) in enumerate(zip(outs[:2], jacs[:2])):
        ref = probit(o, (j * j / (h + 1.0)).sum(1), 3).reshape(-1)
        torch.testing.assert_close(probs[i], ref, atol=TOL, rtol=0)


def test_model_keyword_arguments_reach_the_forward() -> None:
    """``la(x, **model_kwargs)``: every call of the model in the predictive gets them."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.fc(x) * scale

    torch.manual_seed(0)
    model = Scaled().to(DTYPE)
    x, y = torch.randn(5, 3, dtype=DTYPE), torch.randn(5, 2, dtype=DTYPE)
    la = Laplace(model, "regression", "all", "full").fit([(x, y)])
    f_mu, f_var = la(x, scale=2.0)
    torch.testing.assert_close(f_mu, 2 * model(x), atol=1e-12, rtol=0)
    _, f_var1 = la(x)
    torch.testing.assert_close(f_var, 4 * f_var1, atol=1e-10, rtol=0)
    nn_mean, _ = la(x, pred_type="nn", link_approx="mc", n_samples=3, scale=0.0)
    assert torch.all(nn_mean == 0)
    with pytest.raises(TypeError, match=r"\['scale'\] are tensors"):
        la(x, scale=torch.ones(5, 1))
    with pytest.raises(ValueError, match="link_approx='mc'"):
        la(x, pred_type="nn", scale=2.0)  # laplace-torch's rule, for regression too


def test_laplace_torchs_base_classes_answer_isinstance() -> None:
    """``BaseLaplace`` and ``ParametricLaplace`` (laplace-torch's names, for ``isinstance``
    and type hints) hold every posterior the front door builds."""
    from multiscale_jac.laplace import BaseLaplace, ParametricLaplace

    model = mlp(3, seed=17)
    for structure in ("full", "diag", "kron"):
        la = Laplace(model, "classification", "all", structure)
        assert isinstance(la, BaseLaplace) and isinstance(la, ParametricLaplace), structure


def test_a_subnetwork_sample_holds_every_parameter() -> None:
    """laplace-torch's subnetwork Laplace samples every parameter, the others at the MAP
    (``parameters_to_vector`` order); the class called directly samples its entries."""
    model = mlp(3, seed=18)
    x, y = classification_data(12, seed=19)
    idx = torch.tensor([3, 17, 40, 41, 50])
    la = Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=6))
    g = torch.Generator().manual_seed(0)
    full = la.sample(7, generator=g)
    theta = parameters_to_vector(model.parameters()).detach()
    assert full.shape == (7, theta.numel())
    rest = torch.ones(theta.numel(), dtype=torch.bool)
    rest[idx] = False
    torch.testing.assert_close(full[:, rest], theta[rest].expand(7, -1), atol=0, rtol=0)
    own = mj.SubnetLaplace(model, "classification", mj.ParamSubset.from_flat_indices(model, idx))
    own.fit(DataLoader(TensorDataset(x, y), batch_size=6))
    part = own.sample(7, generator=torch.Generator().manual_seed(0))
    assert part.shape == (7, 5)
    torch.testing.assert_close(full[:, idx], part, atol=1e-12, rtol=0)
