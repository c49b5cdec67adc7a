"""Training a small CNN with the Jacobian-norm penalty ``S = sum_i sum_o |d f_o(x_i)/d theta|^2``.

``(task_loss + lam * S).backward()`` adds the exact gradient of ``S`` (Hessian-vector products,
computed chunk by chunk). Prints the loss and the penalty over steps and, if matplotlib is
installed and ``--plot PATH`` is given, saves a plot. A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import multiscale_jac as mj


def data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(2, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g)
    x[:, :, 2:6, 2:6] += (2 * y - 1).view(-1, 1, 1, 1).float()  # a bright or dark square
    return x, y


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--lam", type=float, default=1e-3)
    p.add_argument("--plot", help="save a PNG of loss and penalty (needs matplotlib)")
    args, _ = p.parse_known_args(argv)  # unknown options (e.g. a test runner's) are ignored
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 2),
    )
    x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    history = []
    for step in range(args.steps):
        batch = torch.randperm(len(x))[:32]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[batch]), y[batch])
        penalty = mj.jacobian_sq_norm(model, x[batch], chunk_size=16)
        (loss + args.lam * penalty).backward()
        opt.step()
        history.append((loss.item(), penalty.item()))
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}: loss {loss.item():.3f}, penalty S {penalty.item():.2f}")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed; no plot")
            return
        fig, ax = plt.subplots(1, 2, figsize=(8, 3))
        ax[0].plot([h[0] for h in history])
        ax[0].set_title("task loss")
        ax[1].plot([h[1] for h in history])
        ax[1].set_title("Jacobian-norm penalty S")
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"saved {args.plot}")


if __name__ == "__main__":
    main(sys.argv[1:])
