"""Diagonal Fisher / GGN of a subset of parameters, streamed over data (EWC, Laplace).

Shapes (stated once): a batch of ``N`` samples; ``P`` selected entries (subset flat order); a
sample's output after ``output_fn`` keeps the batch dim of one: classification logits ``(1, C)``
or dense logits ``(1, C, *spatial)`` (one categorical per position), regression outputs of any
shape. Targets per sample: a class index ``()`` or a label map ``(*spatial)`` (positions equal to
``ignore_index`` are left out), or a regression target shaped like the output.

* ``kind="empirical"``: ``F = 1/N sum_i g_i^2`` with ``g_i = grad log p(y_i | x_i)``: the mean
  of squares, not the square of the mean gradient.
* ``kind="mc"``: the same with ``y`` drawn from the model's predictive (``mc_samples`` draws per
  input, averaged), seeded by ``generator``.
* ``kind="exact"``: ``F = 1/N sum_i diag(J_i^T Lambda_i J_i)`` with ``Lambda`` the Hessian of the
  negative log-likelihood w.r.t. the outputs (``diag(p) - p p^T`` per position; ``1/sigma^2``).

Memory: per-sample gradients (``empirical``, ``mc``) are formed ``chunk`` samples at a time and
squared into a ``(P,)`` accumulator; ``exact`` takes per-sample Jacobians of a chunk from the
engine and reduces them at once. Nothing of size ``N x P`` is held.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from ._checks import (
    check_bool,
    check_chunk_size,
    check_generator,
    check_memory_budget,
    check_model,
    check_output_fn,
    check_positive_int,
    check_train_mode_layers,
)
from .adapter import PerSampleFunction
from .engine import per_sample_jacobian
from .enums import BatchNormPolicy, InputKind, Randomness, _StrEnum, parse_enum
from .packing import PackedBatch, pack
from .subset import ParamSubset, resolve_subset

__all__ = ["DiagFisherResult", "FisherKind", "Likelihood", "diag_fisher"]


class Likelihood(_StrEnum):
    """``classification`` (softmax categorical over dim 1 of the output) or ``regression``
    (Gaussian with ``sigma_noise``)."""

    CLASSIFICATION = "classification"
    REGRESSION = "regression"


class FisherKind(_StrEnum):
    """``empirical``, ``mc`` or ``exact`` (see the module docstring)."""

    EMPIRICAL = "empirical"
    MC = "mc"
    EXACT = "exact"


@dataclass(frozen=True)
class DiagFisherResult:
    """The diagonal and how it was computed.

    Attributes:
        flat: ``(P,)`` in the subset's flat order.
        subset: The :class:`ParamSubset` that defines the order.
        num_samples: The number of inputs averaged over.
        kind: ``empirical``, ``mc`` or ``exact``.
        likelihood: ``classification`` or ``regression``.
        method: How the per-sample terms were computed (``"vmap(grad) per bucket"`` or
            ``"per-sample Jacobians (per_sample_jacobian)"``).
    """

    flat: Tensor
    subset: ParamSubset
    num_samples: int
    kind: FisherKind
    likelihood: Likelihood
    method: str = ""
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Tensor]:
        """Per-tensor diagonals shaped like the selected entries."""
        return self.subset.split(self.flat)


def diag_fisher(
    model: nn.Module,
    data: Iterable[tuple[Any, Any]],
    *,
    params: ParamSubset | str | list[str] | None = None,
    likelihood: str | Likelihood = "classification",
    kind: str | FisherKind = "empirical",
    mc_samples: int = 1,
    output_fn: Callable[[Any], Any] | None = None,
    sigma_noise: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    progress: bool = True,
    generator: torch.Generator | None = None,
    batch_norm: str | BatchNormPolicy = "error",
) -> DiagFisherResult:
    """Diagonal Fisher / GGN of the selected parameters, averaged over ``data``.

    Args:
        model: Any ``nn.Module`` (never changed).
        data: A DataLoader or any iterable of ``(inputs, targets)``; ``inputs`` in any form
            :func:`~multiscale_jac.pack` accepts, ``targets`` a tensor with a leading batch dim
            or a list of per-sample tensors (ragged label maps).
        params: Which entries (see :func:`~multiscale_jac.per_sample_jacobian`).
        likelihood: ``classification`` or ``regression``.
        kind: ``empirical``, ``mc`` or ``exact``.
        mc_samples: Draws per input for ``kind="mc"``.
        output_fn: Applied to the model's output (batch dim of one kept).
        sigma_noise: Gaussian noise scale for ``regression``.
        ignore_index: Label of positions left out (classification).
        chunk_size: Samples per vectorised call (default: 32).
        memory_budget: Passed to the engine for ``kind="exact"``.
        progress: A tqdm bar over the batches when a terminal is attached (never in logs).
        generator: Seeds the labels drawn for ``kind="mc"``.
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.

    Returns:
        A :class:`DiagFisherResult`.

    Raises:
        TypeError, ValueError: bad arguments or data (the message names the value).
    """
    model = check_model(model)
    output_fn = check_output_fn(output_fn)
    likelihood = parse_enum(Likelihood, likelihood, "likelihood")
    kind = parse_enum(FisherKind, kind, "kind")
    batch_norm_policy = parse_enum(BatchNormPolicy, batch_norm, "batch_norm")
    progress = check_bool(progress, "progress")
    mc_samples = check_positive_int(mc_samples, "mc_samples")
    if isinstance(sigma_noise, bool) or not isinstance(sigma_noise, (int, float)):
        raise TypeError(f"sigma_noise must be a positive number; got {sigma_noise!r}")
    if not sigma_noise > 0:
        raise ValueError(f"sigma_noise must be a positive number; got {sigma_noise!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int; got {ignore_index!r}")
    chunk_size = check_chunk_size(chunk_size)
    memory_budget = check_memory_budget(memory_budget)
    generator = check_generator(generator)
    subset = resolve_subset(params, model)
    eval_bn = check_train_mode_layers(model, batch_norm_policy, Randomness.ERROR)
    total = None
    count = 0
    method = ""
    for batch in _progress(data, progress):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(
                f"data must yield (inputs, targets) pairs; got a {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
        inputs, targets = batch
        packed = inputs if isinstance(inputs, PackedBatch) else pack(inputs)
        per_sample = _split_targets(targets, packed.num_samples)
        fn = PerSampleFunction(
            model, subset, packed.kind, _Capture(output_fn), eval_batch_norm=eval_bn
        )
        packed = packed.to(fn.device)
        per_sample = [t.to(fn.device) for t in per_sample]
        if kind is FisherKind.EXACT:
            part = _exact(
                fn,
                packed,
                per_sample,
                likelihood,
                sigma_noise,
                ignore_index,
                chunk_size,
                memory_budget,
                batch_norm_policy,
            )
            method = "per-sample Jacobians (per_sample_jacobian), reduced with Lambda"
        else:
            part = _gradients(
                fn,
                packed,
                per_sample,
                likelihood,
                kind,
                mc_samples,
                sigma_noise,
                ignore_index,
                chunk_size or 32,
                generator,
            )
            method = "vmap(grad) per shape bucket, chunked, squared into a (P,) accumulator"
        total = part if total is None else total + part
        count += packed.num_samples
    if total is None or count == 0:
        raise ValueError("data yielded no samples")
    return DiagFisherResult(total / count, subset, count, kind, likelihood, method)


# ---------------------------------------------------------------------- helpers
def _progress(data: Iterable, enabled: bool) -> Iterable:
    if not enabled or not sys.stderr.isatty():
        return data
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return data
    return tqdm(data, desc="diag_fisher", leave=False)


def _split_targets(targets: Any, n: int) -> list[Tensor]:
    if isinstance(targets, Tensor):
        if targets.dim() == 0 or targets.shape[0] != n:
            raise ValueError(
                f"targets must have a leading batch dim of {n} (the number of samples); got "
                f"shape {tuple(targets.shape)}"
            )
        return list(targets.unbind(0))
    if isinstance(targets, (list, tuple)) and all(isinstance(t, Tensor) for t in targets):
        if len(targets) != n:
            raise ValueError(f"got {len(targets)} targets for {n} samples")
        return list(targets)
    raise TypeError(
        f"targets must be a tensor or a list of per-sample tensors; got {type(targets).__name__}"
    )


def _nll(out: Tensor, target: Tensor, likelihood: Likelihood, sigma: float, ignore: int) -> Tensor:
    """Negative log-likelihood of one sample; ``out`` keeps its batch dim of one."""
    if likelihood is Likelihood.REGRESSION:
        if target.numel() != out.numel():
            raise ValueError(
                f"regression target has {target.numel()} entries, the output {out.numel()}"
            )
        return 0.5 * ((out.reshape(-1) - target.reshape(-1).to(out.dtype)) ** 2).sum() / sigma**2
    logits = out.reshape(out.shape[0], out.shape[1], -1)[0]  # (C, positions)
    y = target.reshape(-1).long()
    valid = y != ignore
    logp = torch.log_softmax(logits, dim=0)
    picked = logp.gather(0, torch.where(valid, y, 0).unsqueeze(0)).squeeze(0)
    return -(picked * valid.to(picked.dtype)).sum()


class _Capture:
    """An ``output_fn`` that applies the user's and keeps the (unflattened) result."""

    def __init__(self, user: Callable[[Any], Any] | None) -> None:
        self.user = user
        self.last: Tensor | None = None

    def __call__(self, out: Any) -> Any:
        out = self.user(out) if self.user is not None else out
        if not isinstance(out, Tensor):
            raise TypeError(
                f"diag_fisher needs the model (after output_fn) to return one tensor; got "
                f"{type(out).__name__}"
            )
        self.last = out
        return out


