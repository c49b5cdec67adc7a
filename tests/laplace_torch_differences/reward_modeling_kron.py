"""likelihood="reward_modeling" with K-FAC (each pair folded into the batch inside the model):
both libraries' factors vs a hand K-FAC counting a pair's two rows as two calls of each layer."""

import copy
import json

import torch
from laplace import Laplace as LTLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac.laplace import Laplace as MJLaplace

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
D, E, N = 3, 6, 10


class RewardModel(nn.Module):  # laplace-torch's reward_modeling example, width 6
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, E), nn.ReLU(), nn.Linear(E, 1))

    def forward(self, x):
        return self.net(x.reshape(-1, D)).reshape(-1, 2) if x.dim() == 3 else self.net(x)


model = RewardModel()
X, y = torch.randn(N, 2, D), torch.randint(0, 2, (N,))
opt = torch.optim.AdamW(model.parameters(), weight_decay=1e-3)
for _ in range(50):
    opt.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()

# hand K-FAC: Lambda_n = Q_n Q_n^T over the pair; rows (n, r) carry q = Q_n[r, :]. Per layer
# with inputs a and output gradients g_k (one per column k of Q), weight block
# (sum_k g_k^T g_k) (x) (a^T a / N), bias block sum_k g_k^T g_k.
with torch.no_grad():
    pr = model(X).softmax(-1)
    ev, U = torch.linalg.eigh(torch.diag_embed(pr) - pr[:, :, None] * pr[:, None])
    q = (U * ev.clamp(min=0).sqrt()[:, None, :]).reshape(2 * N, 2)
    x = X.reshape(-1, D)
    z = model.net[0](x)
    g1 = q.T[:, :, None] * model.net[2].weight * (z > 0)  # (k, rows, E)
    G1, G2 = torch.einsum("kri,krj->ij", g1, g1), (q**2).sum().reshape(1, 1)
    A1, A2 = x.T @ x / N, z.relu().T @ z.relu() / N
H_hand = torch.block_diag(torch.kron(G1, A1), G1, torch.kron(G2, A2), G2)

out, kw = {}, dict(subset_of_weights="all", hessian_structure="kron")
for name, cls in [("lt", LTLaplace), ("mj", MJLaplace)]:
    la = cls(copy.deepcopy(model), "reward_modeling", **kw)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=3))  # as the example: 3, 3, 3, 1
    out[name] = (la.H_facs if name == "lt" else la.H).to_matrix().detach()
    out[f"{name}_lml"] = float(la.log_marginal_likelihood(torch.tensor(1.0)))
for a, b in [("lt", "hand"), ("mj", "hand"), ("mj", "lt")]:
    ref = H_hand if b == "hand" else out[b]
    out[f"{a}_rel_err_vs_{b}"] = float((out[a] - ref).norm() / ref.norm())
print(json.dumps({k: v for k, v in out.items() if not isinstance(v, torch.Tensor)}))
