# laplace-torch examples/bayesopt_example.py (aleximmer/Laplace@44ea62a), adapted: botorch and
# gpytorch are not installed, so the LaplaceBNN class is kept with every Laplace call as written
# (its botorch `Model` base replaced by nn.Module, `posterior` returning (mean, cov) instead of a
# GPyTorchPosterior) and the BO loop replaced by: fit on 20 Branin points, MSE on 10000 test points
# (evaluate_model), a joint posterior on a (B=4, q=5, d=2) batch, and 3 condition_on_observations
# steps with random proposals. Branin is written out. "R|"/"T|" lines added. [tests copy] The
# global RNG is reseeded after each fit (see there).
from __future__ import annotations

import math
import sys
import warnings

warnings.filterwarnings("ignore")

import numpy as np
import torch
import torch.utils.data as data_utils
from torch import distributions as dists
from torch import nn, optim
from torch.nn import functional as F
from helper.report import R, timed

from laplace import BaseLaplace, Laplace


def branin(x):
    x1, x2 = x[..., 0], x[..., 1]
    b, c, r, s, t = 5.1 / (4 * math.pi**2), 5 / math.pi, 6.0, 10.0, 1 / (8 * math.pi)
    return (x2 - b * x1**2 + c * x1 - r) ** 2 + s * (1 - t) * torch.cos(x1) + s


class LaplaceBNN(nn.Module):
    def __init__(self, train_X, train_Y, bnn: BaseLaplace | None = None,
                 likelihood: str = "regression", batch_size: int = 1024):
        super().__init__()
        self.train_X = train_X
        self.train_Y = train_Y
        self.likelihood = likelihood
        self.batch_size = batch_size
        self.nn = nn.Sequential(
            nn.Linear(train_X.shape[-1], 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(),
            nn.Linear(50, train_Y.shape[-1]),
        )
        self.bnn = bnn
        if self.bnn is None:
            self._train_model(self._get_train_loader())

    def posterior(self, X):
        B, Q, D = X.shape
        X = X.reshape(B * Q, D)
        mean_y, cov_y = self._get_prediction(X, use_test_loader=False)
        K = self.num_outputs
        mean_y = mean_y.reshape(B, Q * K)
        cov_y += 1e-4 * torch.eye(B * Q * K)
        cov_y = cov_y.reshape(B, Q, K, B, Q, K)
        cov_y = torch.einsum("bqkbrl->bqkrl", cov_y)  # (B, Q, K, Q, K)
        cov_y = cov_y.reshape(B, Q * K, Q * K)
        return mean_y, cov_y

    def condition_on_observations(self, X, Y, **kwargs):
        self.train_X = torch.cat([self.train_X, X], dim=0)
        self.train_Y = torch.cat([self.train_Y, Y], dim=0)
        train_loader = self._get_train_loader()
        self._train_model(train_loader)
        return LaplaceBNN(self.train_X, self.train_Y, self.bnn, self.likelihood, self.batch_size)

    @property
    def num_outputs(self) -> int:
        return self.train_Y.shape[-1]

    def _train_model(self, train_loader):
        n_epochs = 1000
        optimizer = optim.Adam(self.nn.parameters(), lr=1e-1, weight_decay=1e-3)
        scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer, n_epochs * len(train_loader))
        loss_func = nn.MSELoss()
        for i in range(n_epochs):
            for x, y in train_loader:
                optimizer.zero_grad()
                output = self.nn(x)
                loss = loss_func(output, y)
                loss.backward()
                optimizer.step()
                scheduler.step()
        self.nn.eval()
        self.bnn = Laplace(
            self.nn,
            self.likelihood,
            subset_of_weights="all",
            hessian_structure="kron",
            enable_backprop=True,
        )
        with timed("fit"):
            self.bnn.fit(train_loader)
        # [tests copy] reseeded: laplace-torch's fit iterates the shuffled train loader twice (a
        # first batch to set up, then the pass), multiscale_jac's once, so the global RNG would
        # differ from here on (the next net's init, the proposals, the shuffles)
        torch.manual_seed(len(self.train_X))
        self.bnn.optimize_prior_precision(n_steps=50)
        R("prior_precision", self.bnn.prior_precision)

    def _get_prediction(self, test_x, joint=True, use_test_loader=False):
        if self.bnn is None:
            print("Train your model first before making prediction!")
            sys.exit(1)
        if not use_test_loader:
            mean_y, cov_y = self.bnn(test_x, joint=True)
        else:
            test_loader = data_utils.DataLoader(
                data_utils.TensorDataset(test_x, torch.zeros_like(test_x)), batch_size=256)
            mean_y, cov_y = [], []
            for x_batch, _ in test_loader:
                _mean_y, _cov_y = self.bnn(x_batch, joint=joint)
                mean_y.append(_mean_y)
                cov_y.append(_cov_y)
            mean_y = torch.cat(mean_y, dim=0).squeeze()
            cov_y = torch.cat(cov_y, dim=0).squeeze()
        return mean_y, cov_y

    def _get_train_loader(self):
        return data_utils.DataLoader(
            data_utils.TensorDataset(self.train_X, self.train_Y),
            batch_size=self.batch_size, shuffle=True)


np.random.seed(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(1)
bounds = torch.tensor([[-5, 10], [0, 15]]).T.double()
train_x = torch.cat([dists.Uniform(*bounds.T[i]).sample((20, 1)) for i in range(2)], dim=1)
train_y = branin(train_x).reshape(-1, 1)
test_x = torch.cat([dists.Uniform(*bounds.T[i]).sample((10000, 1)) for i in range(2)], dim=1)
test_y = branin(test_x)

model = LaplaceBNN(train_x, train_y)
print("type:", type(model.bnn).__module__, type(model.bnn).__name__)
pred, _ = model._get_prediction(test_x, use_test_loader=True, joint=False)
R("mse", F.mse_loss(pred, test_y))
R("pred", pred)
mean, cov = model.posterior(test_x[:20].reshape(4, 5, 2))
R("post_mean", mean); R("post_cov", cov)
for step in range(3):
    new_x = torch.cat([dists.Uniform(*bounds.T[i]).sample((1, 1)) for i in range(2)], dim=1)
    model = model.condition_on_observations(new_x, branin(new_x).unsqueeze(-1))
    pred, _ = model._get_prediction(test_x, use_test_loader=True, joint=False)
    R(f"mse_step{step}", F.mse_loss(pred, test_y))
print("DONE")
