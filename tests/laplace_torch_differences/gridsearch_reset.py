"""Grid search of the prior precision: laplace-torch vs the library vs each grid value's own loss."""

import json

import numpy as np
import torch
from laplace import Laplace as LTLaplace
from laplace.utils.metrics import RunningNLLMetric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac.laplace import Laplace as MJLaplace

torch.set_num_threads(1)
torch.manual_seed(0)
N, D, C = 200, 5, 3
X = torch.randn(N, D)
y = (X @ (2 * torch.randn(D, C)) + 0.8 * torch.randn(N, C)).argmax(1)
model = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, C))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(400):
    opt.zero_grad()
    nn.functional.cross_entropy(model(X[:150]), y[:150]).backward()
    opt.step()
train = DataLoader(TensorDataset(X[:150], y[:150]), batch_size=50)
val = DataLoader(TensorDataset(X[150:], y[150:]), batch_size=50)
grid = torch.logspace(-3, 3, 13)
pred = dict(pred_type="glm", link_approx="probit")
search = dict(method="gridsearch", log_prior_prec_min=-3, log_prior_prec_max=3, grid_size=13)

out = {}
for name, cls in [("lt", LTLaplace), ("mj", MJLaplace)]:
    la = cls(model, "classification", subset_of_weights="all", hessian_structure="full")
    la.fit(train)
    la.optimize_prior_precision(val_loader=val, **search, **pred)  # loss: the validation NLL
    out[f"{name}_choice"] = float(la.prior_precision)
    own = []  # reference: each grid value's own validation NLL (a fresh metric per value)
    for g in grid:
        la.prior_precision = g
        metric = RunningNLLMetric()
        for xb, yb in val:
            metric.update(la(xb, **pred), yb)
        own.append(float(metric.compute()))
    out[f"{name}_own_loss"] = own
own = np.array(out["lt_own_loss"])
out["grid"] = grid.tolist()
out["ref_choice"] = float(grid[own.argmin()])
out["running_mean_choice"] = float(grid[(np.cumsum(own) / np.arange(1, own.size + 1)).argmin()])
print(json.dumps(out))