def _raw_output(
    fn: PerSampleFunction, values: tuple[Tensor, ...], levels: tuple[Tensor, ...]
) -> Tensor:
    """The sample's output after ``output_fn``, batch dim of one kept (not flattened);
    ``fn.output_fn`` must be a :class:`_Capture`."""
    fn.call(fn.full_params(values), levels)
    return fn.output_fn.last  # type: ignore[union-attr]


def _gradients(
    fn: PerSampleFunction,
    packed: PackedBatch,
    targets: list[Tensor],
    likelihood: Likelihood,
    kind: FisherKind,
    mc_samples: int,
    sigma: float,
    ignore: int,
    chunk: int,
    generator: torch.Generator | None,
) -> Tensor:
    values = fn.values()

    def loss(vals: tuple[Tensor, ...], target: Tensor, *levels: Tensor) -> Tensor:
        return _nll(_raw_output(fn, vals, levels), target, likelihood, sigma, ignore)

    def logits(vals: tuple[Tensor, ...], *levels: Tensor) -> Tensor:
        return _raw_output(fn, vals, levels)[0]

    per_grad = vmap(grad(loss), in_dims=(None, 0) + (0,) * len(packed.levels))
    total = values[0].new_zeros(fn.subset.numel)
    for b in packed.buckets():
        for s in range(0, len(b.indices), chunk):
            idx = b.indices[s : s + chunk]
            levels = packed.stack(idx)
            y = torch.stack([targets[i] for i in idx])
            draws = (
                [y]
                if kind is FisherKind.EMPIRICAL
                else _draw(
                    vmap(logits, in_dims=(None,) + (0,) * len(levels))(values, *levels),
                    y,
                    likelihood,
                    sigma,
                    ignore,
                    mc_samples,
                    generator,
                )
            )
            for yd in draws:
                g = per_grad(values, yd, *levels)  # per tensor (n, *selected)
                sq = torch.cat([t.reshape(len(idx), -1) for t in g], dim=1) ** 2
                total += sq.sum(0) / len(draws)
    return total


