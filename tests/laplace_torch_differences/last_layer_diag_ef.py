"""Last-layer diagonal empirical Fisher with backend=CurvlinopsEF vs the sum of squared
per-sample gradients by hand (float64)."""

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
N, D, C = 60, 4, 3
X, y = torch.randn(N, D), torch.randint(0, C, (N,))
model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, C))

ref = 0  # sum_n (d NLL_n / d (weight, bias) of the last layer)^2
for n in range(N):
    nll = nn.functional.cross_entropy(model(X[n : n + 1]), y[n : n + 1], reduction="sum")
    grads = torch.autograd.grad(nll, [*model[2].parameters()])
    ref = ref + torch.cat([g.flatten() for g in grads]) ** 2

out = {"ref_min": float(ref.min())}
for name, cls, backend in [
    ("lt", LTLaplace, lc.CurvlinopsEF),
    ("mj", MJLaplace, lc.CurvlinopsEF),
    ("lt_backpack", LTLaplace, lc.BackPackEF),  # control: laplace-torch's other EF backend
]:
    la = cls(model, "classification", "last_layer", "diag", backend=backend)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=20))
    H = torch.as_tensor(la.H).detach().flatten()
    out[f"{name}_max_abs"] = float(H.abs().max())
    out[f"{name}_rel_err"] = float((H - ref).abs().max() / ref.abs().max())
print(json.dumps(out))
