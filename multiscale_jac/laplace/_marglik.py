"""The tuning of the prior precision, as laplace-torch does: Adam on the log prior precision
against the negative log marginal likelihood (``marglik``) or the validation loss of the
predictive on a grid (``gridsearch``, the validation batches' Jacobian rows kept across the
grid while they fit the budget)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import check_bool, check_positive_int, check_positive_number
from .._memory import DEFAULT_JACOBIAN_BYTES
from .._stream import pair, split_targets, with_progress
from ..enums import Likelihood, LinkApprox, PredType, PriorStructure, TuningMethod, parse_enum
from ._batches import DictPairs
from ._forms import NotPositiveDefinite
from ._jacobian_rows import JacobianRows
from ._options import LaplaceOptions
from ._posterior import Posterior

__all__ = ["optimize_gp_prior", "optimize_prior_precision", "validation_loss"]


def optimize_prior_precision(
    la: Any,
    rows: JacobianRows,
    posterior: Posterior,
    options: LaplaceOptions,
    choices: tuple[Any, ...],
    *,
    method: Any,
    pred_type: Any,
    n_steps: int,
    lr: float,
    init_prior_prec: Any,
    prior_structure: Any,
    val_loader: Iterable[tuple[Any, Any]] | None,
    loss: Any,
    log_prior_prec_min: float,
    log_prior_prec_max: float,
    grid_size: int,
    link_approx: Any,
    n_samples: int,
    verbose: bool,
    progress_bar: bool,
) -> None:
    """``LaplaceBase.optimize_prior_precision`` (its arguments) on the posterior ``la`` (its
    ``__call__``, ``log_marginal_likelihood`` and ``prior_precision`` are what is used) and
    its parts."""
    tuner = _Tuner(la, rows, posterior, options)
    method, pred = _method_and_pred_type(choices, method, pred_type)
    link = parse_enum(LinkApprox, link_approx, "link_approx")
    structure = parse_enum(PriorStructure, prior_structure, "prior_structure")
    show = check_bool(progress_bar, "progress_bar")
    posterior.fitted()
    if method is TuningMethod.MARGLIK:
        if val_loader is not None:
            warnings.warn(
                "val_loader is ignored by method='marglik' (did you mean 'gridsearch'?)",
                UserWarning,
                stacklevel=2,
            )
        steps = check_positive_int(n_steps, "n_steps")
        tuner.marglik(structure, steps, check_positive_number(lr, "lr"), init_prior_prec, show)
    else:
        if val_loader is None:
            raise ValueError(
                "method='gridsearch' needs val_loader, an iterable of (inputs, targets)"
            )
        size = check_positive_int(grid_size, "grid_size")
        grid = torch.logspace(
            float(log_prior_prec_min), float(log_prior_prec_max), size, dtype=posterior.mean.dtype
        )
        n_samples = check_positive_int(n_samples, "n_samples")
        la.prior_precision = tuner.gridsearch(val_loader, loss, grid, (pred, link, n_samples), show)
    if check_bool(verbose, "verbose"):
        print(f"Optimized prior precision is {la.prior_precision}.")


class _Tuner:
    """The two searches on a posterior's parts."""

    def __init__(
        self,
        la: Any,
        rows: JacobianRows,
        posterior: Posterior,
        options: LaplaceOptions,
    ) -> None:
        self._la, self._rows, self._post, self._options = la, rows, posterior, options

    def marglik(
        self, structure: PriorStructure, n_steps: int, lr: float, init: Any, show: bool
    ) -> None:
        """Adam on ``log prior_precision`` of ``structure``'s shape (or ``init``'s, when it is a
        tensor of more than one value); stores the result."""
        start = self._post.prior.form(init, "init_prior_prec", True).detach()
        if start.numel() == 1 and structure is not PriorStructure.SCALAR:
            subset = self._post.subset
            k = subset.numel if structure is PriorStructure.DIAG else len(subset.names)
            start = start.expand(k).clone()
        _adam_on_log_prior(self._la, start, n_steps, lr, show)

    def gridsearch(
        self,
        val_loader: Iterable[tuple[Any, Any]],
        loss: Any,
        grid: Tensor,
        how: tuple[PredType, LinkApprox, int],
        show: bool,
    ) -> Tensor:
        """The grid value of the smallest validation loss (a non-positive-definite posterior
        scores infinity)."""
        o = self._options
        batches = [pair(b) for b in DictPairs(val_loader, o.dict_key_x, o.dict_key_y)]
        if not batches:
            raise ValueError("val_loader yielded no batches")
        cap = o.memory_budget if o.memory_budget is not None else 4 * DEFAULT_JACOBIAN_BYTES
        dtype = self._post.mean.dtype
        results: list[float] = []
        with self._rows.remembering(cap):
            for prec in with_progress(grid, show, "gridsearch", len(grid)):
                self._la.prior_precision = prec.to(dtype)
                try:
                    likelihood, ignore = self._post.likelihood, o.ignore_index
                    results.append(
                        validation_loss(self._la, batches, loss, how, likelihood, ignore)
                    )
                except NotPositiveDefinite:
                    results.append(math.inf)
        return grid[min(range(len(results)), key=results.__getitem__)].to(dtype)