def _draw(
    out: Tensor,
    y: Tensor,
    likelihood: Likelihood,
    sigma: float,
    ignore: int,
    n: int,
    generator: torch.Generator | None,
) -> list[Tensor]:
    """``n`` label draws from the predictive for a chunk; ignored positions stay ignored."""
    draws = []
    with torch.no_grad():
        for _ in range(n):
            if likelihood is Likelihood.REGRESSION:
                noise = torch.randn(out.shape, generator=generator, dtype=out.dtype, device="cpu")
                draws.append((out + sigma * noise.to(out.device)).reshape(y.shape))
                continue
            logits = out.reshape(out.shape[0], out.shape[1], -1)  # (n, C, positions)
            probs = torch.softmax(logits, dim=1).transpose(1, 2).reshape(-1, out.shape[1])
            picked = torch.multinomial(probs.cpu(), 1, generator=generator).view(y.shape)
            picked = picked.to(y.device)
            draws.append(torch.where(y == ignore, y, picked) if y.dim() > 1 else picked)
    return draws


def _exact(
    fn: PerSampleFunction,
    packed: PackedBatch,
    targets: list[Tensor],
    likelihood: Likelihood,
    sigma: float,
    ignore: int,
    chunk: int | None,
    memory_budget: int | None,
    batch_norm: BatchNormPolicy,
) -> Tensor:
    """``sum_i diag(J_i^T Lambda_i J_i)`` for one batch, from the engine's per-sample Jacobians
    in chunks of samples (``fn``'s output function is a :class:`_Capture`; classification reads
    each sample's logits from it)."""
    total = None
    n = packed.num_samples
    step = chunk or 8
    values = fn.values()
    for s in range(0, n, step):
        idx = list(range(s, min(n, s + step)))
        part = _subbatch(packed, idx)
        res = per_sample_jacobian(
            fn.model,
            part,
            params=fn.subset,
            output_fn=fn.output_fn.user,  # type: ignore[union-attr]
            memory_budget=memory_budget,
            batch_norm=batch_norm,
        )
        for k, i in enumerate(idx):
            jac = res.jacobian[k, : res.output_sizes[k]]  # (O, P)
            if likelihood is Likelihood.REGRESSION:
                d = (jac**2).sum(0) / sigma**2
            else:
                out = _raw_output(fn, values, tuple(part.sample(k)))
                c = out.shape[1]
                j = jac.view(c, -1, jac.shape[-1])  # (C, positions, P)
                p = torch.softmax(out.reshape(c, -1), dim=0).unsqueeze(-1)  # (C, positions, 1)
                valid = (
                    (targets[i].reshape(-1) != ignore).to(jac.dtype) if targets[i].dim() else None
                )
                per_pos = (p * j**2).sum(0) - ((p * j).sum(0)) ** 2  # (positions, P)
                if valid is not None:
                    per_pos = per_pos * valid.unsqueeze(-1)
                d = per_pos.sum(0)
            total = d if total is None else total + d
    return total


def _subbatch(packed: PackedBatch, idx: list[int]) -> PackedBatch:
    return (
        pack([list(packed.sample(i)) for i in idx])
        if packed.kind is not InputKind.TENSOR
        else pack(torch.stack([packed.sample(i)[0] for i in idx]))
    )
