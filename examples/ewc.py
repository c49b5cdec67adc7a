"""EWC with ``diag_fisher``: a drop-in replacement for the usual EWC
``_update_fisher_params`` (same buffers), on two synthetic tasks.

Task A and task B are 3-class problems on the same 20-d inputs with different labelling rules
and a shared head, so training on B overwrites A. The EWC penalty
``lam/2 * sum F (theta - theta_A)^2`` with the diagonal empirical Fisher of task A keeps more of
A. Runs in a few seconds on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import multiscale_jac as mj


def make_task(seed: int, n: int = 600) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rule = torch.randn(3, 20, generator=g)
    x = torch.randn(n, 20, generator=g)
    return x, (x @ rule.T).argmax(dim=1)


def batches(x: torch.Tensor, y: torch.Tensor, size: int = 100):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def update_fisher_params(model: nn.Module, dataloader) -> None:
    """What the usual ``_update_fisher_params`` registers, via ``diag_fisher``: per
    parameter the mean of squared per-sample gradients of log p(y|x) (not the square of the
    mean), and the parameter values (``_estimated_mean``), as buffers."""
    fisher = mj.diag_fisher(model, dataloader, kind="empirical", progress=False).as_dict()
    for name, param in model.named_parameters():
        key = name.replace(".", "__")
        model.register_buffer(key + "_estimated_fisher", fisher[name].detach().clone())
        model.register_buffer(key + "_estimated_mean", param.detach().clone())


def ewc_penalty(model: nn.Module) -> torch.Tensor:
    total = 0.0
    for name, param in model.named_parameters():
        key = name.replace(".", "__")
        f = getattr(model, key + "_estimated_fisher")
        m = getattr(model, key + "_estimated_mean")
        total = total + (f * (param - m) ** 2).sum()
    return total


def train(model, x, y, steps: int, lam: float = 0.0) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if lam:
            loss = loss + lam / 2 * ewc_penalty(model)
        loss.backward()
        opt.step()


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    torch.manual_seed(0)
    xa, ya = make_task(1)
    xb, yb = make_task(2)
    results = {}
    lam_ewc = 5000.0  # the empirical Fisher of a well-fit task is small: a large weight
    for lam in (0.0, lam_ewc):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
        train(model, xa, ya, 60)
        acc_a = accuracy(model, xa, ya)
        update_fisher_params(model.eval(), batches(xa, ya))
        train(model, xb, yb, 150, lam=lam)
        results[lam] = (acc_a, accuracy(model, xa, ya), accuracy(model, xb, yb))
        print(
            f"lam={lam:>5}: task A {acc_a:.2f} before B, {results[lam][1]:.2f} after; "
            f"task B {results[lam][2]:.2f}"
        )
    kept_plain, kept_ewc = results[0.0][1], results[lam_ewc][1]
    print(f"task-A accuracy after B: {kept_plain:.2f} without EWC, {kept_ewc:.2f} with EWC")
    assert kept_ewc > kept_plain, "EWC should retain task A better"


if __name__ == "__main__":
    main()