def validation_loss(
    la: Any,
    batches: list[tuple[Any, Any]],
    loss: Any,
    how: tuple[Any, LinkApprox, int],
    likelihood: Likelihood,
    ignore_index: int,
) -> float:
    """The validation loss of ``la``'s predictive (laplace-torch's ``validate``): ``loss`` (a
    metric with ``update``/``compute``, or a callable of the outputs and the targets), or by
    default the negative log probability of each valid label (classification) or the squared
    error of each output entry (regression), averaged."""
    pred, link, n_samples = how
    metric = loss is not None and hasattr(loss, "update") and hasattr(loss, "compute")
    if metric and hasattr(loss, "reset"):
        loss.reset()
    outs: list[Any] = []
    targets: list[Any] = []
    total, count = 0.0, 0
    for x, y in batches:
        out = la(x, pred_type=pred, link_approx=link, n_samples=n_samples)
        if loss is None:
            s, c = _default_loss(out, y, likelihood, ignore_index)
            total, count = total + s, count + c
        elif metric:
            _update_metric(loss, out, y)
        else:
            outs.append(out)
            targets.append(y)
    if loss is None:
        return total / max(count, 1)
    if metric:
        return float(loss.compute().sum())
    if isinstance(outs[0], tuple):
        means, variances = zip(*outs)
        return float(loss(_cat(means), _cat(variances), _cat(targets)))
    return float(loss(_cat(outs), _cat(targets)))


def _default_loss(out: Any, y: Any, likelihood: Likelihood, ignore_index: int) -> tuple[float, int]:
    """Sum and count of laplace-torch's default validation loss on one batch."""
    if likelihood is Likelihood.REGRESSION:
        mean = out[0]
        means = list(mean) if isinstance(mean, list) else list(mean.unbind(0))
        ys = split_targets(y, len(means))
        sq = [((m.reshape(-1) - t.to(m).reshape(-1)) ** 2).sum() for m, t in zip(means, ys)]
        return float(sum(sq)), sum(m.numel() for m in means)
    probs = list(out) if isinstance(out, list) else list(out.unbind(0))
    ys = split_targets(y, len(probs))
    total, count = 0.0, 0
    for pr, t in zip(probs, ys):
        flat = pr.reshape(pr.shape[0], -1)
        lab = t.to(flat.device).reshape(-1).long()
        keep = lab != ignore_index
        picked = flat.gather(0, torch.where(keep, lab, 0).unsqueeze(0)).squeeze(0)
        total -= float(picked[keep].log().sum())
        count += int(keep.sum())
    return total, count


