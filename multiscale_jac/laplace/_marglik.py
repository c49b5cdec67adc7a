"""The log marginal likelihood and the tuning of the prior precision.

:class:`MarginalLikelihood` is the mixin: ``log_likelihood`` and ``log_marginal_likelihood``
(differentiable in the prior precision and the noise), and ``optimize_prior_precision`` by
Adam on the log prior precision against the negative log marginal likelihood (``marglik``) or
by the validation loss of the predictive on a grid (``gridsearch``, the validation batches'
Jacobian rows kept across the grid while they fit the budget), as laplace-torch does.
"""

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
from ._curvature import BlockMemo
from ._posterior import NotPositiveDefinite, Posterior

__all__ = ["MarginalLikelihood"]


class MarginalLikelihood(Posterior):
    """The Laplace approximation of ``log p(D)`` and the prior precision that maximises it (or
    minimises a validation loss of the predictive: the class's ``__call__``)."""

    @property
    def log_likelihood(self) -> Tensor:
        """``log p(D | theta_MAP)`` with the temperature applied (see the module docstring); a
        property, as laplace-torch's."""
        return self._log_likelihood()

    @property
    def scatter(self) -> Tensor:
        """``(theta_MAP - mu_0)^T P_0 (theta_MAP - mu_0)`` (laplace-torch's name)."""
        delta = self.mean - self.prior_mean
        return (delta * self.prior_precision_diag) @ delta

    def log_prob(self, value: Tensor, normalized: bool = True) -> Tensor:
        """The posterior's log density at ``value`` ``(P,)`` (the prior's before :meth:`fit`),
        laplace-torch's call; ``normalized=False`` leaves out ``0.5 (log det P_post - P log
        2 pi)``."""
        if not isinstance(value, Tensor) or value.shape != (self.subset.numel,):
            what = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"value must be (P={self.subset.numel},); got {what}")
        d = value.to(self.mean) - self.mean
        if self.H is None:
            prior = self.prior_precision_diag
            quad, logdet = (d * prior) @ d, prior.log().sum()
        else:
            post = self.posterior_precision
            if isinstance(post, Tensor):
                quad = d @ (post @ d) if post.dim() == 2 else (d * post) @ d
            else:
                quad = d @ post.matmul(d)
            logdet = self._posterior_logdet(self.prior_precision_diag, None)
        out = -0.5 * quad
        if check_bool(normalized, "normalized"):
            out = out + 0.5 * (logdet - d.numel() * math.log(2 * math.pi))
        return out

    def _log_likelihood(self, sigma_noise: Any = None) -> Tensor:
        self._fitted()
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        sigma_t = torch.as_tensor(sigma, dtype=self.mean.dtype, device=self.mean.device)
        ll = -self._loss / (sigma_t**2 * self.temperature)
        if self.likelihood is Likelihood.REGRESSION:
            ll = ll - self._n_entries * torch.log(sigma_t * math.sqrt(2 * math.pi))
        return ll

    def log_marginal_likelihood(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """The Laplace approximation of ``log p(D)``; differentiable in tensor arguments.

        Args:
            prior_precision: Stored first, as laplace-torch does (any form the constructor
                takes; a tensor that requires grad keeps the graph), then evaluated at.
            sigma_noise: Stored first likewise (regression only).

        Returns:
            A scalar tensor.
        """
        if sigma_noise is not None and self.likelihood is not Likelihood.REGRESSION:
            raise ValueError("sigma_noise can only be changed for regression")
        if prior_precision is not None:
            self.prior_precision = prior_precision
        if sigma_noise is not None:
            self.sigma_noise = sigma_noise
        prior = self.prior_precision_diag
        logdet_post = self._posterior_logdet(prior, sigma_noise)
        logdet_prior = prior.log().sum()
        delta = self.mean - self.prior_mean
        scatter = (delta * prior) @ delta
        return self._log_likelihood(sigma_noise) - 0.5 * (logdet_post - logdet_prior + scatter)

    def optimize_prior_precision(
        self,
        *choices: str | TuningMethod | PredType,
        method: str | TuningMethod | None = None,
        pred_type: str | PredType | None = None,
        n_steps: int = 100,
        lr: float = 0.1,
        init_prior_prec: Any = 1.0,
        prior_structure: str | PriorStructure = "scalar",
        val_loader: Iterable[tuple[Any, Any]] | None = None,
        loss: Any = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
    ) -> None:
        """Tune the prior precision, as laplace-torch does, and store it.

        Args:
            *choices: ``method`` and ``pred_type`` by position in either order, each read by its
                value (``("gridsearch")`` here, laplace-torch's ``(PredType.GLM, "gridsearch")``).
            method: ``marglik`` (default: Adam on the log prior precision, maximising the log
                marginal likelihood) or ``gridsearch`` (the validation loss at ``grid_size``
                values ``logspace(log_prior_prec_min, log_prior_prec_max)``; the least wins).
            pred_type: ``glm`` (default) or ``nn``, the predictive the grid search scores.
            n_steps: Adam steps (``marglik``).
            lr: Adam learning rate (``marglik``).
            init_prior_prec: Starting value (``marglik``): a number, or a tensor whose shape
                then fixes the structure.
            prior_structure: ``scalar`` (stored as a one-element tensor), ``layerwise`` (or
                ``tensor``: one per selected tensor) or ``diag`` (``(P,)``), for a number
                ``init_prior_prec`` (``marglik``; the grid search is scalar).
            val_loader: ``(inputs, targets)`` batches for ``gridsearch`` (read once and kept
                for the search; the Jacobians of the batches are reused across the grid while
                they fit in ``memory_budget``, default 128 MiB).
            loss: The grid search's loss: ``None`` (classification: the mean negative log
                probability of the labels; regression: the mean squared error of ``f_mu``), a
                callable ``loss(probs, targets)`` / ``loss(f_mu, f_var, targets)`` on the
                concatenated predictions, or an object with ``update``/``compute`` (a
                torchmetrics metric).
            log_prior_prec_min: ``log10`` of the grid's smallest value.
            log_prior_prec_max: ``log10`` of the grid's largest value.
            grid_size: Number of grid values.
            link_approx: ``probit``, ``mc`` or ``bridge`` for the grid search's probabilities.
            n_samples: Samples for ``link_approx="mc"`` and ``pred_type="nn"``.
            verbose: Print the result.
            progress_bar: A tqdm bar over the steps or grid values when a terminal is attached.

        Returns:
            ``None`` (as laplace-torch); the result is :attr:`prior_precision`.

        Raises:
            ValueError: an unknown ``method``/``pred_type``/``link_approx``/``prior_structure``,
                ``gridsearch`` without ``val_loader``, not fitted.
        """
        method, pred = _method_and_pred_type(choices, method, pred_type)
        link = parse_enum(LinkApprox, link_approx, "link_approx")
        structure = parse_enum(PriorStructure, prior_structure, "prior_structure")
        show = check_bool(progress_bar, "progress_bar")
        self._fitted()
        if method is TuningMethod.MARGLIK:
            if val_loader is not None:
                warnings.warn(
                    "val_loader is ignored by method='marglik' (did you mean 'gridsearch'?)",
                    UserWarning,
                    stacklevel=2,
                )
            steps = check_positive_int(n_steps, "n_steps")
            self._optimize_marglik(
                structure, steps, check_positive_number(lr, "lr"), init_prior_prec, show
            )
        else:
            if val_loader is None:
                raise ValueError(
                    "method='gridsearch' needs val_loader, an iterable of (inputs, targets)"
                )
            size = check_positive_int(grid_size, "grid_size")
            grid = torch.logspace(
                float(log_prior_prec_min), float(log_prior_prec_max), size, dtype=self.mean.dtype
            )
            n_samples = check_positive_int(n_samples, "n_samples")
            self.prior_precision = self._gridsearch(
                val_loader, loss, grid, (pred, link, n_samples), show
            )
        if check_bool(verbose, "verbose"):
            print(f"Optimized prior precision is {self.prior_precision}.")

    def _optimize_marglik(
        self, structure: PriorStructure, n_steps: int, lr: float, init: Any, show: bool
    ) -> None:
        """Adam on ``log prior_precision`` of ``structure``'s shape (or ``init``'s, when it is a
        tensor of more than one value); stores the result."""
        start = self._prior_form(init, "init_prior_prec", positive=True).detach()
        if start.numel() == 1 and structure is not PriorStructure.SCALAR:
            k = self.subset.numel if structure is PriorStructure.DIAG else len(self.subset.names)
            start = start.expand(k).clone()
        log_prec = start.log().clone().requires_grad_(True)
        opt = torch.optim.Adam([log_prec], lr=lr)
        for _ in with_progress(range(n_steps), show, "optimize_prior_precision", n_steps):
            opt.zero_grad()
            loss = -self.log_marginal_likelihood(prior_precision=log_prec.exp())
            loss.backward()
            opt.step()
        self.prior_precision = log_prec.detach().exp()

    def _gridsearch(
        self,
        val_loader: Iterable[tuple[Any, Any]],
        loss: Any,
        grid: Tensor,
        how: tuple[PredType, LinkApprox, int],
        show: bool,
    ) -> Tensor:
        """The grid value of the smallest validation loss (a non-positive-definite posterior
        scores infinity)."""
        batches = [pair(b) for b in self._data(val_loader)]
        if not batches:
            raise ValueError("val_loader yielded no batches")
        cap = self.memory_budget if self.memory_budget is not None else 4 * DEFAULT_JACOBIAN_BYTES
        self._memo = BlockMemo(cap)
        results: list[float] = []
        try:
            for prec in with_progress(grid, show, "gridsearch", len(grid)):
                self.prior_precision = prec.to(self.mean.dtype)
                try:
                    results.append(self._validate(batches, loss, *how))
                except NotPositiveDefinite:
                    results.append(math.inf)
        finally:
            self._memo = None
        return grid[min(range(len(results)), key=results.__getitem__)].to(self.mean.dtype)

    def _validate(
        self,
        batches: list[tuple[Any, Any]],
        loss: Any,
        pred: PredType,
        link: LinkApprox,
        n_samples: int,
    ) -> float:
        """The validation loss of the predictive (laplace-torch's ``validate``)."""
        metric = loss is not None and hasattr(loss, "update") and hasattr(loss, "compute")
        if metric and hasattr(loss, "reset"):
            loss.reset()
        outs: list[Any] = []
        targets: list[Any] = []
        total, count = 0.0, 0
        for x, y in batches:
            out = self(x, pred_type=pred, link_approx=link, n_samples=n_samples)
            if loss is None:
                s, c = self._default_loss(out, y)
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

    def _default_loss(self, out: Any, y: Any) -> tuple[float, int]:
        """Sum and count of laplace-torch's default validation loss on one batch: the negative
        log probability of each valid label (classification), the squared error of each output
        entry (regression)."""
        if self.likelihood is Likelihood.REGRESSION:
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
            keep = lab != self.ignore_index
            picked = flat.gather(0, torch.where(keep, lab, 0).unsqueeze(0)).squeeze(0)
            total -= float(picked[keep].log().sum())
            count += int(keep.sum())
        return total, count


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
