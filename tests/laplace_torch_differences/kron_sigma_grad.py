"""K-FAC regression: d log_marginal_likelihood / d sigma_noise by autograd and by central
differences, laplace-torch vs the library (float64)."""

import json

import torch
from laplace import Laplace as LTLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac.laplace import Laplace as MJLaplace

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
X = torch.rand(200, 1) * 8 - 4
y = torch.sin(X) + 0.3 * torch.randn(200, 1)
model = nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(500):
    opt.zero_grad()
    ((model(X) - y) ** 2).mean().backward()
    opt.step()
loader = DataLoader(TensorDataset(X, y), batch_size=50)
prior, sigma, h = torch.tensor(0.5), 0.3, 1e-6

out = {}
for name, cls in [("lt", LTLaplace), ("mj", MJLaplace)]:
    la = cls(model, "regression", subset_of_weights="all", hessian_structure="kron")
    la.fit(loader)
    s = torch.tensor(sigma, requires_grad=True)
    lml = la.log_marginal_likelihood(prior, s)
    (grad,) = torch.autograd.grad(lml, s)
    up = la.log_marginal_likelihood(prior, torch.tensor(sigma + h))
    down = la.log_marginal_likelihood(prior, torch.tensor(sigma - h))
    out[name] = {"lml": float(lml), "autograd": float(grad), "fd": float((up - down) / (2 * h))}
print(json.dumps(out))
