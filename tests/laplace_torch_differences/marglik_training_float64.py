"""marglik_training (network and prior trained together, the regression example's call) on both
sides in float64: its float32 numbers differ by a few percent after 1,000 epochs of chaotic
float32 round-off, so the agreement is checked where round-off cannot grow that much."""

import json

import laplace
import torch
from laplace.curvature.backpack import BackPackGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multiscale_jac.laplace import marglik_training

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
X = torch.rand(150, 1) * 8
y = torch.sin(X) + 0.3 * torch.randn_like(X)
out = {}
for side, train in (("lt", laplace.marglik_training), ("mj", marglik_training)):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 1))
    la, _, margliks, losses = train(
        model=model,
        train_loader=DataLoader(TensorDataset(X, y), batch_size=150),
        likelihood="regression",
        hessian_structure="full",
        backend=BackPackGGN,
        n_epochs=50,
        optimizer_kwargs={"lr": 1e-2},
        prior_structure="scalar",
    )
    out[side] = [la.sigma_noise.item(), la.prior_precision.item(), margliks[-1], losses[-1]]
print(json.dumps(out))
