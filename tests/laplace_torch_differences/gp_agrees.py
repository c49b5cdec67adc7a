"""GPLaplace against laplace-torch's FunctionalLaplace in float64 (a context of 12 of 30
samples, a prior mean off zero): the predictive, the evidence and its parts, the tuned prior.
Prints one JSON line: the largest relative difference per quantity over five settings."""

import json
import warnings

import laplace
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multiscale_jac.laplace as mjl

warnings.simplefilter("ignore")
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
worst: dict[str, float] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


settings = [("regression", 1, False), ("regression", 3, False), ("regression", 3, True),
            ("classification", 3, False), ("classification", 3, True)]  # fmt: skip
for lik, outputs, independent in settings:
    x = torch.randn(30, 4)
    y = torch.randn(30, outputs) if lik == "regression" else torch.randint(outputs, (30,))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, outputs))
    data = DataLoader(TensorDataset(x, y), batch_size=7)
    opts = dict(subset_of_weights="all", hessian_structure="gp", n_subset=12, prior_mean=0.1,
                independent_outputs=independent, prior_precision=1.5)  # fmt: skip
    if lik == "regression":
        opts["sigma_noise"] = 0.5
    theirs = laplace.Laplace(model, lik, backend=laplace.curvature.CurvlinopsGGN, **opts)
    ours = mjl.Laplace(model, lik, **opts)
    theirs.fit(data)
    ours.fit(data)
    query = torch.randn(4, 4)
    a, b = ours(query), theirs(query)
    pairs = {"predictive": (a, b)}
    for name in ("log_marginal_likelihood", "scatter", "log_det_ratio"):
        value = getattr(ours, name)
        pairs[name] = (value() if callable(value) else value,
                       (lambda v: v() if callable(v) else v)(getattr(theirs, name)))  # fmt: skip
    ours.optimize_prior_precision(n_steps=30)
    theirs.optimize_prior_precision(n_steps=30)
    pairs["tuned prior"] = (ours.prior_precision, theirs.prior_precision)
    for name, (u, v) in pairs.items():
        us, vs = (u, v) if isinstance(u, tuple) else ((u,), (v,))
        d = max(rel(p, q) for p, q in zip(us, vs, strict=True))
        worst[name] = max(worst.get(name, 0.0), d)
print(json.dumps(worst))
