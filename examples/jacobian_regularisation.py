"""Training a small CNN with the Jacobian-norm penalty ``S = sum_i sum_o |d f_o(x_i)/d theta|^2``.

``(task_loss + lam * S).backward()`` adds the exact gradient of ``S`` (second derivatives,
computed chunk by chunk by the route the library finds fastest). The same model (same initial weights, same batches) is trained twice:
with ``lam = 0`` (plain training; ``S`` is only measured) and with ``lam > 0``. Prints the task
loss and the penalty over steps for both, and the warm time of one training step with and
without the penalty (median over the steps after the first, which is a warm-up). With
matplotlib installed and ``--plot PATH`` given, saves a plot of both runs: task loss and ``S``
against the training step. A few seconds on a CPU.

Run: python examples/jacobian_regularisation.py [--steps N] [--lam LAM] [--plot PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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


def make_model() -> nn.Module:
    """The small CNN, with the same initial weights on every call."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 2),
    )


def train(lam: float, steps: int) -> tuple[list[tuple[float, float]], float]:
    """SGD on ``loss + lam * S``; returns ``[(loss, S)]`` per step and the median seconds of a
    step after the first (warm: the first step is the warm-up). ``lam == 0``: ``S`` is
    measured on every batch but not differentiated."""
    model = make_model()
    x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)  # the same batches for every lam
    history, seconds = [], []
    for step in range(steps):
        batch = torch.randperm(len(x), generator=g)[:32]
        if not lam:  # measured before the step and outside its time: plain training has no S
            penalty = mj.jacobian_sq_norm(model, x[batch], chunk_size=16).detach()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x[batch]), y[batch])
        if lam:
            penalty = mj.jacobian_sq_norm(model, x[batch], chunk_size=16)
            (loss + lam * penalty).backward()
        else:
            loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
        history.append((loss.item(), penalty.item()))
        if step % 5 == 0 or step == steps - 1:
            print(f"  step {step + 1:3d}: loss {loss.item():.3f}, penalty S {penalty.item():.2f}")
    warm = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    return history, warm


def plot_runs(plt, runs: dict[float, tuple[list[tuple[float, float]], float]], path: str) -> None:
    """Save a PNG: task loss and penalty ``S`` against the training step, one line per
    ``lam`` (``runs[lam] = ([(loss, S)] per step, warm seconds per step)``), ``lam = 0`` dashed."""
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    for lam, (history, _) in runs.items():
        steps = range(1, len(history) + 1)
        label = "λ = 0 (no penalty)" if not lam else f"λ = {lam:g}"
        style = {"color": "tab:gray", "ls": "--"} if not lam else {"color": "tab:blue"}
        ax[0].plot(steps, [h[0] for h in history], label=label, marker=".", **style)
        ax[1].plot(steps, [h[1] for h in history], label=label, marker=".", **style)
    ax[0].set_title("task loss")
    ax[0].set_xlabel("training step")
    ax[0].set_ylabel("cross-entropy on the batch")
    ax[1].set_title(
        r"Jacobian-norm penalty S = $\sum_i\sum_o\|\partial f_o(x_i)/\partial\theta\|^2$"
    )
    ax[1].set_xlabel("training step")
    ax[1].set_ylabel("S on the batch (log scale)")
    ax[1].set_yscale("log")
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle("Training with and without the Jacobian-norm penalty (same start, same batches)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--lam", type=float, default=1e-3, help="penalty weight of the second run")
    p.add_argument("--plot", help="save a PNG of loss and penalty (needs matplotlib)")
    args, _ = p.parse_known_args(argv)  # unknown options (e.g. a test runner's) are ignored
    if not args.lam > 0 or args.steps < 2:
        p.error("--lam must be > 0 (lam = 0 is always run for comparison) and --steps >= 2")
    runs = {}
    for lam in (0.0, args.lam):
        print(f"lam = {lam:g}{' (no penalty; S only measured)' if not lam else ''}:")
        runs[lam] = train(lam, args.steps)
    (plain, t_plain), (reg, t_reg) = runs[0.0], runs[args.lam]
    print(
        f"final penalty S: {plain[-1][1]:.2f} with lam = 0, {reg[-1][1]:.2f} with "
        f"lam = {args.lam:g}; final task loss {plain[-1][0]:.3f} vs {reg[-1][0]:.3f}"
    )
    print(
        f"one training step, warm (median over steps 2-{args.steps}, the first is a warm-up): "
        f"{t_plain * 1e3:.1f} ms without the penalty, {t_reg * 1e3:.1f} ms with it"
    )
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed; no plot")
            return
        plot_runs(plt, runs, args.plot)
        print(f"saved {args.plot}")


if __name__ == "__main__":
    main(sys.argv[1:])
