"""The likelihood maths of the diagonal Fisher and the Laplace approximation (private).

Shapes (stated once): a sample's output after ``output_fn`` keeps its batch dim of one;
classification logits are ``(n, C, *spatial)`` (softmax over dim 1, one categorical per position;
vector logits have no spatial dims) and targets class indices ``(n, *spatial)`` where positions
equal to ``ignore_index`` are left out; regression outputs have any shape and targets the same
number of entries. ``Lambda``, the Hessian of the negative log-likelihood w.r.t. the outputs, is
``diag(p) - p p^T`` per position (classification) or ``I / sigma^2`` (regression).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .enums import ArgumentTypeError, Likelihood

__all__ = [
    "check_target",
    "check_targets",
    "draw_noise",
    "ggn_factors",
    "labels_from_noise",
    "nll_sum",
    "output_gradient",
]


def output_dim(shape: tuple[int, ...] | torch.Size) -> int:
    """The size of dim 1 of a batched output from a sample's output ``shape`` (batch dim
    dropped): classes, channels or regression outputs; 1 for one value per sample."""
    return int(shape[0]) if len(shape) else 1


def check_target(
    target: Tensor, out_shape: torch.Size, likelihood: Likelihood, ignore_index: int, i: int
) -> Tensor:
    """Validate one sample's target against its output shape ``(C, *spatial)`` / ``(*out)``
    (no batch dim); returns it flattened (class indices as int64).

    Raises:
        TypeError: float or complex class labels.
        ValueError: a shape mismatch, a label outside ``0..C-1`` (other than ``ignore_index``),
            a non-finite regression target.
    """
    if likelihood is Likelihood.REGRESSION:
        y = target.reshape(-1)
        if y.numel() != math.prod(out_shape):
            raise ValueError(
                f"targets[{i}]: the regression target has {y.numel()} entries, the output "
                f"{math.prod(out_shape)} (target shape {tuple(target.shape)}, output shape "
                f"{tuple(out_shape)})"
            )
        if y.is_floating_point() and not bool(torch.isfinite(y).all()):
            k = int((~torch.isfinite(y)).nonzero()[0, 0])
            raise ValueError(f"targets[{i}]: the regression target has {y[k].item()} at entry {k}")
        return y
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ArgumentTypeError(
            f"targets[{i}]: classification targets must be integer class indices; got dtype "
            f"{target.dtype} (values such as {target.reshape(-1)[:3].tolist()}). Convert "
            "labels with .long() if they are whole numbers; a float target is not a class"
        )
    if len(out_shape) == 0:
        raise ValueError("classification needs logits with a class dim; got a scalar output")
    y = target.reshape(-1).long()
    positions = math.prod(out_shape[1:])
    if y.numel() != positions:
        raise ValueError(
            f"targets[{i}]: the classification target has {y.numel()} positions, the logits "
            f"{positions} (target shape {tuple(target.shape)}, output shape {tuple(out_shape)})"
        )
    classes = int(out_shape[0])
    bad = ((y < 0) | (y >= classes)) & (y != ignore_index)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        where = f" at position {k}" if y.numel() > 1 else ""
        raise ValueError(
            f"targets[{i}]: label {int(y[k])}{where} is out of range for {classes} classes "
            f"(valid: 0..{classes - 1}, or ignore_index={ignore_index})"
        )
    return y


def check_targets(
    targets: list[Tensor],
    out_shape: torch.Size,
    likelihood: Likelihood,
    ignore_index: int,
    numbers: list[int],
) -> list[Tensor]:
    """:func:`check_target` of samples ``numbers`` (as errors name them) that share
    ``out_shape``, at one check for all where their targets share a shape and dtype (a
    per-sample check costs a device sync: 4 ms per 128 samples); the error names the first
    bad sample all the same."""
    if len(targets) < 2 or len({(tuple(t.shape), t.dtype) for t in targets}) > 1:
        return [
            check_target(y, out_shape, likelihood, ignore_index, i)
            for y, i in zip(targets, numbers)
        ]
    check_target(targets[0], out_shape, likelihood, ignore_index, numbers[0])  # shape, dtype
    stacked = torch.stack(targets).reshape(len(targets), -1)
    if likelihood is Likelihood.REGRESSION:
        bad = ~torch.isfinite(stacked) if stacked.is_floating_point() else None
    else:
        stacked = stacked.long()
        classes = int(out_shape[0])
        bad = ((stacked < 0) | (stacked >= classes)) & (stacked != ignore_index)
    if bad is not None and bool(bad.any()):
        k = int(bad.any(dim=1).nonzero()[0, 0])
        check_target(targets[k], out_shape, likelihood, ignore_index, numbers[k])  # raises
    return list(stacked.unbind(0))


def nll_sum(
    out: Tensor, target: Tensor, likelihood: Likelihood, sigma: float, ignore_index: int
) -> Tensor:
    """Negative log-likelihood summed over samples and positions: ``out`` ``(n, ...)``,
    ``target`` ``(n, ...)`` (regression: ``0.5 |f - y|^2 / sigma^2``, no constant)."""
    n = out.shape[0]
    if likelihood is Likelihood.REGRESSION:
        diff = out.reshape(n, -1) - target.reshape(n, -1).to(out.dtype)
        return 0.5 * (diff**2).sum() / sigma**2
    logits = out.reshape(n, out.shape[1], -1)  # (n, C, positions)
    y = target.reshape(n, -1).long()
    valid = y != ignore_index
    logp = torch.log_softmax(logits, dim=1)
    picked = logp.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
    return -(picked * valid.to(picked.dtype)).sum()


def ggn_factors(
    out: Tensor, jac: Tensor, likelihood: Likelihood, valid: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """``J^T Lambda J = A^T A - B^T B`` at ``sigma = 1`` for one sample's rows.

    Args:
        out: Classification: logits ``(C, m)`` of ``m`` positions; regression: ``(rows,)``.
        jac: ``(rows, P)``, rows in ``out``'s flat (class-major) order.
        likelihood: Classification or regression.
        valid: ``(m,)`` bool, positions that count (classification); ``None``: all.

    Returns:
        ``(A, B)``: classification ``A = sqrt(p) J`` ``(C m, P)`` and ``B = sum_c p_c J_c``
        ``(m, P)``; regression ``(J, None)``.
    """
    if likelihood is Likelihood.REGRESSION:
        return jac, None
    c, m = out.shape
    prob = torch.softmax(out, dim=0)
    if valid is not None:
        prob = prob * valid.to(prob.dtype)
    j = jac.reshape(c, m, -1)
    root = (prob.sqrt().unsqueeze(-1) * j).reshape(c * m, -1)
    mixed = (prob.unsqueeze(-1) * j).sum(0)
    return root, mixed


def output_gradient(
    out: Tensor, y: Tensor, likelihood: Likelihood, valid: Tensor | None = None
) -> Tensor:
    """``dNLL / d out`` at ``sigma = 1``, flat in ``out``'s order: ``p - onehot(y)`` per valid
    position (``out`` ``(C, m)``, ``y`` ``(m,)``) or ``f - y`` (regression)."""
    if likelihood is Likelihood.REGRESSION:
        return out.reshape(-1) - y.to(out.dtype)
    prob = torch.softmax(out, dim=0)
    index = y if valid is None else torch.where(valid, y, 0)
    onehot = torch.zeros_like(prob).scatter_(0, index.unsqueeze(0), 1.0)
    grad = prob - onehot
    if valid is not None:
        grad = grad * valid.to(grad.dtype)
    return grad.reshape(-1)


def draw_noise(
    out_shape: torch.Size, likelihood: Likelihood, draws: int, generator: torch.Generator | None
) -> list[Tensor]:
    """The randomness of ``draws`` label draws for a chunk whose outputs are ``out_shape``
    ``(n, ...)``: uniforms ``(n, *spatial)`` (classification) or standard normals shaped like the
    outputs (regression), on the CPU, seeded by ``generator``."""
    shape = out_shape if likelihood is Likelihood.REGRESSION else (out_shape[0], *out_shape[2:])
    make = torch.randn if likelihood is Likelihood.REGRESSION else torch.rand
    return [make(shape, generator=generator, dtype=torch.float64) for _ in range(draws)]


def labels_from_noise(
    out: Tensor, noise: Tensor, y: Tensor, likelihood: Likelihood, sigma: float, ignore_index: int
) -> Tensor:
    """Targets drawn from the predictive at ``out`` ``(n, ...)`` with :func:`draw_noise`'s
    ``noise``, shaped like ``y`` (inverse-CDF sampling of the softmax per position; ignored
    positions stay ignored). Pure tensor code: it runs under ``vmap``, so a label is drawn from
    the very forward pass its gradient is taken in."""
    out = out.detach()
    noise = noise.to(device=out.device, dtype=out.dtype)
    if likelihood is Likelihood.REGRESSION:
        return (out + sigma * noise).reshape(y.shape)
    cdf = torch.softmax(out, dim=1).cumsum(dim=1)
    picked = (cdf < noise.unsqueeze(1)).sum(dim=1).clamp(max=out.shape[1] - 1).reshape(y.shape)
    return torch.where(y == ignore_index, y, picked)
