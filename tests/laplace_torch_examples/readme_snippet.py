# laplace-torch README's code block (aleximmer/Laplace@44ea62a), made runnable: load_map_model(),
# train_loader, val_loader and x are defined here (a small MLP trained briefly on synthetic
# 10-class data). The Laplace calls are exactly the README's. [tests copy] Numbers at a fixed
# prior precision added at the end.
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from helper.report import R, timed

from laplace import Laplace

torch.manual_seed(0)
Xtr, ytr = torch.randn(256, 20), torch.randint(10, (256,))
Xva, yva = torch.randn(64, 20), torch.randint(10, (64,))
train_loader = DataLoader(TensorDataset(Xtr, ytr), batch_size=32)
val_loader = DataLoader(TensorDataset(Xva, yva), batch_size=32)
x = torch.randn(8, 20)


def load_map_model():
    m = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(30):
        for xb, yb in train_loader:
            opt.zero_grad(); nn.functional.cross_entropy(m(xb), yb).backward(); opt.step()
    return m


# --- README ---
# Pre-trained model
model = load_map_model()

# User-specified LA flavor
la = Laplace(model, "classification",
             subset_of_weights="all",
             hessian_structure="diag")
with timed("fit"):
    la.fit(train_loader)
la.optimize_prior_precision(
    method="gridsearch",
    pred_type="glm",
    link_approx="probit",
    val_loader=val_loader
)

# User-specified predictive approx.
pred = la(x, pred_type="glm", link_approx="probit")
# --- end README ---
R("prior_precision", la.prior_precision)
R("pred", pred)
R("log_marginal_likelihood", la.log_marginal_likelihood())
# [tests copy] added: the same at one fixed prior precision (the gridsearch above picks
# different grid values in the two libraries, see tests/test_laplace_torch_examples.py)
la.prior_precision = 1.0
R("pred_at_prior_1", la(x, pred_type="glm", link_approx="probit"))
R("log_marginal_likelihood_at_prior_1", la.log_marginal_likelihood())
print("DONE")
