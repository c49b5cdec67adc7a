"""Regression empirical Fisher: H and the posterior precision vs the textbook EF of the Gaussian
NLL 0.5 ||f - y||^2 by hand (float64)."""

import json

import laplace.curvature as lc
import torch
from laplace import Laplace as LTLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac.laplace import Laplace as MJLaplace

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
N, D, sigma, prior = 100, 3, 0.5, 2.0
X, y = torch.randn(N, D), torch.randn(N, 1)
model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))


def nll(p, x, t):
    return 0.5 * ((torch.func.functional_call(model, p, (x[None],)) - t[None]) ** 2).sum()


params = {k: v.detach() for k, v in model.named_parameters()}
G = torch.func.vmap(torch.func.grad(nll), in_dims=(None, 0, 0))(params, X, y)
G = torch.cat([v.flatten(1) for v in G.values()], 1)
ef, eye = G.T @ G, torch.eye(G.shape[1])  # the textbook empirical Fisher at sigma = 1

out = {}
for name, cls, kw in [
    ("lt", LTLaplace, dict(backend=lc.CurvlinopsEF)),
    ("mj_backend", MJLaplace, dict(backend=lc.CurvlinopsEF)),
    ("mj_no_backend", MJLaplace, dict(hessian="empirical")),
]:
    la = cls(model, "regression", "all", "full", sigma_noise=sigma, prior_precision=prior, **kw)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=25))
    out[name] = (torch.as_tensor(la.H).detach(), torch.as_tensor(la.posterior_precision).detach())


def rel(a, b):
    return float((a - b).norm() / b.norm())


print(json.dumps({
    "lt_H_over_ef": float((out["lt"][0] * ef).sum() / (ef * ef).sum()),  # least squares
    "lt_precision_rel_err_vs_2ef_over_sigma2": rel(out["lt"][1], 2 * ef / sigma**2 + prior * eye),
    "mj_backend_H_rel_err": rel(out["mj_backend"][0], ef),
    "mj_backend_precision_rel_err_vs_lt": rel(out["mj_backend"][1], out["lt"][1]),
    "mj_no_backend_H_rel_err": rel(out["mj_no_backend"][0], ef),
    "mj_no_backend_precision_rel_err": rel(out["mj_no_backend"][1], ef / sigma**4 + prior * eye),
}))  # fmt: skip