def optimize_gp_prior(
    la: Any,
    method: Any,
    adam: tuple[Any, Any, Any],
    val_loader: Iterable[Any] | None,
    loss: Any,
    grid: tuple[float, float, int],
    how: tuple[Any, LinkApprox, int],
    show: bool,
) -> None:
    """:class:`~._gp.GPLaplace`'s prior search: ``marglik`` (Adam on the log of the one
    prior precision; ``adam`` is ``(n_steps, lr, init_prior_prec)``) or ``gridsearch`` over
    ``logspace(*grid)`` of the validation loss (``how``: ``(pred_type, link, n_samples)``)."""
    if parse_enum(TuningMethod, method, "method") is TuningMethod.MARGLIK:
        steps, lr, init = adam
        start = torch.as_tensor(init, dtype=la.mean.dtype).reshape(1)
        steps = check_positive_int(steps, "n_steps")
        _adam_on_log_prior(la, start, steps, check_positive_number(lr, "lr"), show)
        return
    if val_loader is None:
        raise ValueError("method='gridsearch' needs val_loader, an iterable of (inputs, targets)")
    batches = [pair(b) for b in DictPairs(val_loader, la.options.dict_key_x, la.options.dict_key_y)]
    values = torch.logspace(float(grid[0]), float(grid[1]), check_positive_int(grid[2], "grid_size"),
                            dtype=la.mean.dtype)  # fmt: skip
    scores = []
    for prec in with_progress(values, show, "gridsearch", len(values)):
        la.prior_precision = prec
        scores.append(validation_loss(la, batches, loss, how, la.likelihood, -100))
    la.prior_precision = values[min(range(len(scores)), key=scores.__getitem__)]


def _adam_on_log_prior(la: Any, start: Tensor, n_steps: int, lr: float, show: bool) -> None:
    """Adam on ``log prior_precision`` from ``start`` against ``la``'s negative evidence;
    stores the result in ``la.prior_precision``."""
    log_prec = start.detach().log().clone().requires_grad_(True)
    opt = torch.optim.Adam([log_prec], lr=lr)
    for _ in with_progress(range(n_steps), show, "optimize_prior_precision", n_steps):
        opt.zero_grad()
        (-la.log_marginal_likelihood(prior_precision=log_prec.exp())).backward()
        opt.step()
    la.prior_precision = log_prec.detach().exp()


def _method_and_pred_type(
    choices: tuple[Any, ...], method: Any, pred_type: Any
) -> tuple[TuningMethod, PredType]:
    """``optimize_prior_precision``'s method and predictive type from its positional
    ``choices`` (each read by its value: laplace-torch's order puts ``pred_type`` first) and
    keywords; one given twice, or a third positional, is refused with the values."""
    given: dict[str, Any] = {"method": method, "pred_type": pred_type}
    if len(choices) > 2:
        raise TypeError(
            f"optimize_prior_precision takes at most 2 positional choices; got {choices!r}"
        )
    for value in choices:
        plain = getattr(value, "value", value)
        name = "pred_type" if plain in {p.value for p in PredType} else "method"
        if given[name] is not None:
            raise ValueError(
                f"optimize_prior_precision: {name} given twice ({given[name]!r} and {value!r})"
            )
        given[name] = plain
    method = "marglik" if given["method"] is None else given["method"]
    pred_type = "glm" if given["pred_type"] is None else given["pred_type"]
    return parse_enum(TuningMethod, method, "method"), parse_enum(PredType, pred_type, "pred_type")


def _cat(parts: Sequence[Any]) -> Any:
    """Batches joined: tensors along dim 0, lists (ragged outputs) into one list."""
    if all(isinstance(p, Tensor) for p in parts):
        return torch.cat(list(parts), dim=0)
    joined: list[Tensor] = []
    for p in parts:
        joined.extend(p if isinstance(p, list) else list(p.unbind(0)))
    return joined


def _update_metric(metric: Any, out: Any, y: Any) -> None:
    """A running metric's update, as laplace-torch calls it."""
    if isinstance(out, tuple):
        try:
            metric.update(*out, y)
        except TypeError:  # a metric that takes only the mean
            metric.update(out[0], y)
    else:
        metric.update(out, y)
