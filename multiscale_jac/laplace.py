"""Subnetwork Laplace and the linearised (GLM) predictive for multiscale networks.

The posterior over a :class:`~multiscale_jac.subset.ParamSubset` ``theta`` (``P`` entries,
everything else fixed at the MAP) is ``N(theta_MAP, Sigma)`` with precision

    ``P_post = H / (sigma^s T) + diag(prior_precision)``

where ``H = sum_i J_i^T Lambda_i J_i`` is accumulated over the data by :meth:`SubnetLaplace.fit`
(``J_i`` ``(O_i, P)``: the per-sample Jacobian of the outputs on the subset; ``Lambda_i``: the
Hessian of the negative log-likelihood w.r.t. the outputs at ``sigma = 1``), ``T`` the
temperature and ``s = 2`` (``s = 4`` for the empirical Fisher of a regression, whose gradients
carry ``1/sigma^2`` each). Conventions follow laplace-torch (Immer et al. 2021, Daxberger et al.
2021) so the numbers agree with it where it can run:

* classification: ``Lambda_i`` per output position is ``diag(p) - p p^T`` (softmax over dim 1
  of the model output, so vector logits ``(C,)`` and dense logits ``(C, *spatial)`` per sample);
  positions whose label is ``ignore_index`` contribute nothing; ``sigma_noise`` must be 1.
* regression: ``Lambda_i = I``; the loss is ``0.5 sum (f - y)^2``.
* ``log_marginal_likelihood = -loss / (sigma^2 T) - c - 0.5 (log det P_post - log det P_0 +
  (theta - mu_0)^T P_0 (theta - mu_0))`` with ``c = n_out log(sigma sqrt(2 pi))`` for regression
  (``n_out``: output entries seen by :meth:`~SubnetLaplace.fit`), 0 for classification.

Only a chunk of Jacobian rows is ever held (``memory_budget``): never ``N x O x P`` and never
the model's full Jacobian. Padded positions of ragged multi-level batches do not exist in the
per-sample outputs (every sample runs unpadded through the engine), so they contribute nothing.

:class:`DiagLaplace` keeps only the diagonal of ``H`` (``(P,)``, from
:func:`~multiscale_jac.diag_fisher`'s closed forms), so it scales to every weight of a network.
:func:`Laplace` is laplace-torch's front door: ``subset_of_weights`` and ``hessian_structure``
choose the class, and both classes answer laplace-torch's calls (``la(x)``,
``predictive_samples``, ``optimize_prior_precision(method=...)``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ._checks import (
    check_bool,
    check_chunk_size,
    check_generator,
    check_int,
    check_memory_budget,
    check_positive_int,
    check_positive_number,
    prepare,
    warn_fallback,
)
from ._distributed import Reducer
from ._likelihood import check_target, ggn_factors, nll_sum, output_gradient
from ._ops import twice_differentiable
from ._planning import EngineOptions
from ._stream import Capture, pair, raw_output, split_targets, with_progress
from .adapter import PerSampleFunction
from .engine import run_engine
from .enums import (
    BatchNormPolicy,
    Entries,
    FisherMethod,
    HessianKind,
    HessianStructure,
    InputKind,
    Likelihood,
    LinkApprox,
    MemoryBudgetError,
    PredType,
    PriorStructure,
    Randomness,
    SubsetOfWeights,
    TuningMethod,
    parse_enum,
)
from .fisher import diag_fisher
from .packing import PackedBatch
from .subset import ParamSubset

__all__ = [
    "DiagLaplace",
    "GLMPredictive",
    "Laplace",
    "SubnetLaplace",
]


class _Block(NamedTuple):
    """Rows of one sample's Jacobian: ``out`` the outputs of the rows (classification:
    ``(C, m)``, all classes of ``m`` positions; regression: ``(rows,)``), ``jac`` ``(rows, P)``,
    ``span`` the positions (classification) or entries (regression) ``[a, b)`` covered and
    ``shape`` the sample's whole output shape (no batch dim). A fit's block of a whole sample
    may carry its curvature instead of rows (``jac`` ``None``): ``ggn`` ``(P, P)``, or the
    gradient ``(P,)`` for the empirical Fisher."""

    i: int
    out: Tensor
    jac: Tensor | None
    span: tuple[int, int]
    shape: torch.Size
    ggn: Tensor | None = None


#: default bytes for the Jacobian rows held at once (per chunk of samples or output positions)
DEFAULT_JACOBIAN_BYTES = 32 * 2**20


@dataclass(frozen=True)
class GLMPredictive:
    """The linearised predictive ``f(x) + J (theta - theta_MAP)`` at a batch of inputs.

    Per-sample tensors are stacked to ``(N, *out)`` when every sample's output has one shape,
    and given as lists of ``(*out)`` tensors otherwise (ragged dense outputs). ``*out`` is the
    per-sample output shape after ``output_fn`` without the batch dim of one.

    Attributes:
        mean: ``f(x)``, the output at the MAP.
        variance: Marginal variances of ``f`` (``diag(J Sigma J^T)``), shaped like ``mean``;
            epistemic only (add ``sigma_noise**2`` for a regression's predictive of ``y``).
        covariance: ``J Sigma J^T`` ``(N, O, O)`` when every output is a vector (a list of
            ``(O_i, O_i)`` when their sizes differ); ``None`` for dense outputs, whose
            covariance is never formed.
        probs: Classification: class probabilities shaped like ``mean`` (``link_approx``).
        link_approx: The link approximation used, ``None`` for regression.
    """

    mean: Tensor | list[Tensor]
    variance: Tensor | list[Tensor]
    covariance: Tensor | list[Tensor] | None = None
    probs: Tensor | list[Tensor] | None = None
    link_approx: LinkApprox | None = None


class SubnetLaplace:
    """Laplace approximation over a subset of a model's parameter entries.

    Args:
        model: Any ``nn.Module`` at its MAP; never changed (inputs: anything
            :func:`~multiscale_jac.pack` accepts).
        likelihood: ``classification`` or ``regression``.
        subset: A :class:`ParamSubset` (entries or whole tensors), a name/glob or list of them.
        prior_precision: A number, a ``(P,)`` diagonal, one value per selected tensor (a
            sequence or ``{name: value}``).
        sigma_noise: Gaussian noise scale (regression; must be 1 for classification).
        temperature: ``T``; the curvature is divided by it.
        prior_mean: A number or a ``(P,)`` vector.
        hessian: ``ggn`` (default) or ``empirical``.
        output_fn: Applied to the model's output (batch dim of one kept).
        ignore_index: Label of positions left out of dense classification.
        input_kind: How to read inputs where it is ambiguous (:func:`~multiscale_jac.pack`).
        chunk_size: Samples per engine call (default: as many as the Jacobian rows allow).
        memory_budget: Bytes of the working set of :meth:`fit` and :meth:`predictive`,
            including the ``(P, P)`` curvature and its factor. Samples are taken in chunks and
            a sample whose Jacobian rows do not fit in slices of its output positions. Default:
            32 MiB of Jacobian rows at a time and the engine's default working set.
        randomness: ``error``, ``different`` or ``same``, as in ``torch.func.vmap``; the
            outputs and Jacobians of a sample come from one pass (one set of masks).
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        strict: Raise instead of letting the engine fall back to another strategy.
        entries: How the engine forms single-entry columns (``auto``, ``structured`` or
            ``generic``; see :func:`~multiscale_jac.per_sample_jacobian`).

    The options shared with the other entry points mean the same everywhere (the options table
    in ``docs/design.md``); the subset is called ``subset`` here, as in laplace-torch.

    laplace-torch's calls work too: ``la(x, pred_type=, link_approx=, n_samples=)`` (probabilities
    or ``(f_mu, f_var)``), :meth:`predictive_samples`, ``fit(train_loader, override,
    progress_bar)`` and ``optimize_prior_precision(method="marglik" | "gridsearch", ...)``;
    :func:`Laplace` builds this class from laplace-torch's arguments.

    Raises:
        TypeError, ValueError: bad arguments (the message names the value).
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: ParamSubset | str | Sequence[str],
        *,
        prior_precision: Any = 1.0,
        sigma_noise: float = 1.0,
        temperature: float = 1.0,
        prior_mean: Any = 0.0,
        hessian: str | HessianKind = "ggn",
        output_fn: Callable[[Any], Any] | None = None,
        ignore_index: int = -100,
        input_kind: str | InputKind | None = None,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        randomness: str | Randomness = "error",
        batch_norm: str | BatchNormPolicy = "error",
        strict: bool = False,
        entries: str | Entries = "auto",
    ) -> None:
        self._prep = prepare(
            model,
            params=subset,
            params_name="subset",
            output_fn=output_fn,
            batch_norm=batch_norm,
            randomness=randomness,
            input_kind=input_kind,
        )
        self.model, self.subset, self.output_fn = model, self._prep.subset, output_fn
        self.likelihood = parse_enum(Likelihood, likelihood, "likelihood")
        self.hessian = parse_enum(HessianKind, hessian, "hessian")
        self.ignore_index = check_int(ignore_index, "ignore_index")
        self.chunk_size = check_chunk_size(chunk_size)
        self.memory_budget = check_memory_budget(memory_budget)
        self.strict = check_bool(strict, "strict")
        self.entries = parse_enum(Entries, entries, "entries")
        self.mean = self.subset.flatten(self.subset.check_model(model)).detach().clone()
        self.temperature = check_positive_number(temperature, "temperature")
        self.sigma_noise = check_positive_number(sigma_noise, "sigma_noise")
        if self.likelihood is Likelihood.CLASSIFICATION and self.sigma_noise != 1.0:
            raise ValueError(f"sigma_noise must be 1 for classification; got {sigma_noise!r}")
        self.prior_mean = self._vector(prior_mean, "prior_mean", positive=False)
        self._prior_precision = self._form(prior_precision, "prior_precision", positive=True)
        self.H: Tensor | None = None
        self.loss = 0.0
        self.n_data = 0
        self.n_outputs = 0
        self._chol: Tensor | None = None
        self._fallbacks: list[str] = []
        self._memo: _BlockMemo | None = None

    @property
    def n_params(self) -> int:
        """``P``, the number of entries the posterior is over."""
        return self.subset.numel

    # ------------------------------------------------------------------ fitting
    def fit(
        self,
        train_loader: Iterable[tuple[Any, Any]],
        override: bool = True,
        progress_bar: bool = False,
        *,
        progress: bool = False,
        process_group: Any = None,
        max_outputs_per_sample: int | None = None,
        generator: torch.Generator | None = None,
    ) -> SubnetLaplace:
        """Accumulate the subset curvature ``H`` (``(P, P)``) and the loss at the MAP.

        Args:
            train_loader: An iterable of ``(inputs, targets)`` (a DataLoader, a list of pairs);
                ``inputs`` in any form :func:`~multiscale_jac.pack` accepts, ``targets`` a
                tensor with a leading batch dim or a list of per-sample tensors (ragged label
                maps).
            override: Start from zero (``False`` adds to a previous fit: online / continual
                learning).
            progress_bar: laplace-torch's name for ``progress``.
            progress: A tqdm bar over the batches when a terminal is attached.
            process_group: With ``torch.distributed`` initialised, every rank fits its shard of
                the data and ``H``, the loss and the counts are all-reduced once at the end:
                every rank ends with the fit over all of the data (``None``: the default group).
            max_outputs_per_sample: Opt-in unbiased subsampling of the curvature (``None``:
                exact). A sample with more output positions ``M`` (classification: pixels, all
                classes of a pixel kept together; regression: output entries) than this
                contributes the GGN of ``m = max_outputs_per_sample`` positions drawn
                uniformly without replacement, times ``M / m``: its expectation is the exact
                GGN. Its rows are ``C m`` pullbacks through one forward pass: the cost follows
                ``m``, not the image size. The loss stays exact; ``hessian="ggn"`` only.
            generator: Seeds the subsampling.

        Returns:
            ``self``.
        """
        progress = check_bool(progress, "progress") | check_bool(progress_bar, "progress_bar")
        override = check_bool(override, "override")
        sampling = _Sampling(
            self._check_max_outputs(max_outputs_per_sample), check_generator(generator)
        )
        data = train_loader
        reducer = Reducer(process_group)
        p = self.subset.numel
        previous = None if override or self.H is None else self.H
        stats = (0.0, 0, 0) if previous is None else (self.loss, self.n_data, self.n_outputs)
        # this rank's shard from zero, summed over the ranks at the end
        self.H = self.mean.new_zeros(p, p)
        self.loss, self.n_outputs = 0.0, 0
        seen = 0
        for batch in with_progress(reducer.shard(data), progress, f"{type(self).__name__}.fit"):
            inputs, targets = pair(batch)
            packed = self._prep.pack(inputs, finite=True)
            per_sample = [t.to(self.mean.device) for t in split_targets(targets, len(packed))]
            pending: Tensor | None = None  # empirical: a sample's gradient, over its blocks
            spec = _FitSpec(per_sample, seen, self, sampling)
            for block in self._jacobians(packed, spec):
                y = check_target(
                    per_sample[block.i],
                    block.shape,
                    self.likelihood,
                    self.ignore_index,
                    seen + block.i,
                )
                g = self._accumulate(block, y)
                if g is None:
                    continue
                if pending is not None and block.span[0] == 0:  # a new sample starts
                    self.H.addr_(pending, pending)
                    pending = None
                pending = g if pending is None else pending + g
            if pending is not None:
                self.H.addr_(pending, pending)
            seen += packed.num_samples
        reducer.sum_([self.H])
        loss, seen_f, n_out = reducer.sum_numbers(
            [self.loss, float(seen), float(self.n_outputs)], self.H
        )
        if seen_f == 0:
            self.H = previous
            raise ValueError("data yielded no samples")
        if previous is not None:
            self.H += previous
        self.loss = stats[0] + loss
        self.n_data = stats[1] + int(seen_f)
        self.n_outputs = stats[2] + int(n_out)
        self._chol = None
        self._warn_fallbacks()
        return self

    def _accumulate(self, block: _Block, y: Tensor) -> Tensor | None:
        """Add one block's GGN and loss (``y``: the sample's checked, flat target); the
        empirical Fisher's gradient part is returned (its outer product is taken once a
        sample's blocks are summed)."""
        h = self._fitted()
        out, jac, (a, b) = block.out, block.jac, block.span
        regression = self.likelihood is Likelihood.REGRESSION
        y = y[a:b].to(out.dtype) if regression else y[a:b]
        valid = None if regression else y != self.ignore_index
        rows = out.reshape(1, -1) if regression else out.unsqueeze(0)
        self.loss += float(nll_sum(rows, y.unsqueeze(0), self.likelihood, 1.0, self.ignore_index))
        self.n_outputs += out.numel() if regression else 0
        if block.ggn is not None:  # a whole sample's curvature (or gradient), computed already
            if block.ggn.dim() == 1:
                return block.ggn
            h.add_(block.ggn)
            return None
        if jac is None:  # pragma: no cover - a block without curvature carries its Jacobian
            raise RuntimeError("internal error: a Laplace block carries neither curvature nor rows")
        if self.hessian is HessianKind.EMPIRICAL:
            return jac.T @ output_gradient(out, y, self.likelihood, valid)
        root, mixed = ggn_factors(out, jac, self.likelihood, valid)
        h.addmm_(root.T, root)
        if mixed is not None:
            h.addmm_(mixed.T, mixed, alpha=-1.0)
        return None

    # ------------------------------------------------------------------ posterior
    @property
    def prior_precision(self) -> Tensor:
        """The prior precision as given: ``(1,)`` (one value, as laplace-torch stores a scalar),
        ``(K,)`` (one per selected tensor) or ``(P,)``. Assign a number, a tensor, a sequence
        or ``{name: value}``; the cached posterior factor is then recomputed."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None:
        self._prior_precision = self._form(value, "prior_precision", positive=True)
        self._chol = None

    @property
    def prior_precision_diag(self) -> Tensor:
        """The prior precision expanded to the ``(P,)`` diagonal ``p_0``."""
        return self._expand(self._prior_precision)

    def _factor(self, sigma: Tensor | float) -> Tensor | float:
        """``1 / (sigma^s T)``: ``s = 4`` for a regression's empirical Fisher, else 2."""
        empirical_regression = (
            self.hessian is HessianKind.EMPIRICAL and self.likelihood is Likelihood.REGRESSION
        )
        return 1.0 / (sigma ** (4 if empirical_regression else 2) * self.temperature)

    def posterior_precision_matrix(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """``P_post`` ``(P, P)`` (differentiable in tensor-valued arguments)."""
        h = self._fitted()
        prior = self._prior(prior_precision)
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        return h * self._factor(sigma) + torch.diag_embed(prior)

    @property
    def posterior_precision(self) -> Tensor:
        """``P_post`` ``(P, P)`` at the current prior precision and noise."""
        return self.posterior_precision_matrix()

    @property
    def posterior_scale(self) -> Tensor:
        """Lower Cholesky factor ``L`` of ``P_post`` (``Sigma = L^{-T} L^{-1}``), cached."""
        if self._chol is None:
            self._chol = _cholesky(self.posterior_precision)
        return self._chol

    @property
    def posterior_covariance(self) -> Tensor:
        """``Sigma = P_post^{-1}`` ``(P, P)``."""
        return torch.cholesky_inverse(self.posterior_scale)

    @property
    def posterior_variance(self) -> Tensor:
        """``diag(Sigma)`` ``(P,)``."""
        return self.posterior_covariance.diagonal()

    def _posterior_logdet(self, prior: Tensor, sigma_noise: Any) -> Tensor:
        """``log det P_post`` at a ``(P,)`` prior and a noise (differentiable in both)."""
        chol = _cholesky(self.posterior_precision_matrix(prior, sigma_noise))
        return 2 * chol.diagonal().log().sum()

    def _whiten(self, jac: Tensor) -> Tensor:
        """``V`` ``(P, rows)`` with ``V^T V = J Sigma J^T`` for Jacobian rows ``jac``."""
        return torch.linalg.solve_triangular(self.posterior_scale, jac.T, upper=False)

    def _draw(self, z: Tensor) -> Tensor:
        """Standard normals ``z`` ``(P, S)`` -> draws ``(P, S)`` from ``N(0, Sigma)``."""
        return torch.linalg.solve_triangular(self.posterior_scale.T, z, upper=True)

    def _kept_bytes(self) -> int:
        """Bytes of what the posterior keeps: the ``(P, P)`` curvature and its factor."""
        p, s = self.subset.numel, self.mean.element_size()
        return 2 * p * p * s + 4 * p * s

    def log_likelihood(self, sigma_noise: Any = None) -> Tensor:
        """``log p(D | theta_MAP)`` with the temperature applied (see the module docstring)."""
        self._fitted()
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        sigma_t = torch.as_tensor(sigma, dtype=self.mean.dtype, device=self.mean.device)
        ll = -self.loss / (sigma_t**2 * self.temperature)
        if self.likelihood is Likelihood.REGRESSION:
            ll = ll - self.n_outputs * torch.log(sigma_t * math.sqrt(2 * math.pi))
        return ll

    def log_marginal_likelihood(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """The Laplace approximation of ``log p(D)``; differentiable in tensor arguments.

        Args:
            prior_precision: Evaluates at this prior precision instead of the stored one (any
                form the constructor takes; a tensor that requires grad keeps the graph). The
                stored value is not changed (laplace-torch stores it).
            sigma_noise: Evaluates at this noise scale (regression only), likewise.

        Returns:
            A scalar tensor.
        """
        if sigma_noise is not None and self.likelihood is not Likelihood.REGRESSION:
            raise ValueError("sigma_noise can only be changed for regression")
        prior = self._prior(prior_precision)
        logdet_post = self._posterior_logdet(prior, sigma_noise)
        logdet_prior = prior.log().sum()
        delta = self.mean - self.prior_mean
        scatter = (delta * prior) @ delta
        return self.log_likelihood(sigma_noise) - 0.5 * (logdet_post - logdet_prior + scatter)

    def optimize_prior_precision(
        self,
        method: str | TuningMethod = "marglik",
        *,
        pred_type: str | PredType = "glm",
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
            method: ``marglik`` (Adam on the log prior precision, maximising the log marginal
                likelihood) or ``gridsearch`` (the validation loss at ``grid_size`` values
                ``logspace(log_prior_prec_min, log_prior_prec_max)``; the smallest wins).
            pred_type: ``glm`` or ``nn``, the predictive the grid search scores.
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
        method = parse_enum(TuningMethod, method, "method")
        pred = parse_enum(PredType, pred_type, "pred_type")
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
        start = self._form(init, "init_prior_prec", positive=True).detach()
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
        batches = [pair(b) for b in val_loader]
        if not batches:
            raise ValueError("val_loader yielded no batches")
        cap = self.memory_budget if self.memory_budget is not None else 4 * DEFAULT_JACOBIAN_BYTES
        self._memo = _BlockMemo(cap)
        results: list[float] = []
        try:
            for prec in with_progress(grid, show, "gridsearch", len(grid)):
                self.prior_precision = prec.to(self.mean.dtype)
                try:
                    results.append(self._validate(batches, loss, *how))
                except _NotPositiveDefinite:
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

    # ------------------------------------------------------------------ sampling / predictive
    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """``n_samples`` draws ``(n_samples, P)`` from the posterior over the selected entries
        (laplace-torch's subnetwork Laplace returns every parameter, the rest at the MAP)."""
        n = check_positive_int(n_samples, "n_samples")
        generator = check_generator(generator)
        z = torch.randn(n, self.subset.numel, generator=generator, dtype=self.mean.dtype)
        return self.mean + self._draw(z.to(self.mean.device).T).T

    def __call__(
        self,
        x: Any,
        pred_type: str | PredType = "glm",
        joint: bool = False,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor | list[Tensor] | tuple[Any, Any]:
        """laplace-torch's predictive at ``x`` (any form :func:`~multiscale_jac.pack` accepts).

        Args:
            x: The inputs.
            pred_type: ``glm`` (linearised) or ``nn`` (the model run with posterior samples;
                classification then needs ``link_approx="mc"``).
            joint: Must be ``False`` (a covariance across samples is not formed).
            link_approx: ``probit``, ``mc`` or ``bridge`` (classification).
            n_samples: Samples for ``mc`` and ``nn``.
            diagonal_output: Regression ``glm``: the marginal variances ``(N, O)`` instead of
                the covariance.
            generator: Seeds the sampling.

        Returns:
            Classification: probabilities ``(N, C)`` (dense logits: ``(N, C, *spatial)``, a
            softmax per position; ragged outputs: a list of ``(C, *spatial_i)``). Regression:
            ``(f_mu, f_var)`` with ``f_mu`` ``(N, O)`` and ``f_var`` ``(N, O, O)`` for vector
            outputs; for dense outputs (or ``diagonal_output``, or a sample sliced under
            ``memory_budget``) ``f_var`` holds the marginal variances shaped like ``f_mu``
            (lists for ragged outputs). ``pred_type="nn"``: the sample mean and the (unbiased)
            sample variance.
        """
        pred = parse_enum(PredType, pred_type, "pred_type")
        link = parse_enum(LinkApprox, link_approx, "link_approx")
        n_samples = check_positive_int(n_samples, "n_samples")
        diagonal_output = check_bool(diagonal_output, "diagonal_output")
        if check_bool(joint, "joint"):
            raise ValueError(
                "joint=True (one covariance across the samples of the batch) is not supported; "
                "use functional_samples for joint draws"
            )
        cls = self.likelihood is Likelihood.CLASSIFICATION
        if pred is PredType.NN:
            if cls and link is not LinkApprox.MC:
                raise ValueError(
                    f"pred_type='nn' supports only link_approx='mc'; got {link.value!r}"
                )
            samples = self.functional_samples(x, n_samples, linearized=False, generator=generator)
            if cls:
                return _per_sample(samples, lambda s: _softmax(s).mean(0))
            return _per_sample(samples, lambda s: s.mean(0)), _per_sample(
                samples, lambda s: s.var(0)
            )
        generator = check_generator(generator)
        covariance = not cls and not diagonal_output
        out = self._predictive(x, link, n_samples, generator, covariance=covariance)
        if cls:
            return out.probs  # type: ignore[return-value]
        if diagonal_output or out.covariance is None:
            return out.mean, out.variance
        return out.mean, out.covariance

    def predictive_samples(
        self,
        x: Any,
        pred_type: str | PredType = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor | list[Tensor]:
        """Samples of the predictive at ``x``: ``(n_samples, N, *out)`` (a list of
        ``(n_samples, *out_i)`` for ragged outputs); class probabilities (a softmax over the
        class dim) for classification, outputs for regression.

        Args:
            x: The inputs.
            pred_type: ``glm`` (linearised, exact joint draws over each sample's outputs) or
                ``nn`` (the model run with posterior samples).
            n_samples: Number of samples.
            diagonal_output: ``glm``: independent draws per output from the marginal variances.
            generator: Seeds the draws.
        """
        pred = parse_enum(PredType, pred_type, "pred_type")
        n_samples = check_positive_int(n_samples, "n_samples")
        generator = check_generator(generator)
        if pred is PredType.GLM and check_bool(diagonal_output, "diagonal_output"):
            p = self.predictive(x, link_approx="probit")

            def draw(m: Tensor, v: Tensor) -> Tensor:
                z = torch.randn((n_samples, *m.shape), generator=generator, dtype=m.dtype)
                return m + v.sqrt() * z.to(m.device)

            if isinstance(p.mean, list):
                samples: Tensor | list[Tensor] = [draw(m, v) for m, v in zip(p.mean, p.variance)]
            else:
                samples = draw(p.mean, p.variance)  # type: ignore[arg-type]
        else:
            samples = self.functional_samples(
                x, n_samples, linearized=pred is PredType.GLM, generator=generator
            )
        if self.likelihood is Likelihood.CLASSIFICATION:
            return _per_sample(samples, _softmax, batched=False)
        return samples

    def predictive(
        self,
        inputs: Any,
        *,
        link_approx: str | LinkApprox = "probit",
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> GLMPredictive:
        """The GLM predictive at ``inputs`` (any form :func:`~multiscale_jac.pack` accepts).

        Marginal variances are ``||V_o||^2`` per output row (``V = L^{-1} J^T``), computed in
        chunks of rows; dense outputs never form an ``O x O`` matrix.

        Args:
            inputs: The batch.
            link_approx: ``probit``, ``mc`` or ``bridge`` (classification).
            n_samples: Joint samples for ``mc``.
            generator: Seeds ``mc``.
        """
        link = parse_enum(LinkApprox, link_approx, "link_approx")
        n_samples = check_positive_int(n_samples, "n_samples")
        generator = check_generator(generator)
        return self._predictive(inputs, link, n_samples, generator, covariance=True)

    def _predictive(
        self,
        inputs: Any,
        link: LinkApprox,
        n_samples: int,
        generator: torch.Generator | None,
        covariance: bool,
    ) -> GLMPredictive:
        """:meth:`predictive` on checked arguments; ``covariance=False`` skips the ``O x O``
        covariances of vector outputs."""
        self._fitted()
        packed = self._prep.pack(inputs)
        n = packed.num_samples
        means: list[list[Tensor]] = [[] for _ in range(n)]
        variances: list[list[Tensor]] = [[] for _ in range(n)]
        covs: list[list[Tensor]] = [[] for _ in range(n)]
        probs: list[list[Tensor]] = [[] for _ in range(n)]
        shapes: list[torch.Size] = [torch.Size()] * n
        vector = True
        cls = self.likelihood is Likelihood.CLASSIFICATION
        for block in self._blocks(inputs, packed):
            i, out, jac, shape = block.i, block.out, block.jac, block.shape
            if jac is None:  # pragma: no cover - predictive blocks always carry rows
                raise RuntimeError("internal error: a predictive block without Jacobian rows")
            shapes[i] = shape
            v = self._whiten(jac)  # (P, rows)
            var = (v * v).sum(0)
            f = out.reshape(-1)
            means[i].append(f)
            variances[i].append(var)
            vector = vector and len(shape) <= 1 and covariance
            if vector:
                covs[i].append(v.T @ v)
            if cls:
                pr = self._probs(link, f.view(out.shape[0], -1), var, v, jac, n_samples, generator)
                probs[i].append(pr.reshape(-1))
        mean = _stack_or_list([_join(b, s, cls) for b, s in zip(means, shapes)])
        variance = _stack_or_list([_join(b, s, cls) for b, s in zip(variances, shapes)])
        cov_out = None
        if vector and all(len(c) == 1 for c in covs):
            cov_out = _stack_or_list([c[0] for c in covs])
        prob_out = (
            _stack_or_list([_join(b, s, cls) for b, s in zip(probs, shapes)]) if cls else None
        )
        self._warn_fallbacks()
        return GLMPredictive(mean, variance, cov_out, prob_out, link if cls else None)

    def _probs(
        self,
        link: LinkApprox,
        logits: Tensor,
        var: Tensor,
        v: Tensor,
        jac: Tensor,
        n_samples: int,
        generator: torch.Generator | None,
    ) -> Tensor:
        """Class probabilities ``(C, m)`` of one block: ``logits`` ``(C, m)``, the marginal
        variances ``var`` and the whitened rows ``v`` ``(P, C m)`` of the Jacobian rows
        ``jac``."""
        c = logits.shape[0]
        if link is LinkApprox.PROBIT:
            kappa = torch.rsqrt(1 + math.pi / 8 * var.view(c, -1))
            return torch.softmax(kappa * logits, dim=0)
        if link is LinkApprox.BRIDGE:
            vc = v.view(-1, c, logits.shape[1])  # (P, C, m)
            cov = torch.einsum("pcm,pdm->mcd", vc, vc)
            return _bridge(logits.T, cov).T
        z = torch.randn(n_samples, v.shape[0], generator=generator, dtype=v.dtype).to(v.device)
        eps = self._draw(z.T)  # (P, S)
        fs = logits.reshape(1, -1) + (jac @ eps).T  # (S, rows)
        return torch.softmax(fs.view(n_samples, c, -1), dim=1).mean(0)

    def functional_samples(
        self,
        inputs: Any,
        n_samples: int,
        *,
        linearized: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor | list[Tensor]:
        """``n_samples`` output samples per input: ``(n_samples, N, *out)`` (a list of
        ``(n_samples, *out)`` for ragged outputs).

        Args:
            linearized: ``f + J (theta_s - theta_MAP)`` (the GLM predictive); ``False`` runs the
                model with the sampled entries in place (a functional call; the model itself is
                not changed).
        """
        n_samples = check_positive_int(n_samples, "n_samples")
        linearized = check_bool(linearized, "linearized")
        thetas = self.sample(n_samples, generator=generator)  # (S, P)
        packed = self._prep.pack(inputs)
        n = packed.num_samples
        cls = self.likelihood is Likelihood.CLASSIFICATION
        out: list[Tensor] = []
        if linearized:
            delta = (thetas - self.mean).T  # (P, S)
            parts: list[list[Tensor]] = [[] for _ in range(n)]
            shapes: list[torch.Size] = [torch.Size()] * n
            for block in self._jacobians(packed):
                shapes[block.i] = block.shape
                f = block.out.reshape(-1).unsqueeze(-1)
                parts[block.i].append((f + block.jac @ delta).T)  # (S, rows)
            out = [_join(p, s, cls, lead=n_samples) for p, s in zip(parts, shapes)]
        else:
            fn = self._function(packed)
            with torch.no_grad():
                for i in range(n):
                    levels = tuple(packed.sample(i))
                    rows = [
                        raw_output(fn, tuple(self.subset.split(theta).values()), levels)[0]
                        for theta in thetas
                    ]
                    out.append(torch.stack(rows))
        self._warn_fallbacks()
        return _stack_or_list(out, dim=1)

    # ------------------------------------------------------------------ internals
    def _fitted(self) -> Tensor:
        if self.H is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(data) first")
        return self.H

    def _blocks(self, inputs: Any, packed: PackedBatch) -> Iterable[_Block]:
        """:meth:`_jacobians`, or the blocks kept for ``inputs`` during a grid search (kept
        while the memo's byte cap allows)."""
        memo = self._memo
        if memo is None:
            return self._jacobians(packed)
        key = id(inputs)
        if key in memo.blocks:
            return memo.blocks[key]
        return memo.keep(key, self._jacobians(packed))

    def _function(
        self, packed: PackedBatch, output_fn: Callable[[Any], Any] | None = None
    ) -> PerSampleFunction:
        return self._prep.function(
            packed, output_fn=output_fn or Capture(self.output_fn, "SubnetLaplace")
        )

    def _budget(
        self, packed: PackedBatch, shapes: list[torch.Size], options: EngineOptions
    ) -> tuple[int, int | None]:
        """Bytes of Jacobian rows held at once (3 copies of each: rows, a copy, a product) and
        the engine's ``memory_budget``, from :attr:`memory_budget`: the ``(P, P)`` curvature and
        its factor, and the engine's working set for the rows (asked of the engine itself, for
        the rows of one output position of the largest sample) must fit."""
        if self.memory_budget is None:
            return DEFAULT_JACOBIAN_BYTES, None
        p, s = self.subset.numel, self.mean.element_size()
        kept = self._kept_bytes()
        cls = self.likelihood is Likelihood.CLASSIFICATION
        i = packed.largest_sample
        least = int(shapes[i][0]) if cls else 1  # the rows of one output position
        try:  # the engine's own minimum for those rows (it plans, then refuses a 1-byte budget)
            probe = dataclasses.replace(options, memory_budget=1, strict=False)
            self._engine(packed.select([i]), _span_fn(self.output_fn, 0, 1, cls), probe)
            engine = 0
        except MemoryBudgetError as err:
            engine = err.minimum
        ours = 3 * p * s  # per row: the rows, a copy, a product
        if kept + least * ours + engine > self.memory_budget:
            raise MemoryBudgetError(
                self.memory_budget,
                kept + least * ours + engine,
                f"the posterior over P={p} entries takes {kept} bytes, the "
                f"Jacobian rows of one output position {least * ours} and the engine computing "
                f"them {engine}",
            )
        # the engine's working set grows by about 3 rows per row (its result, the outputs and
        # the per-sample pieces)
        grows = 3 * (p + 1) * s
        base = max(0, engine - least * grows)
        rows = max(least, (self.memory_budget - kept - base) // (ours + grows))
        return rows * ours, self.memory_budget - kept - rows * ours

    def _jacobians(self, packed: PackedBatch, fit: _FitSpec | None = None) -> Iterator[_Block]:
        """The Jacobian rows of every sample with the outputs of the same pass, in sample order,
        a chunk of samples (or, for one sample above the budget, of its output positions) at a
        time. In a fit (``fit``), a sample above the budget or subsampled comes as one block
        carrying its curvature (:meth:`_curvature`): the model is not re-run per slice."""
        fn = self._function(packed)
        values = fn.values()
        n = packed.num_samples
        shapes: list[torch.Size] = [torch.Size()] * n
        with torch.no_grad():  # one forward pass per shape bucket: its samples' outputs agree
            for bucket in packed.buckets():
                shape = raw_output(fn, values, tuple(packed.sample(bucket.indices[0]))).shape
                for i in bucket.indices:
                    shapes[i] = shape[1:]
        per_row = max(1, self.subset.numel * self.mean.element_size() * 3)
        options = EngineOptions(
            entries=self.entries,
            chunk_size=self.chunk_size,
            randomness=self._prep.randomness,
            strict=self.strict,
        )
        row_bytes, engine_budget = self._budget(packed, shapes, options)
        options = dataclasses.replace(options, memory_budget=engine_budget)
        most = self.chunk_size or n

        def alone(i: int) -> bool:  # a fit's sample above the budget or subsampled
            big = math.prod(shapes[i]) * per_row > row_bytes
            return fit is not None and (big or fit.sampled(self._positions(shapes[i])))

        start = 0
        while start < n:
            if alone(start):
                yield self._curvature(packed, start, shapes[start], fit, row_bytes)
                start += 1
                continue
            stop, rows = start + 1, math.prod(shapes[start])
            while (
                stop < n
                and stop - start < most
                and not alone(stop)
                and (rows + math.prod(shapes[stop])) * per_row <= row_bytes
            ):
                rows += math.prod(shapes[stop])
                stop += 1
            if rows * per_row > row_bytes and stop - start == 1:  # slices of its positions
                yield from self._sliced(packed, start, shapes[start], row_bytes, options)
            else:
                idx = list(range(start, stop))
                res = self._engine(packed.select(idx), None, options)
                for k, i in enumerate(idx):
                    o = res.output_sizes[k]
                    out = self._rows(res.outputs[k, :o], shapes[i])
                    yield _Block(i, out, res.jacobian[k, :o], (0, out.shape[-1]), shapes[i])
            start = stop

    def _rows(self, flat: Tensor, shape: torch.Size) -> Tensor:
        """A sample's flat outputs as block rows: ``(C, positions)`` or ``(entries,)``."""
        if self.likelihood is Likelihood.CLASSIFICATION:
            if len(shape) == 0:
                raise ValueError("classification needs logits with a class dim; got a scalar")
            return flat.reshape(shape[0], -1)
        return flat.reshape(-1)

    def _sliced(
        self,
        packed: PackedBatch,
        i: int,
        shape: torch.Size,
        row_bytes: int,
        options: EngineOptions,
    ) -> Iterator[_Block]:
        one = packed.select([i])
        cls = self.likelihood is Likelihood.CLASSIFICATION
        width = math.prod(shape[1:]) if cls else math.prod(shape)
        per_row = max(1, self.subset.numel * self.mean.element_size() * 3)
        step = max(1, row_bytes // (per_row * (shape[0] if cls else 1)))
        for a in range(0, width, step):
            b = min(width, a + step)
            res = self._engine(one, _span_fn(self.output_fn, a, b, cls), options)
            rows = res.output_sizes[0]
            out = self._rows(res.outputs[0, :rows], shape)
            yield _Block(i, out, res.jacobian[0, :rows], (a, b), shape)

    def _positions(self, shape: torch.Size) -> int:
        """Output positions of a sample (classification: pixels; regression: entries)."""
        cls = self.likelihood is Likelihood.CLASSIFICATION
        return math.prod(shape[1:]) if cls else math.prod(shape)

    def _check_max_outputs(self, value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"max_outputs_per_sample must be None or a positive int; got {value!r}"
            )
        if self.hessian is HessianKind.EMPIRICAL:
            raise ValueError(
                "max_outputs_per_sample subsamples the GGN; hessian='empirical' has no "
                f"unbiased subsample (got max_outputs_per_sample={value!r})"
            )
        return value

    def _curvature(
        self,
        packed: PackedBatch,
        i: int,
        shape: torch.Size,
        fit: _FitSpec,
        row_bytes: int,
    ) -> _Block:
        """Sample ``i``'s block carrying its whole curvature, from ONE forward pass kept for
        reverse mode (its pullback ``pull``): the empirical gradient (one pullback); a random
        subset of its positions, or all of its rows when they are no more than ``P``, by
        pulling the rows back in blocks (:meth:`_reverse_ggn`); else ``H[:, A] = J^T Lambda
        J_A`` for column chunks ``A`` of the entries, ``J_A`` and its pullback from the same
        pass (:meth:`_column_ggn`). The model runs once for the sample, however many slices
        its rows would need."""
        one = packed.select([i])
        fn = self._function(one)
        levels = tuple(one.sample(0))
        with twice_differentiable():  # the column route differentiates the pullback
            flat, pull = torch.func.vjp(lambda *v: fn(v, *levels), *fn.values())
        out = self._rows(flat.detach(), shape)
        y = fit.target(i, shape)
        cls = self.likelihood is Likelihood.CLASSIFICATION
        valid = y != self.ignore_index if cls else None
        if self.hessian is HessianKind.EMPIRICAL:
            grad = output_gradient(out, y if cls else y.to(out.dtype), self.likelihood, valid)
            ggn = self._pulled(pull, grad.unsqueeze(0))[0]
        elif fit.sampled(self._positions(shape)) or out.numel() <= self.subset.numel:
            positions, scale = fit.sampling.draw(self._positions(shape), out.device)
            ggn = self._reverse_ggn(out, pull, valid, positions, row_bytes) * scale
        else:
            ggn = self._column_ggn(out, pull, valid, row_bytes)
        return _Block(i, out, None, (0, out.shape[-1]), shape, ggn)

    def _pulled(self, pull: Callable[..., tuple[Tensor, ...]], cot: Tensor) -> Tensor:
        """``cot @ J`` ``(r, P)`` (flat order) for cotangents ``cot`` ``(r, O)`` through one
        kept forward pass."""
        grads = torch.func.vmap(pull)(cot)
        return self.subset.to_flat_order(torch.cat([g.reshape(len(cot), -1) for g in grads], 1))

    def _reverse_ggn(
        self,
        out: Tensor,
        pull: Callable[..., tuple[Tensor, ...]],
        valid: Tensor | None,
        positions: Tensor,
        row_bytes: int,
    ) -> Tensor:
        """``sum J_q^T Lambda_q J_q`` over ``positions`` (all classes of each), the rows
        pulled back in blocks that fit ``row_bytes`` (each row: itself, its one-hot cotangent
        and the pulled copy)."""
        p, s = self.subset.numel, out.element_size()
        c = out.shape[0] if out.dim() == 2 else 1
        width, total = out.shape[-1], out.numel()
        step = max(1, row_bytes // (c * (3 * p + 2 * total) * s))
        h = out.new_zeros(p, p)
        for a in range(0, len(positions), step):
            q = positions[a : a + step]
            rows = (torch.arange(c, device=q.device).unsqueeze(1) * width + q).reshape(-1)
            cot = out.new_zeros(rows.numel(), total)
            cot[torch.arange(rows.numel(), device=q.device), rows] = 1
            jac = self._pulled(pull, cot)
            sub = out[:, q] if out.dim() == 2 else out[q]
            root, mixed = ggn_factors(
                sub, jac, self.likelihood, None if valid is None else valid[q]
            )
            h.addmm_(root.T, root)
            if mixed is not None:
                h.addmm_(mixed.T, mixed, alpha=-1.0)
        return h

    def _column_ggn(
        self,
        out: Tensor,
        pull: Callable[..., tuple[Tensor, ...]],
        valid: Tensor | None,
        row_bytes: int,
    ) -> Tensor:
        """``J^T Lambda J`` by column chunks ``A`` of the entries, all from the one kept
        forward pass: ``J_A`` by transposing the pullback (``v -> J^T v`` is linear, so its own
        pullback is ``u -> J u``: a double backward, vmapped over the chunk's one-hot
        tangents), then ``Lambda J_A`` pulled back gives the rows ``H[A, :]``. ``k`` columns
        at a time from ``row_bytes`` (the chunk, ``Lambda J_A`` and the pulled copy)."""
        p, column = self.subset.numel, out.numel() * out.element_size()
        k = max(1, min(p, row_bytes // (3 * column)))
        _, transposed = torch.func.vjp(pull, out.new_zeros(out.numel()))
        eye = torch.eye(p, dtype=out.dtype, device=out.device)

        def ggn_column(*tangent: Tensor) -> Tensor:  # J^T Lambda J e_j, grouped
            col = transposed(tangent)[0].unsqueeze(1)  # J e_j (O, 1)
            grads = pull(_lambda_times(out, col, self.likelihood, valid).squeeze(1))
            return torch.cat([g.reshape(-1) for g in grads])

        h = out.new_zeros(p, p)
        for a in range(0, p, k):
            tangents = tuple(self.subset.split(eye[a : a + k]).values())
            h[a : a + k] = self.subset.to_flat_order(torch.func.vmap(ggn_column)(*tangents))
        return (h + h.T) / 2

    def _engine(
        self,
        packed: PackedBatch,
        output_fn: Callable[[Any], Any] | None,
        options: EngineOptions,
    ) -> Any:
        fn = self._prep.function(packed, output_fn=output_fn or self.output_fn)
        res = run_engine(fn, packed, options)
        self._fallbacks.append(res.fallback or "")
        return res

    def _warn_fallbacks(self) -> None:
        fallbacks, self._fallbacks = self._fallbacks, []
        warn_fallback(fallbacks)

    def _vector(self, value: Any, what: str, positive: bool) -> Tensor:
        """A number, ``(P,)``, one value per selected tensor (sequence or dict) -> ``(P,)``."""
        return self._expand(self._form(value, what, positive))

    def _form(self, value: Any, what: str, positive: bool) -> Tensor:
        """A number, ``(P,)``, one value per selected tensor (sequence or dict), checked, as a
        1-d tensor of 1, ``K`` (selected tensors) or ``P`` values (differentiable)."""
        p, names = self.subset.numel, self.subset.names
        dtype, device = self.mean.dtype, self.mean.device
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in names]
            missing = [k for k in names if k not in value]
            if unknown or missing:
                raise ValueError(
                    f"{what}: keys must be the selected tensors {list(names)}; unknown "
                    f"{unknown}, missing {missing}"
                )
            value = [value[k] for k in names]
        if isinstance(value, bool) or not isinstance(value, (int, float, Tensor, list, tuple)):
            raise TypeError(f"{what} must be a number, a tensor or a sequence; got {value!r}")
        t = (
            torch.as_tensor(value, dtype=dtype, device=device)
            if not isinstance(value, Tensor)
            else value.to(dtype=dtype, device=device)
        )
        if t.dim() > 1 or t.numel() not in (1, p, len(names)):
            raise ValueError(
                f"{what} must be a number, P={p} values or one per selected tensor "
                f"({len(names)}); got shape {tuple(t.shape)}"
            )
        if positive and not bool((t.detach() > 0).all()):
            raise ValueError(f"{what} must be positive; got {value!r}")
        return t.reshape(-1)

    def _expand(self, t: Tensor) -> Tensor:
        """A checked 1-d form (:meth:`_form`) -> the ``(P,)`` diagonal in flat order."""
        p = self.subset.numel
        if t.numel() == p:
            return t
        if t.numel() == 1:
            return t.reshape(()).expand(p)
        sizes = [b - a for a, b in self.subset.offsets.values()]
        return self.subset.to_flat_order(
            torch.repeat_interleave(t, torch.tensor(sizes, device=t.device))
        )

    def _prior(self, prior_precision: Any) -> Tensor:
        if prior_precision is None:
            return self.prior_precision_diag
        return self._vector(prior_precision, "prior_precision", positive=True)

    def __repr__(self) -> str:
        fitted = f"fitted on {self.n_data} samples" if self.H is not None else "not fitted"
        return (
            f"{type(self).__name__}(likelihood={self.likelihood.value!r}, P={self.subset.numel}, "
            f"hessian={self.hessian.value!r}, {fitted})"
        )


class DiagLaplace(SubnetLaplace):
    """Diagonal Laplace: ``P_post = diag(h) / (sigma^s T) + diag(p_0)``, where ``h`` ``(P,)`` is
    the diagonal of ``sum_i J_i^T Lambda_i J_i`` (``hessian="ggn"``) or of ``sum_i g_i g_i^T``
    (``hessian="empirical"``).

    ``h`` comes from :func:`~multiscale_jac.diag_fisher`'s closed forms (per-layer sums of
    squares from batched passes; ``vmap`` or per-sample Jacobians where a layer has none), so the
    memory is ``O(P)`` and every weight of a network can be covered. Everything else is
    :class:`SubnetLaplace`'s, with the diagonal in place of the full matrix: the marginal
    likelihood (``log det P_post`` is the sum of the logs of the diagonal), the GLM predictive
    ``f_var = J diag(Sigma) J^T`` (per-sample Jacobian rows in chunks, never ``N x P``), the
    link approximations, sampling, prior tuning and laplace-torch's calls. laplace-torch's
    ``DiagLaplace`` computes the same quantities.

    Args:
        model: Any ``nn.Module`` at its MAP; never changed.
        likelihood: ``classification`` or ``regression``.
        subset: The entries the posterior is over (a :class:`ParamSubset`, a name/glob or a
            list of them); default: every parameter that requires grad.
        prior_precision: A number, a ``(P,)`` diagonal or one value per selected tensor.
        sigma_noise: Gaussian noise scale (regression; must be 1 for classification).
        temperature: ``T``; the curvature is divided by it.
        prior_mean: A number or a ``(P,)`` vector.
        hessian: ``ggn`` (default; one backward pass per class, or per regression output, of
            a chunk) or ``empirical`` (one backward pass per chunk).
        output_fn: Applied to the model's output (batch dim of one kept).
        ignore_index: Label of positions left out of dense classification.
        input_kind: How to read inputs where it is ambiguous (:func:`~multiscale_jac.pack`).
        chunk_size: Samples per batched run (fit) and per engine call (predictive).
        memory_budget: Bytes of the working set of :meth:`fit` (see
            :func:`~multiscale_jac.diag_fisher`) and of :meth:`predictive`.
        randomness: ``error``, ``different`` or ``same``, as in ``torch.func.vmap``.
        batch_norm: ``"error"`` or ``"eval"`` for BatchNorm layers in train mode.
        strict: Raise instead of falling back.
        entries: How the predictive's engine forms single-entry columns.
        method: How :func:`~multiscale_jac.diag_fisher` computes ``h`` (``auto``,
            ``layerwise`` or ``vmap``).

    Raises:
        TypeError, ValueError: bad arguments (the message names the value).
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: ParamSubset | str | Sequence[str] | None = None,
        *,
        prior_precision: Any = 1.0,
        sigma_noise: float = 1.0,
        temperature: float = 1.0,
        prior_mean: Any = 0.0,
        hessian: str | HessianKind = "ggn",
        output_fn: Callable[[Any], Any] | None = None,
        ignore_index: int = -100,
        input_kind: str | InputKind | None = None,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        randomness: str | Randomness = "error",
        batch_norm: str | BatchNormPolicy = "error",
        strict: bool = False,
        entries: str | Entries = "auto",
        method: str | FisherMethod = "auto",
    ) -> None:
        if subset is None and isinstance(model, nn.Module):
            subset = ParamSubset.all(model, trainable_only=True)
        super().__init__(
            model,
            likelihood,
            subset,  # type: ignore[arg-type]
            prior_precision=prior_precision,
            sigma_noise=sigma_noise,
            temperature=temperature,
            prior_mean=prior_mean,
            hessian=hessian,
            output_fn=output_fn,
            ignore_index=ignore_index,
            input_kind=input_kind,
            chunk_size=chunk_size,
            memory_budget=memory_budget,
            randomness=randomness,
            batch_norm=batch_norm,
            strict=strict,
            entries=entries,
        )
        self._fisher_options = {
            "output_fn": output_fn,
            "ignore_index": self.ignore_index,
            "input_kind": input_kind,
            "chunk_size": self.chunk_size,
            "memory_budget": self.memory_budget,
            "randomness": randomness,
            "batch_norm": batch_norm,
            "strict": self.strict,
            "method": parse_enum(FisherMethod, method, "method"),
        }

    def fit(
        self,
        train_loader: Iterable[tuple[Any, Any]],
        override: bool = True,
        progress_bar: bool = False,
        *,
        progress: bool = False,
        process_group: Any = None,
    ) -> DiagLaplace:
        """Accumulate the diagonal curvature ``h`` (``(P,)``) and the loss at the MAP, in one
        pass over the data (arguments as :meth:`SubnetLaplace.fit`).

        Returns:
            ``self``.
        """
        show = check_bool(progress, "progress") | check_bool(progress_bar, "progress_bar")
        override = check_bool(override, "override")
        kind = "exact" if self.hessian is HessianKind.GGN else "empirical"
        res = diag_fisher(  # the loss at the MAP from the fisher's own forward passes
            self.model,
            train_loader,
            params=self.subset,
            likelihood=self.likelihood,
            kind=kind,
            sigma_noise=1.0,
            progress=show,
            process_group=process_group,
            return_loss=True,
            **self._fisher_options,
        )
        h = (res.flat * res.num_samples).to(self.mean)
        loss = float(res.loss)  # type: ignore[arg-type]
        n_out = res.num_outputs if self.likelihood is Likelihood.REGRESSION else 0
        if override or self.H is None:
            self.H, self.loss, self.n_data, self.n_outputs = h, loss, 0, 0
        else:
            self.H, self.loss = self.H + h, self.loss + loss
        self.n_data += res.num_samples
        self.n_outputs += int(n_out)
        self._chol = None
        return self

    # ------------------------------------------------------------------ posterior (diagonal)
    def posterior_precision_matrix(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """The diagonal of ``P_post``, ``(P,)`` (differentiable in tensor-valued arguments)."""
        h = self._fitted()
        prior = self._prior(prior_precision)
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        return h * self._factor(sigma) + prior

    @property
    def posterior_precision(self) -> Tensor:
        """The diagonal of ``P_post``, ``(P,)``."""
        return self.posterior_precision_matrix()

    @property
    def posterior_scale(self) -> Tensor:
        """``diag(Sigma)^(1/2)``, ``(P,)``, cached."""
        if self._chol is None:
            self._chol = self.posterior_precision.rsqrt()
        return self._chol

    @property
    def posterior_variance(self) -> Tensor:
        """``diag(Sigma)``, ``(P,)``."""
        return 1 / self.posterior_precision

    @property
    def posterior_covariance(self) -> Tensor:
        """``Sigma`` as a dense ``(P, P)`` diagonal matrix (for small ``P`` only)."""
        return torch.diag(self.posterior_variance)

    def _posterior_logdet(self, prior: Tensor, sigma_noise: Any) -> Tensor:
        return self.posterior_precision_matrix(prior, sigma_noise).log().sum()

    def _whiten(self, jac: Tensor) -> Tensor:
        return (jac * self.posterior_scale).T

    def _draw(self, z: Tensor) -> Tensor:
        return self.posterior_scale.unsqueeze(1) * z

    def _kept_bytes(self) -> int:
        return 6 * self.subset.numel * self.mean.element_size()


#: laplace-torch options with no counterpart here, and what to do instead
_FOREIGN_OPTIONS = {
    "backend": "the curvature is computed exactly by this library; remove it",
    "backend_kwargs": "the curvature is computed exactly by this library; remove it",
    "asdl_fisher_kwargs": "the curvature is computed exactly by this library; remove it",
    "enable_backprop": "the predictive is not differentiable w.r.t. the inputs here",
    "dict_key_x": "pass the inputs in any form multiscale_jac.pack accepts",
    "dict_key_y": "pass (inputs, targets) pairs",
}


def Laplace(  # laplace-torch's name
    model: nn.Module,
    likelihood: str | Likelihood,
    subset_of_weights: str | SubsetOfWeights = "last_layer",
    hessian_structure: str | HessianStructure = "full",
    *,
    subnetwork_indices: Tensor | ParamSubset | None = None,
    sigma_noise: float = 1.0,
    prior_precision: Any = 1.0,
    prior_mean: Any = 0.0,
    temperature: float = 1.0,
    **library_options: Any,
) -> SubnetLaplace:
    """laplace-torch's ``Laplace``: the approximation chosen by two strings.

    - ``subset_of_weights="subnetwork"``: :class:`SubnetLaplace` over ``subnetwork_indices``
      (``hessian_structure="full"``), :class:`DiagLaplace` over them (``"diag"``);
    - ``"last_layer"``: :class:`SubnetLaplace` over the last layer, :class:`DiagLaplace` over it;
    - ``"all"``: :class:`SubnetLaplace` over every weight (``P x P``: small models only),
      :class:`DiagLaplace` over every weight.

    Args:
        model: Any ``nn.Module`` at its MAP; never changed.
        likelihood: ``classification`` or ``regression``.
        subset_of_weights: ``subnetwork``, ``last_layer`` (default, as laplace-torch: the weight
            and bias of the last ``nn.Linear`` in registration order, or of the last module
            that owns parameters when there is none, e.g. a 1x1 convolution head) or ``all``
            (every parameter that requires grad).
        hessian_structure: ``full`` (default here; laplace-torch defaults to ``kron``, which
            has no counterpart) or ``diag``.
        subnetwork_indices: For ``subnetwork``: a 1-d LongTensor of indices into
            ``parameters_to_vector(model.parameters())`` (the posterior's order), or a
            :class:`ParamSubset`.
        sigma_noise: Gaussian noise scale (regression; must be 1 for classification).
        prior_precision: A number, one value per selected tensor, or a ``(P,)`` diagonal.
        prior_mean: A number or a ``(P,)`` vector.
        temperature: ``T``; the curvature is divided by it.
        **library_options: The classes' other keyword arguments (``hessian``, ``output_fn``,
            ``memory_budget``, ``chunk_size``, ...; see :class:`SubnetLaplace` and
            :class:`DiagLaplace`).

    Returns:
        A :class:`SubnetLaplace` (``full``) or :class:`DiagLaplace` (``diag``), not fitted.

    Raises:
        ValueError: an unknown string (named with the choices), ``subnetwork`` without
            ``subnetwork_indices`` or ``subnetwork_indices`` with another subset, bad indices.
        TypeError: a model that is not an ``nn.Module``, a laplace-torch option that has no
            counterpart here (the message says what to do).
    """
    for name, why in _FOREIGN_OPTIONS.items():
        if name in library_options:
            raise TypeError(
                f"Laplace() got laplace-torch's {name}=, which has no counterpart: {why}"
            )
    if "subset" in library_options:
        raise TypeError(
            "Laplace() takes the subset as subset_of_weights='subnetwork' with "
            "subnetwork_indices=...; SubnetLaplace(model, likelihood, subset) takes it directly"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    which = parse_enum(SubsetOfWeights, subset_of_weights, "subset_of_weights")
    structure = _hessian_structure(hessian_structure)
    subset = _subset_of_weights(model, which, subnetwork_indices)
    cls = DiagLaplace if structure is HessianStructure.DIAG else SubnetLaplace
    return cls(
        model,
        likelihood,
        subset,
        sigma_noise=sigma_noise,
        prior_precision=prior_precision,
        prior_mean=prior_mean,
        temperature=temperature,
        **library_options,
    )


def _hessian_structure(value: Any) -> HessianStructure:
    try:
        return parse_enum(HessianStructure, value, "hessian_structure")
    except ValueError as err:
        if value in ("kron", "lowrank", "gp"):
            raise ValueError(
                f"{err} (laplace-torch's {value!r} has no counterpart here: 'full' is exact on "
                "a subnetwork or the last layer, 'diag' covers every weight)"
            ) from None
        raise


def _subset_of_weights(model: nn.Module, which: SubsetOfWeights, indices: Any) -> ParamSubset:
    """The entries ``subset_of_weights`` names (laplace-torch's conventions)."""
    if which is not SubsetOfWeights.SUBNETWORK:
        if indices is not None:
            raise ValueError(
                "subnetwork_indices is used only with subset_of_weights='subnetwork'; got "
                f"subset_of_weights={which.value!r}"
            )
        if which is SubsetOfWeights.ALL:
            return ParamSubset.all(model, trainable_only=True)
        return _last_layer(model)
    if indices is None:
        raise ValueError(
            "subset_of_weights='subnetwork' needs subnetwork_indices: a 1-d LongTensor of "
            "indices into parameters_to_vector(model.parameters()), or a ParamSubset"
        )
    if isinstance(indices, ParamSubset):
        indices.check_model(model)
        return indices
    if not isinstance(indices, Tensor) or indices.dim() != 1:
        what = (
            f"shape {tuple(indices.shape)}"
            if isinstance(indices, Tensor)
            else type(indices).__name__
        )
        raise TypeError(f"subnetwork_indices must be a 1-d LongTensor; got {what}")
    try:
        return ParamSubset.from_flat_indices(model, indices)
    except (TypeError, ValueError) as err:
        raise type(err)(f"subnetwork_indices: {err}") from None


def _last_layer(model: nn.Module) -> ParamSubset:
    """The weight and bias of the last ``nn.Linear`` (registration order); without one, every
    parameter of the last module that owns parameters."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    if last is None:
        return ParamSubset.last_layer(model)
    owned = [n for n, _ in model.get_submodule(last).named_parameters(recurse=False)]
    return ParamSubset.from_names(model, [f"{last}.{n}" if last else n for n in owned])


# ---------------------------------------------------------------------- helpers
class _NotPositiveDefinite(ValueError):
    """The posterior precision has no Cholesky factor."""


@dataclass
class _BlockMemo:
    """Jacobian blocks kept per input batch during a grid search, up to ``cap`` bytes."""

    cap: int
    used: int = 0
    blocks: dict[int, list[_Block]] = field(default_factory=dict)

    def keep(self, key: int, blocks: Iterator[_Block]) -> Iterator[_Block]:
        """``blocks`` passed through; kept under ``key`` when all of them fit the cap."""
        kept: list[_Block] | None = []
        size = 0
        for b in blocks:
            if kept is not None:
                size += (b.jac.numel() + b.out.numel()) * b.jac.element_size()
                if self.used + size <= self.cap:
                    kept.append(b)
                else:
                    kept = None
            yield b
        if kept is not None:
            self.blocks[key] = kept
            self.used += size


def _cholesky(mat: Tensor) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(mat)
    if int(info) != 0:
        raise _NotPositiveDefinite(
            "the posterior precision is not positive definite (leading minor "
            f"{int(info)}); increase prior_precision"
        )
    return chol


class _Sampling(NamedTuple):
    """A fit's output-position subsampling: at most ``most`` positions per sample (``None``:
    exact), drawn with ``generator``."""

    most: int | None
    generator: torch.Generator | None

    def draw(self, positions: int, device: torch.device) -> tuple[Tensor, float]:
        """Sorted positions ``(m,)`` drawn uniformly without replacement and the factor
        ``positions / m`` that makes their GGN unbiased (all of them, 1, when exact)."""
        if self.most is None or positions <= self.most:
            return torch.arange(positions, device=device), 1.0
        picked = torch.randperm(positions, generator=self.generator)[: self.most]
        return picked.sort().values.to(device), positions / self.most


@dataclass
class _FitSpec:
    """What :meth:`SubnetLaplace._jacobians` needs to hand a fit whole samples' curvature: the
    batch's targets (checked on use), the samples seen before it and the subsampling."""

    targets: list[Tensor]
    seen: int
    la: SubnetLaplace
    sampling: _Sampling

    def sampled(self, positions: int) -> bool:
        return self.sampling.most is not None and positions > self.sampling.most

    def target(self, i: int, shape: torch.Size) -> Tensor:
        la = self.la
        return check_target(self.targets[i], shape, la.likelihood, la.ignore_index, self.seen + i)


def _lambda_times(out: Tensor, jac: Tensor, likelihood: Likelihood, valid: Tensor | None) -> Tensor:
    """``Lambda J`` for rows ``jac`` ``(O, k)`` of one sample: per position ``(diag(p) - p
    p^T) J`` (classification, ``out`` ``(C, m)``; ``p`` zero where not ``valid``) or ``J``."""
    if likelihood is Likelihood.REGRESSION:
        return jac
    c, m = out.shape
    prob = torch.softmax(out, dim=0)
    if valid is not None:
        prob = prob * valid.to(prob.dtype)
    pj = prob.unsqueeze(-1) * jac.reshape(c, m, -1)
    return (pj - prob.unsqueeze(-1) * pj.sum(0, keepdim=True)).reshape(c * m, -1)


def _span_fn(
    user: Callable[[Any], Any] | None, a: int, b: int, classes: bool
) -> Callable[[Any], Any]:
    """``output_fn`` keeping output positions ``[a, b)`` of every class (``classes``) or flat
    output entries ``[a, b)``."""

    def fn(out: Any) -> Tensor:
        out = user(out) if user is not None else out
        if classes:
            return out.reshape(out.shape[0], out.shape[1], -1)[:, :, a:b]
        return out.reshape(out.shape[0], -1)[:, a:b]

    return fn


def _join(
    blocks: list[Tensor], shape: torch.Size, classes: bool, lead: int | None = None
) -> Tensor:
    """A sample's blocks ``(*lead, rows_k)`` (classification rows: ``C x m_k`` class-major)
    joined along positions and shaped ``(*lead, *shape)``."""
    pre = () if lead is None else (lead,)
    c = (shape[0] if len(shape) else 1) if classes else 1
    if len(blocks) == 1:
        return blocks[0].reshape(*pre, *shape)
    joined = torch.cat([b.reshape(*pre, c, -1) for b in blocks], dim=-1)
    return joined.reshape(*pre, *shape)


def _stack_or_list(parts: list[Tensor], dim: int = 0) -> Tensor | list[Tensor]:
    """Stacked along ``dim`` when all parts share one shape, else the list."""
    if len({p.shape for p in parts}) == 1:
        return torch.stack(parts, dim=dim)
    return parts


def _bridge(mean: Tensor, cov: Tensor) -> Tensor:
    """Laplace bridge: ``mean`` ``(m, C)``, ``cov`` ``(m, C, C)`` -> probabilities ``(m, C)``."""
    k = mean.shape[-1]
    total = cov.sum(dim=(1, 2)).unsqueeze(-1)
    mean = mean - cov.sum(-1) * mean.sum(-1, keepdim=True) / total
    cov = cov - torch.einsum("bi,bj->bij", cov.sum(-1), cov.sum(-2)) / total.unsqueeze(-1)
    var = torch.diagonal(cov, dim1=1, dim2=2)
    sum_exp = torch.exp(-mean).sum(dim=1, keepdim=True)
    alpha = (1 - 2 / k + mean.exp() / k**2 * sum_exp) / var
    return torch.nan_to_num(alpha / alpha.sum(dim=1, keepdim=True), nan=1.0)


def _softmax(samples: Tensor) -> Tensor:
    """Softmax over the class dim of one sample's draws ``(S, C, *spatial)``."""
    return torch.softmax(samples, dim=1)


def _per_sample(
    samples: Tensor | list[Tensor], fn: Callable[[Tensor], Tensor], batched: bool = True
) -> Tensor | list[Tensor]:
    """``fn`` on each sample's draws ``(S, *out)``; a stacked ``(S, N, *out)`` gives the results
    stacked along dim 0 (``batched``: ``fn`` reduces the draws) or dim 1 (it keeps them)."""
    if isinstance(samples, list):
        return [fn(s) for s in samples]
    parts = [fn(samples[:, i]) for i in range(samples.shape[1])]
    return torch.stack(parts, dim=0 if batched else 1)


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
