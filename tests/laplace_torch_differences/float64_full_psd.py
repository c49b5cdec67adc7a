"""A float64 model with the default full backend while torch's default dtype stays float32:
H vs the exact GGN by hand, and its smallest eigenvalue."""

import json

import torch
from laplace import Laplace as LTLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac.laplace import Laplace as MJLaplace

torch.set_num_threads(1)  # the default dtype is left float32 on purpose
torch.manual_seed(0)
N, D, C = 200, 6, 4
X, y = torch.randn(N, D, dtype=torch.float64), torch.randint(0, C, (N,))
model = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, C)).double()
params = {k: v.detach() for k, v in model.named_parameters()}


def f(p, x):
    return torch.func.functional_call(model, p, (x[None],))[0]


J = torch.func.vmap(torch.func.jacrev(f), in_dims=(None, 0))(params, X)
J = torch.cat([v.flatten(2) for v in J.values()], 2)
with torch.no_grad():
    p = model(X).softmax(-1)
H_exact = torch.einsum("ncp,ncd,ndq->pq", J, torch.diag_embed(p) - p[:, :, None] * p[:, None], J)

out = {"exact_max_eig": float(torch.linalg.eigvalsh(H_exact).max())}
for name, cls in [("lt", LTLaplace), ("mj", MJLaplace)]:
    la = cls(model, "classification", subset_of_weights="all", hessian_structure="full")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=50))
    H = torch.as_tensor(la.H).detach()
    eig = torch.linalg.eigvalsh((H + H.T) / 2)
    err = float((H - H_exact).abs().max() / H_exact.abs().max())
    out[name] = {"dtype": str(H.dtype), "min_over_max_eig": float(eig[0] / eig[-1]), "rel_err": err}
print(json.dumps(out))
